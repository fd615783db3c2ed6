"""Telegram adapter: python-telegram-bot's `Bot` for every Bot API call, our own polling
loop (so an update is acknowledged only after the gateway recorded it), an optional
webhook server, mention gating in groups, and delivery that never fails on formatting.

Nothing here touches storage or decides anything about tenants: inbound updates become
`InboundMessage`s handed to the gateway's sink, outbound chunks are sent as asked.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dtm
import hmac
import logging
import os
import re
import time
import warnings
from typing import Any, cast

import httpx
from telegram import Bot, BotCommand, Message, ReplyParameters, Update
from telegram.constants import ChatAction, ParseMode
from telegram.error import (
    BadRequest,
    ChatMigrated,
    Conflict,
    EndPointNotFound,
    Forbidden,
    InvalidToken,
    NetworkError,
    RetryAfter,
    TelegramError,
    TimedOut,
)
from telegram.request import HTTPXRequest
from telegram.warnings import PTBDeprecationWarning, PTBUserWarning

from adapters.telegram.flood import FloodGate, FloodLimits
from adapters.telegram.format import markdown_to_telegram_html
from core.commands import COMMAND_SPECS
from core.messages import (
    Attachment,
    DeliveryDeferred,
    DownloadError,
    InboundMessage,
    InboundSink,
    OutboundMessage,
    OverheardHook,
    SentMessage,
)
from core.redact import RedactingFilter, Redactor
from core.settings import ConfigError, TelegramConfig
from core.text import split_text, utf16_len

log = logging.getLogger("adapters.telegram")

DEFAULT_BASE_URL = "https://api.telegram.org/bot"
DEFAULT_BASE_FILE_URL = "https://api.telegram.org/file/bot"
_COMMAND_NAME_RE = re.compile(r"^[a-z0-9_]{1,32}$")
_SECRET_TOKEN_RE = re.compile(r"^[A-Za-z0-9_-]{1,256}$")
_TOKEN_SHAPE_RE = re.compile(r"^\d+:[A-Za-z0-9_-]+$")
# Telegram's service account that relays linked-channel posts into discussion groups.
_TELEGRAM_SERVICE_USER_ID = 777000
_ATTACHMENT_KINDS = ("photo", "document", "audio", "voice", "video", "video_note", "animation", "sticker")


# --------------------------------------------------------------------------- logging


def _shorten_bot_calls(record: logging.LogRecord) -> bool:
    """PTB's telegram.Bot logs every call's parameters and results at DEBUG: keep only the
    endpoint name, so message payloads never reach the logs."""
    try:
        if record.name == "telegram.Bot" and isinstance(record.msg, str) and record.args:
            # PTB's telegram.Bot logs with positional args (a tuple); a mapping would raise
            # on [0] and be caught below, exactly as without the cast
            args = cast(tuple[object, ...], record.args)
            if record.msg.startswith("Calling Bot API endpoint"):
                record.msg, record.args = "Calling Bot API endpoint `%s`", (args[0],)
            elif record.msg.startswith("Call to Bot API endpoint"):
                record.msg, record.args = "Call to Bot API endpoint `%s` finished", (args[0],)
    except Exception:  # noqa: S110 (a filter must never break logging)
        pass
    return True


# bot tokens: PTB and httpx log URLs containing `/bot<token>/`
_REDACTOR = RedactingFilter("telegram-redactor", Redactor(mark="<redacted>", patterns=False, min_len=1))
_REDACTED_LOGGERS = (
    "adapters.telegram",
    "httpx",
    "httpcore",
    "telegram",
    "telegram.Bot",
    "telegram.request.BaseRequest",
    "telegram.request.HTTPXRequest",
)


def _register_secret(secret: str | None) -> None:
    if not secret:
        return
    _REDACTOR.redactor.add(secret)
    for name in _REDACTED_LOGGERS:
        logger = logging.getLogger(name)
        if _shorten_bot_calls not in logger.filters:
            logger.addFilter(_shorten_bot_calls)
    _REDACTOR.attach(_REDACTED_LOGGERS)


# --------------------------------------------------------------------------- helpers


def _utf16_slice(text: str, offset: int, length: int) -> str:
    # surrogatepass: a lone surrogate (broken text) counts as one unit, as Telegram counts
    # it, so a bad message still reaches the gateway, which refuses it clearly
    data = text.encode("utf-16-le", "surrogatepass")
    return data[2 * offset : 2 * (offset + length)].decode("utf-16-le", errors="surrogatepass")


def _utf16_cut(text: str, spans: list[tuple[int, int]]) -> str:
    """Remove the given (offset, length) UTF-16 spans from `text`."""
    data = text.encode("utf-16-le", "surrogatepass")
    for offset, length in sorted(spans, reverse=True):
        data = data[: 2 * offset] + data[2 * (offset + length) :]
    return data.decode("utf-16-le", errors="surrogatepass")


def _tidy(text: str) -> str:
    """Whitespace left behind by a removed mention: 'hey  , you' -> 'hey, you'."""
    text = re.sub(r"[ \t]{2,}", " ", text)
    text = re.sub(r" ([,.!?;:])", r"\1", text)
    return text.strip()


def _chat_id_param(chat_id: str) -> int | str:
    return int(chat_id) if chat_id.lstrip("-").isdigit() else chat_id


def _retry_after_seconds(exc: RetryAfter) -> float:
    raw = exc.retry_after  # int today; a timedelta once PTB makes that the default
    seconds = raw.total_seconds() if isinstance(raw, dtm.timedelta) else float(raw)
    return max(seconds, 0.0)


def _quiet_expected_ptb_warnings() -> None:
    """Silence the two PTB warnings our deliberate choices cause, and nothing else.

    - `RetryAfter.__init__` reads its own `retry_after`, which (PTB >= 22.2) warns about the
      coming int -> timedelta change on every 429 unless PTB_TIMEDELTA is set process-wide;
      `_retry_after_seconds` accepts both forms, so the warning says nothing to us.
    - `do_api_request("getUpdates")` suggests `Bot.get_updates`, which parses a whole batch
      and fails it as a whole; we want the raw JSON to skip one malformed update alone.
    Idempotent (warnings.filterwarnings replaces an identical filter).
    """
    warnings.filterwarnings(
        "ignore", message=r".*In a future major version attribute `retry_after`", category=PTBDeprecationWarning
    )
    warnings.filterwarnings("ignore", message=r"Please use 'Bot\.getUpdates' instead", category=PTBUserWarning)


def _never_sent(exc: BaseException) -> bool:
    """True when a failed request provably never reached Telegram (safe to resend)."""
    cause = exc.__cause__
    if isinstance(cause, (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)):
        return True
    return "Pool timeout" in str(exc)


def _derive_file_url(base_url: str) -> str:
    if base_url.rstrip("/").endswith("/bot"):
        return base_url.rstrip("/")[: -len("bot")] + "file/bot"
    return DEFAULT_BASE_FILE_URL


def _make_bot(cfg: TelegramConfig, token: str, *, send_timeout_s: float) -> tuple[Bot, HTTPXRequest]:
    """The Bot, and the connection its getUpdates calls use (we close it on its own at stop)."""
    _quiet_expected_ptb_warnings()
    request = HTTPXRequest(
        connection_pool_size=64,
        read_timeout=send_timeout_s,
        write_timeout=send_timeout_s,
        connect_timeout=10.0,
        pool_timeout=30.0,
    )
    polling = HTTPXRequest(
        connection_pool_size=2, read_timeout=10.0, write_timeout=10.0, connect_timeout=10.0, pool_timeout=10.0
    )
    bot = Bot(
        token,
        base_url=cfg.base_url,
        base_file_url=cfg.base_file_url or _derive_file_url(cfg.base_url),
        request=request,
        get_updates_request=polling,
    )
    return bot, polling


async def _shutdown_bot(bot: Bot, polling: HTTPXRequest) -> None:
    """Close both HTTP clients (Bot.shutdown skips them if getMe never succeeded)."""
    for request in (polling, bot.request):
        try:
            await request.shutdown()
        except Exception:  # pragma: no cover
            log.debug("closing a Bot API connection failed", exc_info=True)


def telegram_commands() -> list[BotCommand]:
    """The menu registered with setMyCommands: every non-admin command Telegram accepts."""
    commands = []
    for spec in COMMAND_SPECS:
        if spec.admin_only or not _COMMAND_NAME_RE.match(spec.name):
            continue
        description = (spec.description or spec.name)[:256]
        commands.append(BotCommand(spec.name, description))
    return commands


# --------------------------------------------------------------------------- adapter


class TelegramAdapter:
    """One bot account on Telegram (see `core.protocols.Adapter`)."""

    platform = "telegram"
    max_message_length = 4096
    can_edit = True

    def __init__(
        self,
        cfg: TelegramConfig,
        token: str,
        *,
        webhook_secret: str | None = None,
        backoff_initial_s: float = 1.0,
        backoff_max_s: float = 30.0,
        send_timeout_s: float = 20.0,
        max_send_attempts: int = 5,
        max_flood_wait_s: float = 300.0,
        flood_limits: FloodLimits | None = None,
        elected: bool = False,
    ) -> None:
        """`elected=True` (cluster mode): `start()` connects (and serves the webhook in
        webhook mode) but receives nothing by itself; the node elected for ingress calls
        `start_receiving()` (polling: poll; webhook: call setWebhook) and `stop_receiving()`."""
        if not token:
            raise ConfigError(f"platforms.telegram: the bot token (env {cfg.token_env}) is empty")
        self.cfg = cfg
        self._token = token
        _register_secret(token)
        if webhook_secret is None and cfg.webhook.secret_token_env:
            webhook_secret = os.environ.get(cfg.webhook.secret_token_env) or None
        self._webhook_secret = webhook_secret
        _register_secret(webhook_secret)
        self._backoff_initial = backoff_initial_s
        self._backoff_max = backoff_max_s
        self._max_send_attempts = max(1, max_send_attempts)
        self._max_flood_wait = max_flood_wait_s
        self._flood = FloodGate(flood_limits)
        self.bot, self._polling_request = _make_bot(cfg, token, send_timeout_s=send_timeout_s)

        self.bot_id: int | None = None
        self.bot_username: str | None = None
        self._sink: InboundSink | None = None
        self.overheard: OverheardHook | None = None  # group text dropped unanswered (link-code screen)
        self._task: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()
        self._ready = asyncio.Event()
        self._offset: int | None = None  # next update_id to ask for (= acknowledge below it)
        self._acked_offset: int | None = None  # the offset Telegram has last been told
        self._forbidden: set[str] = set()  # chats that answered 403: logged once, skipped
        self._runner: Any = None  # aiohttp AppRunner in webhook mode
        self._bound_port: int | None = None
        self._elected = elected
        self._receiving = asyncio.Event()  # set while this adapter polls or owns the webhook
        self._recv_stop = asyncio.Event()  # ends the poll loop (stop() or stop_receiving())
        self._recv_task: asyncio.Task[None] | None = None
        self._sink_lock = asyncio.Lock()
        # the connection as /healthz and `hermes_adapter_connected` see it (see `status`)
        self._failed: str | None = None  # final: only a rejected token or an unusable webhook
        self._last_error: str | None = None  # why the last Bot API call of the receive path failed
        self._ok_at: float | None = None  # monotonic time the Bot API last answered that path
        self._down_since: float | None = None  # monotonic time it stopped (or had not yet begun)
        #: seconds a success stays fresh while polling (a long poll answers within
        #: poll_timeout_s); None when nothing polls (webhook, or not elected to receive)
        self._fresh_s: float | None = None
        #: updates that could not be parsed, skipped (polling goes on)
        self.skipped_events = 0

    # ----------------------------------------------------------------- construction

    @property
    def elected(self) -> bool:
        """Cluster mode: receiving is started and stopped by the node's ingress election."""
        return self._elected

    @classmethod
    def from_config(cls, cfg: TelegramConfig, **kwargs: Any) -> TelegramAdapter:
        """Build from config, reading the token (and webhook secret) from the environment."""
        token = os.environ.get(cfg.token_env, "").strip()
        if not token:
            raise ConfigError(
                f"platforms.telegram.token_env: environment variable {cfg.token_env} is not set "
                "(put the token BotFather gave you there)"
            )
        secret = None
        if cfg.mode == "webhook":
            env = cfg.webhook.secret_token_env
            if not env:
                raise ConfigError(
                    "platforms.telegram.webhook.secret_token_env: webhook mode needs a secret token "
                    "(name an environment variable holding 1-256 characters of A-Z a-z 0-9 _ -)"
                )
            secret = os.environ.get(env, "").strip()
            if not secret:
                raise ConfigError(f"platforms.telegram.webhook.secret_token_env: environment variable {env} is not set")
            if not _SECRET_TOKEN_RE.match(secret):
                raise ConfigError(
                    f"platforms.telegram.webhook.secret_token_env: the value of {env} must be 1-256 "
                    "characters of A-Z a-z 0-9 _ - (Telegram's rule for secret tokens)"
                )
        return cls(cfg, token, webhook_secret=secret, **kwargs)

    def measure(self, text: str) -> int:
        return utf16_len(text)

    @property
    def webhook_port(self) -> int | None:
        """The port the webhook server is listening on, once started."""
        return self._bound_port

    @property
    def allowed_updates(self) -> list[str]:
        kinds = ["message", "my_chat_member"]
        if self.cfg.handle_edited_messages:
            kinds.append("edited_message")
        if self.cfg.handle_channel_posts:
            kinds.append("channel_post")
            if self.cfg.handle_edited_messages:
                kinds.append("edited_channel_post")
        return kinds

    @property
    def status(self) -> str:
        """`connected (polling|webhook|sending)`, `connecting[: why]`, `failed: <what to do>`
        or `stopped`. Connected means getMe succeeded and, while polling, a getUpdates was
        answered within the last long-poll window; in webhook mode, the webhook is set."""
        if self._failed is not None:
            return f"failed: {self._failed}"
        if self._task is None or self._stopping.is_set():
            return "stopped"
        if self._fresh():
            if self._fresh_s is not None:
                return "connected (polling)"
            return "connected (webhook)" if self.cfg.mode == "webhook" and self.receiving else "connected (sending)"
        if self._last_error is not None:
            return f"connecting: {self._last_error}"
        if self._ok_at is not None:
            return f"connecting: no answer from getUpdates for {time.monotonic() - self._ok_at:.0f}s"
        return "connecting"

    @property
    def down_since(self) -> float | None:
        """`time.monotonic()` since which the adapter has not been connected; None while it is."""
        if self._fresh():
            return None
        if self._down_since is not None:
            return self._down_since
        if self._ok_at is not None and self._fresh_s is not None:
            return self._ok_at + self._fresh_s
        return time.monotonic()

    def _fresh(self) -> bool:
        if self._failed is not None or self._last_error is not None or self._ok_at is None:
            return False
        return self._fresh_s is None or time.monotonic() - self._ok_at <= self._fresh_s

    def _answered(self) -> None:
        """The Bot API answered the receive path (getMe, getUpdates, setWebhook, a webhook call)."""
        self._ok_at = time.monotonic()
        self._last_error = None
        self._down_since = None

    def _unanswered(self, why: str) -> None:
        self._last_error = why
        if self._down_since is None:
            self._down_since = time.monotonic()

    def _give_up(self, reason: str) -> None:
        """A failure no retry can mend: logged once, shown as `failed: ...` until restart."""
        if self._failed is None:
            log.error("telegram: %s", reason)
        self._failed = reason
        if self._down_since is None:
            self._down_since = time.monotonic()

    # ----------------------------------------------------------------- lifecycle

    async def start(self, sink: InboundSink) -> None:
        if self._task is not None:
            raise RuntimeError("TelegramAdapter already started")
        if self.cfg.mode == "webhook" and not self._webhook_secret:
            raise ConfigError("platforms.telegram.webhook.secret_token_env: webhook mode needs a secret token")
        self._sink = sink
        self._stopping.clear()
        self._recv_stop = asyncio.Event()
        self._down_since = time.monotonic()
        try:
            await self._identify()
        except InvalidToken:
            await self._close_bot()
            self._failed = f"Telegram rejected the bot token in {self.cfg.token_env} (401 Unauthorized)"
            raise ConfigError(
                f"platforms.telegram: Telegram rejected the bot token in {self.cfg.token_env} "
                "(401 Unauthorized); get a fresh one from @BotFather (/token)"
            ) from None
        except (NetworkError, TelegramError) as exc:
            # Telegram unreachable at boot: keep trying in the background instead of failing.
            self._unanswered(f"getMe failed ({type(exc).__name__})")
            log.warning("telegram: getMe failed at start (%s); retrying in the background", type(exc).__name__)
        if self.cfg.mode == "webhook":
            try:
                await self._start_webhook_server()
            except OSError as exc:
                await self._close_bot()
                where = f"{self.cfg.webhook.listen}:{self.cfg.webhook.port}"
                self._failed = f"the webhook server cannot listen on {where} ({exc.strerror or exc})"
                raise ConfigError(
                    f"platforms.telegram.webhook: cannot listen on {where} ({exc.strerror or exc}); "
                    "free the port or set platforms.telegram.webhook.port to another one"
                ) from None
        self._task = asyncio.create_task(self._run(), name="telegram-adapter")

    @property
    def receiving(self) -> bool:
        """True while this adapter polls (or, in webhook mode, registered the webhook)."""
        return self._receiving.is_set()

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

    async def stop(self) -> None:
        self._stopping.set()
        self._recv_stop.set()
        recv, self._recv_task = self._recv_task, None
        if recv is not None:
            await self._end(recv)
        task, self._task = self._task, None
        if task is not None:
            await self._end(task)
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()
        if self.cfg.mode == "polling":
            await self._ack_final_offset()
        # Only the polling connection closes here: the gateway stops adapters first and then
        # lets running turns finish, and their answers still have to go out. `aclose()`
        # releases the sending connection once the gateway is done with the adapter.
        try:
            await self._polling_request.shutdown()
        except Exception:  # pragma: no cover
            log.debug("closing the polling connection failed", exc_info=True)

    async def aclose(self) -> None:
        """Stop, and release every HTTP connection (call after the last send)."""
        await self.stop()
        await self._close_bot()

    async def _close_bot(self) -> None:
        await _shutdown_bot(self.bot, self._polling_request)

    async def _identify(self) -> None:
        await self.bot.initialize()  # getMe
        me = self.bot.bot
        self.bot_id = me.id
        self.bot_username = me.username
        self._answered()
        log.info("telegram: connected as @%s (id %s)", me.username, me.id)
        try:
            await self.bot.set_my_commands(telegram_commands())
        except TelegramError as exc:
            log.warning("telegram: setMyCommands failed (%s); the command menu may be stale", type(exc).__name__)
        self._ready.set()

    async def _run(self) -> None:
        backoff = self._backoff_initial
        while not self._ready.is_set() and not self._stopping.is_set():
            try:
                await self._identify()
            except InvalidToken:
                self._give_up(f"Telegram rejected the bot token in {self.cfg.token_env} (401); fix it and restart")
                return
            except (TelegramError, OSError) as exc:
                self._unanswered(f"getMe failed ({type(exc).__name__})")
                log.warning("telegram: getMe failed (%s); retrying in %.0fs", type(exc).__name__, backoff)
                if await self._sleep(backoff):
                    return
                backoff = min(backoff * 2, self._backoff_max)
        if self._stopping.is_set():
            return
        if self._elected:  # the ingress election calls start_receiving()
            await self._stopping.wait()
        elif self.cfg.mode == "webhook":
            self._receiving.set()
            await self._register_webhook()
            await self._stopping.wait()
        else:
            self._receiving.set()
            await self._poll_loop()

    async def _sleep(self, seconds: float, until: asyncio.Event | None = None) -> bool:
        """Sleep, but wake up at stop() (or when `until` is set); True when stopping."""
        try:
            await asyncio.wait_for((until or self._stopping).wait(), timeout=seconds)
        except TimeoutError:
            return False
        return True

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
        backoff = self._backoff_initial
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
                log.error(
                    "telegram: getUpdates conflict (409): another process polls with this token, "
                    "or a webhook is set; retrying in %.0fs",
                    backoff,
                )
                prepared = False
                if await self._sleep(backoff, self._recv_stop):
                    return
                backoff = min(backoff * 2, self._backoff_max)
                continue
            except RetryAfter as exc:
                if await self._sleep(_retry_after_seconds(exc), self._recv_stop):
                    return
                continue
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # network errors and anything unexpected: never crash
                self._unanswered(f"getUpdates failed ({type(exc).__name__})")
                log.warning("telegram: getUpdates failed (%s); retrying in %.0fs", type(exc).__name__, backoff)
                if await self._sleep(backoff, self._recv_stop):
                    return
                backoff = min(backoff * 2, self._backoff_max)
                continue
            if updates is None:
                return
            backoff = self._backoff_initial
            for raw in updates:
                ok = await self._deliver_raw(raw)
                if not ok:
                    # The sink failed: keep the offset (Telegram redelivers this update and
                    # everything after it) and try again after a pause.
                    if await self._sleep(backoff, self._recv_stop):
                        return
                    backoff = min(backoff * 2, self._backoff_max)
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
        if the sink raised; malformed or ignored updates return True."""
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
        backoff = self._backoff_initial
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
                log.warning("telegram: setWebhook failed (%s); retrying in %.0fs", type(exc).__name__, backoff)
                if await self._sleep(backoff):
                    return
                backoff = min(backoff * 2, self._backoff_max)

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

    # ----------------------------------------------------------------- normalisation

    def normalize(self, raw: dict[str, Any]) -> InboundMessage | None:
        """The InboundMessage for a raw update, or None when the bot must ignore it."""
        update = Update.de_json(dict(raw), self.bot)
        if update.my_chat_member is not None:
            self._on_my_chat_member(update)
            return None
        edited = False
        message: Message | None = update.message
        if message is None and self.cfg.handle_edited_messages and update.edited_message is not None:
            message, edited = update.edited_message, True
        if message is None and self.cfg.handle_channel_posts:
            if update.channel_post is not None:
                message = update.channel_post
            elif self.cfg.handle_edited_messages and update.edited_channel_post is not None:
                message, edited = update.edited_channel_post, True
        if message is None:
            return None
        return self._normalize_message(message, raw, edited=edited)

    def _on_my_chat_member(self, update: Update) -> None:
        change = update.my_chat_member
        if change is None:  # normalize() calls this only when it is set
            return
        chat_id = str(change.chat.id)
        status = change.new_chat_member.status
        if status in ("left", "kicked"):
            if chat_id not in self._forbidden:
                log.info("telegram: the bot was removed from chat %s", chat_id)
            self._forbidden.add(chat_id)
        elif status in ("member", "administrator", "creator"):
            self._forbidden.discard(chat_id)

    def _normalize_message(self, message: Message, raw: dict[str, Any], *, edited: bool) -> InboundMessage | None:
        chat = message.chat
        if chat is None or message.message_id is None:
            raise ValueError("message without chat or message_id")
        sender = message.from_user
        channel = chat.type == "channel"
        if not channel:
            if sender is None:
                return None
            if sender.is_bot or (self.bot_id is not None and sender.id == self.bot_id):
                return None
            if sender.id == _TELEGRAM_SERVICE_USER_ID or message.is_automatic_forward:
                return None  # linked-channel posts relayed into a discussion group

        text = message.text if message.text is not None else (message.caption or "")
        entities = list(message.entities or message.caption_entities or ())
        attachments = self._attachments(message)
        if not text and not attachments:
            return None  # service messages: joins, pins, topic edits, ...

        if chat.type == "private":
            chat_type = "dm"
        elif channel:
            chat_type = "channel"
        elif message.is_topic_message and message.message_thread_id is not None:
            chat_type = "thread"
        else:
            chat_type = "group"
        thread_id = (
            str(message.message_thread_id)
            if message.is_topic_message and message.message_thread_id is not None
            else None
        )

        reply_to = message.reply_to_message
        if reply_to is not None and (
            reply_to.forum_topic_created is not None
            or (thread_id is not None and reply_to.message_id == message.message_thread_id)
        ):
            reply_to = None  # every topic message "replies" to the topic's creation message
        replies_to_bot = bool(
            reply_to is not None
            and reply_to.from_user is not None
            and self.bot_id is not None
            and reply_to.from_user.id == self.bot_id
        )

        text, mentioned, command_for_other = self._strip_addressing(text, entities)
        if command_for_other:
            return None  # /cmd@otherbot
        is_command = text.startswith("/")
        if chat_type == "dm":
            mentions_bot = True
        else:
            mentions_bot = mentioned or replies_to_bot
            if self.cfg.require_mention_in_groups and not (mentions_bot or is_command):
                return None

        self._forbidden.discard(str(chat.id))
        if channel:
            user_id = str(message.sender_chat.id if message.sender_chat else chat.id)
            user_name = chat.title or chat.username or ""
        else:
            assert sender is not None  # non-channel chats returned above when it is None
            user_id = str(sender.id)
            user_name = sender.username or sender.full_name or ""
        message_id = str(message.message_id)
        stamp = message.date
        if edited:
            edit_date = message.edit_date
            # The gateway deduplicates by message id: an edit is a new message to it.
            message_id = f"{message_id}:edit:{int(edit_date.timestamp()) if edit_date else int(time.time())}"
            stamp = edit_date or stamp
        return InboundMessage(
            platform="telegram",
            chat_id=str(chat.id),
            chat_type=chat_type,
            thread_id=thread_id,
            user_id=user_id,
            user_name=user_name,
            message_id=message_id,
            text=text,
            attachments=tuple(attachments),
            reply_to_message_id=str(reply_to.message_id) if reply_to is not None else None,
            **self._reply_context(message, reply_to),
            mentions_bot=mentions_bot,
            timestamp=stamp.timestamp() if stamp else time.time(),
            raw=raw,
        )

    def _strip_addressing(self, text: str, entities: list[Any]) -> tuple[str, bool, bool]:
        """(text without @bot mentions and with `/cmd@bot` -> `/cmd`, mentioned, command
        addressed to another bot)."""
        username = (self.bot_username or "").lower()
        cuts: list[tuple[int, int]] = []
        mentioned = False
        command_for_other = False
        for entity in entities:
            kind, offset, length = entity.type, entity.offset, entity.length
            if kind == "mention":
                if username and _utf16_slice(text, offset, length).lower() == f"@{username}":
                    mentioned = True
                    cuts.append((offset, length))
            elif kind == "text_mention":
                if entity.user is not None and entity.user.id == self.bot_id:
                    mentioned = True
                    cuts.append((offset, length))
            elif kind == "bot_command" and offset == 0:
                command = _utf16_slice(text, offset, length)
                name, at, target = command.partition("@")
                if at:
                    if target.lower() == username:
                        mentioned = True
                        cuts.append((utf16_len(name), utf16_len(at + target)))
                    else:
                        command_for_other = True
        if cuts:
            text = _tidy(_utf16_cut(text, cuts))
        return text, mentioned, command_for_other

    @staticmethod
    def _attachments(message: Message) -> list[Attachment]:
        found: list[Attachment] = []
        for kind in _ATTACHMENT_KINDS:
            value = getattr(message, kind, None)
            if not value:
                continue
            if isinstance(value, (tuple, list)):  # photo sizes: keep the largest
                value = value[-1]
            name = getattr(value, "file_name", None) or kind
            size = getattr(value, "file_size", None) or 0
            mime = getattr(value, "mime_type", None) or ("image/jpeg" if kind == "photo" else "")
            # only the file id: Telegram's file URLs carry the bot token
            found.append(Attachment(type=kind, name=name, size=size, file_id=value.file_id, mime_type=mime))
        return found

    def _reply_context(self, message: Message, reply_to: Message | None) -> dict[str, Any]:
        """The quoted text of the message replied to (the part the person selected, when
        they quoted one), and who wrote it. Only what Telegram sent with this message."""
        if reply_to is None:
            return {}
        quote = message.quote.text if message.quote is not None and message.quote.text else None
        text = quote or reply_to.text or reply_to.caption
        if not text:
            return {}
        author = reply_to.from_user
        if author is not None and self.bot_id is not None and author.id == self.bot_id:
            who = "you"
        elif author is not None:
            who = author.username or author.full_name or ""
        else:
            who = reply_to.sender_chat.title if reply_to.sender_chat is not None and reply_to.sender_chat.title else ""
        return {"reply_to_text": text, "reply_to_author": who}

    async def download(self, attachment: Attachment, max_bytes: int) -> bytes:
        """Fetch one attachment with getFile + File.download_as_bytearray. Errors become
        `DownloadError` with a safe message (the file URL, which holds the token, never
        leaves this method)."""
        if not attachment.file_id:
            raise DownloadError("the file is not available")
        try:
            file = await self.bot.get_file(attachment.file_id)
            if file.file_size and file.file_size > max_bytes:
                raise DownloadError("the file is too large", too_big=True)
            data = await file.download_as_bytearray()
        except DownloadError:
            raise
        except BadRequest as exc:
            too_big = "too big" in str(exc).lower()
            log.warning("telegram: getFile refused a %s (%s)", attachment.type, "too big" if too_big else "bad request")
            raise DownloadError("Telegram refused the download", too_big=too_big) from None
        except (TelegramError, RuntimeError, OSError) as exc:
            log.warning("telegram: downloading a %s failed (%s)", attachment.type, type(exc).__name__)
            raise DownloadError("the download from Telegram failed") from None
        if len(data) > max_bytes:
            raise DownloadError("the file is too large", too_big=True)
        return bytes(data)

    # ----------------------------------------------------------------- delivery

    async def send(self, message: OutboundMessage) -> SentMessage | None:
        chat_id = message.chat_id
        if chat_id in self._forbidden:
            log.debug("telegram: not sending to chat %s (the bot was removed or blocked)", chat_id)
            return None
        text = message.text
        if not text.strip():
            return None
        if utf16_len(text) > self.max_message_length:  # the gateway splits; this is a safety net
            sent = None
            for piece in split_text(text, self.max_message_length, utf16_len):
                part = message.model_copy(update={"text": piece})
                result = await self._send_one(part)
                sent = sent or result
            return sent
        return await self._send_one(message)

    async def _send_one(self, message: OutboundMessage) -> SentMessage | None:
        kwargs: dict[str, Any] = {}
        if message.thread_id:
            kwargs["message_thread_id"] = int(message.thread_id)
        # ids of edited messages look like "<id>:edit:<date>": reply to the message itself
        reply_to = (message.reply_to_message_id or "").split(":", 1)[0]
        if reply_to.isdigit():
            kwargs["reply_parameters"] = ReplyParameters(message_id=int(reply_to), allow_sending_without_reply=True)
        if message.kind == "notice":
            kwargs["disable_notification"] = True
        chat_id: int | str = _chat_id_param(message.chat_id)
        html_text = markdown_to_telegram_html(message.text)
        formatted = True
        attempts = 0
        flood_waited = 0.0
        while True:
            attempts += 1
            await self._flood.wait_turn(str(chat_id))
            if message.may_send is not None and not message.may_send():  # e.g. a lease lost meanwhile
                raise DeliveryDeferred("no longer ours to send")
            try:
                if formatted:
                    sent = await self.bot.send_message(chat_id, html_text, parse_mode=ParseMode.HTML, **kwargs)
                else:
                    sent = await self.bot.send_message(chat_id, message.text, **kwargs)
                return SentMessage(
                    chat_id=str(sent.chat.id), message_id=str(sent.message_id), thread_id=message.thread_id
                )
            except RetryAfter as exc:
                # 429: Telegram did not send it, so sending the same chunk again cannot duplicate.
                wait = _retry_after_seconds(exc)
                if attempts >= self._max_send_attempts + 3 or flood_waited + wait > self._max_flood_wait:
                    log.warning(
                        "telegram: flood control in chat %s lasts long; the outbox retries later", message.chat_id
                    )
                    raise DeliveryDeferred("flood control", retry_after=wait) from None
                log.warning("telegram: flood control (429) in chat %s; retrying in %.1fs", message.chat_id, wait)
                flood_waited += wait
                self._flood.hold(str(chat_id), wait)  # the next wait_turn sleeps it off
            except Forbidden:
                self._mark_forbidden(message.chat_id)
                return None
            except ChatMigrated as exc:
                log.info("telegram: chat %s became supergroup %s; resending there", message.chat_id, exc.new_chat_id)
                chat_id = exc.new_chat_id
                kwargs.pop("reply_parameters", None)
            except BadRequest as exc:
                text = exc.message.lower()
                if formatted and ("parse entities" in text or "too long" in text or "text is empty" in text):
                    log.info("telegram: markup rejected in chat %s; resending as plain text", message.chat_id)
                    formatted = False
                    continue
                if "chat not found" in text:
                    self._mark_forbidden(message.chat_id)
                    return None
                if "thread not found" in text and "message_thread_id" in kwargs:
                    log.warning("telegram: topic %s in chat %s is gone; not sent", message.thread_id, message.chat_id)
                    return None
                log.warning("telegram: sendMessage refused in chat %s: %s", message.chat_id, exc.message)
                return None
            except (TimedOut, NetworkError) as exc:
                if _never_sent(exc) and attempts < self._max_send_attempts:
                    await asyncio.sleep(min(self._backoff_initial * attempts, self._backoff_max))
                    continue
                # The request may have reached Telegram: the outbox resends it later, which can
                # post the chunk twice (Telegram has no idempotency key; see README "Delivery").
                log.warning(
                    "telegram: sendMessage to chat %s failed (%s); the outbox retries it",
                    message.chat_id,
                    type(exc).__name__,
                )
                raise DeliveryDeferred(type(exc).__name__) from None
            except TelegramError as exc:
                log.warning("telegram: sendMessage to chat %s failed (%s)", message.chat_id, type(exc).__name__)
                return None

    def _mark_forbidden(self, chat_id: str) -> None:
        if chat_id not in self._forbidden:
            log.warning(
                "telegram: chat %s refused the message (the bot was removed or blocked); "
                "not sending there until it hears from that chat again",
                chat_id,
            )
        self._forbidden.add(chat_id)

    async def edit(self, sent: SentMessage, text: str) -> bool:
        if not text.strip() or sent.chat_id in self._forbidden:
            return False
        chat_id = _chat_id_param(sent.chat_id)
        message_id = int(sent.message_id)
        html_text = markdown_to_telegram_html(text)
        formatted = True
        for _ in range(self._max_send_attempts + 3):
            await self._flood.wait_turn(sent.chat_id)
            try:
                if formatted:
                    await self.bot.edit_message_text(
                        html_text, chat_id=chat_id, message_id=message_id, parse_mode=ParseMode.HTML
                    )
                else:
                    await self.bot.edit_message_text(text, chat_id=chat_id, message_id=message_id)
                return True
            except RetryAfter as exc:
                wait = _retry_after_seconds(exc)
                if wait > self._max_flood_wait:
                    return False
                self._flood.hold(sent.chat_id, wait)  # 429: not applied, so retrying is safe
            except Forbidden:
                self._mark_forbidden(sent.chat_id)
                return False
            except BadRequest as exc:
                low = exc.message.lower()
                if "not modified" in low:
                    return True
                if formatted and ("parse entities" in low or "too long" in low or "text is empty" in low):
                    formatted = False
                    continue
                log.info("telegram: editMessageText refused in chat %s: %s", sent.chat_id, exc.message)
                return False
            except TelegramError as exc:
                log.info("telegram: editMessageText in chat %s failed (%s)", sent.chat_id, type(exc).__name__)
                return False
        return False

    async def is_chat_admin(self, chat_id: str, user_id: str) -> bool:
        """The chat's creator or an administrator (getChatMember); False when unsure."""
        try:
            member = await self.bot.get_chat_member(_chat_id_param(chat_id), int(user_id))
        except (TelegramError, ValueError) as exc:
            log.warning("telegram: could not look up a member of chat %s (%s)", chat_id, type(exc).__name__)
            return False
        return member.status in ("creator", "administrator")

    async def typing(self, chat_id: str, thread_id: str | None) -> None:
        if chat_id in self._forbidden:
            return
        try:
            await self.bot.send_chat_action(
                _chat_id_param(chat_id),
                ChatAction.TYPING,
                message_thread_id=int(thread_id) if thread_id else None,
            )
        except Forbidden:
            self._mark_forbidden(chat_id)
        except Exception as exc:  # typing is cosmetic: never raise, never retry
            log.debug("telegram: sendChatAction failed (%s)", type(exc).__name__)


