"""The console adapter: one line of stdin is one message; replies go to stdout.

Works with piped stdin, so a script can play several people and group rooms, one
process after another, over the same data directory.
"""

from __future__ import annotations

import asyncio
import itertools
import sys
import time
from typing import Awaitable, Callable, TextIO

from adapters.base import InboundMessage, InboundSink, OutboundMessage, SentMessage


class ConsoleAdapter:
    platform = "console"
    max_message_length = 100_000
    can_edit = False

    def __init__(self, user: str, room: str | None = None, *, stdin: TextIO | None = None,
                 stdout: TextIO | None = None, agent_name: str = "Hermes",
                 after_line: Callable[[], Awaitable[object]] | None = None) -> None:
        self.user = user
        self.room = room
        self._stdin = stdin or sys.stdin
        self._stdout = stdout or sys.stdout
        self._agent_name = agent_name
        self._after_line = after_line
        self._ids = itertools.count(1)
        self._run_id = f"{time.time_ns():x}"  # message ids stay unique across runs
        self._task: asyncio.Task | None = None
        self.finished = asyncio.Event()

    @staticmethod
    def measure(text: str) -> int:
        return len(text)

    async def is_chat_admin(self, chat_id: str, user_id: str) -> bool:
        """The person at the console runs the room (the only one typing in it)."""
        return user_id == self.user

    @property
    def chat_id(self) -> str:
        return self.room if self.room else self.user

    def _message(self, text: str) -> InboundMessage:
        return InboundMessage(
            platform="console", chat_id=self.chat_id, chat_type="group" if self.room else "dm",
            user_id=self.user, user_name=self.user, message_id=f"{self._run_id}-{next(self._ids)}",
            text=text, mentions_bot=True)

    async def start(self, sink: InboundSink) -> None:
        self._task = asyncio.create_task(self._read(sink))

    async def _read(self, sink: InboundSink) -> None:
        interactive = self._stdin.isatty()
        try:
            while True:
                if interactive:
                    self._write(f"{self.user}> ", end="")
                line = await asyncio.to_thread(self._stdin.readline)
                if not line:
                    break
                text = line.rstrip("\r\n")
                if not text.strip():
                    continue
                await sink(self._message(text))
                if self._after_line is not None:
                    await self._after_line()
        finally:
            self.finished.set()

    async def stop(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
        self.finished.set()

    def _write(self, text: str, end: str = "\n") -> None:
        self._stdout.write(text + end)
        self._stdout.flush()

    async def send(self, message: OutboundMessage) -> SentMessage | None:
        label = {"reply": self._agent_name, "notice": "notice", "error": "error"}[message.kind]
        self._write(f"{label}: {message.text}")
        return SentMessage(chat_id=message.chat_id, message_id=f"out-{next(self._ids)}")

    async def edit(self, sent: SentMessage, text: str) -> bool:
        return False

    async def typing(self, chat_id: str, thread_id: str | None) -> None:
        return None
