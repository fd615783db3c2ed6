"""Ingress election: which node receives from a platform, by named leases.

A role is a singleton lease on the `tenant_leases` table under a name of its own
(`ingress:telegram-polling`, `ingress:telegram-webhook`, `ingress:discord-shard:<n>`), with
the epochs and expiry every lease has. `IngressElection` runs one loop per node: it renews
the roles it holds, takes free or expired ones, and calls each role's `start` when it gains
it and `stop` when it loses it or gives it up.

- A holder that cannot renew (database unreachable) stops the role itself once
  `stop_after` of the ttl has passed since its last renewal, before the lease can expire
  and another node take it, so two nodes never receive at once.
- Roles marked `spread` (Discord shards) are shared out: a node holds at most
  ceil(roles / live nodes) of them and gives up the surplus one per round, so a node that
  joins gets its share and the shards of a node that died are taken over by the others.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from gateway.cluster.db import Pool, fetch_one
from gateway.cluster.leases import Lease, acquire_lease, release_lease, renew_lease
from gateway.metrics import ClusterMetrics

log = logging.getLogger("hermes.cluster.ingress")

TELEGRAM_POLLING = "ingress:telegram-polling"
TELEGRAM_WEBHOOK = "ingress:telegram-webhook"


def discord_shard(n: int) -> str:
    return f"ingress:discord-shard:{n}"


@dataclass(frozen=True)
class Role:
    name: str  # the lease name
    start: Callable[[], Awaitable[None]]
    stop: Callable[[], Awaitable[None]]
    spread: bool = False  # one of a set shared out among the live nodes

    @property
    def kind(self) -> str:
        """The metric kind: `telegram_polling`, `telegram_webhook`, `discord_shard`."""
        return self.name.removeprefix("ingress:").split(":")[0].replace("-", "_")


class IngressElection:
    """One node's ingress roles. `start()` runs a first round before it returns (so a lone
    node receives at once), then one round every `interval_s` (default ttl/3)."""

    def __init__(
        self,
        pool: Pool,
        node_id: str,
        ttl_s: float,
        roles: Sequence[Role],
        *,
        interval_s: float | None = None,
        stop_after: float = 0.8,
        metrics: ClusterMetrics | None = None,
        may_hold: Callable[[], bool] = lambda: True,
    ) -> None:
        """`metrics` counts every role gained, lost or released, and takeovers; `may_hold`
        False (the node id is another process's now) gives every role up, taking none."""
        self.pool = pool
        self.node_id = node_id
        self.ttl_s = ttl_s
        self.roles = list(roles)
        self.interval_s = interval_s if interval_s is not None else ttl_s / 3
        self.stop_after_s = ttl_s * stop_after
        self.metrics = metrics
        self.may_hold = may_hold
        self._held: dict[str, Lease] = {}
        self._renewed_at: dict[str, float] = {}
        self._task: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()

    @property
    def held(self) -> list[str]:
        """The roles this node holds now, in role order."""
        return [r.name for r in self.roles if r.name in self._held]

    async def start(self) -> None:
        await self.step()
        self._task = asyncio.create_task(self._loop(), name=f"ingress-election-{self.node_id}")

    async def stop(self) -> None:
        """Stop every held role and release its lease, so another node takes over at once."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        async with self._lock:
            for role in reversed(self.roles):
                if role.name in self._held:
                    await self._give_up(role, "released")

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.step()
            except asyncio.CancelledError:
                raise
            except Exception:  # the database may be away: the next round tries again
                log.warning("ingress election round failed; retrying", exc_info=True)

    async def step(self) -> None:
        """One round: renew, give up the surplus, take what is free."""
        async with self._lock:
            if not self.may_hold():  # its leases are keyed by the id: renewing would take the other's
                for role in reversed(self.roles):
                    if role.name in self._held:
                        await self._give_up(role, "lost", release=False)
                return
            await self._renew_all()
            share = await self._share()
            spread_held = [r for r in self.roles if r.spread and r.name in self._held]
            if len(spread_held) > share:  # a node joined: give one back per round
                await self._give_up(spread_held[-1], "released")
                spread_held.pop()
            for role in self.roles:
                if role.name in self._held:
                    continue
                if role.spread and len(spread_held) >= share:
                    continue
                lease = await acquire_lease(self.pool, role.name, self.node_id, self.ttl_s)
                if lease is None:
                    continue
                try:
                    await role.start()
                except Exception:
                    log.exception("ingress: could not start %s; giving the role back", role.name)
                    await release_lease(self.pool, lease)
                    continue
                self._held[role.name] = lease
                self._renewed_at[role.name] = asyncio.get_running_loop().time()
                if role.spread:
                    spread_held.append(role)
                log.info("ingress: this node now holds %s (epoch %d)", role.name, lease.epoch)
                self._changed(role, "gained")
                if lease.taken_over and self.metrics is not None:  # it moved here from another node
                    self.metrics.lease_taken_over("ingress")

    async def _renew_all(self) -> None:
        now = asyncio.get_running_loop().time()
        for role in self.roles:
            lease = self._held.get(role.name)
            if lease is None:
                continue
            try:
                renewed = await renew_lease(self.pool, lease, self.ttl_s)
            except Exception as err:
                if now - self._renewed_at[role.name] < self.stop_after_s:
                    continue  # keep receiving; the lease is still ours for a while
                log.warning("ingress: cannot renew %s (%s); stopping it before it expires", role.name, err)
                await self._give_up(role, "lost", release=False)
                continue
            if renewed is None:
                log.warning("ingress: %s was taken over by another node; stopping it here", role.name)
                await self._give_up(role, "lost", release=False)
            else:
                self._held[role.name] = renewed
                self._renewed_at[role.name] = now

    async def _share(self) -> int:
        spread = sum(1 for r in self.roles if r.spread)
        if not spread:
            return 0
        async with self.pool.connection() as conn:
            row = await fetch_one(
                conn,
                "SELECT count(*) AS n FROM nodes WHERE lease_expires_at > now() OR node_id = %s",
                (self.node_id,),
            )
        return math.ceil(spread / max(1, int(row["n"])))

    async def _give_up(self, role: Role, outcome: str, *, release: bool = True) -> None:
        lease = self._held.pop(role.name)
        self._renewed_at.pop(role.name, None)
        try:
            await role.stop()
        except Exception:
            log.exception("ingress: stopping %s failed", role.name)
        if release:
            try:
                await release_lease(self.pool, lease)
            except Exception as err:  # it expires by itself after the ttl
                log.warning("ingress: could not release %s (%s)", role.name, err)
        self._changed(role, outcome)

    def _changed(self, role: Role, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.ingress_changed(role.kind, outcome, len(self._held))
