"""The adapter interface every platform implements, and the small capability protocols
an adapter may add (chat admins, overheard group text, downloads, status, close).

The gateway asks `isinstance(adapter, ChatAdmins)` and the like instead of probing
attributes, so what an adapter can do is written in one place.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from core.messages import (
    Attachment,
    ConfirmAnswerer,
    ConfirmRequest,
    InboundMessage,
    InboundSink,
    OutboundMessage,
    OverheardHook,
    SentMessage,
)


class Adapter(Protocol):
    """A platform connection. `send` delivers one chunk; splitting is the gateway's job."""

    platform: str
    #: the platform's per-message limit, measured with `measure`
    max_message_length: int
    #: whether `edit` works (progress notices are edited in place where it does)
    can_edit: bool

    def measure(self, text: str) -> int:
        """Length of `text` in the platform's unit (UTF-16 units on Telegram, chars on Discord)."""
        ...

    async def start(self, sink: InboundSink) -> None:
        """Connect and begin feeding inbound messages to `sink`; returns once running."""
        ...

    async def stop(self) -> None: ...

    async def send(self, message: OutboundMessage) -> SentMessage | None:
        """Send one chunk (already within the limit); None when the chat is gone or refuses
        it for good (never retried); raises when it may work later (retried by the outbox)."""
        ...

    async def edit(self, sent: SentMessage, text: str) -> bool: ...

    async def typing(self, chat_id: str, thread_id: str | None) -> None:
        """Show the typing indicator once (the gateway repeats it while a turn runs)."""
        ...


@runtime_checkable
class ChatAdmins(Protocol):
    """Whether a user moderates a chat on the platform (Telegram chat administrators,
    Discord members with Manage Messages). Adapters without it have no chat admins; only
    the gateway's own admins count there."""

    async def is_chat_admin(self, chat_id: str, user_id: str) -> bool: ...


@runtime_checkable
class Overhears(Protocol):
    """Group text the adapter drops unanswered (no mention) is still handed to the gateway
    (a link code posted where others read it is burnt). The gateway sets the hook before
    `start`, never after."""

    overheard: OverheardHook | None


@runtime_checkable
class Confirms(Protocol):
    """Platforms with buttons ask a person to allow a tool call:
    `ask` posts the question with "Allow" / "Deny", a press is handed to `answerer` (set by
    the gateway before `start`, never after) and the adapter shows the presser a short
    refusal unless the verdict is "ok"; `settle` replaces the buttons by the outcome."""

    answerer: ConfirmAnswerer | None

    async def ask(self, request: ConfirmRequest) -> SentMessage | None:
        """Post the question; None when the chat refuses it (the call is then denied)."""
        ...

    async def settle(self, request: ConfirmRequest, sent: SentMessage, outcome: str) -> None:
        """Edit the question to say `outcome` ("Allowed." / "Denied." / "No answer: denied."), buttons removed."""
        ...


@runtime_checkable
class Downloads(Protocol):
    """Platforms with files: fetch one attachment through the platform's client library,
    raising `DownloadError` (too_big when over `max_bytes`). The gateway calls it; the
    inbound path never does."""

    async def download(self, attachment: Attachment, max_bytes: int) -> bytes: ...


@runtime_checkable
class ReportsStatus(Protocol):
    """What /healthz and /metrics show of a platform (docs/operator-guide.md#health-and-metrics):
    `connected...`, `connecting...`, `failed: <what to do>` when no retry can help, or `stopped`."""

    @property
    def status(self) -> str: ...


@runtime_checkable
class ReportsConnected(Protocol):
    """A simpler platform state than `ReportsStatus`: only whether it is connected."""

    @property
    def is_connected(self) -> bool: ...


@runtime_checkable
class TracksDowntime(Protocol):
    """`time.monotonic()` since the platform is not connected (None while it is): /healthz
    turns red once that is longer than `observability.unhealthy_after_s`."""

    @property
    def down_since(self) -> float | None: ...


@runtime_checkable
class SkipsEvents(Protocol):
    """Counts platform events it could not parse and skipped."""

    @property
    def skipped_events(self) -> int: ...


@runtime_checkable
class Closable(Protocol):
    """Has resources to release after `stop` (an HTTP client, a webhook server)."""

    async def aclose(self) -> None: ...


class SendPacer(Protocol):
    """Spaces a bot's sends under the platform's flood limits (per chat, per group, per bot).
    One node paces in its own process (adapters/telegram/flood.py `FloodGate`); a cluster
    shares the pacing through PostgreSQL (docs/cluster.md#flood-pacing-across-nodes)."""

    async def wait_turn(self, chat_id: str) -> None:
        """Return when a message to `chat_id` may go out now, and count it as sent; raises
        `DeliveryDeferred` when that cannot be known now (the shared pacing is unreachable)."""
        ...

    def hold(self, chat_id: str, seconds: float) -> None:
        """The platform answered 429 for this chat: nothing goes there for `seconds`."""
        ...


@runtime_checkable
class ElectedReceiver(Protocol):
    """Cluster mode: receives only while this node holds the platform's ingress role
    (Telegram's polling or webhook registration), started and stopped by the election."""

    @property
    def elected(self) -> bool: ...

    async def start_receiving(self) -> None: ...

    async def stop_receiving(self) -> None: ...


@runtime_checkable
class AdoptsReplies(Protocol):
    """Cluster mode: a message another node received may carry a `ReplyHandle` (a Discord
    slash command that node deferred); the node that runs its turn hands it to its own
    adapter first, so the answer completes that interaction
    (docs/cluster.md#slash-commands-answered-from-any-node)."""

    def adopt(self, msg: InboundMessage) -> None:
        """Answer `msg` through its handle from now on (an expired one still keeps a private
        answer out of the channel)."""
        ...

    async def release(self, message_ids: Sequence[str], done: bool) -> None:
        """The lane's claim ended: forget these messages' handles. With `done` nothing will
        answer them any more, so the placeholder of one still unanswered is removed."""
        ...


@runtime_checkable
class ElectedShards(Protocol):
    """Cluster mode: each gateway shard (Discord) is its own ingress role, spread over the
    nodes by the election."""

    @property
    def elected(self) -> bool: ...

    async def start_shard(self, shard_id: int) -> None: ...

    async def stop_shard(self, shard_id: int) -> None: ...
