"""What the parts of the Telegram adapter share: the attributes receive, normalise and
send read and write (declared here once, set in `TelegramAdapter.__init__`), and the
connection health /healthz reads (`status`, `down_since`), which the receive path updates.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from telegram import Bot
from telegram.request import HTTPXRequest

from adapters.telegram.client import log
from core.messages import ConfirmAnswerer, InboundSink, OverheardHook
from core.protocols import SendPacer
from core.settings import TelegramConfig


class TelegramState:
    """The state of one `TelegramAdapter`; the parts (`Normalising`, `Receiving`,
    `Sending`) are mixins over it."""

    cfg: TelegramConfig
    max_message_length: int
    bot: Bot
    _polling_request: HTTPXRequest  # the connection getUpdates uses (closed on its own at stop)
    _token: str
    _webhook_secret: str | None
    _backoff_initial: float
    _backoff_max: float
    _max_send_attempts: int
    _max_flood_wait: float
    _flood: SendPacer  # FloodGate on one node, the shared pacer in a cluster

    bot_id: int | None
    bot_username: str | None
    _sink: InboundSink | None
    overheard: OverheardHook | None  # group text dropped unanswered (link-code screen)
    answerer: ConfirmAnswerer | None  # a press of a confirmation button (set before start)
    _task: asyncio.Task[None] | None
    _stopping: asyncio.Event
    _ready: asyncio.Event
    _offset: int | None  # next update_id to ask for (= acknowledge below it)
    _acked_offset: int | None  # the offset Telegram has last been told
    _forbidden: set[str]  # chats that answered 403: logged once, skipped
    _runner: Any  # aiohttp AppRunner in webhook mode
    _bound_port: int | None
    _elected: bool
    _receiving: asyncio.Event  # set while this adapter polls or owns the webhook
    _recv_stop: asyncio.Event  # ends the poll loop (stop() or stop_receiving())
    _recv_task: asyncio.Task[None] | None
    _sink_lock: asyncio.Lock
    # the connection as /healthz and `hermes_adapter_connected` see it (see `status`)
    _failed: str | None  # final: only a rejected token or an unusable webhook
    _last_error: str | None  # why the last Bot API call of the receive path failed
    _ok_at: float | None  # monotonic time the Bot API last answered that path
    _down_since: float | None  # monotonic time it stopped (or had not yet begun)
    #: seconds a success stays fresh while polling (a long poll answers within
    #: poll_timeout_s); None when nothing polls (webhook, or not elected to receive)
    _fresh_s: float | None
    #: updates that could not be parsed, skipped (polling goes on)
    skipped_events: int

    # ----------------------------------------------------------------- health

    @property
    def receiving(self) -> bool:
        """True while this adapter polls (or, in webhook mode, registered the webhook)."""
        return self._receiving.is_set()

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

    async def _sleep(self, seconds: float, until: asyncio.Event | None = None) -> bool:
        """Sleep, but wake up at stop() (or when `until` is set); True when stopping."""
        try:
            await asyncio.wait_for((until or self._stopping).wait(), timeout=seconds)
        except TimeoutError:
            return False
        return True
