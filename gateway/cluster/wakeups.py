"""Wakeups through LISTEN/NOTIFY: `record_inbound` notifies on commit, so an idle node can
wait for new work instead of polling the claim query. The channel is per schema, so two
installations in one database do not wake each other. A wakeup is only a hint: after it
(or after the timeout) the node runs the claim query, which is the truth."""

from __future__ import annotations

import psycopg
from psycopg import sql

from gateway.cluster.db import ClusterError, connect_kwargs, one_line

CHANNEL_PREFIX = "hermes_inbox:"


class InboxWakeups:
    """A dedicated connection (LISTEN cannot share a pooled one) that waits for new inbox rows."""

    def __init__(self, dsn: str, schema: str | None = None) -> None:
        self._dsn, self._schema = dsn, schema
        self._conn: psycopg.AsyncConnection | None = None

    async def __aenter__(self) -> InboxWakeups:
        try:
            self._conn = await psycopg.AsyncConnection.connect(self._dsn, **connect_kwargs(self._schema))  # type: ignore[arg-type]
        except psycopg.Error as err:
            raise ClusterError(f"cannot reach PostgreSQL: {one_line(err)}") from None
        row = await (await self._conn.execute("SELECT current_schema() AS s")).fetchone()
        channel = CHANNEL_PREFIX + str(row["s"] if row else "")  # type: ignore[call-overload]
        await self._conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._conn is not None:
            await self._conn.close()

    async def wait(self, timeout_s: float) -> bool:
        """True when new work was recorded within `timeout_s`, False on timeout."""
        assert self._conn is not None, "use `async with InboxWakeups(...)`"
        gen = self._conn.notifies(timeout=timeout_s, stop_after=1)
        async for _ in gen:
            return True
        return False


NOTIFY_SQL = "SELECT pg_notify('" + CHANNEL_PREFIX + "' || current_schema(), '')"
