"""The cluster-mode factory: a gateway whose inbox, outbox, small shared state, identity
links, open confirmations and reminders' due index are in PostgreSQL, whose profiles open only under their tenant
lease, whose lanes are claimed and run by claim workers, and whose nodes signal each other
a /stop or a decided confirmation (docs/cluster.md).

Every part is built here before the runtime exists; what needs the database at start is
started by the runtime, in order, through `ClusterParts` (gateway/modes.py `ClusterNode`):
run lock, node start, signal listener, shared state import and refresh, replay,
observability, adapters, ingress election, claims.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from typing import Any, cast

from agent.llm import LLMClient
from agent.tokens import TokenCounter
from core.lanes import Lane
from core.messages import InboundMessage
from core.protocols import Adapter, ElectedReceiver, ElectedShards, SendPacer
from core.settings import Config
from gateway.build import ModeParts, build_parts
from gateway.cluster.budgets import PgLedger
from gateway.cluster.claims import ClaimWorkers
from gateway.cluster.db import Pool, dsn_from_env
from gateway.cluster.health import ClusterHealth
from gateway.cluster.identity import SharedIdentity
from gateway.cluster.inbox import Claim
from gateway.cluster.ingress import TELEGRAM_POLLING, TELEGRAM_WEBHOOK, IngressElection, Role, discord_shard
from gateway.cluster.ledger import ClusterInbox, ClusterOutbox
from gateway.cluster.node import ClusterNode, HeldLease, NodePool, ProfileLeases
from gateway.cluster.questions import PgQuestions
from gateway.cluster.reminders import PgReminders
from gateway.cluster.runner import ClaimRunner, HandedReplies, LeaseFencing, SharedIngress
from gateway.cluster.signals import NodeSignals, StopPublisher
from gateway.inbox import Inbox
from gateway.outbox import Outbox
from gateway.runtime import GatewayApp, Parts
from tenancy.keys import resolve_lane


def ingress_roles(adapters: Iterable[Adapter], cfg: Config) -> list[Role]:
    """One role per way in: Telegram's polling or webhook registration, each Discord shard."""
    roles: list[Role] = []
    for adapter in adapters:
        # an adapter that is not elected receives by itself (a test's loopback adapter, a console)
        if adapter.platform == "telegram" and isinstance(adapter, ElectedReceiver) and adapter.elected:
            name = TELEGRAM_WEBHOOK if cfg.platforms.telegram.mode == "webhook" else TELEGRAM_POLLING
            roles.append(Role(name, adapter.start_receiving, adapter.stop_receiving))
        elif adapter.platform == "discord" and isinstance(adapter, ElectedShards) and adapter.elected:
            for n in range(cfg.platforms.discord.shard_count):
                roles.append(
                    Role(discord_shard(n), partial(adapter.start_shard, n), partial(adapter.stop_shard, n), spread=True)
                )
    return roles


class ClusterParts:
    """A node's own parts, started and stopped by the runtime in its order (the
    `ClusterNode` protocol of gateway/modes.py)."""

    def __init__(
        self,
        node: ClusterNode,
        identity: SharedIdentity,
        claims: ClaimWorkers,
        runner: ClaimRunner,
        election: IngressElection | None,
        health: ClusterHealth,
        signals: NodeSignals,
    ) -> None:
        self.node = node
        self.identity = identity
        self.claims = claims
        self.runner = runner
        self.election = election  # None when no adapter receives by election
        self._health = health
        self.signals = signals  # /stop and confirmation signals from the other nodes
        self._idle_closer: asyncio.Task | None = None

    @property
    def displaced(self) -> str | None:
        return self.node.displaced

    async def join(self) -> None:
        await self.node.start()  # pool, migrations, registration, heartbeats
        self.signals.start()  # before any turn runs here: a /stop elsewhere must reach it
        await self.identity.start()  # pairing, link codes and links in PostgreSQL

    async def receive(self) -> None:
        if self.election is not None:
            await self.election.start()

    def run_claims(self) -> None:
        self.runner.accepting = True
        self.claims.start()
        self._idle_closer = asyncio.create_task(self.runner.close_idle_profiles(), name="idle-profiles")

    async def stop_claims(self, timeout: float) -> None:
        self.runner.accepting = False
        await self.claims.stop(timeout)
        if self._idle_closer is not None:
            self._idle_closer.cancel()
            self._idle_closer = None

    async def stop_receiving(self) -> None:
        if self.election is not None:
            await self.election.stop()

    async def leave(self) -> None:
        await self.signals.stop()
        await self.node.stop()

    async def health(self) -> tuple[bool, dict[str, Any]]:
        return await self._health.check()


class ClusterGateway(GatewayApp):
    """A cluster node's runtime: a `GatewayApp` that also names its node's parts."""

    def __init__(self, parts: Parts, cluster: ClusterParts, shared_outbox: ClusterOutbox) -> None:
        super().__init__(parts, cluster=cluster)
        self.node = cluster.node
        self.claims: ClaimWorkers | None = cluster.claims
        self.shared_outbox = shared_outbox
        self._election = cluster.election


