"""A cluster node's lanes: what the ingress records goes into the shared inbox
(`SharedIngress`), claim workers run claimed lanes through the same admit/turn path as on one
node (`ClaimRunner`), and a turn under a lost lease is fenced (`LeaseFencing`). These are
the parts behind gateway/modes.py's protocols."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from core.lanes import Lane
from core.messages import InboundMessage
from gateway.cluster.claims import ClaimWorkers, LaneStalled
from gateway.cluster.db import Pool
from gateway.cluster.inbox import Claim, Inbound, pending_messages, record_inbound
from gateway.cluster.ledger import ClusterOutbox
from gateway.cluster.node import ClusterNode, HeldLease
from gateway.jobs import Background, Job, RunningTurns
from gateway.lanes import Lanes
from gateway.outbox import Deliverer
from gateway.turns import close_profile
from tenancy.profiles import ProfileManager

log = logging.getLogger("hermes.gateway")

Admit = Callable[..., Awaitable[str | None]]
"""`Ingress.admit(msg, force=True)`: refuse the message or queue it; the lane key it went on."""


def without_nul(value: Any) -> Any:
    """`value` (JSON data) with NUL characters removed from every string."""
    if isinstance(value, str):
        return value.replace("\0", "")
    if isinstance(value, list):
        return [without_nul(v) for v in value]
    if isinstance(value, dict):
        return {without_nul(k): without_nul(v) for k, v in value.items()}
    return value


def inbound_of(msg: InboundMessage, lane: Lane | None) -> Inbound:
    """`msg` as the shared inbox keeps it, on `lane` (None: it cannot be placed, and is
    refused ("bad_ids") by whichever node runs it, like on one node)."""
    if lane is not None:
        tenant, lane_key = lane.tenant_id, lane.key
    else:
        tenant = lane_key = f"unplaceable/{msg.platform}/{msg.chat_id}"
    payload = without_nul(msg.model_dump(mode="json"))  # PostgreSQL text cannot hold NUL
    return Inbound(msg.platform, msg.chat_id, msg.message_id, lane_key, tenant, payload)


class SharedIngress:
    """The `SharedInbox` of gateway/modes.py: a message goes into PostgreSQL on its lane
    (once per platform message id), and this node's claim workers are woken."""

    def __init__(self, pool: Pool, claims: ClaimWorkers) -> None:
        self.pool = pool
        self.claims = claims

    async def record(self, msg: InboundMessage, lane: Lane | None) -> bool:
        new = await record_inbound(self.pool, inbound_of(msg, lane))
        if new is None:
            return False
        self.claims.kick()
        return True


class LeaseFencing:
    """The `Fencing` of gateway/modes.py: PostgreSQL unreachable is a storage fault (the lane
    waits and retries); a turn fenced out by a lost lease is counted."""

    def __init__(self, node: ClusterNode, outbox: ClusterOutbox) -> None:
        self.node = node
        self.outbox = outbox

    def database_fault(self, exc: BaseException) -> str | None:
        if isinstance(exc, self.outbox.TRANSIENT):
            return "database unreachable"
        return None

    def fenced(self) -> None:
        self.node.metrics.fenced_out("turn")


class ClaimRunner:
    """Runs the lanes this node claimed, under their tenant leases (`ClaimWorkers`' `run`)."""

    def __init__(
        self,
        node: ClusterNode,
        outbox: ClusterOutbox,
        deliverer: Deliverer,
        lanes: Lanes[Job],
        admit: Admit,
        profiles: ProfileManager,
        running: RunningTurns,
        background: Background,
    ) -> None:
        self.node = node
        self.outbox = outbox
        self.deliverer = deliverer
        self.lanes = lanes
        self.admit = admit
        self.profiles = profiles
        self.running = running
        self.background = background
        self.accepting = False  # claimed lanes take their next batch only while the node serves

    async def run(self, claim: Claim, held: HeldLease) -> None:
        """Run a lane this node claimed, under its tenant lease: the chunks a node before us
        recorded but did not send go out first, in order; then the pending messages, in
        arrival order, through the same admit/turn path as on one node; every answer is sent
        before the lane is given back. Raises LeaseLost when the lease goes."""
        await self._send_unsent(claim.lane, held)
        seen, batch, first = 0, claim.messages, True
        while batch and self.accepting:
            keys: list[str] = []
            try:
                for m in batch:
                    seen = max(seen, m.id)
                    if m.answered:  # its turn ran; only its chunks were left (sent above)
                        continue
                    held.check()
                    key = await self.admit(InboundMessage.model_validate(m.payload), force=True)
                    if key is not None and key not in keys:
                        keys.append(key)
                    if first and key is not None:
                        # the lane's oldest open message may have been answered in the profile
                        # by a node that died before recording the answer: it runs alone (not
                        # collected with later ones), so that stored answer is what it gets
                        first = False
                        await self.lanes.settle(key)
            except asyncio.CancelledError:  # stopping: what is queued stays pending
                for key in keys:
                    self.lanes.discard(key)
                raise
            except Exception:  # what is queued stays pending; the running turn ends first
                for key in keys:
                    self.lanes.discard(key)
                    await self.lanes.settle(key)
                raise
            for key in keys:
                await self.lanes.settle(key)
            held.check()
            await self._send_unsent(claim.lane, held)
            pending = await pending_messages(self.node.pool, claim.lane)
            if any(m.id <= seen and not m.answered for m in pending):
                # a turn of this batch did not finish (fenced, failed): later messages wait,
                # the lane is given back and its oldest open message is run again first
                raise LaneStalled(f"lane {claim.lane} has an unfinished message")
            batch = [m for m in pending if m.id > seen]

    async def _send_unsent(self, lane: str, held: HeldLease) -> None:
        """Until every chunk recorded for `lane` was sent (or given up), by the Deliverer."""
        for platform, chat_id, last in await self.outbox.unsent_chats(lane):
            while True:
                held.check()
                self.deliverer.kick(platform, chat_id)
                await self.deliverer.wait(last, timeout=self.node.ttl / 3)
                if await self.outbox.status(last) != "pending":
                    break

    def lease_lost(self, tenant: str) -> None:
        """The node lost `tenant`'s lease: stop its running turns now and close its profile."""
        self.running.stop_tenant(tenant)
        self.background.run(close_profile(self.profiles, tenant))

    async def close_idle_profiles(self) -> None:
        """A profile idle for a lease ttl is closed, so its tenant lease is free for
        whichever node claims the tenant's next lane."""
        while True:
            await asyncio.sleep(self.node.ttl / 3)
            for tenant in self.profiles.idle(self.node.ttl):
                try:
                    await self.profiles.evict(tenant)
                except Exception:
                    log.exception("closing an idle profile failed")
