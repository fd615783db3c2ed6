"""The running gateway: adapters in, turns out. It is built from parts, completely, by the
factory of its mode (gateway/build.py, gateway/cluster/build.py) and only starts, drains
and stops them, in order.

Data flows one way: adapter -> `handle_inbound` (gateway/ingress.py: record, admit) ->
lane worker (gateway/turns.py: command or agent turn, inside the tenant's profile) ->
outbox (recorded together with the turn's completion) -> deliverer -> adapter.
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from agent.agents import Agents
from agent.fileio import private_mkdir
from agent.llm import LLMClient
from agent.sessions import StoragePool
from agent.tokens import TokenCounter
from agent.turn import Agent
from core.messages import InboundMessage
from core.protocols import Adapter, Closable, Confirms, Overhears, SkipsEvents
from core.redact import Redactor
from core.settings import Config, ConfigError
from gateway.access import Access
from gateway.confirmations import Confirmations
from gateway.faults import StartupError, storage_fault
from gateway.inbox import Inbox
from gateway.ingress import Ingress, Refusals
from gateway.jobs import Background, Job, RunningTurns
from gateway.lanes import Lanes
from gateway.linking import Linking
from gateway.logs import secrets_from_config
from gateway.media import MediaIntake
from gateway.metrics import InstrumentedLLM, Metrics
from gateway.modes import ClusterNode, Reminders
from gateway.outbox import Deliverer, Outbox
from gateway.replies import Replies
from gateway.reviews import Reviews
from gateway.tooling import ToolClients
from gateway.turns import Turns
from tenancy.identity import IdentityLinks
from tenancy.profiles import ProfileManager

if TYPE_CHECKING:
    from gateway.observability import Observability, Observed
    from gateway.runlock import RunLock

log = logging.getLogger("hermes.gateway")

DEDUPE_WINDOW_S = 14 * 24 * 3600  # answered message ids are remembered this long
HOUSEKEEPING_INTERVAL_S = 3600.0
STOP_TAIL_S = 2.0  # how long past the drain deadline a stop still lets recorded answers go out


def _unopenable_db(path: Any, exc: sqlite3.DatabaseError) -> str:
    """The one sentence for a gateway.db SQLite cannot open."""
    fault = storage_fault(exc)
    if fault is not None:
        return f"cannot open {path} ({fault}); free disk space or stop what holds it, then start again"
    return (
        f"{path} cannot be opened as a database ({exc}); restore it from a backup, or move it "
        "aside to start with an empty one (its pending messages and reply history stay in the moved file)"
    )


@dataclass(frozen=True)
class Parts:
    """Every part of a gateway, built by a mode's factory before the runtime exists."""

    cfg: Config
    adapters: Mapping[str, Adapter]
    inbox: Inbox
    outbox: Outbox
    links: IdentityLinks
    access: Access
    linking: Linking
    storage_pool: StoragePool
    profiles: ProfileManager
    llm: LLMClient
    own_llm: bool  # built here from the config (closed at stop), not handed in
    tokens: TokenCounter
    metrics: Metrics
    llm_monitor: InstrumentedLLM
    agent: Agent  # the default model's (agents.default)
    agents: Agents
    offer_clients: list[LLMClient]  # of the llm.models offers: built here, closed at stop
    tools: ToolClients  # the web and MCP clients (gateway/tooling.py): closed at stop
    confirmations: Confirmations  # the open tool-call questions; adapters with buttons answer them
    media: MediaIntake
    deliverer: Deliverer
    replies: Replies
    reminders: Reminders
    reviews: Reviews
    turns: Turns
    refusals: Refusals
    ingress: Ingress
    running: RunningTurns
    background: Background
    # cluster mode: brings `links` up to date with links other nodes made, before routing
    links_refresh: Callable[[], Awaitable[object]] | None = None


