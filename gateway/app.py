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
import time
from dataclasses import dataclass
from typing import Sequence

from adapters.base import Adapter, InboundMessage, OutboundKind, OutboundMessage
from agent.llm import LLMClient
from agent.prompt import ChatPlace
from agent.tokens import TokenCounter
from agent.turn import Agent, TurnResult, UserInput
from gateway.access import Access
from gateway.commands import HANDLERS, CommandContext, parse_command
from gateway.config import Config
from gateway.delivery import split_text
from gateway.faults import storage_fault
from gateway.inbox import Inbox
from gateway.lanes import Lanes
from gateway.limits import RateLimiter
from gateway.linking import LaneMoved, Linking
from gateway.logs import log_text, turn_logger
from gateway.metrics import InstrumentedLLM, Metrics
from gateway.outbox import Deliverer, Draft, Outbox
from tenancy.identity import IdentityLinks
from tenancy.keys import Lane, resolve_lane
from tenancy.profiles import ProfileManager

log = logging.getLogger("hermes.gateway")

TYPING_INTERVAL_S = 4.0
DEDUPE_WINDOW_S = 14 * 24 * 3600  # answered message ids are remembered this long
HOUSEKEEPING_INTERVAL_S = 3600.0


@dataclass(frozen=True)
class Job:
    msg: InboundMessage
    lane: Lane


def input_uid(msg: InboundMessage) -> str:
    """The stored uid of an inbound message: derived from its platform identity, so the
    same message replayed after a crash is stored once."""
    digest = hashlib.sha256(f"{msg.platform}\0{msg.chat_id}\0{msg.message_id}".encode()).hexdigest()
    return f"in-{digest[:32]}"


class _Notifier:
    """Progress notices of one turn: the start notice is edited into the end notice where
    the platform can edit; routine ones are dropped unless `progress_notices` is on."""

    def __init__(self, app: "GatewayApp", msg: InboundMessage) -> None:
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
        ids = await self.app.send(self.msg, text, kind="notice" if kind.startswith("progress") else "error",
                                  reply=False)
        if kind == "progress" and len(ids) == 1:
            self._progress = ids[0]