AdaptersFor = Callable[[SendPacer | None], Sequence[Adapter]]
"""Builds a node's adapters around what they share with the other nodes: the Telegram send
pacer (None when Telegram is off; docs/cluster.md#flood-pacing-across-nodes)."""


def shared_flood_gate(cfg: Config, pool: Pool) -> SendPacer | None:
    """The Telegram pacer every node shares through `pool`; None when Telegram is off (so a
    Discord-only node never loads the Telegram library)."""
    if not cfg.platforms.telegram.enabled:
        return None
    from gateway.cluster.pacing import PgFloodGate

    return PgFloodGate(pool)


def build_cluster_gateway(
    cfg: Config,
    adapters: Sequence[Adapter] = (),
    *,
    adapters_for: AdaptersFor | None = None,
    llm: LLMClient | None = None,
    tokens: TokenCounter | None = None,
) -> GatewayApp:
    """A cluster node for `cfg` (cluster.enabled) serving `adapters`, and those `adapters_for`
    builds around the node's shared parts (what `run` does); `llm` and `tokens` for tests."""
    if not cfg.cluster.enabled:
        raise ValueError("cluster.enabled is not set: build this gateway with gateway.build.build_gateway")
    runner: ClaimRunner | None = None  # built once the lanes exist; the node and the claim workers call it

    def lease_lost(tenant: str) -> None:
        assert runner is not None
        runner.lease_lost(tenant)

    async def run_claim(claim: Claim, held: HeldLease) -> None:
        assert runner is not None
        await runner.run(claim, held)

    node = ClusterNode(cfg.cluster, dsn_from_env(cfg.cluster.postgres_dsn_env or ""), on_lost=lease_lost)
    pool = NodePool(node).as_pool()  # opened by node.start()
    if adapters_for is not None:
        adapters = [*adapters, *adapters_for(shared_flood_gate(cfg, pool))]
    shared_outbox = ClusterOutbox(node)
    identity = SharedIdentity(cfg, pool, node.node_id, node.ttl)
    claims = ClaimWorkers(node, run_claim, workers=cfg.cluster.max_lanes, poll_s=cfg.cluster.poll_interval_s)
    # tool-call confirmations a press on any node decides (docs/cluster.md#stop-and-confirmations-across-nodes)
    questions = PgQuestions(pool, node.node_id, cfg.tools.confirm_timeout_s)

    async def lane_of(msg: InboundMessage) -> Lane | None:
        await identity.refresh()  # a link another node made places the occurrence too
        try:
            return resolve_lane(msg, cfg.tenancy, identity.links)
        except ValueError:
            return None

    # the due index in PostgreSQL, fired under tenant leases (docs/cluster.md#reminders)
    reminders = PgReminders(node, cfg.data_dir, lane_of, poll_s=cfg.cluster.poll_interval_s)
    mode = ModeParts(
        # duck-typed: they implement what the gateway, Access and Linking call in cluster mode
        inbox=cast(Inbox, ClusterInbox(node, shared_outbox)),
        outbox=cast(Outbox, shared_outbox),
        links=identity.links,
        kv=identity.kv,
        gate=ProfileLeases(node, opened=reminders.opened if cfg.reminders_on else None),
        links_refresh=identity.refresh,
        merge_guard=identity.merge_guard,
        shared=SharedIngress(pool, claims),
        stop_signals=StopPublisher(pool),
        questions=questions,
        fencing=LeaseFencing(node, shared_outbox),
        drafts=shared_outbox,  # a streamed answer goes on from a dead node's draft
        cluster_metrics=node.metrics,
        ledger_for=lambda profile: PgLedger(pool, profile.tenant_id),  # budgets atomic across nodes
        reminders=reminders,
        cluster=True,
    )
    parts = build_parts(cfg, adapters, mode, llm=llm, tokens=tokens)
    runner = ClaimRunner(
        node,
        shared_outbox,
        parts.deliverer,
        parts.turns.lanes,
        parts.ingress.admit,
        parts.profiles,
        parts.running,
        parts.background,
        HandedReplies(parts.adapters.values()),  # slash commands deferred by any node
    )
    roles = ingress_roles(parts.adapters.values(), cfg)
    election = (
        IngressElection(
            pool, node.node_id, node.ttl, roles, metrics=node.metrics, may_hold=lambda: node.displaced is None
        )
        if roles
        else None
    )
    health = ClusterHealth(pool, node.node_id, instance=node.instance)
    signals = NodeSignals(node.dsn, node.node_id, on_stop=parts.ingress.stop_here, on_decided=questions.decided)
    return ClusterGateway(parts, ClusterParts(node, identity, claims, runner, election, health, signals), shared_outbox)