class GatewayApp:
    """The running gateway; build it with `gateway.build.build_gateway` (one node) or
    `gateway.cluster.build.build_cluster_gateway` (cluster mode)."""

    def __init__(self, parts: Parts, *, cluster: ClusterNode | None = None) -> None:
        self.cfg = parts.cfg
        self.adapters = parts.adapters
        self.inbox = parts.inbox
        self.outbox = parts.outbox
        self.links = parts.links
        self.access = parts.access
        self.linking = parts.linking
        self.links_refresh = parts.links_refresh
        self.storage_pool = parts.storage_pool
        self.profiles = parts.profiles
        self.llm = parts.llm
        self._own_llm = parts.own_llm
        self.tokens = parts.tokens
        self.metrics = parts.metrics
        self.llm_monitor = parts.llm_monitor
        self.agent = parts.agent
        self.agents = parts.agents
        self._offer_clients = parts.offer_clients
        self._tools = parts.tools
        self.confirmations = parts.confirmations
        self.media = parts.media
        self.deliverer = parts.deliverer
        self.replies = parts.replies
        self.reminders = parts.reminders
        self.reviews = parts.reviews
        self.turns = parts.turns
        self.lanes: Lanes[Job] = parts.turns.lanes
        self.ingress = parts.ingress
        self._background = parts.background
        # cluster mode (docs/cluster.md): the node's membership, ingress election and claim
        # workers; None on a single node
        self.cluster = cluster
        # cluster mode: the database and this node's leases, for /healthz (gateway/cluster/health.py)
        self.cluster_health: Callable[[], Awaitable[tuple[bool, dict[str, Any]]]] | None = (
            cluster.health if cluster is not None else None
        )
        self.observability: Observability | None = None  # when observability.listen is set
        self._run_lock: RunLock | None = None
        self._started = False
        #: platform -> why its adapter's start() raised (it serves nothing in this process)
        self.start_failures: dict[str, str] = {}
        self._housekeeping: asyncio.Task | None = None
        self.metrics.bind(
            platforms=self.adapters,
            open_profiles=lambda: self.profiles.open_count,
            queue_depth=lambda: self.lanes.queued_by(lambda job: job.msg.platform),
            adapters_up=self._adapters_up,
            skipped_events=self._skipped_events,
        )

    # the adapters' sink and the admission step (tests reach them here)
    async def handle_inbound(self, msg: InboundMessage) -> None:
        """The adapters' sink: returns once `msg` is durably recorded (or known already)."""
        await self.ingress.handle_inbound(msg)

    async def _admit(self, msg: InboundMessage, *, replay: bool = False, force: bool = False) -> str | None:
        return await self.ingress.admit(msg, replay=replay, force=force)

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
        self._run_lock = RunLock(self.cfg.data_dir).acquire("hermes-gateway", shared=self.cluster is not None)
        if self.cluster is not None:
            # pool, migrations, registration, heartbeats; pairing, link codes and links in PostgreSQL
            await self.cluster.join()
        else:
            try:
                await self.inbox.open()
                await self.reminders.open()
                await self.outbox.open()
            except sqlite3.DatabaseError as exc:
                raise StartupError(_unopenable_db(self.inbox.path, exc)) from None
            await self.linking.recover()  # a /link merge a crash interrupted: finished or undone
        self._started = True
        self.ingress.accepting = True
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
                await self.ingress.admit(msg, replay=True)
            except Exception:  # one bad record must not stop the gateway from starting
                log.exception("could not replay a %s message; it stays pending", msg.platform)
        if self.cfg.observability.listen:  # before the platforms: a taken address stops us cheaply
            from gateway.observability import Observability

            self.observability = Observability(self.observed(), self.cfg.observability.listen)
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
                adapter.overheard = self.ingress.overheard
            if isinstance(adapter, Confirms):  # presses on tool-call questions' buttons
                adapter.answerer = self.confirmations.answer
            try:
                await adapter.start(self.ingress.handle_inbound)
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
        if self.cluster is not None:  # this node receives what it is elected for
            await self.cluster.receive()
        if self.cfg.reminders_on:
            self.reminders.start()
        await self.deliverer.resume()  # what the previous run recorded but did not get sent
        if self.cluster is not None:
            self.cluster.run_claims()

    def observed(self) -> Observed:
        """What /healthz and /metrics read (gateway/observability.py)."""
        from gateway.observability import Observed

        return Observed(
            cfg=self.cfg,
            metrics=self.metrics,
            profiles=self.profiles,
            adapters=self.adapters,
            platform_states=self.platform_states,
            llm_monitor=self.llm_monitor,
            cluster_health=self.cluster_health,
        )

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
        if self.cluster is not None and self.cluster.displaced is not None:
            return self.cluster.displaced
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
        self.ingress.accepting = False
        self.turns.stopping.set()
        deadline = time.monotonic() + drain_timeout

        def left() -> float:
            return max(0.0, deadline - time.monotonic())

        running = self.lanes.running()
        if running and drain_timeout > 0:
            turns = "running turn" if running == 1 else "running turns"
            log.info("waiting up to %g s for %d %s%s", drain_timeout, running, turns, hint)
        if self.cluster is not None:  # running lanes finish and deliver (bounded), no new claims
            await self.cluster.stop_claims(left())
        await self.reminders.stop()
        if self._housekeeping is not None:
            self._housekeeping.cancel()
            self._housekeeping = None
        if not await self.lanes.drain(left()):
            log.warning("turns still running after %.0fs; they will be replayed on the next start", drain_timeout)
            await self.lanes.cancel()
        if self._background:
            for task in await self._background.wait(left()):  # their messages stay pending for the next start
                task.cancel()
        # in a cluster the sessions go on elsewhere
        if self._started and self.cluster is None and self.reviews.active:
            try:
                await asyncio.wait_for(self.reviews.flush(), left())
            except TimeoutError:
                log.warning("memory flush at shutdown did not finish within the %gs drain", drain_timeout)
        # what the turns delivered may still go out, for a moment past the deadline at most
        rest = max(left(), min(drain_timeout, STOP_TAIL_S))
        await self.linking.close(rest)
        if self.cluster is not None:  # another node takes the ingress roles over at once
            await self.cluster.stop_receiving()
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
        if self._started or self.cluster is None:  # a failed start may have left gateway.db open
            await self._close_step("the outbox", self.outbox.close())
            await self._close_step("the inbox", self.inbox.close())
            self._started = False
        if self.cluster is not None:  # after the profiles closed: leaves the cluster, frees what is left
            await self.cluster.leave()
        if self._own_llm:
            await self.llm.aclose()
        for client in self._offer_clients:
            await client.aclose()
        await self._close_step("the tools", self._tools.aclose())
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
            self.ingress.refusals.forget_quiet()

    async def drain(self, timeout: float | None = 30.0) -> bool:
        """Wait until every queued turn and pending refusal has finished (tests, console)."""
        if not await self.lanes.drain(timeout):
            return False
        # refusals and notices sent outside the sink record into the outbox
        if self._background and await self._background.wait(timeout):
            return False
        return await self.deliverer.drain(timeout)

    def _adapters_up(self) -> dict[str, bool | None]:
        return {platform: connected for platform, (connected, _) in self.platform_states().items()}

    def _skipped_events(self) -> dict[str, int]:
        return {
            platform: adapter.skipped_events
            for platform, adapter in self.adapters.items()
            if isinstance(adapter, SkipsEvents)
        }
