"""Streaming delivery: the answer appears in the chat as the model writes it.

One message is sent once the answer has been growing for `interval_s` (a quick answer
arrives whole, exactly as without streaming), then edited at most once per `interval_s`
(Telegram and Discord allow about one edit a second per message); past the platform limit
the text continues in further messages. `finish` puts the final text in place. A reply
may start from `drafts` an earlier run left in the chat (cluster mode, after a takeover):
they are edited, not sent again.

Sending and editing go through the callables given to the constructor, so the caller
decides how a chunk reaches the platform (directly, or through a delivery ledger).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence

from core.messages import SentMessage

log = logging.getLogger("hermes.streaming")

# send(chunk, first): deliver one new chunk (`first`: it replies to the person's message)
SendChunk = Callable[[str, bool], Awaitable[SentMessage | None]]
EditChunk = Callable[[SentMessage, str], Awaitable[bool]]
Split = Callable[[str], list[str]]

CURSOR = " …"  # shown at the end of a draft while the model is still writing


class StreamingReply:
    """One reply being streamed into a chat: `feed(text_so_far)` while the model writes,
    then `close()` and, if `started`, `finish(final_text)`."""

    def __init__(
        self,
        send: SendChunk,
        edit: EditChunk,
        split: Split,
        *,
        interval_s: float,
        max_chars: int | None = None,
        drafts: Sequence[SentMessage] = (),
    ) -> None:
        self._send, self._edit, self._split = send, edit, split
        self._interval = interval_s
        self._max_chars = max_chars  # a draft never grows past the first page of a long answer
        self._latest = ""
        self._changed = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._lock = asyncio.Lock()  # one show at a time; finish waits for one in flight
        # the messages of this reply and what they show ("": unknown, an earlier run's draft)
        self._sent: list[tuple[SentMessage, str]] = [(d, "") for d in drafts]
        self._closed = False

    @property
    def started(self) -> bool:
        """True once a draft is in the chat (the final text must then be put in place)."""
        return bool(self._sent)

    def feed(self, text: str) -> None:
        """The answer so far (the whole text, not a delta); cheap, never waits."""
        if self._closed:
            return
        if self._max_chars is not None and len(text) > self._max_chars:
            text = text[: self._max_chars]
        self._latest = text
        self._changed.set()
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="streaming-reply")

    async def _run(self) -> None:
        await asyncio.sleep(self._interval)  # quick answers never show a draft
        while True:
            await self._changed.wait()
            self._changed.clear()
            if self._latest.strip():
                # shielded: close() never cuts a send or edit in half (no unrecorded message)
                await asyncio.shield(self._show(self._latest.rstrip() + CURSOR, final=False))
            await asyncio.sleep(self._interval)

    async def close(self) -> None:
        """Stop drafting (after an edit in flight is done); nothing more is shown."""
        self._closed = True  # a draft show not yet begun does nothing
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None
        async with self._lock:  # an edit shielded from the cancel finishes first
            pass

    async def finish(self, text: str) -> SentMessage | None:
        """Put the final `text` in place of the draft (edits, then new messages past the
        limit); returns the reply's first message, None when nothing could be delivered."""
        await self.close()
        await self._show(text, final=True)
        return self._sent[0][0] if self._sent else None

    def placement(self, text: str) -> list[tuple[SentMessage | None, str]]:
        """Where the final `text` goes, chunk by chunk: the draft message it replaces, or
        None for a new message past the drafts (for a caller that records them at once)."""
        chunks = self._split(text)
        return [(self._sent[i][0] if i < len(self._sent) else None, chunk) for i, chunk in enumerate(chunks)]

    async def _show(self, text: str, *, final: bool) -> None:
        async with self._lock:
            if self._closed and not final:
                return
            for i, chunk in enumerate(self._split(text)):
                if i < len(self._sent):
                    sent, shown = self._sent[i]
                    if shown == chunk:
                        continue
                    if await self._edit(sent, chunk):
                        self._sent[i] = (sent, chunk)
                        continue
                    if not final:
                        return  # a draft edit that failed: the next one (or the final) tries again
                    log.info("could not edit a streamed message; sending the final text anew")
                    anew = await self._send(chunk, False)
                    if anew is None:
                        return
                    self._sent[i] = (anew, chunk)
                    continue
                new = await self._send(chunk, i == 0)
                if new is None:
                    return
                self._sent.append((new, chunk))
