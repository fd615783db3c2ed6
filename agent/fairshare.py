"""Fair share of the model: at most `llm.max_concurrency` model calls at once for the
whole gateway, handed out round-robin across tenants (docs/concepts.md#fair-share).

One FIFO queue per tenant. A free slot goes to the waiting tenant served least recently:
one that holds no slot and has not been served since it last had nothing running or
waiting counts as never served, and those go first, in the order they began to wait. So
one person writing in a dozen lanes at once waits behind their own calls, never in front of
everyone else's: with N others waiting and C slots, each of them starts within
ceil(N / C) + 1 call latencies. A waiter that is cancelled leaves its queue; one cancelled
after it was handed a slot gives the slot on, so no slot leaks. What it keeps of a tenant
(its id, how many calls it runs and when it was last served) lives only while the tenant
has a call running or waiting.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager


class FairShare:
    """Bounds concurrent model calls; serves waiting tenants in turn."""

    def __init__(self, max_concurrency: int) -> None:
        if max_concurrency < 1:
            raise ValueError("max_concurrency must be at least 1")
        self.max_concurrency = max_concurrency
        self.active = 0
        self._queues: dict[str, deque[asyncio.Future[None]]] = {}
        self._since: dict[str, int] = {}  # when each waiting tenant's queue began (FIFO among the never served)
        self._running: dict[str, int] = {}
        self._last: dict[str, int] = {}  # the grant number of a tenant's latest slot
        self._seq = 0

    @property
    def waiting(self) -> int:
        """Calls queued for a slot right now."""
        return sum(len(q) for q in self._queues.values())

    @asynccontextmanager
    async def slot(self, tenant_id: str) -> AsyncIterator[None]:
        """Hold one of the gateway's model-call slots for the body, queued fairly."""
        await self._acquire(tenant_id)
        try:
            yield
        finally:
            self._release(tenant_id)

    async def _acquire(self, tenant_id: str) -> None:
        if self.active < self.max_concurrency and not self._queues:
            self._grant(tenant_id)
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        queue = self._queues.get(tenant_id)
        if queue is None:
            queue = self._queues[tenant_id] = deque()
            self._seq += 1
            self._since[tenant_id] = self._seq
        queue.append(fut)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self._release(tenant_id)  # handed a slot as it was cancelled: pass it on
            else:
                self._forget(tenant_id, fut)
            raise

    def _grant(self, tenant_id: str) -> None:
        self.active += 1
        self._running[tenant_id] = self._running.get(tenant_id, 0) + 1
        self._seq += 1
        self._last[tenant_id] = self._seq

    def _idle(self, tenant_id: str) -> None:
        """Drop what is kept of a tenant with nothing running or waiting."""
        if tenant_id not in self._running and tenant_id not in self._queues:
            self._last.pop(tenant_id, None)

    def _forget(self, tenant_id: str, fut: asyncio.Future[None]) -> None:
        queue = self._queues.get(tenant_id)
        if queue is None:
            return
        try:
            queue.remove(fut)
        except ValueError:
            return
        if not queue:
            del self._queues[tenant_id], self._since[tenant_id]
            self._idle(tenant_id)
        self._dispatch()  # it may have been the head of the line

    def _release(self, tenant_id: str) -> None:
        self.active -= 1
        left = self._running[tenant_id] - 1
        if left:
            self._running[tenant_id] = left
        else:
            del self._running[tenant_id]
            self._idle(tenant_id)
        self._dispatch()

    def _dispatch(self) -> None:
        while self.active < self.max_concurrency and self._queues:
            tenant_id = min(self._queues, key=lambda t: (self._last.get(t, -1), self._since[t]))
            queue = self._queues[tenant_id]
            fut = queue.popleft()
            if not queue:
                del self._queues[tenant_id], self._since[tenant_id]
            if fut.done():  # cancelled while queued (its _forget finds nothing left to do)
                self._idle(tenant_id)
                continue
            self._grant(tenant_id)
            fut.set_result(None)


__all__ = ["FairShare"]
