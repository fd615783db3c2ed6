"""One turn at a time per lane, in arrival order; lanes run in parallel.

A lane's worker task exists only while the lane has work, so ten thousand quiet lanes
cost nothing. A full lane refuses new work (the caller tells the person it is busy).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

log = logging.getLogger("hermes.lanes")

Job = TypeVar("Job")


class Lanes(Generic[Job]):
    """Serial queues keyed by lane; `handler(key, jobs)` gets one job, or a burst when
    `coalesce` says consecutive jobs may be merged into one turn."""

    def __init__(
        self,
        handler: Callable[[str, list[Job]], Awaitable[None]],
        *,
        max_queued: int,
        coalesce: Callable[[Job], bool] | None = None,
        coalesce_wait_s: float = 0.0,
    ) -> None:
        self._handler = handler
        self._max_queued = max_queued
        self._coalesce = coalesce
        self._coalesce_wait_s = coalesce_wait_s
        self._queues: dict[str, deque[Job]] = {}
        self._workers: dict[str, asyncio.Task] = {}
        self._idle = asyncio.Event()
        self._idle.set()
        self._settled: dict[str, asyncio.Event] = {}  # lanes someone waits on (`settle`)

    def depth(self) -> int:
        return sum(len(q) for q in self._queues.values()) + len(self._workers)

    def running(self) -> int:
        """Lanes with a turn in progress."""
        return len(self._workers)

    def queued_by(self, label: Callable[[Job], str]) -> dict[str, int]:
        """Jobs waiting (not yet running) per `label(job)`, e.g. per platform for /metrics."""
        out: dict[str, int] = {}
        for queue in self._queues.values():
            for job in queue:
                key = label(job)
                out[key] = out.get(key, 0) + 1
        return out

    def submit(self, key: str, job: Job, *, force: bool = False) -> bool:
        """Queue `job` on lane `key`; False when the lane already holds `max_queued` jobs
        (unless `force`, for work that was accepted before, such as a replay)."""
        queue = self._queues.setdefault(key, deque())
        if len(queue) >= self._max_queued and not force:
            return False
        queue.append(job)
        self._idle.clear()
        if key not in self._workers:
            self._workers[key] = asyncio.create_task(self._run(key), name=f"lane:{len(self._workers)}")
        return True

    def _take(self, queue: deque[Job]) -> list[Job]:
        first = queue.popleft()
        batch = [first]
        if self._coalesce is not None and self._coalesce(first):
            while queue and self._coalesce(queue[0]):
                batch.append(queue.popleft())
        return batch

    async def _run(self, key: str) -> None:
        queue = self._queues[key]
        try:
            while queue:
                if self._coalesce is not None and self._coalesce_wait_s > 0:
                    await asyncio.sleep(self._coalesce_wait_s)  # let a burst arrive
                batch = self._take(queue)
                try:
                    await self._handler(key, batch)
                except asyncio.CancelledError:
                    raise
                except Exception:
                    log.exception("lane handler failed")
        finally:
            self._workers.pop(key, None)
            if not queue:
                self._queues.pop(key, None)
            settled = self._settled.pop(key, None)
            if settled is not None:
                settled.set()
            if not self._workers:
                self._idle.set()

    async def settle(self, key: str) -> None:
        """Wait until lane `key` has no job queued or running."""
        while key in self._workers:
            await self._settled.setdefault(key, asyncio.Event()).wait()

    def discard(self, key: str) -> int:
        """Drop the jobs queued on lane `key` (not the running one); how many."""
        queue = self._queues.get(key)
        if not queue:
            return 0
        n = len(queue)
        queue.clear()
        return n

    async def drain(self, timeout: float | None = None) -> bool:
        """Wait until every lane is empty; False on timeout."""
        if self._idle.is_set():  # wait_for(..., 0) would time out even with nothing to wait for
            return True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except TimeoutError:
            return False

    async def cancel(self) -> None:
        tasks = list(self._workers.values())
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
