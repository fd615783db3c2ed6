"""One gateway process as a cluster node: membership, heartbeats, held tenant leases.

The node registers at start, heartbeats every `lease_ttl_s / 3` (renewing its node lease
and every tenant lease it holds) and leaves on a graceful stop. A tenant lease is held
while a claimed lane of the tenant runs or its profile is open (reference counted), and
released when neither is the case any more.

Each held lease keeps a local deadline: the monotonic time taken *before* the acquire or
renew request, plus the ttl, minus a margin. Past it (a paused process, a database that
stopped answering) every write on the tenant's behalf is refused locally, whatever the
database would say; the database fences the same writes by epoch (`leases.fenced`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
import time
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any, cast

from core.errors import LeaseLost
from core.settings import ClusterConfig
from gateway.cluster.db import ClusterError, Conn, Pool, open_pool
from gateway.cluster.inbox import spend_expired_handles
from gateway.cluster.leases import (
    Lease,
    NodeHolder,
    acquire_lease,
    claim_node_id,
    heartbeat,
    leave,
    release_lease,
    renew_lease,
    retire_leases,
)
from gateway.cluster.migrations import migrate
from gateway.metrics import ClusterMetrics

log = logging.getLogger("hermes.cluster")


class LeaseBusy(LeaseLost):
    """Another node holds the tenant's lease: this node may not open its profile now."""


class NodeIdInUse(ClusterError):
    """Another live process heartbeats under this node's id: two processes must never share one."""


def _in_use(node_id: str, holder: NodeHolder) -> str:
    return (
        f"node id {node_id} is in use by another running process ({holder.instance}, which heartbeats under it): "
        "give each node its own cluster.node_id, or stop that process first"
    )


@dataclass
class HeldLease:
    """A tenant lease this node holds, with its local deadline (monotonic)."""

    lease: Lease
    deadline: float
    users: int = 0
    lost: bool = False
    reason: str = ""

    @property
    def tenant(self) -> str:
        return self.lease.tenant

    @property
    def epoch(self) -> int:
        return self.lease.epoch

    def valid(self) -> bool:
        return not self.lost and time.monotonic() < self.deadline

    def check(self) -> None:
        """Raise LeaseLost unless writing under this lease is still allowed (any thread)."""
        if self.lost:
            raise LeaseLost(f"lease on {self.tenant} at epoch {self.epoch} was lost ({self.reason})")
        if time.monotonic() >= self.deadline:
            raise LeaseLost(f"lease on {self.tenant} at epoch {self.epoch} ran past its local deadline")


