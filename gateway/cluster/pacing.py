"""Telegram flood pacing for the whole cluster: the per-chat, per-group and per-bot limits
hold for every node together, not for each one (docs/cluster.md#flood-pacing-across-nodes).

Each limit is a window row in `send_pacing`; a send is granted by one call of the
`pacing_take` function (one round trip), which locks the send's windows, reads the
database's clock, and either records the grant or says how long to wait. The node's own
`FloodGate` runs first, so a node waits out its own recent sends without asking the
database at all; what it asks is only whether the other nodes left room.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import psycopg
import psycopg_pool

from adapters.telegram.flood import FloodGate, FloodLimits, is_group_chat
from core.messages import DeliveryDeferred
from gateway.cluster.db import Pool, fetch_one

log = logging.getLogger("hermes.cluster")

TAKE_SQL = "SELECT pacing_take(%s, %s, %s, %s, %s) AS wait"
# windows untouched this long (and not held by a 429) are deleted, by each node this often
PRUNE_IDLE_S = 3600.0
PRUNE_EVERY_S = 600.0
_PRUNE_SQL = """DELETE FROM send_pacing WHERE touched_at < now() - make_interval(secs => %s)
                AND held_until < extract(epoch FROM now())"""
_UNREACHABLE = (psycopg.OperationalError, psycopg_pool.PoolTimeout, OSError)


class PgFloodGate:
    """The `SendPacer` of a cluster's Telegram adapter (core/protocols.py): `FloodGate`'s
    policy, with the windows shared by every node through PostgreSQL."""

    _LOCKS_ABOVE = 512  # per-chat locks kept before idle ones are dropped

    def __init__(
        self,
        pool: Pool,
        limits: FloodLimits | None = None,
        *,
        sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
    ) -> None:
        self.limits = limits or FloodLimits()
        self._pool = pool
        self._sleep = sleep
        self._local = FloodGate(self.limits, sleep=sleep)
        self._locks: dict[str, asyncio.Lock] = {}  # FIFO per chat on this node, as FloodGate's
        self._holds: dict[str, float] = {}  # 429 holds not yet written (go with the next take)
        self._next_prune = time.monotonic() + PRUNE_EVERY_S
        #: round trips to PostgreSQL and how many of them said "wait" (for tests and benchmarks)
        self.takes = 0
        self.refused = 0

    def _windows(self, chat_id: str) -> tuple[list[str], list[int], list[float]]:
        windows = [("telegram:bot", self.limits.overall), (f"telegram:chat:{chat_id}", self.limits.per_chat)]
        if is_group_chat(chat_id):
            windows.append((f"telegram:group:{chat_id}", self.limits.per_group))
        return [k for k, _ in windows], [max(1, w[0]) for _, w in windows], [float(w[1]) for _, w in windows]

    def _lock(self, chat_id: str) -> asyncio.Lock:
        lock = self._locks.get(chat_id)
        if lock is None:
            if len(self._locks) >= self._LOCKS_ABOVE:
                for key in [k for k, v in self._locks.items() if not v.locked()]:
                    del self._locks[key]
            lock = self._locks[chat_id] = asyncio.Lock()
        return lock

    async def wait_turn(self, chat_id: str) -> None:
        """Return when every node together has room for a message to `chat_id`, counted as
        sent; `DeliveryDeferred` when the database cannot be asked (the outbox retries)."""
        async with self._lock(chat_id):
            await self._local.wait_turn(chat_id)  # this node's own sends: no round trip
            keys, limits, periods = self._windows(chat_id)
            while True:
                hold = self._holds.pop(chat_id, 0.0)
                try:
                    wait = await self._take(keys, limits, periods, f"telegram:chat:{chat_id}", hold)
                except _UNREACHABLE as exc:
                    if hold:
                        self._holds[chat_id] = max(hold, self._holds.get(chat_id, 0.0))
                    raise DeliveryDeferred(f"flood pacing unavailable ({type(exc).__name__})") from None
                if wait <= 0:
                    return
                self.refused += 1
                await self._sleep(wait)

    async def _take(
        self, keys: list[str], limits: list[int], periods: list[float], hold_key: str, hold: float
    ) -> float:
        async with self._pool.connection() as conn:
            self.takes += 1
            row = await fetch_one(conn, TAKE_SQL, (keys, limits, periods, hold_key if hold > 0 else None, hold))
            if time.monotonic() >= self._next_prune:
                self._next_prune = time.monotonic() + PRUNE_EVERY_S
                await conn.execute(_PRUNE_SQL, (PRUNE_IDLE_S,))
        return float(row["wait"])

    def hold(self, chat_id: str, seconds: float) -> None:
        """Telegram answered 429 for this chat: the hold is written for every node with the
        next take for the chat (the retry that follows right away), which then waits it out."""
        self._holds[chat_id] = max(self._holds.get(chat_id, 0.0), seconds)
