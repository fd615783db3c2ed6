"""Tool-call confirmations in PostgreSQL (docs/cluster.md#stop-and-confirmations-across-nodes):
the `OpenQuestions` of a cluster node. A button press may reach any node (a Telegram
webhook, the Discord shard's node), so the open questions are rows of `confirmations`; a
press decides with one conditional UPDATE and notifies the asking node, whose waiting turn
wakes on the signal, or at the latest at its next look at the row.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from core.lanes import tenant_of_key
from core.messages import ConfirmRequest, ConfirmVerdict
from gateway.cluster.db import Pool, one_line
from gateway.cluster.signals import notify

log = logging.getLogger("hermes.cluster")

POLL_S = 1.0  # the asking node reads the row this often too: a lost signal costs at most this
FORGET_AFTER_S = 60  # rows of a dead asker are removed this long after they expired


class PgQuestions:
    """The open questions of every node, in table `confirmations`; `decided(token)` is this
    node's signal handler (gateway/cluster/signals.py)."""

    def __init__(self, pool: Pool, node_id: str, timeout_s: float, *, poll_s: float = POLL_S) -> None:
        self.pool = pool
        self.node_id = node_id
        self.timeout_s = timeout_s  # the row expires by itself then, should the asker die
        self.poll_s = poll_s
        self._waiting: dict[str, asyncio.Event] = {}  # tokens this node asked -> set on their signal

    def decided(self, token: str) -> None:
        event = self._waiting.get(token)
        if event is not None:
            event.set()

    async def open(self, request: ConfirmRequest, lane: str) -> None:
        self._waiting[request.token] = asyncio.Event()
        try:
            async with self.pool.connection() as conn, conn.transaction():
                await conn.execute(
                    "DELETE FROM confirmations WHERE expires_at < now() - make_interval(secs => %s)",
                    (FORGET_AFTER_S,),
                )
                await conn.execute(
                    """INSERT INTO confirmations (token, tenant, lane, user_id, node, expires_at)
                       VALUES (%s, %s, %s, %s, %s, now() + make_interval(secs => %s))""",
                    (request.token, tenant_of_key(lane), lane, request.user_id, self.node_id, self.timeout_s),
                )
        except BaseException:
            self._waiting.pop(request.token, None)
            raise

    async def decide(self, token: str, user_id: str, allow: bool) -> ConfirmVerdict:
        async with self.pool.connection() as conn, conn.transaction():
            row = await (
                await conn.execute(
                    """UPDATE confirmations SET state = %s, decided_at = now()
                       WHERE token = %s AND state = 'open' AND user_id = %s AND expires_at > now()
                       RETURNING node""",
                    ("allowed" if allow else "denied", token, user_id),
                )
            ).fetchone()
            if row is not None:
                await notify(conn, {"kind": "decided", "token": token, "node": row["node"]})
                return "ok"
            row = await (
                await conn.execute(
                    "SELECT 1 FROM confirmations WHERE token = %s AND state = 'open' AND expires_at > now()", (token,)
                )
            ).fetchone()
        return "not_yours" if row is not None else "expired"

    async def wait(self, token: str, timeout: float, stop: asyncio.Event | None) -> bool | None:
        event = self._waiting.get(token)
        if event is None:
            return None
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or (stop is not None and stop.is_set()):
                return await self._expire(token)
            await _first(event, stop, min(left, self.poll_s))
            event.clear()
            state = await self._state(token)
            if state in ("allowed", "denied"):
                return state == "allowed"
            if state is None:  # gone: nobody can press it any more
                return None

    async def close(self, token: str) -> None:
        self._waiting.pop(token, None)
        async with self.pool.connection() as conn:
            await conn.execute("DELETE FROM confirmations WHERE token = %s", (token,))

    async def _state(self, token: str) -> str | None:
        """The row's state ("open" while it cannot be read: the database may come back)."""
        try:
            async with self.pool.connection() as conn:
                row = await (
                    await conn.execute("SELECT state FROM confirmations WHERE token = %s", (token,))
                ).fetchone()
        except Exception as exc:
            log.warning("could not read a confirmation (%s); still waiting", one_line(exc))
            return "open"
        return None if row is None else str(row["state"])

    async def _expire(self, token: str) -> bool | None:
        """No press in time, or /stop: the question expires (a later press says so), unless
        a press decided it just before, which then stands."""
        try:
            async with self.pool.connection() as conn, conn.transaction():
                cur = await conn.execute(
                    """UPDATE confirmations SET state = 'expired', decided_at = now()
                       WHERE token = %s AND state = 'open' RETURNING token""",
                    (token,),
                )
                if await cur.fetchone() is not None:
                    return None
                row = await (
                    await conn.execute("SELECT state FROM confirmations WHERE token = %s", (token,))
                ).fetchone()
        except Exception as exc:  # denied: nothing runs without a recorded press
            log.warning("could not expire a confirmation (%s); the call is denied", one_line(exc))
            return None
        state = None if row is None else row["state"]
        return True if state == "allowed" else False if state == "denied" else None


async def _first(event: asyncio.Event, stop: asyncio.Event | None, timeout: float) -> None:
    """Until `event` or `stop` is set, or `timeout` passed."""
    waits = [asyncio.ensure_future(event.wait())]
    if stop is not None:
        waits.append(asyncio.ensure_future(stop.wait()))
    try:
        await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*waits, return_exceptions=True)


__all__ = ["PgQuestions"]
