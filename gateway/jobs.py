"""Small things the ingress, the lane worker and the runtime share: a lane's job, the
stored uid of an inbound message, the running turns' stop events and the background tasks."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

from core.lanes import Lane, tenant_of_key
from core.messages import InboundMessage


@dataclass(frozen=True)
class Job:
    msg: InboundMessage
    lane: Lane


def input_uid(msg: InboundMessage) -> str:
    """The stored uid of an inbound message: derived from its platform identity, so the
    same message replayed after a crash is stored once."""
    digest = hashlib.sha256(f"{msg.platform}\0{msg.chat_id}\0{msg.message_id}".encode()).hexdigest()
    return f"in-{digest[:32]}"


class RunningTurns:
    """Lane key -> the stop event of its running turn: set by /stop, by a message in
    `busy_mode: interrupt`, and (cluster mode) when the tenant's lease is lost."""

    def __init__(self) -> None:
        self._stops: dict[str, asyncio.Event] = {}

    def get(self, key: str) -> asyncio.Event | None:
        return self._stops.get(key)

    def begin(self, key: str) -> asyncio.Event:
        stop = self._stops[key] = asyncio.Event()
        return stop

    def end(self, key: str, stop: asyncio.Event) -> None:
        if self._stops.get(key) is stop:
            del self._stops[key]

    def stop_tenant(self, tenant: str) -> None:
        """Stop every running turn of `tenant`'s lanes."""
        for key, stop in self._stops.items():
            if tenant_of_key(key) == tenant:
                stop.set()


class Background:
    """Work run outside an adapter's sink, so a slow step never holds up receiving
    (refusals, reviews, closing a profile); the runtime's stop() and drain() wait for it."""

    def __init__(self) -> None:
        self.tasks: set[asyncio.Task] = set()

    def run(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def __bool__(self) -> bool:
        return bool(self.tasks)

    async def wait(self, timeout: float | None) -> set[asyncio.Task]:
        """Wait up to `timeout` for every task; the ones still running."""
        _, late = await asyncio.wait(list(self.tasks), timeout=timeout)
        return late
