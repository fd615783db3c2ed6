"""Receiving Telegram updates: our own long-poll loop (an update is acknowledged only
after the gateway recorded it, a malformed one is skipped alone), or a webhook server
that checks Telegram's secret token; in cluster mode only the node elected for ingress
receives (`start_receiving` / `stop_receiving`). Presses of confirmation buttons
(callback queries) go to the gateway's `answerer`, never to the sink.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
from typing import Any

from telegram.error import BadRequest, Conflict, EndPointNotFound, InvalidToken, RetryAfter, TelegramError

from adapters.telegram.client import _retry_after_seconds, log
from adapters.telegram.normalise import Normalising
from core.backoff import Backoff
from core.messages import CONFIRM_REFUSALS, ConfirmVerdict, parse_confirm_payload, press_verdict

# How long a press waits for the gateway's answer: Telegram's client shows a spinner until
# the callback query is answered, and refuses answers to a query older than ~15 s.
_PRESS_ANSWER_TIMEOUT_S = 10.0


class Receiving(Normalising):
    """Polling and the webhook (part of `TelegramAdapter`)."""

    @property
    def allowed_updates(self) -> list[str]:
        kinds = ["message", "my_chat_member", "callback_query"]
        if self.cfg.handle_edited_messages:
            kinds.append("edited_message")
        if self.cfg.handle_channel_posts:
            kinds.append("channel_post")
            if self.cfg.handle_edited_messages:
                kinds.append("edited_channel_post")
        return kinds

    async def start_receiving(self) -> None:
        """Cluster mode, on the node elected for ingress: poll, or register the webhook."""
        if not self._elected or self._recv_task is not None or self._stopping.is_set():
            return
        self._recv_stop = asyncio.Event()
        self._recv_task = asyncio.create_task(self._receive(), name="telegram-receiving")

    async def stop_receiving(self) -> None:
        """Cluster mode, when the ingress role is lost or given up: stop polling (the last
        offset is acknowledged, so the next holder starts after it). In webhook mode the
        webhook stays registered: every node keeps accepting it."""
        task, self._recv_task = self._recv_task, None
        self._recv_stop.set()
        if task is not None:
            await self._end(task)
            if self.cfg.mode == "polling":
                await self._ack_final_offset()
        self._receiving.clear()
        self._fresh_s = None  # sending only: nothing polls here any more

    async def _receive(self) -> None:
        ready = asyncio.ensure_future(self._ready.wait())
        halt = asyncio.ensure_future(self._recv_stop.wait())
        await asyncio.wait({ready, halt}, return_when=asyncio.FIRST_COMPLETED)
        ready.cancel()
        halt.cancel()
        if self._recv_stop.is_set():  # stopped before Telegram answered getMe
            return
        self._receiving.set()
        if self.cfg.mode == "webhook":
            await self._register_webhook()
        else:
            await self._poll_loop()

    async def _end(self, task: asyncio.Task[None]) -> None:
        """Let a sink call in progress finish (it is recording a message); the long poll
        itself is abandoned, which acknowledges nothing."""
        try:
            await asyncio.wait_for(asyncio.shield(task), timeout=15.0)
        except TimeoutError:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        except asyncio.CancelledError:
            task.cancel()
            raise
        except Exception:
            log.exception("telegram: adapter task ended with an error")

    # ----------------------------------------------------------------- polling

    async def _prepare_polling(self) -> None:
        """getUpdates fails while a webhook is set: remove it, keeping pending updates."""
        info = await self.bot.get_webhook_info()
        if info.url:
            log.info("telegram: a webhook is set; deleting it to use polling (pending updates are kept)")
            await self.bot.delete_webhook(drop_pending_updates=False)

    async def _fetch(self) -> list[Any] | None:
        """One long poll; None when stop() interrupted it."""
        timeout = self.cfg.poll_timeout_s
        data: dict[str, Any] = {"timeout": timeout, "allowed_updates": self.allowed_updates}
        if self._offset is not None:
            data["offset"] = self._offset
        # do_api_request without a return type gives the raw JSON, so one malformed update
        # can be skipped on its own (Bot.get_updates parses the whole batch and fails it as
        # a whole). PTB still sends it over the polling connection (get_updates_request).
        poll = asyncio.ensure_future(self.bot.do_api_request("getUpdates", data, read_timeout=timeout + 15.0))
        stop = asyncio.ensure_future(self._recv_stop.wait())
        try:
            await asyncio.wait({poll, stop}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            poll.cancel()
            raise
        finally:
            stop.cancel()
        if not poll.done():
            poll.cancel()
            with contextlib.suppress(BaseException):  # the cancelled poll's outcome is moot
                await poll
            return None
        self._acked_offset = self._offset
        result = poll.result()
        self._answered()
        return result if isinstance(result, list) else []

    async def _poll_loop(self) -> None:
        wait = Backoff(self._backoff_initial, self._backoff_max)
        prepared = False
        # a long poll is answered within poll_timeout_s; its read timeout adds 15 s more
        self._fresh_s = self.cfg.poll_timeout_s + 30.0
        while not self._recv_stop.is_set():
            try:
                if not prepared:
                    await self._prepare_polling()
                    prepared = True
                updates = await self._fetch()
            except (InvalidToken, EndPointNotFound):
                # do_api_request turns the 401 of a revoked token into EndPointNotFound once
                # getMe has succeeded (getUpdates itself always exists)
                self._give_up(
                    f"Telegram rejected the bot token in {self.cfg.token_env} (401) while polling; fix it and restart"
                )
                return
            except Conflict:
                self._unanswered("getUpdates conflict (409): another process polls with this token")
                delay = wait.next()
                log.error(
                    "telegram: getUpdates conflict (409): another process polls with this token, "
                    "or a webhook is set; retrying in %.0fs",
                    delay,
                )
                prepared = False
                if await self._sleep(delay, self._recv_stop):
                    return
                continue
            except RetryAfter as exc:
                if await self._sleep(_retry_after_seconds(exc), self._recv_stop):
                    return
                continue
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # network errors and anything unexpected: never crash
                self._unanswered(f"getUpdates failed ({type(exc).__name__})")
                delay = wait.next()
                log.warning("telegram: getUpdates failed (%s); retrying in %.0fs", type(exc).__name__, delay)
                if await self._sleep(delay, self._recv_stop):
                    return
                continue
            if updates is None:
                return
            wait.reset()
            for raw in updates:
                ok = await self._deliver_raw(raw)
                if not ok:
                    # The sink failed: keep the offset (Telegram redelivers this update and
                    # everything after it) and try again after a pause.
                    if await self._sleep(wait.next(), self._recv_stop):
                        return
                    break
                if self._recv_stop.is_set():
                    return

    async def _deliver_raw(self, raw: Any) -> bool:
        """Normalise one raw update and hand it to the sink. False only when the sink
        failed (the update must not be acknowledged); skipped updates count as done."""
        update_id = raw.get("update_id") if isinstance(raw, dict) else None
        if not isinstance(update_id, int):
            log.warning("telegram: skipping an update without a valid update_id")
            return True
        if self._offset is not None and update_id < self._offset:
            return True  # already handled (Telegram resent a batch)
        ok = await self.process_update(raw)
        if ok:
            self._offset = update_id + 1
        return ok

    async def process_update(self, raw: dict[str, Any]) -> bool:
        """Normalise and deliver one update (polling and webhook share this). Returns False
        if the sink raised; malformed or ignored updates return True (a button press too:
        it is answered here, never recorded, so it is never redelivered)."""
        if "callback_query" in raw:
            await self._on_press(raw)
            return True
        try:
            msg = self.normalize(raw)
        except Exception as exc:
            self.skipped_events += 1
            log.warning("telegram: skipping malformed update %s (%s)", raw.get("update_id"), type(exc).__name__)
            return True
        if msg is None:
            await self._overhear(raw)
            return True
        assert self._sink is not None
        async with self._sink_lock:
            try:
                await self._sink(msg)
            except Exception as exc:
                log.warning(
                    "telegram: the gateway could not record update %s (%s); it will be retried",
                    raw.get("update_id"),
                    type(exc).__name__,
                )
                return False
        return True

    async def _on_press(self, raw: dict[str, Any]) -> None:
        """A press of an inline button: one of ours (`hgc:<token>:a|d`) goes to `answerer`.
        The callback query is always answered, so the person's client stops waiting: a toast
        for "ok", an alert for a refusal, no text for a payload that is not ours or a press
        the gateway failed to take. Never raises (the receive loop goes on)."""
        query = raw.get("callback_query")
        query_id = query.get("id") if isinstance(query, dict) else None
        if not isinstance(query, dict) or not isinstance(query_id, str) or not query_id:
            self.skipped_events += 1
            log.warning("telegram: skipping a callback query without an id (update %s)", raw.get("update_id"))
            return
        sender = query.get("from")
        user_id = sender.get("id") if isinstance(sender, dict) else None
        parsed = parse_confirm_payload(query.get("data"))
        text, alert = "", False
        if parsed is not None and isinstance(user_id, int):
            token, allow = parsed
            verdict = await self._verdict(token, str(user_id), allow)
            if verdict == "ok":
                text = "Allowed." if allow else "Denied."
            elif verdict is not None:
                text, alert = CONFIRM_REFUSALS[verdict], True
        try:
            await self.bot.answer_callback_query(query_id, text=text or None, show_alert=alert)
        except Exception as exc:  # e.g. the query is too old: the press itself was handled
            log.warning("telegram: answerCallbackQuery failed (%s)", type(exc).__name__)

    async def _verdict(self, token: str, user_id: str, allow: bool) -> ConfirmVerdict | None:
        return await press_verdict(self.answerer, token, user_id, allow, timeout_s=_PRESS_ANSWER_TIMEOUT_S, log=log)

    async def _overhear(self, raw: dict[str, Any]) -> None:
        """Show the text of a group message dropped unanswered (no mention, an edit, another
        bot's post) to `overheard`, so a link code pasted there is still burnt."""
        if self.overheard is None:
            return
        message: dict[str, Any] = next(
            (
                raw[k]
                for k in ("message", "edited_message", "channel_post", "edited_channel_post")
                if isinstance(raw.get(k), dict)
            ),
            {},
        )
        sub = message.get("chat")
        chat = sub if isinstance(sub, dict) else {}
        text = message.get("text") or message.get("caption") or ""
        if chat.get("type") in (None, "private") or not isinstance(text, str) or not text:
            return
        try:
            await self.overheard("telegram", text)
        except Exception:
            log.exception("telegram: could not screen an unanswered group message")

    async def _ack_final_offset(self) -> None:
        """Tell Telegram about updates recorded since the last poll, so a restart does not
        redeliver them (they would be deduplicated anyway)."""
        if self._offset is None or self._offset == self._acked_offset or self.bot_id is None:
            return
        try:
            await self.bot.do_api_request(
                "getUpdates", {"offset": self._offset, "timeout": 0, "limit": 1}, read_timeout=5.0
            )
            self._acked_offset = self._offset
        except Exception as exc:
            log.debug("telegram: final offset acknowledgement failed (%s)", type(exc).__name__)

    # ----------------------------------------------------------------- webhook

    async def _start_webhook_server(self) -> None:
        from aiohttp import web

        app = web.Application(client_max_size=4 * 1024 * 1024)
        app.router.add_post(self.cfg.webhook.path, self._handle_webhook)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, self.cfg.webhook.listen, self.cfg.webhook.port)
        await site.start()
        self._runner = runner
        server = getattr(site, "_server", None)
        sockets = getattr(server, "sockets", None) or []
        self._bound_port = sockets[0].getsockname()[1] if sockets else self.cfg.webhook.port
        log.info(
            "telegram: webhook server listening on %s:%s%s",
            self.cfg.webhook.listen,
            self._bound_port,
            self.cfg.webhook.path,
        )

    async def _register_webhook(self) -> None:
        public = self.cfg.webhook.public_url
        self._fresh_s = None  # Telegram calls a webhook only when there is an update
        if not public:
            log.info("telegram: webhook.public_url not set; assuming the webhook is registered elsewhere")
            return
        path = self.cfg.webhook.path
        url = public if public.rstrip("/").endswith(path.rstrip("/")) else public.rstrip("/") + path
        wait = Backoff(self._backoff_initial, self._backoff_max)
        while not self._stopping.is_set():
            try:
                await self.bot.set_webhook(
                    url=url,
                    secret_token=self._webhook_secret,
                    allowed_updates=self.allowed_updates,
                    drop_pending_updates=False,
                )
                log.info("telegram: webhook registered")
                self._answered()
                return
            except InvalidToken:
                self._give_up(f"setWebhook: Telegram rejected the bot token in {self.cfg.token_env} (401)")
                return
            except BadRequest as exc:
                self._give_up(f"Telegram refused the webhook URL (setWebhook: {exc.message})")
                return
            except TelegramError as exc:
                self._unanswered(f"setWebhook failed ({type(exc).__name__})")
                delay = wait.next()
                log.warning("telegram: setWebhook failed (%s); retrying in %.0fs", type(exc).__name__, delay)
                if await self._sleep(delay):
                    return

    async def _handle_webhook(self, request: Any) -> Any:
        from aiohttp import web

        given = request.headers.get("X-Telegram-Bot-Api-Secret-Token", "")
        expected = self._webhook_secret or ""
        if not expected or not hmac.compare_digest(given.encode(), expected.encode()):
            log.warning("telegram: webhook request with a missing or wrong secret token refused")
            return web.Response(status=403, text="forbidden")
        if not self._ready.is_set() or self._sink is None:
            return web.Response(status=503, text="starting")  # Telegram retries later
        try:
            raw = await request.json()
        except Exception:
            log.warning("telegram: webhook body is not JSON; ignored")
            return web.Response(status=200, text="ignored")
        if not isinstance(raw, dict) or not isinstance(raw.get("update_id"), int):
            log.warning("telegram: webhook update without a valid update_id; ignored")
            return web.Response(status=200, text="ignored")
        self._answered()  # Telegram reached us with a signed update: the webhook works
        ok = await self.process_update(raw)
        if not ok:
            return web.Response(status=500, text="retry later")  # Telegram redelivers
        return web.Response(status=200, text="ok")