class GatewayApp:
    """The running gateway; build it with adapters and (for tests) an LLM client."""

    def __init__(self, cfg: Config, adapters: Sequence[Adapter] = (), *, llm: LLMClient | None = None,
                 tokens: TokenCounter | None = None) -> None:
        self.cfg = cfg
        self.adapters: dict[str, Adapter] = {a.platform: a for a in adapters}
        self.inbox = Inbox(cfg.data_dir / "gateway.db", fsync=cfg.storage.fsync)
        self.outbox = Outbox(self.inbox)
        self.links = IdentityLinks.load(cfg.data_dir / "links.json", cfg.tenancy)
        self.profiles = ProfileManager(
            cfg.data_dir, max_open=cfg.tenancy.max_open_profiles, fsync=cfg.storage.fsync,
            memory_char_limit=cfg.memory.memory_char_limit, user_char_limit=cfg.memory.user_char_limit,
            provider_kind=cfg.memory.provider)
        self._own_llm = llm is None
        self.llm = llm or LLMClient.from_config(cfg.llm)
        self.tokens = tokens or TokenCounter.create(log)
        self.metrics = Metrics()
        self.deliverer = Deliverer(self.outbox, self.adapters, self.metrics, cfg.delivery)
        self.llm_monitor = InstrumentedLLM(self.llm, self.metrics)  # counts errors by kind for /metrics
        self.agent = Agent(cfg, self.llm_monitor, self.tokens)
        self.agent.compression.on_outcome = self.metrics.compression  # hermes_compressions_total{outcome}
        self.linking = Linking(self)
        self.observability = None  # gateway.observability.Observability when observability.listen is set
        self._run_lock = None
        self.access = Access(cfg.access, self.inbox)
        self.limiter = RateLimiter(cfg.limits.rate_limit_per_minute)
        self._limit_notified: dict[str, float] = {}
        coalesce_ms = cfg.limits.coalesce_burst_ms
        self.lanes: Lanes[Job] = Lanes(
            self._run_lane, max_queued=cfg.limits.max_queued_turns,
            coalesce=(lambda job: parse_command(job.msg.text) is None) if coalesce_ms else None,
            coalesce_wait_s=coalesce_ms / 1000)
        self._started = False
        self._accepting = False
        self.metrics.bind(platforms=self.adapters, open_profiles=lambda: self.profiles.open_count,
                          queue_depth=lambda: self.lanes.queued_by(lambda job: job.msg.platform),
                          adapters_up=self._adapters_up)
        self._housekeeping: asyncio.Task | None = None

    # ----- lifecycle ------------------------------------------------------------------
    async def start(self) -> None:
        """Open storage, replay what a previous run left unanswered, start the adapters."""
        from gateway.admin import RunLock

        self.cfg.data_dir.mkdir(parents=True, exist_ok=True)
        self._run_lock = RunLock(self.cfg.data_dir).acquire("hermes-gateway")  # one gateway per data dir
        await self.inbox.open()
        await self.outbox.open()
        await self.linking.recover()  # a /link merge a crash interrupted: finished or undone
        self._started = True
        self._accepting = True
        await self.inbox.prune(DEDUPE_WINDOW_S)
        self._housekeeping = asyncio.create_task(self._housekeep())
        pending = await self.inbox.pending()
        if pending:
            log.info("replaying %d message(s) left unanswered by the previous run", len(pending))
        for msg in pending:
            try:
                await self._admit(msg, replay=True)
            except Exception:  # one bad record must not stop the gateway from starting
                log.exception("could not replay a %s message; it stays pending", msg.platform)
        for adapter in self.adapters.values():
            try:
                await adapter.start(self.handle_inbound)
            except Exception:
                log.exception("%s adapter failed to start; the other platforms keep running", adapter.platform)
        await self.deliverer.resume()  # what the previous run recorded but did not get sent
        if self.cfg.observability.listen:
            from gateway.observability import Observability

            self.observability = Observability(self, self.cfg.observability.listen)
            await self.observability.start()

    async def stop(self, drain_timeout: float = 30.0) -> None:
        """Stop taking new turns, let running ones finish and deliver (bounded), then stop
        the adapters and close everything. Messages arriving meanwhile are recorded and
        replayed on the next start."""
        self._accepting = False
        if self._housekeeping is not None:
            self._housekeeping.cancel()
            self._housekeeping = None
        if not await self.lanes.drain(drain_timeout):
            log.warning("turns still running after %.0fs; they will be replayed on the next start", drain_timeout)
            await self.lanes.cancel()
        await self.linking.close(drain_timeout)
        await self.deliverer.close(drain_timeout)  # unsent chunks stay in the outbox for the next start
        for adapter in self.adapters.values():
            try:
                await adapter.stop()
                aclose = getattr(adapter, "aclose", None)
                if aclose is not None:
                    await aclose()
            except Exception:
                log.exception("%s adapter failed to stop cleanly", adapter.platform)
        await self.profiles.close_all()
        if self._started:
            await self.outbox.close()
            await self.inbox.close()
            self._started = False
        if self._own_llm:
            await self.llm.aclose()
        if self.observability is not None:
            await self.observability.stop()
            self.observability = None
        if self._run_lock is not None:
            self._run_lock.release()
            self._run_lock = None

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
        return await self.deliverer.drain(timeout)

    # ----- inbound --------------------------------------------------------------------
    async def handle_inbound(self, msg: InboundMessage) -> None:
        """The adapters' sink: returns once `msg` is durably recorded (or known already)."""
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

    async def _admit(self, msg: InboundMessage, *, replay: bool = False) -> None:
        if not await self.access.is_allowed(msg.principal):
            await self._refuse_stranger(msg)
            return
        if len(msg.text) > self.cfg.limits.max_text_length:
            await self._refuse(msg, "too_long", (
                f"Your message is {len(msg.text):,} characters long; I can take at most "
                f"{self.cfg.limits.max_text_length:,}. Please split it or send a shorter version."))
            return
        if not msg.text.strip() and not msg.attachments:
            await self.inbox.finish(msg, "empty")
            return
        if not replay:
            allowed, wait = self.limiter.allow(msg.principal)
            if not allowed:
                await self._refuse(msg, "rate_limited",
                                   f"You're sending messages faster than I can answer. Please wait about {int(wait) + 1} seconds and send it again.",
                                   quiet_key=msg.principal)
                return
        try:
            lane = resolve_lane(msg, self.cfg.tenancy, self.links)
        except ValueError as err:
            log.warning("cannot place a %s message: %s", msg.platform, err)
            await self._refuse(msg, "bad_ids", "Sorry, I can't handle messages from this chat.")
            return
        # a replayed message was accepted once already: it never gets a "busy" refusal
        if not self.lanes.submit(f"{lane.tenant_id}\0{lane.session_key}", Job(msg, lane), force=replay):
            await self._refuse(msg, "busy", "I'm still working on your earlier messages. "
                                            "Please wait for my answer, then send this again.")

    async def _refuse_stranger(self, msg: InboundMessage) -> None:
        self.metrics.refused(msg.platform, "unauthorized")
        if msg.chat_type == "dm" and self.cfg.access.unauthorized_dm == "pair":
            code = await self.access.pairing_code(msg.principal)
            text = (f"Hi! I don't know you yet. Your pairing code is {code}. "
                    f"Ask the operator of this bot to approve it with /pair {code}.")
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

    async def _send_and_finish(self, msg: InboundMessage, text: str, kind: OutboundKind, outcome: str) -> None:
        """Record the answer in the outbox and mark `msg` done, in one transaction."""
        await self.send(msg, text, kind=kind, finish=[(msg, outcome)])

    # ----- the lane worker ------------------------------------------------------------
    def place_of(self, msg: InboundMessage, lane: Lane) -> ChatPlace:
        return ChatPlace(platform=msg.platform, chat_type=msg.chat_type, shared=lane.kind == "chat",
                         user_name=msg.user_name)

    async def _run_lane(self, key: str, jobs: list[Job]) -> None:
        first, last = jobs[0], jobs[-1]
        lane, platform, started = first.lane, first.msg.platform, time.monotonic()
        # ids of this turn go on its log lines explicitly (no context variable)
        tlog = turn_logger(log, turn_id=secrets.token_hex(6), platform=platform, tenant=lane.tenant_id)
        job_kind = "command" if parse_command(first.msg.text) is not None else "turn"
        for job in jobs:
            log_text(tlog, self.cfg.logging.include_text, "inbound text", job.msg.text)
        failures = 0
        while True:  # a storage fault holds the lane (order) and retries until storage works again
            try:
                text, kind, outcome = await self._answer(jobs, tlog)
                # the answer's chunks and the turn's completion commit together; the deliverer sends them
                await self.send(last.msg, text if kind != "covered" else "",
                                kind="reply" if kind == "covered" else kind,
                                finish=[(job.msg, outcome) for job in jobs])
                break
            except LaneMoved as moved:  # linked or unlinked meanwhile: run it in its new lane
                await self._move_jobs(jobs, moved.lane)
                return
            except Exception as exc:
                fault = storage_fault(exc)
                if fault is None:
                    raise
                failures += 1
                delay = min(self.cfg.delivery.retry_initial_s * 2 ** (failures - 1), self.cfg.delivery.retry_max_s)
                tlog.error("storage fault (%s); the message stays pending, retrying in %.1f s", fault, delay)
                if failures == 1:
                    await self._tell_storage_fault(last.msg, fault)
                await asyncio.sleep(delay)
        seconds = time.monotonic() - started
        self.metrics.turn_done(platform, job_kind, outcome, seconds if job_kind == "turn" else None)
        tlog.info("%s %s in %.0f ms", job_kind, outcome, seconds * 1000,
                  extra={"outcome": outcome, "duration_ms": round(seconds * 1000)})

    async def _answer(self, jobs: list[Job], tlog: logging.LoggerAdapter) -> tuple[str, OutboundKind | str, str]:
        """Run the command or agent turn of `jobs`: (text, kind, outcome). Raises LaneMoved,
        and storage faults of an agent turn (retried by the caller); other failures become
        an apology."""
        first, last = jobs[0], jobs[-1]
        lane, place = first.lane, self.place_of(first.msg, first.lane)
        platform = first.msg.platform
        self.metrics.in_flight.add(1, platform=platform)
        typing = asyncio.create_task(self._keep_typing(last.msg))
        command = parse_command(first.msg.text)
        try:
            async with self.linking.use(first.msg, lane) as profile:
                if lane.principal not in profile.principals and lane.kind == "person":
                    await asyncio.to_thread(profile.add_principal, lane.principal)
                if command is not None:
                    spec, args = command
                    ctx = CommandContext(self, first.msg, lane, place, profile, args)
                    return await HANDLERS[spec.name](ctx), "reply", "replied"
                inputs = [UserInput(uid=input_uid(j.msg), text=self._input_text(j.msg), user_name=j.msg.user_name,
                                    meta={"platform": j.msg.platform, "message_id": j.msg.message_id,
                                          "user": j.msg.principal})
                          for j in jobs]
                result: TurnResult = await self.agent.run_turn(profile, lane, place, inputs,
                                                               notify=_Notifier(self, last.msg))
                outcome = {"error": "llm_error", "covered": "coalesced"}.get(result.kind, "replied")
                return result.text, result.kind, outcome  # covered: a replayed part of a coalesced batch
        except LaneMoved:
            raise
        except Exception as exc:
            if command is None and storage_fault(exc) is not None:
                raise
            tlog.exception("turn failed")
            return ("Something went wrong on my side while answering; your message was kept. "
                    "Please try again."), "error", "error"
        finally:
            typing.cancel()
            self.metrics.in_flight.add(-1, platform=platform)

    async def _tell_storage_fault(self, msg: InboundMessage, fault: str) -> None:
        """Say once why the answer is late: through the outbox, or straight to the platform
        when gateway.db itself cannot take it."""
        text = (f"I can't save anything right now ({fault} on my server), so your answer is delayed. "
                "Your message is kept and I'll answer it as soon as storage works again.")
        try:
            await self.send(msg, text, kind="notice", reply=False)
            return
        except Exception:
            log.warning("could not record the storage notice; sending it directly")
        adapter = self.adapters.get(msg.platform)
        if adapter is not None:
            try:
                await adapter.send(OutboundMessage(chat_id=msg.chat_id, thread_id=msg.thread_id, text=text,
                                                   kind="notice"))
            except Exception:
                log.warning("could not send the storage notice either", exc_info=True)

    async def _move_jobs(self, jobs: list[Job], lane: Lane) -> None:
        """Queue jobs whose tenant changed (a /link or /unlink) on the lane they belong to now."""
        for job in jobs:
            if not self.lanes.submit(f"{lane.tenant_id}\0{lane.session_key}", Job(job.msg, lane)):
                await self._refuse(job.msg, "busy", "I'm still working on your earlier messages. "
                                                    "Please wait for my answer, then send this again.")

    def _adapters_up(self) -> dict[str, bool | None]:
        from gateway.observability import adapter_state

        return {platform: adapter_state(adapter)[0] for platform, adapter in self.adapters.items()}

    @staticmethod
    def _input_text(msg: InboundMessage) -> str:
        if not msg.attachments:
            return msg.text
        names = ", ".join(f"{a.type} {a.name}".strip() for a in msg.attachments)
        return f"{msg.text}\n[attached: {names}]".strip()

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
    async def send(self, msg: InboundMessage, text: str, *, kind: OutboundKind = "reply", reply: bool = True,
                   finish: Sequence[tuple[InboundMessage, str]] = ()) -> list[int]:
        """Record `text` for `msg`'s chat in the outbox, split at the platform limit (the
        first chunk replies to `msg`), mark `finish` done in the same transaction, and
        hand it to the deliverer. Returns the chunk ids."""
        adapter = self.adapters.get(msg.platform)
        chunks = split_text(text, adapter.max_message_length, adapter.measure) if adapter is not None else []
        if adapter is None and text:
            log.warning("no adapter for platform %s; reply dropped", msg.platform)
        drafts = [Draft(platform=msg.platform, chat_id=msg.chat_id, thread_id=msg.thread_id, text=chunk, kind=kind,
                        reply_to=msg.message_id if (reply and i == 0) else None)
                  for i, chunk in enumerate(chunks)]
        ids = await self.outbox.record(drafts, finish=finish)
        if ids:
            self.deliverer.kick(msg.platform, msg.chat_id)
        return ids

    async def edit(self, msg: InboundMessage, chunk_id: int, text: str) -> int:
        """Record new text for the message chunk `chunk_id` became (sent as a new message
        if it cannot be edited); it keeps its place in the chat's order."""
        [edit_id] = await self.outbox.record([Draft(platform=msg.platform, chat_id=msg.chat_id,
                                                    thread_id=msg.thread_id, text=text, kind="notice",
                                                    edit_of=chunk_id)])
        self.deliverer.kick(msg.platform, msg.chat_id)
        return edit_id

    # ----- identity links (the /link command) -----------------------------------------
    async def link_command(self, msg: InboundMessage, args: str) -> str:
        return await self.linking.link_command(msg, args)

    async def unlink_command(self, msg: InboundMessage) -> str:
        return await self.linking.unlink_command(msg)
