"""Per-person rate limiting: a sliding one-minute window per principal."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable


class RateLimiter:
    """Allows `per_minute` messages per principal in any 60-second window."""

    def __init__(self, per_minute: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.per_minute = per_minute
        self._clock = clock
        self._hits: dict[str, deque[float]] = {}

    def allow(self, principal: str) -> tuple[bool, float]:
        """(allowed, seconds to wait when not)."""
        now = self._clock()
        hits = self._hits.setdefault(principal, deque())
        while hits and now - hits[0] >= 60:
            hits.popleft()
        if len(hits) >= self.per_minute:
            return False, 60 - (now - hits[0])
        hits.append(now)
        if len(self._hits) > 10_000:  # drop idle principals so memory stays bounded
            for key in [k for k, v in self._hits.items() if not v or now - v[-1] >= 60]:
                del self._hits[key]
        return True, 0.0
