"""Fair share of the model: at most `llm.max_concurrency` model calls at once for the
whole gateway, handed out round-robin across tenants (docs/concepts.md#fair-share).

One FIFO queue per tenant and a rotating ring of the tenants that wait: a free slot goes
to the head of the next tenant's queue, so one person writing in a dozen lanes at once
waits behind their own calls, never in front of everyone else's. A waiter that is
cancelled leaves its queue; one cancelled after it was handed a slot gives the slot on,
so no slot leaks. Holds no tenant data beyond the ids of the calls waiting right now.
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
        self._ring: deque[str] = deque()  # tenants with waiters, in serving order

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
            self._release()

    async def _acquire(self, tenant_id: str) -> None:
        if self.active < self.max_concurrency and not self._ring:
            self.active += 1
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        queue = self._queues.get(tenant_id)
        if queue is None:
            queue = self._queues[tenant_id] = deque()
            self._ring.append(tenant_id)
        queue.append(fut)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self._release()  # handed a slot as it was cancelled: pass it on
            else:
                self._forget(tenant_id, fut)
            raise

    def _forget(self, tenant_id: str, fut: asyncio.Future[None]) -> None:
        queue = self._queues.get(tenant_id)
        if queue is None:
            return
        try:
            queue.remove(fut)
        except ValueError:
            return
        if not queue:
            del self._queues[tenant_id]
            self._ring.remove(tenant_id)

    def _release(self) -> None:
        self.active -= 1
        self._dispatch()

    def _dispatch(self) -> None:
        while self.active < self.max_concurrency and self._ring:
            tenant_id = self._ring.popleft()
            queue = self._queues[tenant_id]
            fut = queue.popleft()
            if queue:
                self._ring.append(tenant_id)  # the tenant's next call waits for its next turn
            else:
                del self._queues[tenant_id]
            if fut.done():  # cancelled while queued (its _forget runs later)
                continue
            self.active += 1
            fut.set_result(None)


__all__ = ["FairShare"]
