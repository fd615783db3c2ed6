"""Replies: what the gateway says goes into the outbox first (split at the platform's
limit), then the deliverer sends it. Also the streamed draft of an answer, progress
notices and the typing indicator while a turn runs."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence

from core.messages import InboundMessage, OutboundKind, SentMessage
from core.protocols import Adapter
from core.settings import Config
from core.text import split_text
from gateway.modes import StreamedDrafts
from gateway.outbox import Deliverer, Draft, Outbox, StreamRole
from gateway.streaming import StreamingReply

log = logging.getLogger("hermes.gateway")

TYPING_INTERVAL_S = 4.0


class Replies:
    """Send and edit through the outbox, for the chat of an inbound message."""

    def __init__(
        self,
        cfg: Config,
        adapters: Mapping[str, Adapter],
        outbox: Outbox,
        deliverer: Deliverer,
        drafts: StreamedDrafts | None = None,
    ) -> None:
        self.cfg = cfg
        self.adapters = adapters
        self.outbox = outbox
        self.deliverer = deliverer
        self.drafts = drafts  # cluster mode: drafts a dead node's run of a turn left in the chat

    async def send(
        self,
        msg: InboundMessage,
        text: str,
        *,
        kind: OutboundKind = "reply",
        reply: bool = True,
        finish: Sequence[tuple[InboundMessage, str]] = (),
        stream: StreamRole | None = None,
    ) -> list[int]:
        """Record `text` for `msg`'s chat in the outbox, split at the platform limit (the
        first chunk replies to `msg`), mark `finish` done in the same transaction, and
        hand it to the deliverer. Returns the chunk ids."""
        adapter = self.adapters.get(msg.platform)
        chunks = split_text(text, adapter.max_message_length, adapter.measure) if adapter is not None else []
        if adapter is None and text:
            log.warning("no adapter for platform %s; reply dropped", msg.platform)
        drafts = [
            Draft(
                platform=msg.platform,
                chat_id=msg.chat_id,
                thread_id=msg.thread_id,
                text=chunk,
                kind=kind,
                reply_to=msg.message_id if (reply and i == 0) else None,
                stream=stream,
            )
            for i, chunk in enumerate(chunks)
        ]
        ids = await self.outbox.record(drafts, finish=finish, source=msg)
        if ids:
            self.deliverer.kick(msg.platform, msg.chat_id)
        return ids

    async def send_and_finish(self, msg: InboundMessage, text: str, kind: OutboundKind, outcome: str) -> None:
        """Record the answer in the outbox and mark `msg` done, in one transaction."""
        await self.send(msg, text, kind=kind, finish=[(msg, outcome)])

    async def edit(self, msg: InboundMessage, chunk_id: int, text: str, stream: StreamRole | None = None) -> int:
        """Record new text for the message chunk `chunk_id` became (sent as a new message
        if it cannot be edited); it keeps its place in the chat's order."""
        [edit_id] = await self.outbox.record(
            [
                Draft(
                    platform=msg.platform,
                    chat_id=msg.chat_id,
                    thread_id=msg.thread_id,
                    text=text,
                    kind="notice",
                    edit_of=chunk_id,
                    stream=stream,
                )
            ],
            source=msg,
        )
        self.deliverer.kick(msg.platform, msg.chat_id)
        return edit_id

    async def streaming_reply(
        self, msg: InboundMessage, answering: Sequence[InboundMessage] = ()
    ) -> StreamingReply | None:
        """A streamed reply to `msg` when `delivery.streaming` covers its chat and the
        platform can edit messages; None: the answer is sent when it is complete. Drafts go
        through the outbox like every other message (a handle's message_id is its chunk id);
        in cluster mode the reply starts from the drafts an earlier run answering
        `answering` left (docs/cluster.md#streaming-and-progress-notices)."""
        mode, adapter = self.cfg.streaming_mode, self.adapters.get(msg.platform)
        if adapter is None or not adapter.can_edit or mode == "off" or (mode == "dm" and msg.chat_type != "dm"):
            return None
        earlier = await self.drafts.drafts_of(answering or [msg]) if self.drafts is not None else []

        async def send(chunk: str, first: bool) -> SentMessage | None:
            ids = await self.send(msg, chunk, kind="reply", reply=first, stream="draft")
            return SentMessage(chat_id=msg.chat_id, thread_id=msg.thread_id, message_id=str(ids[0])) if ids else None

        async def edit(handle: SentMessage, text: str) -> bool:
            await self.edit(msg, int(handle.message_id), text, stream="draft")
            return True

        return StreamingReply(
            send,
            edit,
            lambda text: split_text(text, adapter.max_message_length, adapter.measure),
            interval_s=self.cfg.delivery.stream_edit_interval_s,
            max_chars=self.cfg.delivery.max_reply_chars,
            drafts=earlier,
        )

    async def keep_typing(self, msg: InboundMessage) -> None:
        """The typing indicator in `msg`'s chat until cancelled."""
        adapter = self.adapters.get(msg.platform)
        if adapter is None:
            return
        while True:
            try:
                await adapter.typing(msg.chat_id, msg.thread_id)
            except Exception:
                log.debug("typing indicator failed", exc_info=True)
            await asyncio.sleep(TYPING_INTERVAL_S)


class Notifier:
    """Progress notices of one turn: the start notice is edited into the end notice where
    the platform can edit; routine ones are dropped unless `progress_notices` is on."""

    def __init__(self, replies: Replies, msg: InboundMessage) -> None:
        self.replies, self.msg = replies, msg
        self._progress: int | None = None  # the outbox chunk of the start notice

    async def __call__(self, kind: str, text: str) -> None:
        if kind in ("progress", "progress_done") and not self.replies.cfg.compression.progress_notices:
            return
        adapter = self.replies.adapters.get(self.msg.platform)
        if adapter is None:
            return
        if kind == "progress_done" and self._progress is not None and adapter.can_edit:
            # the deliverer falls back to a new message
            await self.replies.edit(self.msg, self._progress, text, stream="progress_end")
            self._progress = None
            return
        ids = await self.replies.send(
            self.msg,
            text,
            kind="notice" if kind.startswith("progress") else "error",
            reply=False,
            stream="progress" if kind == "progress" else None,
        )
        if kind == "progress" and len(ids) == 1:
            self._progress = ids[0]
