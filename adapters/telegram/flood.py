"""Proactive flood control for Telegram: space sends out before Telegram answers 429.

Telegram asks bots to stay under about one message per second in a chat, 20 messages a
minute in a group and 30 messages a second overall; past that it answers 429 and the chat
stalls for the `retry_after` it names. `FloodGate.wait_turn(chat_id)` is awaited before
every send or edit and returns when all three sliding windows have room; a 429 that still
happens is fed back with `hold()`, so later sends to that chat wait too.

This is the policy of PTB's `AIORateLimiter` plus the per-chat limit it lacks, in our own
code because that limiter only plugs into `telegram.ext.ExtBot` and retries on its own,
while the adapter must decide itself when a resend is safe (a chunk is never sent twice).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class FloodLimits:
    """(messages, seconds) per window; Telegram's published limits by default."""

    per_chat: tuple[int, float] = (1, 1.0)
    per_group: tuple[int, float] = (20, 60.0)
    overall: tuple[int, float] = (30, 1.0)


class _Window:
    """At most `limit` events in any `period` seconds (a sliding log of send times)."""

    __slots__ = ("limit", "period", "times")

    def __init__(self, limit: int, period: float) -> None:
        self.limit = max(1, limit)
        self.period = period
        self.times: deque[float] = deque()

    def wait_needed(self, now: float) -> float:
        while self.times and self.times[0] <= now - self.period:
            self.times.popleft()
        if len(self.times) < self.limit:
            return 0.0
        return self.times[-self.limit] + self.period - now

    def record(self, now: float) -> None:
        self.times.append(now)


class _ChatState:
    __slots__ = ("chat", "group", "held_until", "lock")

    def __init__(self, limits: FloodLimits, is_group: bool) -> None:
        self.lock = asyncio.Lock()  # FIFO: sends to one chat keep their order
        self.chat = _Window(*limits.per_chat)
        self.group = _Window(*limits.per_group) if is_group else None
        self.held_until = 0.0


def is_group_chat(chat_id: str) -> bool:
    """Groups and channels have negative ids (or an @username); people positive ones."""
    return not chat_id.isdigit()


class FloodGate:
    """Per-bot send pacing (one per adapter; holds no tenant data, only chat ids and times)."""

    _PRUNE_ABOVE = 512  # chats tracked before idle ones are dropped

    def __init__(
        self,
        limits: FloodLimits | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
    ) -> None:
        self.limits = limits or FloodLimits()
        self._clock = clock
        self._sleep = sleep
        self._overall = _Window(*self.limits.overall)
        self._chats: dict[str, _ChatState] = {}

    def _state(self, chat_id: str) -> _ChatState:
        state = self._chats.get(chat_id)
        if state is None:
            if len(self._chats) >= self._PRUNE_ABOVE:
                self._prune()
            state = self._chats[chat_id] = _ChatState(self.limits, is_group_chat(chat_id))
        return state

    async def wait_turn(self, chat_id: str) -> None:
        """Return when a message to `chat_id` may go out now, and count it as sent."""
        state = self._state(chat_id)
        async with state.lock:
            while True:
                now = self._clock()
                windows = [self._overall, state.chat] + ([state.group] if state.group else [])
                wait = max([state.held_until - now] + [w.wait_needed(now) for w in windows])
                if wait <= 0:
                    for window in windows:
                        window.record(now)
                    return
                await self._sleep(wait)

    def hold(self, chat_id: str, seconds: float) -> None:
        """Telegram answered 429 for this chat: nothing goes there for `seconds`."""
        state = self._state(chat_id)
        state.held_until = max(state.held_until, self._clock() + max(seconds, 0.0))

    def _prune(self) -> None:
        now = self._clock()
        for chat_id, state in list(self._chats.items()):
            windows = [state.chat] + ([state.group] if state.group else [])
            # wait_needed() also drops expired send times, so `times` is then current
            quiet = all(w.wait_needed(now) == 0 and not w.times for w in windows)
            if quiet and not state.lock.locked() and state.held_until <= now:
                del self._chats[chat_id]
