"""The gateway: adapters in, turns out. Auth, dedupe, limits, lanes, commands, delivery.

Data flows one way: adapter -> `handle_inbound` (record, admit) -> lane worker
(command or agent turn, inside the tenant's profile) -> outbox (recorded together with the
turn's completion) -> deliverer -> adapter.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import secrets
import sqlite3
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from agent.fileio import private_mkdir
from agent.llm import LLMClient
from agent.prompt import ChatPlace
from agent.reminders import ReminderChat
from agent.sessions import StoragePool
from agent.tokens import TokenCounter
from agent.turn import Agent, TurnResult, UserInput
from core.errors import LaneMoved, LeaseLost, caused_by
from core.lanes import Lane, tenant_of_key
from core.messages import InboundMessage, OutboundKind, OutboundMessage, SentMessage
from core.protocols import Adapter, ChatAdmins, Closable, Overhears, SkipsEvents
from core.redact import Redactor
from core.settings import AgentSettings, Config, ConfigError
from core.text import page_text, split_text
from gateway.access import Access
from gateway.commands import CommandContext, parse_command, run_command
from gateway.delivery import more_key, more_mark, more_offer
from gateway.faults import (
    MODEL_DOWN_KINDS,
    ModelDown,
    StartupError,
    damaged_database,
    damaged_profile,
    resource_fault,
    storage_fault,
)
from gateway.inbox import Inbox
from gateway.kv import SqliteKV
from gateway.lanes import Lanes
from gateway.limits import RateLimiter
from gateway.linking import Linking
from gateway.logs import log_text, secrets_from_config, turn_logger
from gateway.media import MediaIntake
from gateway.metrics import InstrumentedLLM, Metrics
from gateway.outbox import Deliverer, Draft, Outbox
from gateway.reminders import ReminderScheduler, delivered_message, delivery_text, is_reminder
from gateway.streaming import StreamingReply
from tenancy.identity import IdentityLinks
from tenancy.keys import resolve_lane
from tenancy.profiles import ProfileManager

if TYPE_CHECKING:
    from gateway.cluster.claims import ClaimWorkers
    from gateway.cluster.inbox import Claim
    from gateway.cluster.ingress import IngressElection
    from gateway.cluster.ledger import ClusterOutbox
    from gateway.cluster.node import ClusterNode, HeldLease
    from gateway.observability import Observability
    from gateway.runlock import RunLock

log = logging.getLogger("hermes.gateway")

TYPING_INTERVAL_S = 4.0
DEDUPE_WINDOW_S = 14 * 24 * 3600  # answered message ids are remembered this long
HOUSEKEEPING_INTERVAL_S = 3600.0
STOP_TAIL_S = 2.0  # how long past the drain deadline a stop still lets recorded answers go out


@dataclass
class _Answer:
    """What a lane's turn produced: the text to deliver and the inbox outcome."""

    text: str
    kind: OutboundKind
    outcome: str
    reply: bool = True  # the first chunk replies to the person's message
    result: TurnResult | None = None
    streamer: StreamingReply | None = None  # a streamed draft may already be in the chat


@dataclass(frozen=True)
class Job:
    msg: InboundMessage
    lane: Lane


def _without_nul(value: Any) -> Any:
    """`value` (JSON data) with NUL characters removed from every string."""
    if isinstance(value, str):
        return value.replace("\0", "")
    if isinstance(value, list):
        return [_without_nul(v) for v in value]
    if isinstance(value, dict):
        return {_without_nul(k): _without_nul(v) for k, v in value.items()}
    return value


def _unopenable_db(path: Any, exc: sqlite3.DatabaseError) -> str:
    """The one sentence for a gateway.db SQLite cannot open."""
    fault = storage_fault(exc)
    if fault is not None:
        return f"cannot open {path} ({fault}); free disk space or stop what holds it, then start again"
    return (
        f"{path} cannot be opened as a database ({exc}); restore it from a backup, or move it "
        "aside to start with an empty one (its pending messages and reply history stay in the moved file)"
    )


def input_uid(msg: InboundMessage) -> str:
    """The stored uid of an inbound message: derived from its platform identity, so the
    same message replayed after a crash is stored once."""
    digest = hashlib.sha256(f"{msg.platform}\0{msg.chat_id}\0{msg.message_id}".encode()).hexdigest()
    return f"in-{digest[:32]}"


class _Notifier:
    """Progress notices of one turn: the start notice is edited into the end notice where
    the platform can edit; routine ones are dropped unless `progress_notices` is on."""

    def __init__(self, app: GatewayApp, msg: InboundMessage) -> None:
        self.app, self.msg = app, msg
        self._progress: int | None = None  # the outbox chunk of the start notice

    async def __call__(self, kind: str, text: str) -> None:
        if kind in ("progress", "progress_done") and not self.app.cfg.compression.progress_notices:
            return
        adapter = self.app.adapters.get(self.msg.platform)
        if adapter is None:
            return
        if kind == "progress_done" and self._progress is not None and adapter.can_edit:
            await self.app.edit(self.msg, self._progress, text)  # the deliverer falls back to a new message
            self._progress = None
            return
        ids = await self.app.send(
            self.msg, text, kind="notice" if kind.startswith("progress") else "error", reply=False
        )
        if kind == "progress" and len(ids) == 1:
            self._progress = ids[0]