# --------------------------------------------------------------------------- doctor


async def doctor(cfg: TelegramConfig) -> tuple[bool, str]:
    """Check the Telegram setup with getMe; (ok, one sentence saying what is wrong or fine)."""
    token = os.environ.get(cfg.token_env, "").strip()
    if not token:
        return False, (f"environment variable {cfg.token_env} is not set; put the token @BotFather gave you there")
    _register_secret(token)
    if not _TOKEN_SHAPE_RE.match(token):
        return False, (
            f"the value of {cfg.token_env} does not look like a bot token "
            "(expected <digits>:<letters>, as @BotFather prints it)"
        )
    where = cfg.base_url.replace(token, "<token>")
    if cfg.mode == "webhook":
        env = cfg.webhook.secret_token_env
        if not env:
            return False, "webhook mode needs platforms.telegram.webhook.secret_token_env"
        secret = os.environ.get(env, "").strip()
        if not secret:
            return False, f"environment variable {env} (the webhook secret token) is not set"
        if not _SECRET_TOKEN_RE.match(secret):
            return False, f"the value of {env} must be 1-256 characters of A-Z a-z 0-9 _ -"
        _register_secret(secret)
    bot, polling = _make_bot(cfg, token, send_timeout_s=15.0)
    try:
        try:
            me = await bot.get_me()
        except InvalidToken:
            return False, (
                f"Telegram rejected the token in {cfg.token_env} (401 Unauthorized); "
                "it was mistyped or revoked: get the current one from @BotFather (/token)"
            )
        except (TimedOut, NetworkError) as exc:
            return (
                False,
                f"can't reach the Bot API at {where} ({type(exc).__name__}); check the network, proxy or base_url",
            )
        except TelegramError as exc:
            return False, f"getMe failed at {where}: {str(exc).replace(token, '<token>')}"
        notes: list[str] = []
        if me.can_read_all_group_messages:
            notes.append("privacy mode is off (the bot receives every group message; the gateway still filters)")
        else:
            notes.append("privacy mode is on (in groups the bot sees mentions, replies to it and commands)")
        if not me.can_join_groups:
            notes.append("joining groups is disabled in @BotFather (/setjoingroups)")
        try:
            info = await bot.get_webhook_info()
            if cfg.mode == "polling" and info.url:
                notes.append("a webhook is set; polling mode removes it at start")
            if cfg.mode == "webhook" and cfg.webhook.public_url and not info.url:
                notes.append("no webhook registered yet; it is set when the gateway starts")
            if info.last_error_message:
                notes.append(f"Telegram's last webhook error: {info.last_error_message}")
        except TelegramError:
            pass
        return True, f"ok: @{me.username} (id {me.id}); " + "; ".join(notes)
    finally:
        await _shutdown_bot(bot, polling)
