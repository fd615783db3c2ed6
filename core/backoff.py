"""The one backoff: exponential delays between retries, capped, with optional jitter.

Two shapes of the same rule: `backoff_delay(failures, ...)` for code that counts failures
itself (a lane's held turn, the outbox), and `Backoff` for a loop that keeps one going
(an adapter reconnecting, a poller). Both give `initial * factor ** (failures - 1)`,
never more than `maximum`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field


def backoff_delay(failures: int, initial: float, maximum: float, *, factor: float = 2.0, jitter: float = 0.0) -> float:
    """The wait after the `failures`-th failure in a row (1 -> `initial`); `jitter` 0.2
    spreads it over ±20 % so many waiters do not retry in step."""
    delay = min(initial * factor ** max(failures - 1, 0), maximum)
    if jitter:
        delay *= 1 - jitter + 2 * jitter * random.random()
    return delay


@dataclass
class Backoff:
    """A running backoff: `next()` is the wait before the next attempt and grows it;
    `reset()` after a success starts again from `initial`."""

    initial: float
    maximum: float
    factor: float = 2.0
    jitter: float = 0.0
    failures: int = field(default=0, init=False)

    def next(self) -> float:
        self.failures += 1
        return backoff_delay(self.failures, self.initial, self.maximum, factor=self.factor, jitter=self.jitter)

    @property
    def current(self) -> float:
        """The wait `next()` gave last (`initial` before any failure), without jitter."""
        return backoff_delay(max(self.failures, 1), self.initial, self.maximum, factor=self.factor)

    def reset(self) -> None:
        self.failures = 0