class GatewayApp:
    """The running gateway; build it with adapters and (for tests) an LLM client."""

    def __init__(
        self,
        cfg: Config,
        adapters: Sequence[Adapter] = (),
        *,
        llm: LLMClient | None = None,
        tokens: TokenCounter | None = None,
    ) -> None:
        self.cfg = cfg
        self.adapters: dict[str, Adapter] = {a.platform: a for a in adapters}
        # cluster mode (README "Cluster mode"): the inbox and outbox are in PostgreSQL and
        # a profile opens only under its tenant lease; None on a single node
        self.node: ClusterNode | None = None
        self.shared_outbox: ClusterOutbox | None = None
        self.claims: ClaimWorkers | None = None
        gate = None
        if cfg.cluster.enabled:
            from gateway.cluster.db import dsn_from_env
            from gateway.cluster.ledger import ClusterInbox, ClusterOutbox
            from gateway.cluster.node import ClusterNode, ProfileLeases

            self.node = ClusterNode(
                cfg.cluster, dsn_from_env(cfg.cluster.postgres_dsn_env or ""), on_lost=self._lease_lost
            )
            self.shared_outbox = ClusterOutbox(self.node)
            # duck-typed: they implement what the app, Access and Linking call in cluster mode
            self.outbox = cast(Outbox, self.shared_outbox)
            self.inbox = cast(Inbox, ClusterInbox(self.node, self.shared_outbox))
            gate = ProfileLeases(self.node)
        else:
            self.inbox = Inbox(cfg.data_dir / "gateway.db", fsync=cfg.storage.fsync)
            self.outbox = Outbox(self.inbox)
        self.links = IdentityLinks.load(cfg.data_dir / "links.json", cfg.tenancy)
        self.storage_pool = StoragePool(cfg.storage.io_threads)
        self.profiles = ProfileManager(
            cfg.data_dir,
            max_open=cfg.tenancy.max_open_profiles,
            fsync=cfg.storage.fsync,
            memory_char_limit=cfg.memory.memory_char_limit,
            user_char_limit=cfg.memory.user_char_limit,
            provider_kind=cfg.memory.provider,
            pool=self.storage_pool,
            gate=gate,
            # WAL's shared-memory index is for one host; a shared data_dir needs a rollback journal
            journal_mode="delete" if cfg.cluster.enabled else "wal",
        )
        self._own_llm = llm is None
        self.llm = llm or LLMClient.from_config(cfg.llm)
        self.tokens = tokens or TokenCounter.create(log)
        self.metrics = Metrics()
        if self.node is not None:  # claim and failover figures on /metrics
            self.metrics.enable_cluster(self.node.metrics)
        self.deliverer = Deliverer(self.outbox, self.adapters, self.metrics, cfg.delivery)
        self.llm_monitor = InstrumentedLLM(self.llm, self.metrics)  # counts errors by kind for /metrics
        # InstrumentedLLM proxies the LLMClient: same chat() signature, every other attribute
        # passed through (__getattr__), so the Agent can use it as one
        self.agent = Agent(AgentSettings.from_config(cfg), cast(LLMClient, self.llm_monitor), self.tokens)
        self.media = MediaIntake(cfg)
        self.agent.compression.on_outcome = self.metrics.compression  # hermes_compressions_total{outcome}
        self.agent.reviewer.on_outcome = self.metrics.review  # hermes_memory_reviews_total{kind,outcome}
        self.linking = Linking(self)
        self.observability: Observability | None = None  # when observability.listen is set
        self._run_lock: RunLock | None = None
        self.access = Access(cfg.access, SqliteKV(self.inbox))
        # cluster mode: brings `links` up to date with links other nodes made, before routing
        self.links_refresh: Callable[[], Awaitable[object]] | None = None
        # cluster mode: the database and this node's leases, for /healthz (gateway/cluster/health.py)
        self.cluster_health: Callable[[], Awaitable[tuple[bool, dict[str, Any]]]] | None = None
        self.limiter = RateLimiter(cfg.limits.rate_limit_per_minute)
        self._limit_notified: dict[str, float] = {}
        # busy_mode collect/interrupt: messages queued behind a running turn are answered together
        coalesce_ms = cfg.limits.coalesce_burst_ms
        self.lanes: Lanes[Job] = Lanes(
            self._run_lane,
            max_queued=cfg.limits.max_queued_turns,
            coalesce=self._mergeable if cfg.limits.busy_mode != "queue" else None,
            coalesce_wait_s=coalesce_ms / 1000,
        )
        self._background: set[asyncio.Task] = set()  # replies sent outside an adapter's sink
        self._turn_stops: dict[str, asyncio.Event] = {}  # lane key -> stop event of its running turn
        self._stopped_here: set[str] = set()  # cluster mode: /stop messages that stopped a turn at ingress
        self.reminders = ReminderScheduler(lambda: self.inbox.db, cfg.data_dir, self._submit_reminder)
        # the tool keeps the due-time index current; no reminders in cluster mode
        self.agent.reminder_index = self.reminders.note if cfg.reminders_on else None
        self._started = False
        self._accepting = False
        #: platform -> why its adapter's start() raised (it serves nothing in this process)
        self.start_failures: dict[str, str] = {}
        self._stopping = asyncio.Event()  # set by stop(): held lanes stop waiting to retry
        self.metrics.bind(
            platforms=self.adapters,
            open_profiles=lambda: self.profiles.open_count,
            queue_depth=lambda: self.lanes.queued_by(lambda job: job.msg.platform),
            adapters_up=self._adapters_up,
            skipped_events=self._skipped_events,
        )
        self._housekeeping: asyncio.Task | None = None
        self._idle_closer: asyncio.Task | None = None  # cluster mode
        self._election: IngressElection | None = None  # cluster mode: who receives what
        # lanes that ran turns in this process, newest last: flushed at shutdown (bounded)
        self._active_lanes: OrderedDict[str, tuple[InboundMessage, Lane, ChatPlace]] = OrderedDict()

    # ----- lifecycle ------------------------------------------------------------------
    async def start(self) -> None:
        """Open storage, replay what a previous run left unanswered, start the adapters.

        Raises `StartupError` when there is nothing to serve (every platform failed for good,
        gateway.db unreadable, the listen address taken); whatever was opened is closed
        again first, so no thread keeps the failed process alive."""
        try:
            await self._start()
        except BaseException:
            try:
                await self.stop(drain_timeout=1.0)  # nothing ran: a short bound for what start() opened
            except Exception:
                log.exception("cleaning up after a failed start failed")
            raise

    async def _start(self) -> None:
        from gateway.runlock import RunLock

        private_mkdir(self.cfg.data_dir)
        # one gateway per data dir; cluster nodes share it (each node's lease is its own lock)
        self._run_lock = RunLock(self.cfg.data_dir).acquire("hermes-gateway", shared=self.node is not None)
        if self.node is not None:
            from gateway.cluster.wiring import attach_shared_state, ingress_election

            await self.node.start()  # pool, migrations, registration, heartbeats
            await attach_shared_state(self, self.node)  # pairing, link codes and links in PostgreSQL
            self._election = ingress_election(self, self.node)
        else:
            try:
                await self.inbox.open()
                await self.reminders.open()
                await self.outbox.open()
            except sqlite3.DatabaseError as exc:
                raise StartupError(_unopenable_db(self.inbox.path, exc)) from None
            await self.linking.recover()  # a /link merge a crash interrupted: finished or undone
        self._started = True
        self._accepting = True
        await self.inbox.prune(DEDUPE_WINDOW_S)
        self._housekeeping = asyncio.create_task(self._housekeep())
        pending = await self.inbox.pending()
        # a platform not served here keeps its messages pending for the process that serves
        # it: console lanes are left to `chat`, never answered into nowhere by `run`
        elsewhere = sorted({m.platform for m in pending if m.platform not in self.adapters})
        if elsewhere:
            log.info("messages of %s stay pending until it runs again", ", ".join(elsewhere))
            pending = [m for m in pending if m.platform in self.adapters]
        if pending:
            log.info("replaying %d message(s) left unanswered by the previous run", len(pending))
        for msg in pending:
            try:
                await self._admit(msg, replay=True)
            except Exception:  # one bad record must not stop the gateway from starting
                log.exception("could not replay a %s message; it stays pending", msg.platform)
        if self.cfg.observability.listen:  # before the platforms: a taken address stops us cheaply
            from gateway.observability import Observability

            self.observability = Observability(self, self.cfg.observability.listen)
            try:
                await self.observability.start()
            except OSError as exc:
                self.observability = None
                raise StartupError(
                    f"observability.listen {self.cfg.observability.listen}: cannot listen there "
                    f"({exc.strerror or exc}); free the address or set observability.listen to another one"
                ) from None
        for adapter in self.adapters.values():
            if isinstance(adapter, Overhears):  # group text the adapter drops unanswered is still screened
                adapter.overheard = self._overheard
            try:
                await adapter.start(self.handle_inbound)
            except Exception as exc:
                # the adapter's own sentence (a ConfigError names the key), printed at exit and
                # shown on /healthz, so redacted; a traceback only for what nobody foresaw
                why = Redactor(secrets_from_config(self.cfg))(str(exc)) or type(exc).__name__
                self.start_failures[adapter.platform] = why
                if isinstance(exc, (ConfigError, OSError)):
                    log.error("%s: not started: %s", adapter.platform, exc)
                else:
                    log.exception("%s adapter failed to start", adapter.platform)
        gone = self.nothing_to_serve()
        if gone is not None:
            raise StartupError(gone)
        if self._election is not None:  # this node receives what it is elected for
            await self._election.start()
        if self.cfg.reminders_on:
            self.reminders.start()
        await self.deliverer.resume()  # what the previous run recorded but did not get sent
        if self.node is not None:
            from gateway.cluster.claims import ClaimWorkers

            self.claims = ClaimWorkers(
                self.node, self._run_claim, workers=self.cfg.cluster.max_lanes, poll_s=self.cfg.cluster.poll_interval_s
            )
            self.claims.start()
            self._idle_closer = asyncio.create_task(self._close_idle_profiles(), name="idle-profiles")

    def platform_states(self) -> dict[str, tuple[bool | None, str]]:
        """(connected?, status text) of every platform, a failed start included."""
        from gateway.observability import adapter_state

        return {
            platform: (False, f"failed: {self.start_failures[platform]}")
            if platform in self.start_failures
            else adapter_state(adapter)
            for platform, adapter in self.adapters.items()
        }

    def nothing_to_serve(self) -> str | None:
        """One sentence when every platform has failed for good (a rejected token, a refused
        intent, a port in use), or when another process took this node's id; None while at
        least one platform is up or still trying."""
        if self.node is not None and self.node.displaced is not None:
            return self.node.displaced
        states = self.platform_states()
        failed = {
            p: status.removeprefix("failed: ") for p, (_, status) in states.items() if status.startswith("failed")
        }
        if not states or len(failed) < len(states):
            return None
        return "nothing to serve, every platform failed: " + "; ".join(f"{p}: {why}" for p, why in failed.items())

    async def wait_nothing_to_serve(self, poll_s: float = 1.0) -> str:
        """Return the sentence once every platform has failed for good (e.g. a token revoked
        while running); waits forever while one still serves or retries."""
        while True:
            gone = self.nothing_to_serve()
            if gone is not None:
                return gone
            await asyncio.sleep(poll_s)

    async def stop(self, drain_timeout: float = 30.0, *, hint: str = "") -> None:
        """Stop taking new turns, let running ones finish and deliver (bounded), then stop
        the adapters and close everything. Messages arriving meanwhile are recorded and
        replayed on the next start. `drain_timeout` bounds the whole drain, not each step;
        `hint` ends the line that says what the drain waits for."""
        self._accepting = False
        self._stopping.set()
        deadline = time.monotonic() + drain_timeout

        def left() -> float:
            return max(0.0, deadline - time.monotonic())

        running = self.lanes.running()
        if running and drain_timeout > 0:
            turns = "running turn" if running == 1 else "running turns"
            log.info("waiting up to %g s for %d %s%s", drain_timeout, running, turns, hint)
        if self.claims is not None:  # running lanes finish and deliver (bounded), no new claims
            await self.claims.stop(left())
            self.claims = None
        if self._idle_closer is not None:
            self._idle_closer.cancel()
            self._idle_closer = None
        await self.reminders.stop()
        if self._housekeeping is not None:
            self._housekeeping.cancel()
            self._housekeeping = None
        if not await self.lanes.drain(left()):
            log.warning("turns still running after %.0fs; they will be replayed on the next start", drain_timeout)
            await self.lanes.cancel()
        if self._background:
            _, late = await asyncio.wait(list(self._background), timeout=left())
            for task in late:  # their messages stay pending and are handled on the next start
                task.cancel()
        if self._started and self.node is None and self._active_lanes:  # in a cluster the sessions go on elsewhere
            try:
                await asyncio.wait_for(self._flush_lanes(), left())
            except TimeoutError:
                log.warning("memory flush at shutdown did not finish within the %gs drain", drain_timeout)
        # what the turns delivered may still go out, for a moment past the deadline at most
        rest = max(left(), min(drain_timeout, STOP_TAIL_S))
        await self.linking.close(rest)
        if self._election is not None:  # another node takes the ingress roles over at once
            await self._election.stop()
            self._election = None
        await self.deliverer.close(rest)  # unsent chunks stay in the outbox for the next start
        for adapter in self.adapters.values():
            try:
                await adapter.stop()
                if isinstance(adapter, Closable):
                    await adapter.aclose()
            except Exception:
                log.exception("%s adapter failed to stop cleanly", adapter.platform)
        await self._close_step("the profiles", self.profiles.close_all())
        await asyncio.to_thread(self.storage_pool.shutdown)
        if self._started or self.node is None:  # a failed start may have left gateway.db open
            await self._close_step("the outbox", self.outbox.close())
            await self._close_step("the inbox", self.inbox.close())
            self._started = False
        if self.node is not None:  # after the profiles closed: leaves the cluster, frees what is left
            await self.node.stop()
        if self._own_llm:
            await self.llm.aclose()
        if self.observability is not None:
            await self.observability.stop()
            self.observability = None
        if self._run_lock is not None:
            self._run_lock.release()
            self._run_lock = None

    async def _close_step(self, what: str, closing: Awaitable[None]) -> None:
        """One closing step of stop(): a storage fault (a full disk) is one line and the
        stop goes on; what was committed before it is found again on the next start."""
        try:
            await closing
        except Exception as exc:
            fault = storage_fault(exc)
            if fault is None:
                raise
            log.error("could not close %s cleanly (%s); what was recorded is kept for the next start", what, fault)

    async def _housekeep(self) -> None:
        """Hourly: prune old answered ids from gateway.db and forget idle rate-limit notes."""
        while True:
            await asyncio.sleep(HOUSEKEEPING_INTERVAL_S)
            try:
                await self.inbox.prune(DEDUPE_WINDOW_S)
                await self.outbox.prune(DEDUPE_WINDOW_S)
            except Exception:
                log.exception("pruning gateway.db failed")
            now = time.monotonic()
            self._limit_notified = {k: t for k, t in self._limit_notified.items() if now - t < 60}

    async def drain(self, timeout: float | None = 30.0) -> bool:
        """Wait until every queued turn and pending refusal has finished (tests, console)."""
        if not await self.lanes.drain(timeout):
            return False
        if self._background:  # refusals and notices sent outside the sink record into the outbox
            _, late = await asyncio.wait(list(self._background), timeout=timeout)
            if late:
                return False
        return await self.deliverer.drain(timeout)

    # ----- inbound --------------------------------------------------------------------
    async def handle_inbound(self, msg: InboundMessage) -> None:
        """The adapters' sink: returns once `msg` is durably recorded (or known already)."""
        if msg.unreadable_fields():
            await self._refuse_unreadable(msg)
            return
        if self.node is not None:
            await self._record_shared(msg)
            return
        if not await self.inbox.record(msg):
            self.metrics.inbound.inc(platform=msg.platform, outcome="duplicate")
            log.info("duplicate %s message ignored", msg.platform)
            return
        self.metrics.inbound.inc(platform=msg.platform, outcome="new")
        if not self._accepting:
            return  # recorded: replayed on the next start
        try:
            await self._admit(msg)
        except Exception:
            # not admitted: forget the record and fail the sink, so the adapter does not
            # acknowledge and the platform's redelivery is taken in afresh
            log.exception("could not admit a %s message; it will be taken again on redelivery", msg.platform)
            try:
                await self.inbox.forget(msg)
            except Exception:
                log.exception("could not forget the record; the message is replayed on the next start")
            raise

    async def _record_shared(self, msg: InboundMessage) -> None:
        """Cluster mode's ingress: commit `msg` to the shared inbox on its lane (once per
        platform message id) and return; a claim worker of some node runs it."""
        from gateway.cluster.inbox import Inbound, record_inbound

        assert self.node is not None
        if self.links_refresh is not None:  # a link another node made routes this message too
            await self.links_refresh()
        try:
            lane = resolve_lane(msg, self.cfg.tenancy, self.links)
            tenant, lane_key = lane.tenant_id, lane.key
        except ValueError:  # refused ("bad_ids") by whichever node runs it, like on one node
            tenant = lane_key = f"unplaceable/{msg.platform}/{msg.chat_id}"
            lane = None
        payload = _without_nul(msg.model_dump(mode="json"))  # PostgreSQL text cannot hold NUL
        new = await record_inbound(
            self.node.pool, Inbound(msg.platform, msg.chat_id, msg.message_id, lane_key, tenant, payload)
        )
        if new is None:
            self.metrics.inbound.inc(platform=msg.platform, outcome="duplicate")
            log.info("duplicate %s message ignored", msg.platform)
            return
        self.metrics.inbound.inc(platform=msg.platform, outcome="new")
        if lane is not None and not is_reminder(msg):
            command = parse_command(msg.text)
            if command is not None and command[0].name == "stop":  # reaches a turn running on this node
                running = self._turn_stops.get(lane.key)
                if running is not None and not running.is_set():
                    running.set()
                    self._stopped_here.add(input_uid(msg))
        if self.claims is not None:
            self.claims.kick()

    async def _overheard(self, platform: str, text: str) -> None:
        """A group message the adapter does not answer (no mention): nothing is recorded or
        said, but a live link code in it is burnt like anywhere else outside a private chat."""
        msg = InboundMessage(
            platform=platform,
            chat_id="overheard",
            chat_type="group",
            user_id="overheard",
            message_id="overheard",
            text=text,
        )
        await self.linking.screen(msg)

    async def _admit(self, msg: InboundMessage, *, replay: bool = False, force: bool = False) -> str | None:
        """Refuse `msg`, or queue it on its lane (`force`: never refused as busy, as for a
        message a cluster node claimed); the lane key it was queued on, else None."""
        try:  # a link code typed where others can read it is burnt, whoever sent it
            await self.linking.screen(msg)
        except Exception:
            log.exception("could not screen a %s message for link codes", msg.platform)
        if not await self.access.is_allowed(msg.principal):
            await self._refuse_stranger(msg)
            return None
        if len(msg.text) > self.cfg.limits.max_text_length:
            await self._refuse(
                msg,
                "too_long",
                (
                    f"Your message is {len(msg.text):,} characters long; I can take at most "
                    f"{self.cfg.limits.max_text_length:,}. Please split it or send a shorter version."
                ),
            )
            return None
        if not msg.text.strip() and not msg.attachments:
            await self.inbox.finish(msg, "empty")
            return None
        if not replay:
            allowed, wait = self.limiter.allow(msg.principal)
            if not allowed:
                await self._refuse(
                    msg,
                    "rate_limited",
                    f"You're sending messages faster than I can answer. Please wait about {int(wait) + 1} seconds and send it again.",
                    quiet_key=msg.principal,
                )
                return None
        if self.links_refresh is not None:
            await self.links_refresh()
        try:
            lane = resolve_lane(msg, self.cfg.tenancy, self.links)
        except ValueError as err:
            log.warning("cannot place a %s message: %s", msg.platform, err)
            await self._refuse(msg, "bad_ids", "Sorry, I can't handle messages from this chat.")
            return None
        key = lane.key
        command = None if is_reminder(msg) else parse_command(msg.text)
        if command is not None and command[0].name == "stop":  # handled now, not behind the lane's queue
            await self._stop_turn(msg, key, replay)
            return None
        # a replayed message was accepted once already: it never gets a "busy" refusal
        if not self.lanes.submit(key, Job(msg, lane), force=replay or force):
            await self._refuse(
                msg,
                "busy",
                "I'm still working on your earlier messages. Please wait for my answer, then send this again.",
            )
            return None
        if self.cfg.limits.busy_mode == "interrupt" and command is None and not replay:
            running = self._turn_stops.get(key)
            if running is not None:
                running.set()  # the running turn ends; this message is answered next
        return key

    @staticmethod
    def _mergeable(job: Job) -> bool:
        """May join a collected turn: a person's message, not a command or a reminder."""
        return not is_reminder(job.msg) and parse_command(job.msg.text) is None

    async def _submit_reminder(self, msg: InboundMessage) -> bool:
        """A due reminder occurrence: recorded once in the inbox (False: it was before), then
        run on its lane like a replayed message (never refused as busy)."""
        if not await self.inbox.record(msg):
            return False
        if self._accepting:
            await self._admit(msg, replay=True)
        return True

    async def _stop_turn(self, msg: InboundMessage, key: str, replay: bool) -> None:
        """/stop: end the lane's running turn (its partial answer is kept, flagged interrupted)."""
        running = self._turn_stops.get(key)
        if replay:  # a /stop from before a restart has nothing left to stop
            await self.inbox.finish(msg, "command")
            return
        if running is not None and not running.is_set():
            running.set()
            text = "Stopped."
        elif input_uid(msg) in self._stopped_here:  # cluster mode: it stopped the turn on arrival
            self._stopped_here.discard(input_uid(msg))
            text = "Stopped."
        else:
            text = "There's nothing to stop right now."
        if self.node is not None:  # recorded under this lane's claim, before it is given back
            await self._send_and_finish(msg, text, "notice", "command")
            return
        self._in_background(self._send_and_finish(msg, text, "notice", "command"))

    async def _refuse_unreadable(self, msg: InboundMessage) -> None:
        """A message with broken Unicode (lone surrogates) can't be stored or answered as
        usual: it is not recorded, and when its ids are sound the sender gets a clear note."""
        bad = msg.unreadable_fields()
        ids_ok = not set(bad) & {"platform", "chat_id", "thread_id", "message_id"}
        platform = msg.platform if "platform" not in bad else "unknown"
        self.metrics.refused(platform, "bad_unicode")
        log.warning("refused a %s message: invalid Unicode in %s", platform, ", ".join(bad))
        allowed = False
        if not set(bad) & {"platform", "user_id"}:
            try:
                allowed = await self.access.is_allowed(msg.principal)
            except Exception:
                log.exception("access check failed for a refused message")
        # like any refusal: said in a private chat, or in a group only to someone the bot serves
        if ids_ok and platform in self.adapters and (msg.chat_type == "dm" or allowed):
            clean = msg.model_copy(
                update={"text": "", "user_name": "", "user_id": "?", "reply_to_message_id": None, "attachments": ()}
            )
            self._in_background(
                self._send_quietly(
                    clean,
                    (
                        "Sorry, I can't read that message: it contains invalid characters (broken Unicode). "
                        "Please send it again as plain text."
                    ),
                )
            )

    async def _send_quietly(self, msg: InboundMessage, text: str) -> None:
        """A refusal of a message that is never stored: nothing of it (not even its id as
        the reply target) goes into gateway.db."""
        try:
            adapter = self.adapters.get(msg.platform)
            if self.node is not None and adapter is not None:  # cluster mode: not in the shared inbox either
                await adapter.send(
                    OutboundMessage(chat_id=msg.chat_id, thread_id=msg.thread_id, text=text, kind="error")
                )
                return
            await self.send(msg, text, kind="error", reply=False)
        except Exception:
            log.exception("could not send a refusal")

    async def _refuse_stranger(self, msg: InboundMessage) -> None:
        self.metrics.refused(msg.platform, "unauthorized")
        if msg.chat_type == "dm" and self.cfg.access.unauthorized_dm == "pair":
            code = await self.access.pairing_code(msg.principal)
            text = (
                f"Hi! I don't know you yet. Your pairing code is {code}. "
                f"Ask the operator of this bot to approve it with /pair {code}."
            )
            await self._send_and_finish(msg, text, "notice", "unauthorized")
            return
        if msg.message_id.startswith("interaction-"):
            # a slash command waits visibly for an answer; plain group messages get silence
            await self._send_and_finish(msg, "Sorry, you're not on this bot's list of users.", "error", "unauthorized")
            return
        await self.inbox.finish(msg, "unauthorized")

    async def _refuse(self, msg: InboundMessage, outcome: str, text: str, quiet_key: str | None = None) -> None:
        """Tell the person why their message was not taken (rate refusals once a minute)."""
        self.metrics.refused(msg.platform, outcome)
        now = time.monotonic()
        if quiet_key is None or now - self._limit_notified.get(quiet_key, -1e9) >= 60:
            if quiet_key is not None:
                self._limit_notified[quiet_key] = now
            await self._send_and_finish(msg, text, "error", outcome)
            return
        await self.inbox.finish(msg, outcome)

    def _in_background(self, coro) -> None:
        """Run work outside the adapter's sink, so a slow step never holds up receiving;
        stop() waits for these."""
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _send_and_finish(self, msg: InboundMessage, text: str, kind: OutboundKind, outcome: str) -> None:
        """Record the answer in the outbox and mark `msg` done, in one transaction."""
        await self.send(msg, text, kind=kind, finish=[(msg, outcome)])

    # ----- the lane worker ------------------------------------------------------------
    def place_of(self, msg: InboundMessage, lane: Lane) -> ChatPlace:
        return ChatPlace(
            platform=msg.platform, chat_type=msg.chat_type, shared=lane.kind == "chat", user_name=msg.user_name
        )

    async def _run_lane(self, key: str, jobs: list[Job]) -> None:
        first, last = jobs[0], jobs[-1]
        lane, platform, started = first.lane, first.msg.platform, time.monotonic()
        # ids of this turn go on its log lines explicitly (no context variable)
        tlog = turn_logger(log, turn_id=secrets.token_hex(6), platform=platform, tenant=lane.tenant_id)
        reminder = is_reminder(first.msg)
        job_kind = "reminder" if reminder else "command" if parse_command(first.msg.text) is not None else "turn"
        for job in jobs:
            log_text(tlog, self.cfg.logging.include_text, "inbound text", job.msg.text)
        failures = 0
        while True:  # a failed turn holds the lane (order) and retries until it works (gateway/faults.py)
            try:
                answer = await self._answer(key, jobs, tlog)
                # the answer's chunks and the turn's completion commit together; the deliverer sends them
                chunk_ids = await self._deliver(last.msg, answer, finish=[(job.msg, answer.outcome) for job in jobs])
                break
            except LaneMoved as moved:  # linked or unlinked meanwhile: run it in its new lane
                await self._move_jobs(jobs, moved.lane)
                return
            except LeaseLost as lost:  # cluster mode: another node runs this tenant now
                self._fenced_turn(key, lane, lost, tlog)
                return
            except Exception as exc:
                failures += 1
                delay = min(self.cfg.delivery.retry_initial_s * 2 ** (failures - 1), self.cfg.delivery.retry_max_s)
                await self._turn_failed(exc, last, failures, delay, tlog)
                try:  # a stop ends the wait
                    await asyncio.wait_for(self._stopping.wait(), delay)
                except TimeoutError:
                    pass
                if self._stopping.is_set():  # pending in gateway.db, answered after the next start
                    tlog.info("stopping; the failed turn's messages stay pending for the next start")
                    return
        outcome, result = answer.outcome, answer.result
        if result is not None and result.kind == "reply" and not result.replayed and not result.interrupted:
            self._after_reply(
                last.msg, lane, self.place_of(last.msg, lane), result, last_chunk=chunk_ids[-1] if chunk_ids else None
            )
        seconds = time.monotonic() - started
        self.metrics.turn_done(platform, job_kind, outcome, seconds if job_kind == "turn" else None)
        tlog.info(
            "%s %s in %.0f ms",
            job_kind,
            outcome,
            seconds * 1000,
            extra={"outcome": outcome, "duration_ms": round(seconds * 1000)},
        )

    async def _turn_failed(
        self, exc: Exception, job: Job, failures: int, delay: float, tlog: logging.LoggerAdapter
    ) -> None:
        """Log a failed turn (the traceback once), quarantine a profile found damaged, free
        descriptors and memory held by idle profiles on a resource fault, and tell the
        person once that the answer is late."""
        msg = job.msg
        fault = storage_fault(exc) or self._database_fault(exc)
        resource = resource_fault(exc)
        damaged = damaged_profile(exc)
        broken_db = damaged_database(exc) if damaged is None else None
        if broken_db is not None:  # found by the turn, in a profile that opened
            await self.profiles.quarantine_open(job.lane.tenant_id, broken_db)
        elif damaged is not None:  # ProfileManager logged it once, with the fix
            tlog.debug("profile damaged (%s); the message stays pending, retrying in %.1f s", damaged.problem, delay)
        elif fault is not None:
            tlog.error("storage fault (%s); the message stays pending, retrying in %.1f s", fault, delay)
        elif resource is not None:
            tlog.error("resource fault (%s); the message stays pending, retrying in %.1f s", resource, delay)
        elif isinstance(exc, ModelDown):  # agent/llm.py logged the cause
            tlog.warning("%s; the message stays pending, retrying in %.1f s", exc, delay)
        elif failures == 1:
            tlog.exception("turn failed; the message stays pending, retrying in %.1f s", delay)
        else:
            tlog.warning("turn failed again (%s); retrying in %.1f s", type(exc).__name__, delay)
        if resource is not None:
            await self.profiles.shed_idle()
        if failures == 1:
            await self._tell_storage_fault(msg, fault, model_down=isinstance(exc, ModelDown))

    async def _answer(self, key: str, jobs: list[Job], tlog: logging.LoggerAdapter) -> _Answer:
        """Run the reminder, command or agent turn of `jobs`. Raises LaneMoved, LeaseLost and
        every other failure: the caller keeps the messages pending and retries the turn."""
        first, last = jobs[0], jobs[-1]
        lane, place = first.lane, self.place_of(first.msg, first.lane)
        platform = first.msg.platform
        reminder = is_reminder(first.msg)
        self.metrics.in_flight.add(1, platform=platform)
        typing = asyncio.create_task(self._keep_typing(last.msg))
        command = None if reminder else parse_command(first.msg.text)
        streamer: StreamingReply | None = None
        try:
            async with self.linking.use(first.msg, lane) as profile:
                if lane.principal not in profile.principals and lane.kind == "person":
                    await asyncio.to_thread(profile.add_principal, lane.principal)
                if reminder:
                    text = await self._record_reminder(profile, lane, place, first.msg)
                    return _Answer(text, "notice", "replied", reply=False)
                if command is not None:
                    spec, args = command
                    ctx = CommandContext(
                        self, first.msg, lane, place, profile, args, chat_admin=self._chat_admin_check(first.msg)
                    )
                    return _Answer(await run_command(spec.name, ctx), "reply", "replied")
                # attachments and reply quotes, stored in this lane's own profile (gateway/media.py)
                prepared = [
                    await self.media.prepare(
                        j.msg, self.adapters.get(j.msg.platform), profile.path, input_uid(j.msg), profile.guard
                    )
                    for j in jobs
                ]
                inputs = [
                    UserInput(
                        uid=input_uid(j.msg),
                        text=p.text,
                        user_name=j.msg.user_name,
                        meta={
                            "platform": j.msg.platform,
                            "message_id": j.msg.message_id,
                            "user": j.msg.principal,
                            **p.meta,
                        },
                    )
                    for j, p in zip(jobs, prepared, strict=True)
                    if p.answerable
                ]
                notices = [n for p in prepared for n in p.notices]
                if not inputs:  # nothing the model could read: the notices are the answer
                    return _Answer("\n\n".join(notices) or "I couldn't read that.", "error", "refused")
                for notice in notices:
                    await self.send(last.msg, notice, kind="notice", reply=False)
                stop = self._turn_stops[key] = asyncio.Event()
                streamer = self._streaming_reply(last.msg)
                try:
                    result = await self.agent.run_turn(
                        profile,
                        lane,
                        place,
                        inputs,
                        notify=_Notifier(self, last.msg),
                        stop=stop,
                        on_text=streamer.feed if streamer is not None else None,
                        chat=ReminderChat(
                            last.msg.platform,
                            last.msg.chat_id,
                            last.msg.chat_type,
                            last.msg.thread_id,
                            last.msg.user_id,
                            last.msg.user_name,
                            private_thread=last.msg.private_thread,
                            lane=lane.session_key,
                        ),
                    )
                finally:
                    if self._turn_stops.get(key) is stop:
                        del self._turn_stops[key]
                    await streamer.close() if streamer is not None else None
                if result.kind == "covered":  # a replayed part of a coalesced batch: answered already
                    return _Answer("", "reply", "coalesced", result=result)
                if result.kind == "error":
                    if result.error in MODEL_DOWN_KINDS and platform != "console":
                        # not the message's fault: held and retried (the console's person reads the error)
                        raise ModelDown(result.error or "")
                    return _Answer(result.text, "error", "llm_error", result=result, streamer=streamer)
                if result.interrupted:  # the partial answer (if any) is shown marked as stopped
                    text = f"{result.text}\n\n(stopped)" if result.text else ""
                    return _Answer(text, "reply", "stopped", result=result, streamer=streamer)
                text = await self._first_page(lane, result.text)
                return _Answer(text, "reply", "replied", result=result, streamer=streamer)
        except (LaneMoved, LeaseLost):
            raise
        except Exception as exc:
            if caused_by(exc, LeaseLost):  # a store or tool wrapped it
                raise LeaseLost(str(exc)) from exc
            raise
        finally:
            typing.cancel()
            self.metrics.in_flight.add(-1, platform=platform)

    async def _first_page(self, lane: Lane, text: str) -> str:
        """An answer longer than `delivery.max_reply_chars` goes out as its first page and
        an offer of the rest; only where the next page starts is kept (in gateway.db),
        `/more` reads the answer itself from the lane's session."""
        limit = self.cfg.delivery.max_reply_chars
        if len(text) <= limit:
            return text  # a mark of an earlier long answer no longer matches the lane's last answer
        page, nxt = page_text(text, 0, limit)
        await self.inbox.put(more_key(lane), more_mark(text, nxt))
        return page + more_offer(len(text) - nxt)

    async def _deliver(
        self, msg: InboundMessage, answer: _Answer, finish: Sequence[tuple[InboundMessage, str]]
    ) -> list[int]:
        """Record the answer (and the turn's completion) in the outbox; its chunk ids. A
        streamed draft in the chat is edited into the final text, in the same transaction."""
        streamer = answer.streamer
        if streamer is None or not streamer.started:
            return await self.send(msg, answer.text, kind=answer.kind, reply=answer.reply, finish=finish)
        drafts = []
        for handle, chunk in streamer.placement(answer.text or "(stopped)"):
            drafts.append(
                Draft(
                    platform=msg.platform,
                    chat_id=msg.chat_id,
                    thread_id=msg.thread_id,
                    text=chunk,
                    kind=answer.kind,
                    edit_of=int(handle.message_id) if handle is not None else None,
                )
            )
        ids = await self.outbox.record(drafts, finish=finish, source=msg)
        self.deliverer.kick(msg.platform, msg.chat_id)
        return ids

    async def _tell_storage_fault(self, msg: InboundMessage, fault: str | None, *, model_down: bool = False) -> None:
        """Say once why the answer is late (`fault`: a storage fault, or None for any other
        failure): through the outbox, or straight to the platform when gateway.db itself
        cannot take it."""
        if fault is not None:
            text = (
                f"I can't save anything right now ({fault} on my server), so your answer is delayed. "
                "Your message is kept and I'll answer it as soon as storage works again."
            )
        elif model_down:
            text = (
                "I can't reach my language model right now; your message is kept and I'll answer as soon as it is back."
            )
        else:
            text = "I can't answer right now; your message is kept and I'll answer as soon as I can."
        try:
            await self.send(msg, text, kind="notice", reply=False)
            return
        except Exception:
            log.warning("could not record the storage notice; sending it directly")
        adapter = self.adapters.get(msg.platform)
        if adapter is not None:
            try:
                await adapter.send(
                    OutboundMessage(chat_id=msg.chat_id, thread_id=msg.thread_id, text=text, kind="notice")
                )
            except Exception:
                log.warning("could not send the storage notice either", exc_info=True)

    async def _record_reminder(self, profile, lane: Lane, place: ChatPlace, msg: InboundMessage) -> str:
        """Keep a due reminder in the lane's history (once, by its uid), return its text."""
        session_id = await self.agent.open_session(profile, lane, place)
        history = await profile.sessions.history(session_id)
        stored = delivered_message(session_id, msg, delivery_text(msg, self.reminders.clock()))
        for m in history:
            if m.uid == stored.uid:
                return m.content or stored.content or ""
        await profile.sessions.append(stored)
        return stored.content or ""

    # ----- background memory review (agent/review.py) ------------------------------------
    def _after_reply(
        self, msg: InboundMessage, lane: Lane, place: ChatPlace, result: TurnResult, *, last_chunk: int | None = None
    ) -> None:
        """The reply is recorded: count the turn and start a review in the background when
        due; it waits until the reply's last chunk was sent, so it never delays the answer."""
        key = lane.key
        self._active_lanes[key] = (msg, lane, place)
        self._active_lanes.move_to_end(key)
        while len(self._active_lanes) > 1000:
            self._active_lanes.popitem(last=False)
        memory, skills = self.agent.reviewer.note_turn(lane, result.tool_iterations)
        if memory or skills:
            self._in_background(self._review(msg, lane, place, result.session_id, memory, skills, last_chunk))

    async def _review(
        self,
        msg: InboundMessage,
        lane: Lane,
        place: ChatPlace,
        session_id: str,
        memory: bool,
        skills: bool,
        last_chunk: int | None = None,
    ) -> None:
        try:
            if last_chunk is not None:
                await self.deliverer.wait(last_chunk, timeout=self.cfg.memory.review_timeout_s)
            async with self.linking.use(msg, lane) as profile:
                history = await profile.sessions.history(session_id)
                await self.agent.reviewer.review(
                    profile, lane, place, history, memory=memory, skills=skills, trigger="nudge"
                )
        except LaneMoved:
            log.info("background review skipped: the lane moved to another profile")
        except LeaseLost as lost:
            log.info("background review skipped: %s", lost)
        except Exception:  # never shown to the person
            log.exception("background review failed")

    async def _flush_lanes(self) -> None:
        """Shutdown ends every session of this run: flush those with enough unreviewed turns."""
        for msg, lane, place in list(self._active_lanes.values()):
            if not self.agent.reviewer.has_unreviewed(lane):
                continue
            try:
                async with self.linking.use(msg, lane) as profile:
                    session_id = await profile.sessions.route(lane.session_key)
                    if session_id is not None:
                        await self.agent.flush(profile, lane, place, await profile.sessions.history(session_id))
            except (LaneMoved, LeaseLost):  # moved, or another node runs the tenant now
                continue
            except Exception:
                log.exception("memory flush at shutdown failed")

    def _chat_admin_check(self, msg: InboundMessage):
        """The adapter's `is_chat_admin` for this message's sender, if the platform has one."""
        adapter = self.adapters.get(msg.platform)
        if not isinstance(adapter, ChatAdmins):
            return None
        check = adapter.is_chat_admin

        async def is_admin() -> bool:
            try:
                return bool(await check(msg.chat_id, msg.user_id))
            except Exception:
                log.exception("%s: chat admin check failed", msg.platform)
                return False

        return is_admin

    async def _move_jobs(self, jobs: list[Job], lane: Lane) -> None:
        """Queue jobs whose tenant changed (a /link or /unlink) on the lane they belong to now."""
        for job in jobs:
            if not self.lanes.submit(lane.key, Job(job.msg, lane)):
                await self._refuse(
                    job.msg,
                    "busy",
                    "I'm still working on your earlier messages. Please wait for my answer, then send this again.",
                )

    def _adapters_up(self) -> dict[str, bool | None]:
        return {platform: connected for platform, (connected, _) in self.platform_states().items()}

    def _skipped_events(self) -> dict[str, int]:
        return {
            platform: adapter.skipped_events
            for platform, adapter in self.adapters.items()
            if isinstance(adapter, SkipsEvents)
        }

    async def _keep_typing(self, msg: InboundMessage) -> None:
        adapter = self.adapters.get(msg.platform)
        if adapter is None:
            return
        while True:
            try:
                await adapter.typing(msg.chat_id, msg.thread_id)
            except Exception:
                log.debug("typing indicator failed", exc_info=True)
            await asyncio.sleep(TYPING_INTERVAL_S)

    # ----- delivery -------------------------------------------------------------------
    async def send(
        self,
        msg: InboundMessage,
        text: str,
        *,
        kind: OutboundKind = "reply",
        reply: bool = True,
        finish: Sequence[tuple[InboundMessage, str]] = (),
    ) -> list[int]:
        """Record `text` for `msg`'s chat in the outbox, split at the platform limit (the
        first chunk replies to `msg`), mark `finish` done in the same transaction, and
        hand it to the deliverer. Returns the chunk ids."""
        adapter = self.adapters.get(msg.platform)
        chunks = split_text(text, adapter.max_message_length, adapter.measure) if adapter is not None else []
        if adapter is None and text:
            log.warning("no adapter for platform %s; reply dropped", msg.platform)
        drafts = [
            Draft(
                platform=msg.platform,
                chat_id=msg.chat_id,
                thread_id=msg.thread_id,
                text=chunk,
                kind=kind,
                reply_to=msg.message_id if (reply and i == 0) else None,
            )
            for i, chunk in enumerate(chunks)
        ]
        ids = await self.outbox.record(drafts, finish=finish, source=msg)
        if ids:
            self.deliverer.kick(msg.platform, msg.chat_id)
        return ids

    def _streaming_reply(self, msg: InboundMessage) -> StreamingReply | None:
        """A streamed reply to `msg` when `delivery.streaming` covers its chat and the
        platform can edit messages; None: the answer is sent when it is complete. Drafts go
        through the outbox like every other message (a handle's message_id is its chunk id)."""
        mode, adapter = self.cfg.streaming_mode, self.adapters.get(msg.platform)
        if adapter is None or not adapter.can_edit or mode == "off" or (mode == "dm" and msg.chat_type != "dm"):
            return None

        async def send(chunk: str, first: bool) -> SentMessage | None:
            ids = await self.send(msg, chunk, kind="reply", reply=first)
            return SentMessage(chat_id=msg.chat_id, thread_id=msg.thread_id, message_id=str(ids[0])) if ids else None

        async def edit(handle: SentMessage, text: str) -> bool:
            await self.edit(msg, int(handle.message_id), text)
            return True

        return StreamingReply(
            send,
            edit,
            lambda text: split_text(text, adapter.max_message_length, adapter.measure),
            interval_s=self.cfg.delivery.stream_edit_interval_s,
            max_chars=self.cfg.delivery.max_reply_chars,
        )

    async def edit(self, msg: InboundMessage, chunk_id: int, text: str) -> int:
        """Record new text for the message chunk `chunk_id` became (sent as a new message
        if it cannot be edited); it keeps its place in the chat's order."""
        [edit_id] = await self.outbox.record(
            [
                Draft(
                    platform=msg.platform,
                    chat_id=msg.chat_id,
                    thread_id=msg.thread_id,
                    text=text,
                    kind="notice",
                    edit_of=chunk_id,
                )
            ],
            source=msg,
        )
        self.deliverer.kick(msg.platform, msg.chat_id)
        return edit_id

    # ----- cluster mode: claimed lanes -------------------------------------------------
    async def _run_claim(self, claim: Claim, held: HeldLease) -> None:
        """Run a lane this node claimed, under its tenant lease: the chunks a node before us
        recorded but did not send go out first, in order; then the pending messages, in
        arrival order, through the same admit/turn path as on one node; every answer is sent
        before the lane is given back. Raises LeaseLost when the lease goes."""
        from gateway.cluster.claims import LaneStalled
        from gateway.cluster.inbox import pending_messages

        assert self.node is not None
        await self._send_unsent(claim.lane, held)
        seen, batch, first = 0, claim.messages, True
        while batch and self._accepting:
            keys: list[str] = []
            try:
                for m in batch:
                    seen = max(seen, m.id)
                    if m.answered:  # its turn ran; only its chunks were left (sent above)
                        continue
                    held.check()
                    key = await self._admit(InboundMessage.model_validate(m.payload), force=True)
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
        assert self.shared_outbox is not None and self.node is not None
        for platform, chat_id, last in await self.shared_outbox.unsent_chats(lane):
            while True:
                held.check()
                self.deliverer.kick(platform, chat_id)
                await self.deliverer.wait(last, timeout=self.node.ttl / 3)
                if await self.shared_outbox.status(last) != "pending":
                    break

    def _database_fault(self, exc: BaseException) -> str | None:
        """Cluster mode: PostgreSQL unreachable is a storage fault too (the lane waits and retries)."""
        if self.shared_outbox is not None and isinstance(exc, self.shared_outbox.TRANSIENT):
            return "database unreachable"
        return None

    def _fenced_turn(self, key: str, lane: Lane, lost: LeaseLost, tlog: logging.LoggerAdapter) -> None:
        """A turn whose tenant lease went: nothing of it was committed; the lane's queued
        jobs are dropped (their messages stay pending for the lease's new holder) and the
        profile is closed."""
        dropped = self.lanes.discard(key)
        tlog.warning("turn stopped, nothing committed: %s", lost, extra={"event": "turn_fenced", "dropped": dropped})
        if self.node is not None:
            self.node.metrics.fenced_out("turn")
        self._in_background(self._close_profile(lane.tenant_id))

    def _lease_lost(self, tenant: str) -> None:
        """The node lost `tenant`'s lease: stop its running turns now and close its profile."""
        for key, stop in self._turn_stops.items():
            if tenant_of_key(key) == tenant:
                stop.set()
        self._in_background(self._close_profile(tenant))

    async def _close_profile(self, tenant: str) -> None:
        """Close `tenant`'s profile as soon as no turn uses it."""
        for _ in range(600):
            if await self.profiles.evict(tenant):
                return
            await asyncio.sleep(0.05)
        log.warning("a profile whose lease was lost stayed in use for 30 s")

    async def _close_idle_profiles(self) -> None:
        """Cluster mode: a profile idle for a lease ttl is closed, so its tenant lease is
        free for whichever node claims the tenant's next lane."""
        assert self.node is not None
        while True:
            await asyncio.sleep(self.node.ttl / 3)
            for tenant in self.profiles.idle(self.node.ttl):
                try:
                    await self.profiles.evict(tenant)
                except Exception:
                    log.exception("closing an idle profile failed")

    # ----- identity links (the /link command) -----------------------------------------
    async def link_command(self, msg: InboundMessage, args: str) -> str:
        return await self.linking.link_command(msg, args)

    async def unlink_command(self, msg: InboundMessage, args: str = "") -> str:
        return await self.linking.unlink_command(msg, args)
