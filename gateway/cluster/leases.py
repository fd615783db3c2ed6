"""Node membership and tenant leases with a fencing epoch.

A node is alive while it heartbeats within `lease_ttl_s`; when it stops, its lane claims
are reaped by whoever claims next. A tenant (profile) is opened only under its lease; a
lease that expired may be taken over by another node, which bumps the epoch. `fenced()`
is the one way to write on a tenant's behalf: its transaction holds the lease row shared,
so a takeover waits for it, and it refuses a caller whose epoch is no longer current.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import datetime

from psycopg.rows import DictRow

from core.errors import LeaseLost
from gateway.cluster.db import ClusterError, Conn, Pool


class FencedOut(ClusterError, LeaseLost):
    """The caller's lease was taken over or expired: it must stop the turn and close the profile."""


@dataclass(frozen=True)
class Lease:
    tenant: str
    holder: str
    epoch: int
    expires_at: datetime
    taken_over: bool = False  # acquire_lease: it moved here from another holder (epoch bumped)


async def register_node(pool: Pool, node_id: str, ttl_s: float) -> None:
    """Register `node_id` unconditionally, whoever holds it (tests and benches stand in for
    nodes with it; a node process registers with `claim_node_id`). A rejoining node has
    lost its memory, so any claim it still holds under the same id is released first."""
    async with pool.connection() as conn, conn.transaction():
        await conn.execute(
            """INSERT INTO nodes (node_id, lease_expires_at) VALUES (%s, now() + make_interval(secs => %s))
               ON CONFLICT (node_id) DO UPDATE SET started_at = now(), heartbeat_at = now(),
                   lease_expires_at = EXCLUDED.lease_expires_at""",
            (node_id, ttl_s),
        )
        await conn.execute("UPDATE lanes SET claimed_by = NULL, claimed_at = NULL WHERE claimed_by = %s", (node_id,))


@dataclass(frozen=True)
class NodeHolder:
    """The process that holds a node id with a live lease, as another process sees it."""

    instance: str  # host, pid and token of that process ("?" for a node that did not say)
    heartbeat_at: datetime
    expires_in_s: float  # how long its node lease runs without another heartbeat


async def claim_node_id(pool: Pool, node_id: str, ttl_s: float, instance: str) -> NodeHolder | None:
    """Register `node_id` for this process unless another process holds it with a live
    lease: None once registered (the id's old lane claims released), else who holds it."""
    async with pool.connection() as conn, conn.transaction():
        cur = await conn.execute(
            """INSERT INTO nodes AS n (node_id, lease_expires_at, instance)
               VALUES (%s, now() + make_interval(secs => %s), %s)
               ON CONFLICT (node_id) DO UPDATE SET started_at = now(), heartbeat_at = now(),
                   lease_expires_at = EXCLUDED.lease_expires_at, instance = EXCLUDED.instance
               WHERE n.lease_expires_at <= now() OR n.instance = EXCLUDED.instance
               RETURNING node_id""",
            (node_id, ttl_s, instance),
        )
        if await cur.fetchone() is None:
            cur = await conn.execute(
                """SELECT coalesce(instance, '?') AS instance, heartbeat_at,
                          extract(epoch FROM lease_expires_at - now())::float8 AS left_s
                   FROM nodes WHERE node_id = %s""",
                (node_id,),
            )
            row = await cur.fetchone()
            if row is not None:
                return NodeHolder(row["instance"], row["heartbeat_at"], max(0.0, float(row["left_s"])))
            return await claim_node_id(pool, node_id, ttl_s, instance)  # it left just now
        await conn.execute("UPDATE lanes SET claimed_by = NULL, claimed_at = NULL WHERE claimed_by = %s", (node_id,))
        return None


async def retire_leases(pool: Pool, node_id: str) -> int:
    """A node (re)starting under `node_id`: whatever tenant leases an earlier process with
    that id held are expired and their epochs bumped, so this process never writes under an
    epoch an earlier life used (and a stray process still running with the id is fenced out)."""
    async with pool.connection() as conn:
        cur = await conn.execute(
            "UPDATE tenant_leases SET epoch = epoch + 1, expires_at = '-infinity' WHERE holder = %s", (node_id,)
        )
        return cur.rowcount


