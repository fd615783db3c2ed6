"""An in-process platform: the host program pushes messages and receives the replies.

For embedding the gateway in another program, and for tests and benchmarks that need a
real adapter without a network.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

from core.messages import InboundMessage, InboundSink, OutboundMessage, SentMessage


class LoopbackAdapter:
    """`push` feeds the gateway; every reply goes to `on_send` and, with `record`, into `sent`."""

    can_edit = True

    def __init__(
        self,
        platform: str = "loopback",
        max_message_length: int = 4000,
        *,
        on_send: Callable[[OutboundMessage], None] | None = None,
        record: bool = True,
    ) -> None:
        self.platform = platform
        self.max_message_length = max_message_length
        self.on_send = on_send
        self.record = record
        self.sent: list[OutboundMessage] = []
        self.edits: list[tuple[SentMessage, str]] = []
        self.typing_calls = 0
        #: (chat_id, user_id) pairs that are the chat's admins (`is_chat_admin`)
        self.chat_admins: set[tuple[str, str]] = set()
        self.sink: InboundSink | None = None
        self._ids = itertools.count(1)

    @staticmethod
    def measure(text: str) -> int:
        return len(text)

    async def start(self, sink: InboundSink) -> None:
        self.sink = sink

    async def stop(self) -> None:
        self.sink = None

    async def push(self, msg: InboundMessage) -> None:
        """Hand `msg` to the gateway; returns once it is durably recorded."""
        if self.sink is None:
            raise RuntimeError("loopback adapter is not started")
        await self.sink(msg)

    async def send(self, message: OutboundMessage) -> SentMessage | None:
        if self.record:
            self.sent.append(message)
        if self.on_send is not None:
            self.on_send(message)
        return SentMessage(chat_id=message.chat_id, message_id=f"bot-{next(self._ids)}", thread_id=message.thread_id)

    async def edit(self, sent: SentMessage, text: str) -> bool:
        if self.record:
            self.edits.append((sent, text))
        return True

    async def typing(self, chat_id: str, thread_id: str | None) -> None:
        self.typing_calls += 1

    async def is_chat_admin(self, chat_id: str, user_id: str) -> bool:
        return (chat_id, user_id) in self.chat_admins
