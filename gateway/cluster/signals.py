"""Signals between nodes through LISTEN/NOTIFY (docs/cluster.md#stop-and-confirmations-across-nodes):
a `/stop` for a lane whose turn runs on another node, and a confirmation decided by a press
on another node. One channel per schema, JSON payloads with a `kind`; every node listens
on a dedicated connection. A signal is a hint that makes the answer prompt: a lost one
(the listener reconnecting) only makes it late or, for a /stop, means the turn runs on.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from typing import Any

import psycopg
from psycopg import sql

from core.backoff import Backoff
from gateway.cluster.db import Conn, Pool, connect_kwargs, one_line

log = logging.getLogger("hermes.cluster")

CHANNEL_PREFIX = "hermes_signals:"
NOTIFY_SQL = "SELECT pg_notify('" + CHANNEL_PREFIX + "' || current_schema(), %s)"
APPLICATION_NAME = "hermes-signals"  # the listener's connection in pg_stat_activity: "hermes-signals <node id>"
KEEPALIVE_S = 30.0  # with no signal for this long the connection is checked with a query

OnStop = Callable[[str, str], object]
"""(lane key, the /stop message's input uid): stop the lane's turn if it runs here."""
OnDecided = Callable[[str], object]
"""(token): a question this node asked was decided by a press (on any node)."""


async def notify(conn: Conn, payload: dict[str, Any]) -> None:
    """Send `payload` to every node (delivered when `conn`'s transaction commits)."""
    await conn.execute(NOTIFY_SQL, (json.dumps(payload, separators=(",", ":")),))


class StopPublisher:
    """The `StopSignals` of gateway/modes.py: tells every node to stop a lane's running turn."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool

    async def publish(self, lane_key: str, uid: str) -> None:
        try:
            async with self.pool.connection() as conn:
                await notify(conn, {"kind": "stop", "lane": lane_key, "uid": uid})
        except (psycopg.Error, OSError, TimeoutError) as exc:
            # the /stop is recorded: it is answered truthfully once the lane's turn is over
            log.warning("could not signal a /stop to the other nodes (%s); the turn runs on", one_line(exc))


class NodeSignals:
    """This node's listener: one dedicated connection (LISTEN cannot share a pooled one)
    that hands each signal to its handler; after a lost connection (a database restart)
    it reconnects with `core/backoff.py` and carries on."""

    def __init__(
        self,
        dsn: str,
        node_id: str,
        *,
        on_stop: OnStop,
        on_decided: OnDecided,
        backoff: Backoff | None = None,
        schema: str | None = None,
    ) -> None:
        self._dsn, self._schema = dsn, schema
        self.node_id = node_id
        self._on_stop, self._on_decided = on_stop, on_decided
        self._backoff = backoff or Backoff(0.5, 10.0, jitter=0.2)
        self._task: asyncio.Task | None = None
        self._listening = asyncio.Event()
        self.reconnects = 0  # connections lost and made again

    @property
    def listening(self) -> bool:
        """Whether the LISTEN is in place now (a signal sent now reaches this node)."""
        return self._listening.is_set()

    async def wait_listening(self, timeout: float) -> None:
        """Until the LISTEN is in place (TimeoutError after `timeout`)."""
        await asyncio.wait_for(self._listening.wait(), timeout)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="cluster-signals")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        self._listening.clear()

    async def _run(self) -> None:
        while True:
            try:
                await self._listen()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the server went away, a network fault, a refused connection
                self._listening.clear()
                delay = self._backoff.next()
                log.warning("signal listener lost its connection (%s); reconnecting in %.1f s", one_line(exc), delay)
                await asyncio.sleep(delay)

    async def _listen(self) -> None:
        kwargs = {**connect_kwargs(self._schema), "application_name": f"{APPLICATION_NAME} {self.node_id}"}
        conn = await psycopg.AsyncConnection.connect(self._dsn, **kwargs)  # type: ignore[arg-type]
        try:
            row = await (await conn.execute("SELECT current_schema() AS s")).fetchone()
            channel = CHANNEL_PREFIX + str(row["s"] if row else "")  # type: ignore[call-overload]
            await conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))
            if self._backoff.failures:
                self.reconnects += 1
                log.info("signal listener connected again")
            self._backoff.reset()
            self._listening.set()
            while True:
                async for note in conn.notifies(timeout=KEEPALIVE_S):
                    self._dispatch(note.payload)
                await conn.execute("SELECT 1")  # a connection that died quietly shows here
        finally:
            self._listening.clear()
            await conn.close()

    def _dispatch(self, payload: str) -> None:
        try:
            signal = json.loads(payload)
            kind = signal["kind"]
            if kind == "stop":
                self._on_stop(str(signal["lane"]), str(signal["uid"]))
            elif kind == "decided" and signal.get("node") == self.node_id:
                self._on_decided(str(signal["token"]))
        except Exception:  # a malformed or unknown signal (a newer node's) is ignored
            log.warning("ignored a signal this node cannot read", exc_info=True)


__all__ = ["NodeSignals", "StopPublisher", "notify"]
