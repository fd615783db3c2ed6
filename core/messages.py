"""The normalized message types every platform adapter speaks: `InboundMessage` in,
`OutboundMessage` out, and what a send or download answers.

An adapter turns platform events into these; it never touches storage and never decides
anything about tenants or sessions (docs/development.md#layers).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr

ChatType = Literal["dm", "group", "thread", "channel"]
OutboundKind = Literal["reply", "notice", "error"]


def _is_valid_unicode(value: str) -> bool:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class Attachment(BaseModel):
    """A file on a message. `type` is the platform's kind (`photo`, `voice`, `document`,
    `image`, `audio`, `file`, ...); `file_id` / `url` are what the adapter's `download`
    needs (never a URL carrying the bot token: Telegram's file URLs do, so Telegram keeps
    only the file id). `size` 0 means the platform did not say."""

    model_config = ConfigDict(frozen=True)

    type: str
    name: str = ""
    size: int = 0
    url: str = ""
    file_id: str = ""
    mime_type: str = ""


class DownloadError(Exception):
    """A file could not be fetched; the message is safe to show (no URLs, no tokens)."""

    def __init__(self, message: str, *, too_big: bool = False) -> None:
        super().__init__(message)
        self.too_big = too_big


class ReplyHandle(BaseModel):
    """A way to answer one inbound message other than posting into its chat: a Discord slash
    command's follow-up webhook (application id and interaction token, usable 15 minutes).
    The token is a credential: it stays out of reprs, logs and the stored payload; cluster
    mode carries it to the node that runs the turn in its own inbox column, erased once the
    message is done (docs/cluster.md#slash-commands-answered-from-any-node)."""

    model_config = ConfigDict(frozen=True)

    application_id: str
    token: SecretStr
    #: only the asker sees the answer; it must never be posted in the channel instead
    ephemeral: bool = False
    #: wall-clock time the platform created it (its life is counted from there)
    created_at: float

    def stored(self) -> dict[str, Any]:
        """The handle as the cluster's inbox column keeps it (token included)."""
        return {
            "application_id": self.application_id,
            "token": self.token.get_secret_value(),
            "ephemeral": self.ephemeral,
            "created_at": self.created_at,
        }


class InboundMessage(BaseModel):
    """One message from a person, normalized across platforms. All ids are strings."""

    model_config = ConfigDict(frozen=True)

    platform: str
    chat_id: str
    chat_type: ChatType
    thread_id: str | None = None
    # a private thread (Discord): only its invited members read it, so its shared lane is
    # the thread's own chat tenant, never the parent channel's
    private_thread: bool = False
    user_id: str
    user_name: str = ""
    message_id: str
    text: str = ""
    attachments: tuple[Attachment, ...] = ()
    reply_to_message_id: str | None = None
    # the text of the message replied to, as the platform delivered it with this message
    # (never fetched from elsewhere), and who wrote it ("" when unknown)
    reply_to_text: str | None = None
    reply_to_author: str = ""
    mentions_bot: bool = False
    # the platform shows the answer to the sender only (an ephemeral Discord slash-command
    # reply), so it may say what the sender alone should see even in a group
    private_reply: bool = False
    timestamp: float = Field(default_factory=time.time)
    # The platform's own payload: kept out of logs, reprs and prompts.
    raw: Any = Field(default=None, repr=False, exclude=True)
    # how the answer may go out besides the chat (a Discord interaction): never dumped
    reply_handle: ReplyHandle | None = Field(default=None, repr=False, exclude=True)

    @property
    def principal(self) -> str:
        """The person as `<platform>:<user_id>`."""
        return f"{self.platform}:{self.user_id}"

    def unreadable_fields(self) -> list[str]:
        """Names of the fields that are not valid Unicode (lone surrogates, e.g. from a
        platform's JSON escapes): such a message can't be stored, logged or sent to a
        model, so the gateway refuses it instead of failing on it."""
        bad = []
        values: list[tuple[str, str | None]] = [
            ("platform", self.platform),
            ("chat_id", self.chat_id),
            ("thread_id", self.thread_id),
            ("user_id", self.user_id),
            ("user_name", self.user_name),
            ("message_id", self.message_id),
            ("text", self.text),
            ("reply_to_message_id", self.reply_to_message_id),
        ]
        for a in self.attachments:
            values += [("attachments", a.type), ("attachments", a.name), ("attachments", a.url)]
        for name, value in values:
            if value is not None and not _is_valid_unicode(value) and name not in bad:
                bad.append(name)
        return bad


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
    #: checked by the adapter right before the request, after its own waits (flood
    #: pacing): False means this process may no longer send the chunk (cluster mode: its
    #: lane's lease is gone) and the send is deferred instead
    may_send: Callable[[], bool] | None = Field(default=None, exclude=True, repr=False)


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


class ConfirmRequest(BaseModel):
    """A question with two buttons ("Allow" / "Deny") that only `user_id` may answer: a tool
    call waiting for the person whose turn it is.
    `token` is random and names the question in the buttons' payload (at most 32 chars)."""

    model_config = ConfigDict(frozen=True)

    token: str = Field(max_length=32)
    platform: str
    chat_id: str
    thread_id: str | None = None
    user_id: str  # the only person whose press counts
    text: str  # what is asked, already within the platform's limit


#: what a press means, as the gateway answers the adapter (the adapter shows the person a
#: short refusal for anything but "ok": an alert on Telegram, an ephemeral reply on Discord)
ConfirmVerdict = Literal["ok", "not_yours", "expired"]
#: (token, user_id of who pressed, allow) -> verdict; set by the gateway before `start`
ConfirmAnswerer = Callable[[str, str, bool], Awaitable[ConfirmVerdict]]
#: what a refused press is told (a Telegram alert, an ephemeral Discord reply)
CONFIRM_REFUSALS: dict[str, str] = {
    "not_yours": "Only the person who asked can answer this.",
    "expired": "This question has expired.",
}
_CONFIRM_PREFIX = "hgc:"


def confirm_payload(token: str, allow: bool) -> str:
    """A confirmation button's payload (Telegram callback_data, Discord custom_id):
    `hgc:<token>:a` (Allow) or `hgc:<token>:d` (Deny)."""
    return f"{_CONFIRM_PREFIX}{token}:{'a' if allow else 'd'}"


def parse_confirm_payload(data: object) -> tuple[str, bool] | None:
    """(token, allow) of one of our buttons' payloads; None for anything else (another
    feature's button, a malformed payload)."""
    if not isinstance(data, str) or not data.startswith(_CONFIRM_PREFIX):
        return None
    token, sep, verdict = data[len(_CONFIRM_PREFIX) :].rpartition(":")
    if not sep or not token or verdict not in ("a", "d"):
        return None
    return token, verdict == "a"


async def press_verdict(
    answerer: ConfirmAnswerer | None, token: str, user_id: str, allow: bool, *, timeout_s: float, log: logging.Logger
) -> ConfirmVerdict | None:
    """The gateway's verdict on a button press ("expired" while no answerer is set); None
    when the answerer failed, took over `timeout_s` or answered nonsense (logged): the
    adapter then answers the press without a text, and its receive loop goes on."""
    if answerer is None:
        return "expired"
    try:
        verdict = await asyncio.wait_for(answerer(token, user_id, allow), timeout_s)
    except asyncio.CancelledError:
        raise
    except Exception:
        log.exception("the gateway could not take a button press")
        return None
    if verdict not in ("ok", "not_yours", "expired"):
        log.warning("the gateway answered a button press with %r; ignored", verdict)
        return None
    return verdict


def with_outcome(text: str, outcome: str, limit: int, measure: Callable[[str], int] = len) -> str:
    """A settled question: `text`, a blank line and `outcome`, the question shortened (with
    "…") when the whole would be over the platform's `limit` (in `measure`'s unit)."""
    full = f"{text}\n\n{outcome}"
    if measure(full) <= limit:
        return full
    tail = f"…\n\n{outcome}"
    room = max(limit - measure(tail), 0)
    cut = text[:room]
    while (excess := measure(cut) - room) > 0:  # each char is at least one unit
        cut = cut[:-excess]
    return cut.rstrip() + tail


#: (platform, text) of a group message the adapter drops unanswered (no mention): the gateway
#: still looks at it (a link code posted where others read it is burnt); set by the gateway
OverheardHook = Callable[[str, str], Awaitable[None]]
