"""What `hermes-gateway cluster status` shows: nodes, tenant leases, claimed lanes, queue
depth and the oldest pending message, read in one snapshot."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from gateway.cluster.db import Pool

SHOWN = 20  # rows listed per section; the counts are always complete


@dataclass
class ClusterStatus:
    now: datetime
    schema_version: int
    nodes: list[dict[str, Any]] = field(default_factory=list)
    live_leases: int = 0
    leases: list[dict[str, Any]] = field(default_factory=list)
    claimed_lanes: int = 0
    lanes: list[dict[str, Any]] = field(default_factory=list)
    queue_depth: int = 0
    oldest_pending: datetime | None = None
    unsent_chunks: int = 0


async def read_status(pool: Pool, schema_version: int) -> ClusterStatus:
    async with pool.connection() as conn, conn.transaction():
        await conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY")

        async def rows(sql: str) -> list[dict[str, Any]]:
            return await (await conn.execute(sql)).fetchall()

        now = (await rows("SELECT now() AS now"))[0]["now"]
        st = ClusterStatus(now=now, schema_version=schema_version)
        st.nodes = await rows("""SELECT node_id, started_at, heartbeat_at, lease_expires_at,
                                        lease_expires_at > now() AS alive FROM nodes ORDER BY node_id""")
        st.live_leases = (await rows("SELECT count(*) AS n FROM tenant_leases WHERE expires_at > now()"))[0]["n"]
        st.leases = await rows(f"""SELECT tenant, holder, epoch, expires_at FROM tenant_leases
                                  WHERE expires_at > now() ORDER BY tenant LIMIT {SHOWN}""")
        st.claimed_lanes = (await rows("SELECT count(*) AS n FROM lanes WHERE claimed_by IS NOT NULL"))[0]["n"]
        st.lanes = await rows(f"""SELECT lane, claimed_by, claimed_at FROM lanes WHERE claimed_by IS NOT NULL
                                 ORDER BY claimed_at LIMIT {SHOWN}""")
        q = (await rows("SELECT count(*) AS n, min(received_at) AS oldest FROM inbox WHERE done_at IS NULL"))[0]
        st.queue_depth, st.oldest_pending = q["n"], q["oldest"]
        st.unsent_chunks = (await rows("SELECT count(*) AS n FROM outbox WHERE sent_at IS NULL"))[0]["n"]
        return st


def _ago(now: datetime, t: datetime) -> str:
    s = (now - t).total_seconds()
    return f"{s:.0f}s ago" if s >= 0 else f"in {-s:.0f}s"


def _more(total: int, shown: int) -> list[str]:
    return [f"    … and {total - shown} more"] if total > shown else []


def format_status(st: ClusterStatus) -> str:
    out = [f"schema version {st.schema_version}"]
    alive = sum(1 for n in st.nodes if n["alive"])
    out.append(f"nodes: {len(st.nodes)} ({alive} alive)")
    for n in st.nodes:
        state = "alive" if n["alive"] else "EXPIRED"
        out.append(
            f"    {n['node_id']}  {state}, heartbeat {_ago(st.now, n['heartbeat_at'])}, "
            f"up since {n['started_at']:%Y-%m-%d %H:%M:%S}"
        )
    out.append(f"tenant leases: {st.live_leases} held")
    for le in st.leases:
        out.append(f"    {le['tenant']}  {le['holder']}  epoch {le['epoch']}, expires {_ago(st.now, le['expires_at'])}")
    out += _more(st.live_leases, len(st.leases))
    out.append(f"lanes claimed: {st.claimed_lanes}")
    for la in st.lanes:
        out.append(f"    {la['lane']}  by {la['claimed_by']} since {_ago(st.now, la['claimed_at'])}")
    out += _more(st.claimed_lanes, len(st.lanes))
    oldest = "none"
    if st.oldest_pending is not None:
        age = st.now - st.oldest_pending
        oldest = f"received {st.oldest_pending:%Y-%m-%d %H:%M:%S} ({_age(age)} old)"
    out.append(f"queue depth: {st.queue_depth} pending messages; oldest pending: {oldest}")
    out.append(f"outbox: {st.unsent_chunks} unsent reply chunks")
    return "\n".join(out)


def _age(d: timedelta) -> str:
    s = int(d.total_seconds())
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"
