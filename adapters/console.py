"""The console adapter: one line of input is one message; replies go to stdout.

Works with piped stdin, so a script can play several people and group rooms, one
process after another, over the same data directory.
"""

from __future__ import annotations

import asyncio
import itertools
import sys
import time
from collections.abc import Awaitable, Callable
from typing import TextIO

from adapters.console_input import LineSource, PipedLines, PromptLines
from core.messages import InboundMessage, InboundSink, OutboundMessage, SentMessage

THINKING = "thinking… (Ctrl-C quits)"


class ConsoleAdapter:
    """One console person (or group room). On a terminal: a line editor with history, a
    "thinking…" line while the gateway works; piped: plain lines in, plain replies out."""

    platform = "console"
    max_message_length = 100_000
    can_edit = False

    def __init__(
        self,
        user: str,
        room: str | None = None,
        *,
        stdin: TextIO | None = None,
        stdout: TextIO | None = None,
        agent_name: str = "Hermes",
        after_line: Callable[[], Awaitable[object]] | None = None,
        interactive: bool | None = None,
        explain_error: Callable[[], str | None] | None = None,
    ) -> None:
        self.user = user
        self.room = room
        self._stdin = stdin or sys.stdin
        self._stdout = stdout or sys.stdout
        self._agent_name = agent_name
        self._after_line = after_line
        self._explain_error = explain_error
        if interactive is None:
            interactive = _isatty(self._stdin) and _isatty(self._stdout)
        self.interactive = interactive
        self.interrupted = False
        self.errors = 0  # error replies shown (a piped chat then exits non-zero)
        self._thinking = False
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
            platform="console",
            chat_id=self.chat_id,
            chat_type="group" if self.room else "dm",
            user_id=self.user,
            user_name=self.user,
            message_id=f"{self._run_id}-{next(self._ids)}",
            text=text,
            mentions_bot=True,
        )

    async def start(self, sink: InboundSink) -> None:
        self._task = asyncio.create_task(self._read(sink))

    def interrupt(self) -> None:
        """Ctrl-C: stop at once; the turn in flight is cancelled by the caller and its
        message stays pending (answered on the next start)."""
        self.interrupted = True
        self._clear_thinking()
        self.finished.set()

    def _lines(self) -> LineSource:
        if self.interactive:
            return PromptLines(f"{self.user}> ")
        return PipedLines(self._stdin)

    async def _read(self, sink: InboundSink) -> None:
        lines = self._lines()
        try:
            await self._answers()  # replies to messages replayed from the last run come first
            while True:
                try:
                    text = await lines.read()
                except KeyboardInterrupt:
                    self.interrupt()
                    return
                if text is None:
                    break
                if not text.strip():
                    continue
                await sink(self._message(text))
                await self._answers()
                if self.interrupted:
                    return
        finally:
            lines.close()
            self.finished.set()

    async def _answers(self) -> None:
        if self._after_line is not None:
            try:
                await self._after_line()
            finally:
                self._clear_thinking()

    async def stop(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
        self.finished.set()

    def _write(self, text: str, end: str = "\n") -> None:
        self._clear_thinking()
        self._stdout.write(text + end)
        self._stdout.flush()

    def _clear_thinking(self) -> None:
        if self._thinking:
            self._thinking = False
            self._stdout.write("\r\x1b[K")
            self._stdout.flush()

    async def send(self, message: OutboundMessage) -> SentMessage | None:
        label = {"reply": self._agent_name, "notice": "notice", "error": "error"}[message.kind]
        if message.kind == "error":
            self.errors += 1
        self._write(f"{label}: {message.text}")
        if message.kind == "error" and self._explain_error is not None:
            hint = self._explain_error()
            if hint:
                self._write(f"  {hint}")
        return SentMessage(chat_id=message.chat_id, message_id=f"out-{next(self._ids)}")

    async def edit(self, sent: SentMessage, text: str) -> bool:
        return False

    async def typing(self, chat_id: str, thread_id: str | None) -> None:
        """The gateway is working on a turn: show "thinking…" (terminal only)."""
        if self.interactive and not self._thinking and not self.finished.is_set():
            self._thinking = True
            self._stdout.write(f"{self._agent_name} is {THINKING}")
            self._stdout.flush()


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
