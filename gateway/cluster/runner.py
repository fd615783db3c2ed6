"""A cluster node's lanes: what the ingress records goes into the shared inbox
(`SharedIngress`), claim workers run claimed lanes through the same admit/turn path as on one
node (`ClaimRunner`), and a turn under a lost lease is fenced (`LeaseFencing`). These are
the parts behind gateway/modes.py's protocols."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from pydantic import SecretStr

from core.lanes import Lane
from core.messages import InboundMessage, ReplyHandle
from core.protocols import Adapter, AdoptsReplies
from gateway.cluster.claims import ClaimWorkers, LaneStalled
from gateway.cluster.db import Pool
from gateway.cluster.inbox import Claim, Inbound, PendingMessage, pending_messages, record_inbound
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


def to_inbound(msg: InboundMessage, lane: Lane | None) -> Inbound:
    """`msg` as the shared inbox keeps it, on `lane` (None: it cannot be placed, and is
    refused ("bad_ids") by whichever node runs it, like on one node)."""
    if lane is not None:
        tenant, lane_key = lane.tenant_id, lane.key
    else:
        tenant = lane_key = f"unplaceable/{msg.platform}/{msg.chat_id}"
    payload = without_nul(msg.model_dump(mode="json"))  # PostgreSQL text cannot hold NUL
    handle = msg.reply_handle.stored() if msg.reply_handle is not None else None  # not in the payload
    return Inbound(msg.platform, msg.chat_id, msg.message_id, lane_key, tenant, payload, handle)


class SharedIngress:
    """The `SharedInbox` of gateway/modes.py: a message goes into PostgreSQL on its lane
    (once per platform message id), and this node's claim workers are woken."""

    def __init__(self, pool: Pool, claims: ClaimWorkers) -> None:
        self.pool = pool
        self.claims = claims

    async def record(self, msg: InboundMessage, lane: Lane | None) -> bool:
        new = await record_inbound(self.pool, to_inbound(msg, lane))
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


def inbound_of(m: PendingMessage) -> InboundMessage:
    """The message as received, with the reply handle its own column keeps (a spent one,
    its token erased, still says whether the answer is private)."""
    msg = InboundMessage.model_validate(m.payload)
    stored = m.reply_handle
    if stored is None:
        return msg
    handle = ReplyHandle(
        application_id=str(stored.get("application_id") or ""),
        token=SecretStr(str(stored.get("token") or "")),
        ephemeral=bool(stored.get("ephemeral")),
        created_at=float(stored.get("created_at") or 0.0),
    )
    return msg.model_copy(update={"reply_handle": handle})


class HandedReplies:
    """The adapters that answer a message through its reply handle (`AdoptsReplies`,
    core/protocols.py), by platform: the node that runs a lane adopts its messages' handles
    (docs/cluster.md#slash-commands-answered-from-any-node)."""

    def __init__(self, adapters: Iterable[Adapter]) -> None:
        self._by_platform = {a.platform: a for a in adapters if isinstance(a, AdoptsReplies)}

    def adopt(self, msg: InboundMessage) -> None:
        adapter = self._by_platform.get(msg.platform)
        if adapter is not None and msg.reply_handle is not None:
            adapter.adopt(msg)

    async def release(self, adopted: Iterable[InboundMessage], done: bool) -> None:
        by_platform: dict[str, list[str]] = {}
        for msg in adopted:
            by_platform.setdefault(msg.platform, []).append(msg.message_id)
        for platform, ids in by_platform.items():
            try:
                await self._by_platform[platform].release(ids, done)
            except Exception as exc:  # cosmetic (a placeholder left): never fails the lane
                log.warning("%s: releasing answered interactions failed (%s)", platform, type(exc).__name__)


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
        replies: HandedReplies | None = None,
    ) -> None:
        self.node = node
        self.replies = replies or HandedReplies(())
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
        before the lane is given back. A draft or progress notice an earlier epoch left
        half-streamed is tidied first (docs/cluster.md#streaming-and-progress-notices).
        Raises LeaseLost when the lease goes. A message's
        reply handle (a slash command another node deferred) is adopted before anything of
        it is sent, and released when the claim ends."""
        adopted: dict[int, InboundMessage] = {}
        done = False
        try:
            done = await self._run(claim, held, adopted)
        finally:
            await self.replies.release(adopted.values(), done)

    def _adopt(self, batch: list[PendingMessage], adopted: dict[int, InboundMessage]) -> None:
        for m in batch:
            if m.reply_handle is not None and m.id not in adopted:
                adopted[m.id] = msg = inbound_of(m)
                self.replies.adopt(msg)

    async def _run(self, claim: Claim, held: HeldLease, adopted: dict[int, InboundMessage]) -> bool:
        """`run`; True when the lane was left with nothing pending (every message done)."""
        self._adopt(claim.messages, adopted)
        await self.outbox.tidy_after_takeover(claim.lane, held)
        await self._send_unsent(claim.lane, held)
        seen, batch, first = 0, claim.messages, True
        while batch and self.accepting:
            self._adopt(batch, adopted)
            keys: list[str] = []
            try:
                for m in batch:
                    seen = max(seen, m.id)
                    if m.answered:  # its turn ran; only its chunks were left (sent above)
                        continue
                    held.check()
                    key = await self.admit(adopted.get(m.id) or inbound_of(m), force=True)
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
        return not batch

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
