"""The normalized message types and the adapter interface every platform implements.

An adapter turns platform events into `InboundMessage` and sends `OutboundMessage`;
it never touches storage and never decides anything about tenants or sessions.
"""

from __future__ import annotations

import time
from typing import Any, Awaitable, Callable, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field

ChatType = Literal["dm", "group", "thread", "channel"]
OutboundKind = Literal["reply", "notice", "error"]


class Attachment(BaseModel):
    model_config = ConfigDict(frozen=True)

    type: str
    name: str = ""
    size: int = 0
    url: str = ""


class InboundMessage(BaseModel):
    """One message from a person, normalized across platforms. All ids are strings."""

    model_config = ConfigDict(frozen=True)

    platform: str
    chat_id: str
    chat_type: ChatType
    thread_id: str | None = None
    user_id: str
    user_name: str = ""
    message_id: str
    text: str = ""
    attachments: tuple[Attachment, ...] = ()
    reply_to_message_id: str | None = None
    mentions_bot: bool = False
    timestamp: float = Field(default_factory=time.time)
    # The platform's own payload: kept out of logs, reprs and prompts.
    raw: Any = Field(default=None, repr=False, exclude=True)

    @property
    def principal(self) -> str:
        """The person as `<platform>:<user_id>`."""
        return f"{self.platform}:{self.user_id}"


class OutboundMessage(BaseModel):
    """One message the gateway sends into a chat."""

    model_config = ConfigDict(frozen=True)

    chat_id: str
    thread_id: str | None = None
    text: str
    reply_to_message_id: str | None = None
    kind: OutboundKind = "reply"
    #: idempotency key of this chunk (stable across resends): Discord's `nonce` with
    #: `enforce_nonce`, so a resend returns the first message instead of posting twice
    nonce: str | None = None


class DeliveryDeferred(Exception):
    """`send` could not deliver now but may later (5xx, network, long flood control): the
    gateway's outbox retries the chunk, after `retry_after` seconds when the platform said so."""

    def __init__(self, reason: str, retry_after: float | None = None) -> None:
        super().__init__(reason)
        self.retry_after = retry_after


class SentMessage(BaseModel):
    """What the platform answered for a sent message: enough to edit it later."""

    model_config = ConfigDict(frozen=True)

    chat_id: str
    message_id: str
    thread_id: str | None = None


# The gateway's entry point: awaiting it returns once the message is durably recorded,
# so an adapter may acknowledge the platform (e.g. Telegram's offset) right after.
InboundSink = Callable[[InboundMessage], Awaitable[None]]


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