class ClusterNode:
    """Membership and tenant leases of this process; build it with the DSN, `start()` it."""

    def __init__(
        self,
        cfg: ClusterConfig,
        dsn: str,
        *,
        pool_size: int | None = None,
        on_lost: Callable[[str], None] | None = None,
        metrics: ClusterMetrics | None = None,
    ) -> None:
        self.cfg = cfg
        self.dsn = dsn
        self.node_id = cfg.node_name()
        # this process, as the nodes table names it: a second process with the same id is refused
        self.instance = f"{socket.gethostname()} pid {os.getpid()} #{secrets.token_hex(3)}"
        self.displaced: str | None = None  # why this process may hold nothing (its id was taken)
        # the node lease's local deadline (monotonic): past it, as after a freeze, nothing new is
        # held until a heartbeat confirms the id is still this process's
        self._alive_until = 0.0
        self.ttl = cfg.lease_ttl_s
        self.margin = max(0.2 * self.ttl, 0.1)  # local deadline ends this long before the database's
        self.pool_size = pool_size or cfg.max_lanes + 4
        self.on_lost = on_lost  # called with the tenant whose lease was lost (close its profile)
        self.metrics = metrics or ClusterMetrics()  # the app's /metrics share it
        self._pool: Pool | None = None
        self._held: dict[str, HeldLease] = {}
        # lanes this node has claimed -> the tenant lease their claim runs under
        self.claims: dict[str, HeldLease] = {}
        self._lock = asyncio.Lock()
        self._beat: asyncio.Task | None = None
        self._watch: asyncio.Task | None = None

    @property
    def pool(self) -> Pool:
        if self._pool is None:
            raise RuntimeError("the cluster node is not started")
        return self._pool

    # ----- lifecycle ------------------------------------------------------------------
    async def start(self) -> None:
        """Open the pool, migrate the schema (safe on every node at once), register; raises
        NodeIdInUse when another live process heartbeats under this node id."""
        self._pool = await open_pool(self.dsn, max_size=self.pool_size)
        try:
            applied = await migrate(self._pool)
            if applied:
                log.info("cluster schema migrated (applied %s)", ", ".join(map(str, applied)))
            self._alive_until = await self._register() + self.ttl - self.margin
        except BaseException:
            await self._pool.close()
            self._pool = None
            raise
        await retire_leases(self._pool, self.node_id)  # a new life never reuses an old life's epoch
        log.info("node %s joined the cluster (lease ttl %g s)", self.node_id, self.ttl, extra={"node": self.node_id})
        self._beat = asyncio.create_task(self._heartbeats(), name="cluster-heartbeat")
        self._watch = asyncio.create_task(self._expire_leases(), name="cluster-lease-deadlines")

    async def _register(self) -> float:
        """Take the node id for this process (returns the monotonic time the winning request
        was sent). An id still registered by another process (a crashed one, whose lease runs
        out within a ttl) is waited for; one that process heartbeats under meanwhile is alive,
        and this process must not start."""
        first: NodeHolder | None = None
        while True:
            sent = time.monotonic()
            holder = await claim_node_id(self.pool, self.node_id, self.ttl, self.instance)
            if holder is None:
                return sent
            if first is None:
                first = holder
                log.info(
                    "node id %s is still registered by %s; waiting up to %.1f s for its lease to run out",
                    self.node_id,
                    holder.instance,
                    holder.expires_in_s,
                )
            elif holder.instance != first.instance or holder.heartbeat_at != first.heartbeat_at:
                raise NodeIdInUse(_in_use(self.node_id, holder))
            await asyncio.sleep(min(holder.expires_in_s + 0.05, self.ttl / 6))

    async def stop(self) -> None:
        """Leave the cluster: lanes and tenant leases are free for the others at once."""
        for task in (self._beat, self._watch):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        self._beat = self._watch = None
        if self._pool is None:
            return
        try:
            if self.displaced is None:  # else the id, its lanes and leases are another process's
                await leave(self._pool, self.node_id)
                log.info("node %s left the cluster", self.node_id, extra={"node": self.node_id})
        except Exception:
            log.exception("leaving the cluster failed; the other nodes take over after the lease ttl")
        for held in self._held.values():
            held.lost, held.reason = True, "node stopped"
        self._held.clear()
        await self._pool.close()
        self._pool = None

    # ----- tenant leases --------------------------------------------------------------
    def held(self, tenant: str) -> HeldLease | None:
        return self._held.get(tenant)

    def held_tenants(self) -> dict[str, int]:
        """Tenant -> epoch of every lease this node holds now (for /healthz)."""
        return {t: h.epoch for t, h in self._held.items() if h.valid()}

    async def hold(self, tenant: str) -> HeldLease:
        """Hold `tenant`'s lease (acquiring it unless this node holds it already); raises
        LeaseBusy when another node holds it. Pair every call with `unhold`."""
        async with self._lock:
            if self.displaced is not None:
                raise LeaseBusy(self.displaced)
            if time.monotonic() >= self._alive_until:
                raise LeaseBusy(f"node {self.node_id}'s own lease is not confirmed by a recent heartbeat")
            held = self._held.get(tenant)
            if held is not None and held.valid():
                held.users += 1
                return held
            if held is not None:  # lost or stale: its users are failing; start afresh
                del self._held[tenant]
            started = time.monotonic()
            lease = await acquire_lease(self.pool, tenant, self.node_id, self.ttl)
            if lease is None:
                self.metrics.lease_busy.inc()
                raise LeaseBusy(f"tenant {tenant} is held by another node")
            held = HeldLease(lease, started + self.ttl - self.margin, users=1)
            self._held[tenant] = held
            self.metrics.tenants_held.set(len(self._held))
            if lease.taken_over:
                self.metrics.lease_taken_over("tenant")
            return held

    async def unhold(self, held: HeldLease) -> None:
        """One user less; the last one releases the lease (unless it was lost)."""
        async with self._lock:
            held.users -= 1
            if held.users > 0:
                return
            if self._held.get(held.tenant) is held:
                del self._held[held.tenant]
                self.metrics.tenants_held.set(len(self._held))
            if held.lost or self._pool is None:
                return
            held.lost, held.reason = True, "released"
            try:
                await release_lease(self._pool, held.lease)
            except Exception:
                log.warning("could not release the lease on %s; it expires by itself", held.tenant, exc_info=True)

    def _lose(self, held: HeldLease, reason: str) -> None:
        if held.lost:
            return
        held.lost, held.reason = True, reason
        self.metrics.leases_lost.inc()
        log.warning(
            "lease on tenant %s (epoch %d) lost: %s; its turn stops and its profile closes",
            held.tenant,
            held.epoch,
            reason,
            extra={"event": "lease_lost", "tenant": held.tenant, "epoch": held.epoch, "node": self.node_id},
        )
        if self.on_lost is not None:
            self.on_lost(held.tenant)

    # ----- heartbeats -----------------------------------------------------------------
    async def _heartbeats(self) -> None:
        while True:
            await asyncio.sleep(self.ttl / 3)
            try:
                await self.beat()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.metrics.heartbeat_failures.inc()
                log.error("heartbeat failed (%s); writes stop when the leases run out locally", exc)

    async def _expire_leases(self) -> None:
        """Lose each held lease at its local deadline whether or not the database answers (a
        heartbeat waits for it): its profile closes before the database lets another node in."""
        while True:
            now = time.monotonic()
            wake = now + self.ttl / 3
            for held in list(self._held.values()):
                if held.lost:
                    continue
                if now >= held.deadline:
                    self._lose(held, "not renewed in time")
                else:
                    wake = min(wake, held.deadline)
            await asyncio.sleep(max(wake - time.monotonic(), 0.01))

    async def beat(self) -> None:
        """Renew the node lease and every tenant lease; a lease that cannot be renewed is lost."""
        if self.displaced is not None:
            log.error("%s; this process holds nothing and should be stopped", self.displaced)
            return
        started = time.monotonic()
        alive = await heartbeat(self.pool, self.node_id, self.ttl, self.instance)
        if alive:
            self._alive_until = started + self.ttl - self.margin
        else:
            # the node lease ran out (a pause, a partition) or another process took the id:
            # other nodes may run our lanes and tenants now; everything held is lost, then the
            # node joins afresh unless the id is another live process's now
            self.metrics.heartbeat_failures.inc()
            for held in list(self._held.values()):
                self._lose(held, "node lease expired")
            holder = await claim_node_id(self.pool, self.node_id, self.ttl, self.instance)
            if holder is not None:
                self.displaced = _in_use(self.node_id, holder)
                log.error("%s; this process holds nothing and should be stopped", self.displaced)
                return
            self._alive_until = started + self.ttl - self.margin
            log.warning("node %s rejoined the cluster after its lease had expired", self.node_id)
            return
        for held in list(self._held.values()):
            if held.lost:
                continue
            if time.monotonic() >= held.deadline:
                self._lose(held, "not renewed in time")
                continue
            started = time.monotonic()
            lease = await renew_lease(self.pool, held.lease, self.ttl)
            if held.lost:  # its deadline passed while the renewal waited: its profile is closing
                continue
            if lease is None:
                self._lose(held, "taken over by another node")
                continue
            held.lease, held.deadline = lease, started + self.ttl - self.margin
        # after the renewals, which must not wait for it: interaction tokens past their life
        # (docs/cluster.md#slash-commands-answered-from-any-node)
        await spend_expired_handles(self.pool)


