"""Telegram adapter: python-telegram-bot's `Bot` for every Bot API call, our own polling
loop (so an update is acknowledged only after the gateway recorded it), an optional
webhook server, mention gating in groups, and delivery that never fails on formatting.

Nothing here touches storage or decides anything about tenants: inbound updates become
`InboundMessage`s handed to the gateway's sink, outbound chunks are sent as asked.

`TelegramAdapter` is its lifecycle (construction, start, stop); the rest are its parts:
`receive.py` (polling, webhook, button presses), `normalise.py` (update -> InboundMessage),
`send.py` (send, edit, typing, download, confirmation questions), over the state in
`state.py` and the client in `client.py`.
"""

from __future__ import annotations

import asyncio
import os
import re
import time
from typing import Any

from telegram import BotCommand
from telegram.error import InvalidToken, NetworkError, TelegramError

from adapters.telegram.client import _SECRET_TOKEN_RE, _make_bot, _register_secret, _shutdown_bot, log
from adapters.telegram.flood import FloodGate, FloodLimits
from adapters.telegram.receive import Receiving
from adapters.telegram.send import Sending
from core.backoff import Backoff
from core.commands import COMMAND_SPECS
from core.messages import InboundSink
from core.protocols import SendPacer
from core.settings import ConfigError, TelegramConfig
from core.text import utf16_len

_COMMAND_NAME_RE = re.compile(r"^[a-z0-9_]{1,32}$")


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


class TelegramAdapter(Receiving, Sending):
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
        flood_gate: SendPacer | None = None,
        elected: bool = False,
    ) -> None:
        """`elected=True` (cluster mode): `start()` connects (and serves the webhook in
        webhook mode) but receives nothing by itself; the node elected for ingress calls
        `start_receiving()` (polling: poll; webhook: call setWebhook) and `stop_receiving()`.
        `flood_gate` paces the sends (default: this process's own `FloodGate(flood_limits)`;
        a cluster passes the one all nodes share, docs/cluster.md#flood-pacing-across-nodes)."""
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
        self._flood = flood_gate if flood_gate is not None else FloodGate(flood_limits)
        self.bot, self._polling_request = _make_bot(cfg, token, send_timeout_s=send_timeout_s)

        # declared, with what each one means, in state.py
        self.bot_id = None
        self.bot_username = None
        self._sink = None
        self.overheard = None
        self.answerer = None
        self._task = None
        self._stopping = asyncio.Event()
        self._ready = asyncio.Event()
        self._offset = None
        self._acked_offset = None
        self._forbidden = set()
        self._runner = None
        self._bound_port = None
        self._elected = elected
        self._receiving = asyncio.Event()
        self._recv_stop = asyncio.Event()
        self._recv_task = None
        self._sink_lock = asyncio.Lock()
        self._failed = None
        self._last_error = None
        self._ok_at = None
        self._down_since = None
        self._fresh_s = None
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
        wait = Backoff(self._backoff_initial, self._backoff_max)
        while not self._ready.is_set() and not self._stopping.is_set():
            try:
                await self._identify()
            except InvalidToken:
                self._give_up(f"Telegram rejected the bot token in {self.cfg.token_env} (401); fix it and restart")
                return
            except (TelegramError, OSError) as exc:
                self._unanswered(f"getMe failed ({type(exc).__name__})")
                delay = wait.next()
                log.warning("telegram: getMe failed (%s); retrying in %.0fs", type(exc).__name__, delay)
                if await self._sleep(delay):
                    return
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