async def heartbeat(pool: Pool, node_id: str, ttl_s: float, instance: str | None = None) -> bool:
    """Extend this node's lease; False if it had already expired, or (given `instance`)
    another process registered the id since (its claims may be gone: stop every lane and
    register again)."""
    async with pool.connection() as conn:
        cur = await conn.execute(
            """UPDATE nodes SET heartbeat_at = now(), lease_expires_at = now() + make_interval(secs => %s)
               WHERE node_id = %s AND lease_expires_at > now() AND (%s::text IS NULL OR instance = %s)""",
            (ttl_s, node_id, instance, instance),
        )
        return cur.rowcount == 1


async def leave(pool: Pool, node_id: str) -> None:
    """Graceful stop: free this node's lanes and tenant leases at once instead of after the ttl."""
    async with pool.connection() as conn, conn.transaction():
        await conn.execute("UPDATE lanes SET claimed_by = NULL, claimed_at = NULL WHERE claimed_by = %s", (node_id,))
        await conn.execute("UPDATE tenant_leases SET expires_at = '-infinity' WHERE holder = %s", (node_id,))
        await conn.execute("DELETE FROM nodes WHERE node_id = %s", (node_id,))


def _lease(row: DictRow) -> Lease:
    return Lease(row["tenant"], row["holder"], int(row["epoch"]), row["expires_at"], bool(row.get("taken_over")))


async def acquire_lease(pool: Pool, tenant: str, node_id: str, ttl_s: float) -> Lease | None:
    """Take the tenant's lease if it is free, expired, or already ours; None if another node
    holds it. Taking it from another holder bumps the epoch."""
    async with pool.connection() as conn:
        cur = await conn.execute(
            """INSERT INTO tenant_leases AS l (tenant, holder, epoch, expires_at)
               VALUES (%s, %s, 1, now() + make_interval(secs => %s))
               ON CONFLICT (tenant) DO UPDATE SET
                   epoch = CASE WHEN l.holder = EXCLUDED.holder THEN l.epoch ELSE l.epoch + 1 END,
                   acquired_at = CASE WHEN l.holder = EXCLUDED.holder THEN l.acquired_at ELSE now() END,
                   holder = EXCLUDED.holder, expires_at = EXCLUDED.expires_at
               WHERE l.holder = EXCLUDED.holder OR l.expires_at <= now()
               RETURNING tenant, holder, epoch, expires_at, (epoch > 1 AND acquired_at = now()) AS taken_over""",
            (tenant, node_id, ttl_s),
        )
        row = await cur.fetchone()
        return _lease(row) if row else None


async def renew_lease(pool: Pool, lease: Lease, ttl_s: float) -> Lease | None:
    """Extend a lease we still hold under the same epoch; None if it was taken over."""
    async with pool.connection() as conn:
        cur = await conn.execute(
            """UPDATE tenant_leases SET expires_at = now() + make_interval(secs => %s)
               WHERE tenant = %s AND holder = %s AND epoch = %s
               RETURNING tenant, holder, epoch, expires_at""",
            (ttl_s, lease.tenant, lease.holder, lease.epoch),
        )
        row = await cur.fetchone()
        return _lease(row) if row else None


async def release_lease(pool: Pool, lease: Lease) -> None:
    """Let another node take the tenant now. The row stays so that the epoch keeps growing."""
    async with pool.connection() as conn:
        await conn.execute(
            "UPDATE tenant_leases SET expires_at = '-infinity' WHERE tenant = %s AND holder = %s AND epoch = %s",
            (lease.tenant, lease.holder, lease.epoch),
        )


@asynccontextmanager
async def fenced(pool: Pool, lease: Lease) -> AsyncIterator[Conn]:
    """A transaction that commits only while `lease` is current (same holder and epoch, not
    expired). The lease row is locked FOR SHARE until commit, so a takeover cannot slip in
    between the check and the commit. Raises FencedOut otherwise."""
    async with pool.connection() as conn, conn.transaction():
        cur = await conn.execute(
            """SELECT 1 FROM tenant_leases WHERE tenant = %s AND holder = %s AND epoch = %s
               AND expires_at > now() FOR SHARE""",
            (lease.tenant, lease.holder, lease.epoch),
        )
        if await cur.fetchone() is None:
            raise FencedOut(f"lease on {lease.tenant} at epoch {lease.epoch} is no longer held by {lease.holder}")
        yield conn