class NodePool:
    """The node's pool for the parts built before the node starts (gateway/cluster/build.py):
    each use reaches the pool `ClusterNode.start()` opened (RuntimeError before that)."""

    def __init__(self, node: ClusterNode) -> None:
        self._node = node

    def connection(self, timeout: float | None = None) -> AbstractAsyncContextManager[Conn]:
        return self._node.pool.connection(timeout)

    @property
    def conninfo(self) -> Any:
        return self._node.pool.conninfo

    @property
    def kwargs(self) -> Any:
        return self._node.pool.kwargs

    def as_pool(self) -> Pool:
        """Typed as the pool the parts take: they use only `connection`, `conninfo`, `kwargs`."""
        return cast(Pool, self)


class ProfileLeases:
    """Cluster mode's ProfileGate: a profile opens only under its tenant lease, its stores'
    writes are guarded by that lease, and closing it lets the lease go. Every open and
    close is one audit record (logger hermes.cluster): `event` profile_open|profile_close,
    `tenant`, `epoch`, `node` and the wall-clock `ts`; the open is logged once the lease is
    held and before SQLite opens, the close after SQLite closed and before the release."""

    def __init__(self, node: ClusterNode, opened: Callable[[str, HeldLease], Awaitable[None]] | None = None) -> None:
        self.node = node
        # told of every open under its lease, before the profile is used (the reminders' index)
        self.opened = opened
        self._open: dict[str, HeldLease] = {}

    async def opening(self, tenant_id: str) -> Callable[[], None]:
        held = await self.node.hold(tenant_id)
        if self.opened is not None:
            try:
                await self.opened(tenant_id, held)
            except BaseException:
                await self.node.unhold(held)
                raise
        self._open[tenant_id] = held
        self._audit("profile_open", held)
        return held.check

    async def closed(self, tenant_id: str) -> None:
        held = self._open.pop(tenant_id, None)
        if held is None:
            return
        self._audit("profile_close", held, reason=held.reason if held.lost else "closed")
        await self.node.unhold(held)

    def _audit(self, event: str, held: HeldLease, **extra: str) -> None:
        log.info(
            "%s %s epoch %d",
            event,
            held.tenant,
            held.epoch,
            extra={
                "event": event,
                "tenant": held.tenant,
                "epoch": held.epoch,
                "node": self.node.node_id,
                "ts": time.time(),
                **extra,
            },
        )
