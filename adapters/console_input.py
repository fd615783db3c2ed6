"""Where the console chat's lines come from: a line editor with history on a terminal,
plain lines from a pipe or file.

`read()` returns the next line (without its newline), or None at end of input; on a
terminal, Ctrl-C at the prompt raises KeyboardInterrupt.
"""

from __future__ import annotations

import asyncio
import codecs
import os
import threading
from typing import Protocol, TextIO


class LineSource(Protocol):
    async def read(self) -> str | None: ...

    def close(self) -> None: ...


class PromptLines:
    """prompt_toolkit: arrow keys, Home/End, history (up/down), no 4,095-char cut of long
    pastes (the terminal stays in raw mode while typing, so the tty line limit never applies)."""

    def __init__(self, prompt: str) -> None:
        from prompt_toolkit import PromptSession
        from prompt_toolkit.history import InMemoryHistory

        self._prompt = prompt
        self._session: PromptSession[str] = PromptSession(history=InMemoryHistory())

    async def read(self) -> str | None:
        try:
            # SIGINT stays with the caller: Ctrl-C while the prompt is shown arrives as a key
            # and raises KeyboardInterrupt here; during a reply it is a signal.
            return await self._session.prompt_async(self._prompt, handle_sigint=False)
        except EOFError:  # Ctrl-D on an empty line
            return None

    def close(self) -> None:
        return None


class PipedLines:
    """Lines read from a file descriptor by a daemon thread, so a blocked read never holds up
    the event loop or the process exit (Ctrl-C, or the gateway stopping)."""

    def __init__(self, stream: TextIO) -> None:
        self._queue: asyncio.Queue[str | None] = asyncio.Queue()
        self._loop = asyncio.get_running_loop()
        self._stream = stream
        try:
            self._fd: int | None = stream.fileno()
        except (AttributeError, OSError, ValueError):  # e.g. io.StringIO in tests
            self._fd = None
        self._thread = threading.Thread(target=self._pump, name="console-stdin", daemon=True)
        self._thread.start()

    async def read(self) -> str | None:
        return await self._queue.get()

    def close(self) -> None:
        return None

    def _put(self, line: str | None) -> bool:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, line)
            return True
        except RuntimeError:  # the loop is closed: nobody is listening any more
            return False

    def _pump(self) -> None:
        try:
            if self._fd is None:
                for line in iter(self._stream.readline, ""):
                    if not self._put(line.rstrip("\r\n")):
                        return
                return
            # raw reads (no buffered-reader lock a daemon thread could hold at exit);
            # bytes that are not UTF-8 become U+FFFD instead of ending the chat
            decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
            pending = ""
            while True:
                try:
                    chunk = os.read(self._fd, 65536)
                except OSError:
                    chunk = b""
                pending += decoder.decode(chunk, final=not chunk)
                *lines, pending = pending.split("\n")
                for line in lines:
                    if not self._put(line.rstrip("\r")):
                        return
                if not chunk:
                    if pending and not self._put(pending.rstrip("\r")):
                        return
                    return
        finally:
            self._put(None)
