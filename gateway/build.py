"""Building a gateway: every part, completely, before the runtime exists.

`build_gateway(cfg, adapters)` is the single-node factory: gateway.db holds the inbox, the
outbox and the small shared state, links.json the identity links. Cluster mode has its own
factory, `gateway.cluster.build.build_cluster_gateway`, which hands its PostgreSQL parts
to the same `build_parts` (docs/development.md#layers).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import cast

from agent.agents import Agents
from agent.llm import LLMClient
from agent.metering import Ledger, Meter
from agent.profile import Profile
from agent.sessions import StoragePool
from agent.tokens import TokenCounter
from agent.turn import Agent
from agent.vault import TenantKeys, open_keyring
from core.messages import InboundMessage
from core.protocols import Adapter
from core.settings import AgentSettings, Config
from gateway.access import Access
from gateway.commands import CommandParts
from gateway.confirmations import Confirmations, LocalQuestions
from gateway.inbox import Inbox
from gateway.ingress import Ingress, Refusals
from gateway.jobs import Background, RunningTurns
from gateway.kv import KeyValue, SqliteKV
from gateway.linking import Linking, MergeGuard
from gateway.media import MediaIntake
from gateway.metrics import ClusterMetrics, InstrumentedLLM, Metrics
from gateway.modes import Fencing, OpenQuestions, Reminders, SharedInbox, StopSignals, StreamedDrafts
from gateway.outbox import Deliverer, Outbox, reseal_rows
from gateway.rekeys import Rekeys
from gateway.reminders import ReminderScheduler
from gateway.replies import Replies
from gateway.reviews import Reviews
from gateway.runtime import GatewayApp, Parts
from gateway.sealing import MessageSeal
from gateway.tooling import build_tools
from gateway.turns import Turns
from tenancy.identity import IdentityLinks
from tenancy.keys import resolve_lane
from tenancy.profiles import ProfileGate, ProfileManager

log = logging.getLogger("hermes.gateway")


@dataclass
class ModeParts:
    """The parts in which the two modes differ; the rest `build_parts` builds alike."""

    inbox: Inbox
    outbox: Outbox
    links: IdentityLinks
    #: pairing and link codes, approvals (None: gateway.db's kv table, through `inbox`)
    kv: KeyValue | None = None
    #: cluster mode: a profile opens only under its tenant lease
    gate: ProfileGate | None = None
    links_refresh: Callable[[], Awaitable[object]] | None = None
    merge_guard: MergeGuard | None = None
    shared: SharedInbox | None = None
    #: cluster mode: a /stop reaches the node that runs the lane's turn
    stop_signals: StopSignals | None = None
    #: where tool-call confirmations wait for a press (this process, or PostgreSQL in a cluster)
    questions: OpenQuestions = field(default_factory=LocalQuestions)
    fencing: Fencing | None = None
    #: cluster mode: drafts a turn's earlier run on a dead node left, for the new run to edit
    drafts: StreamedDrafts | None = None
    cluster_metrics: ClusterMetrics | None = None
    #: where a tenant's budget counts live (None: its profile's state.db)
    ledger_for: Callable[[Profile], Ledger] | None = None
    #: the reminders' due index and what fires them (None: gateway.db and this process)
    reminders: Reminders | None = None
    #: identity state shared with other nodes: a /link merge needs `merge_guard`
    cluster: bool = False
    #: tenants' data keys (storage.encryption per_tenant), shared by the profiles and gateway.db
    keys: TenantKeys = field(default_factory=lambda: TenantKeys(None))
    running: RunningTurns = field(default_factory=RunningTurns)
    background: Background = field(default_factory=Background)


def build_gateway(
    cfg: Config, adapters: Sequence[Adapter] = (), *, llm: LLMClient | None = None, tokens: TokenCounter | None = None
) -> GatewayApp:
    """A single-node gateway for `cfg` serving `adapters`; `llm` and `tokens` for tests."""
    if cfg.cluster.enabled:
        raise ValueError("cluster.enabled is set: build this gateway with gateway.cluster.build.build_cluster_gateway")
    storage = cfg.storage
    keyring = open_keyring(cfg.data_dir, storage.encryption, storage.master_key_env, storage.master_key_file)
    # a rekey (/forget all) re-seals the tenant's waiting text in gateway.db too (docs/privacy.md#delete-is-crypto-shredding)
    keys = TenantKeys(keyring, rows=partial(reseal_rows, cfg.data_dir / "gateway.db"))
    links = IdentityLinks.load(cfg.data_dir / "links.json", cfg.tenancy)
    seal = MessageSeal(keys, cfg.data_dir, partial(_tenant_of, cfg, links)) if keys.on else None
    inbox = Inbox(cfg.data_dir / "gateway.db", fsync=cfg.storage.fsync, seal=seal)
    mode = ModeParts(inbox=inbox, outbox=Outbox(inbox), links=links, keys=keys)
    return GatewayApp(build_parts(cfg, adapters, mode, llm=llm, tokens=tokens))


def _tenant_of(cfg: Config, links: IdentityLinks, msg: InboundMessage) -> str | None:
    """The tenant whose lane `msg` is on (its text in gateway.db is sealed with its key)."""
    try:
        return resolve_lane(msg, cfg.tenancy, links).tenant_id
    except ValueError:  # refused as "bad_ids" at once
        return None


def build_parts(
    cfg: Config,
    adapters: Sequence[Adapter],
    mode: ModeParts,
    *,
    llm: LLMClient | None = None,
    tokens: TokenCounter | None = None,
) -> Parts:
    """Every part of a gateway around the parts of its mode."""
    by_platform: dict[str, Adapter] = {a.platform: a for a in adapters}
    inbox, outbox, links, running, background = mode.inbox, mode.outbox, mode.links, mode.running, mode.background
    storage_pool = StoragePool(cfg.storage.io_threads)
    profiles = ProfileManager(
        cfg.data_dir,
        max_open=cfg.tenancy.max_open_profiles,
        memory_budget_mib=cfg.storage.memory_budget_mib,
        fsync=cfg.storage.fsync,
        memory_char_limit=cfg.memory.memory_char_limit,
        user_char_limit=cfg.memory.user_char_limit,
        provider_kind=cfg.memory.provider,
        pool=storage_pool,
        gate=mode.gate,
        # WAL's shared-memory index is for one host; a shared data_dir needs a rollback journal
        journal_mode="delete" if cfg.cluster.enabled else "wal",
        keys=mode.keys,
    )
    own_llm = llm is None
    client = llm or LLMClient.from_config(cfg.llm)
    counter = tokens or TokenCounter.create(log)
    metrics = Metrics()
    if mode.cluster_metrics is not None:  # claim and failover figures on /metrics
        metrics.enable_cluster(mode.cluster_metrics)
    deliverer = Deliverer(outbox, by_platform, metrics, cfg.delivery)
    llm_monitor = InstrumentedLLM(client, metrics)  # counts errors by kind for /metrics
    # InstrumentedLLM proxies the LLMClient: same chat() signature, every other attribute
    # passed through (__getattr__), so the Agent can use it as one
    # every model call of a turn, summary or review: budgets, ledger, fair share (agent/metering.py)
    meter = Meter.for_profiles(
        cfg.llm, cfg.budgets, admins=frozenset(cfg.access.admins), sink=metrics, ledger_for=mode.ledger_for
    )
    settings = AgentSettings.from_config(cfg)
    tools = build_tools(cfg, metrics)  # web and MCP clients, shared by every agent (gateway/tooling.py)
    agent = Agent(settings, cast(LLMClient, llm_monitor), counter, meter=meter, tools=tools.services)
    offered: dict[str, Agent] = {}
    offer_clients: list[LLMClient] = []
    for name in cfg.llm.models:  # one agent per offer (agent/agents.py), each with its own client
        offer_llm = cfg.llm.for_offer(name)
        offer_clients.append(LLMClient.from_config(offer_llm))
        offer_monitor = cast(LLMClient, InstrumentedLLM(offer_clients[-1], metrics))
        offered[name] = Agent(
            settings.model_copy(update={"llm": offer_llm}),
            offer_monitor,
            counter,
            meter=meter,
            review_state=agent.reviewer.state,
            tools=tools.services,
        )
    agents = Agents(agent, offered)
    media = MediaIntake(cfg)
    for each in agents.all():
        each.compression.on_outcome = metrics.compression  # hermes_compressions_total{outcome}
        each.reviewer.on_outcome = metrics.review  # hermes_memory_reviews_total{kind,outcome}
    replies = Replies(cfg, by_platform, outbox, deliverer, mode.drafts)
    ingress: Ingress | None = None  # built last: reminders -> linking -> turns -> ingress

    async def submit_reminder(msg: InboundMessage) -> bool:
        assert ingress is not None
        return await ingress.submit_reminder(msg)

    reminders: Reminders = (
        mode.reminders
        if mode.reminders is not None
        else ReminderScheduler(lambda: inbox.db, cfg.data_dir, submit_reminder, keys=mode.keys)
    )
    # the tool keeps the due-time index current
    for each in agents.all():
        each.reminder_index = reminders.note if cfg.reminders_on else None
    kv = mode.kv if mode.kv is not None else SqliteKV(inbox)
    access = Access(cfg.access, kv)
    linking = Linking(
        cfg,
        links,
        profiles,
        inbox,
        metrics,
        reminders,
        replies.send,
        store=mode.kv,
        cluster=mode.cluster,
        merge_guard=mode.merge_guard,
    )
    reviews = Reviews(cfg.memory, agents, linking, deliverer, background)
    refusals = Refusals(cfg, by_platform, inbox, access, metrics, replies, background, shared=mode.shared is not None)
    rekeys = Rekeys(mode.keys, profiles, background)
    commands = CommandParts(cfg, access, agent, agents, inbox, links, linking, reminders, rekeys)
    confirmations = Confirmations(by_platform, cfg.tools.confirm_timeout_s, mode.questions)
    turns = Turns(
        cfg,
        by_platform,
        agents,
        linking,
        profiles,
        media,
        metrics,
        inbox,
        outbox,
        deliverer,
        replies,
        reviews,
        reminders,
        commands,
        running,
        background,
        refusals.refuse,
        confirmations=confirmations,
        fencing=mode.fencing,
    )
    ingress = Ingress(
        cfg,
        inbox,
        access,
        links,
        linking,
        turns.lanes,
        metrics,
        replies,
        refusals,
        running,
        background,
        links_refresh=mode.links_refresh,
        shared=mode.shared,
        stop_signals=mode.stop_signals,
    )
    return Parts(
        cfg=cfg,
        adapters=by_platform,
        inbox=inbox,
        outbox=outbox,
        links=links,
        access=access,
        linking=linking,
        storage_pool=storage_pool,
        profiles=profiles,
        llm=client,
        own_llm=own_llm,
        tokens=counter,
        metrics=metrics,
        llm_monitor=llm_monitor,
        agent=agent,
        agents=agents,
        offer_clients=offer_clients,
        tools=tools,
        confirmations=confirmations,
        media=media,
        deliverer=deliverer,
        replies=replies,
        reminders=reminders,
        reviews=reviews,
        turns=turns,
        refusals=refusals,
        ingress=ingress,
        running=running,
        background=background,
        links_refresh=mode.links_refresh,
    )
