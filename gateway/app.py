"""The gateway: adapters in, turns out. Auth, dedupe, limits, lanes, commands, delivery.

Data flows one way: adapter -> `handle_inbound` (record, admit) -> lane worker
(command or agent turn, inside the tenant's profile) -> delivery back to the adapter.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

from adapters.base import Adapter, InboundMessage, OutboundMessage, SentMessage
from agent.fileio import private_mkdir
from agent.llm import LLMClient
from agent.prompt import ChatPlace
from agent.tokens import TokenCounter
from agent.turn import Agent, TurnResult, UserInput
from gateway.access import Access
from gateway.commands import CommandContext, parse_command, run_command
from gateway.config import Config
from gateway.delivery import split_text
from gateway.inbox import Inbox
from gateway.lanes import Lanes
from gateway.limits import RateLimiter
from gateway.linking import LaneMoved, Linking
from gateway.logs import log_text, turn_logger
from gateway.media import MediaIntake
from gateway.metrics import InstrumentedLLM, Metrics
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
        self._progress: SentMessage | None = None

    async def __call__(self, kind: str, text: str) -> None:
        if kind in ("progress", "progress_done") and not self.app.cfg.compression.progress_notices:
            return
        adapter = self.app.adapters.get(self.msg.platform)
        if adapter is None:
            return
        if kind == "progress_done" and self._progress is not None and adapter.can_edit:
            if await self.app.safe_edit(adapter, self._progress, text):
                self._progress = None
                return
        sent = await self.app.send(self.msg, text, kind="notice" if kind.startswith("progress") else "error",
                                   reply=False)
        if kind == "progress":
            self._progress = sent


class GatewayApp:
    """The running gateway; build it with adapters and (for tests) an LLM client."""

    def __init__(self, cfg: Config, adapters: Sequence[Adapter] = (), *, llm: LLMClient | None = None,
                 tokens: TokenCounter | None = None) -> None:
        self.cfg = cfg
        self.adapters: dict[str, Adapter] = {a.platform: a for a in adapters}
        self.inbox = Inbox(cfg.data_dir / "gateway.db", fsync=cfg.storage.fsync)
        self.links = IdentityLinks.load(cfg.data_dir / "links.json", cfg.tenancy)
        self.profiles = ProfileManager(
            cfg.data_dir, max_open=cfg.tenancy.max_open_profiles, fsync=cfg.storage.fsync,
            memory_char_limit=cfg.memory.memory_char_limit, user_char_limit=cfg.memory.user_char_limit,
            provider_kind=cfg.memory.provider)
        self._own_llm = llm is None
        self.llm = llm or LLMClient.from_config(cfg.llm)
        self.tokens = tokens or TokenCounter.create(log)
        self.metrics = Metrics()
        self.llm_monitor = InstrumentedLLM(self.llm, self.metrics)  # counts errors by kind for /metrics
        self.agent = Agent(cfg, self.llm_monitor, self.tokens)
        self.media = MediaIntake(cfg)
        self.agent.compression.on_outcome = self.metrics.compression  # hermes_compressions_total{outcome}
        self.agent.reviewer.on_outcome = self.metrics.review  # hermes_memory_reviews_total{kind,outcome}
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
        self._background: set[asyncio.Task] = set()
        self._housekeeping: asyncio.Task | None = None
        # lanes that ran turns in this process, newest last: flushed at shutdown (bounded)
        self._active_lanes: OrderedDict[tuple[str, str], tuple[InboundMessage, Lane, ChatPlace]] = OrderedDict()

    # ----- lifecycle ------------------------------------------------------------------
    async def start(self) -> None:
        """Open storage, replay what a previous run left unanswered, start the adapters."""
        from gateway.admin import RunLock

        private_mkdir(self.cfg.data_dir)
        self._run_lock = RunLock(self.cfg.data_dir).acquire("hermes-gateway")  # one gateway per data dir
        await self.inbox.open()
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
            if hasattr(adapter, "overheard"):  # group text the adapter drops unanswered is still screened
                adapter.overheard = self._overheard
            try:
                await adapter.start(self.handle_inbound)
            except Exception:
                log.exception("%s adapter failed to start; the other platforms keep running", adapter.platform)
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
        if self._background:
            _, late = await asyncio.wait(list(self._background), timeout=drain_timeout)
            for task in late:  # their messages stay pending and are handled on the next start
                task.cancel()
        if self._started:
            try:
                await asyncio.wait_for(self._flush_lanes(), drain_timeout)
            except TimeoutError:
                log.warning("memory flush at shutdown did not finish in %.0fs", drain_timeout)
        await self.linking.close(drain_timeout)
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
            except Exception:
                log.exception("pruning gateway.db failed")
            now = time.monotonic()
            self._limit_notified = {k: t for k, t in self._limit_notified.items() if now - t < 60}

    async def drain(self, timeout: float | None = 30.0) -> bool:
        """Wait until every queued turn and pending refusal has finished (tests, console)."""
        if not await self.lanes.drain(timeout):
            return False
        if self._background:
            done, pending = await asyncio.wait(list(self._background), timeout=timeout)
            return not pending
        return True

    # ----- inbound --------------------------------------------------------------------
    async def handle_inbound(self, msg: InboundMessage) -> None:
        """The adapters' sink: returns once `msg` is durably recorded (or known already)."""
        if msg.unreadable_fields():
            await self._refuse_unreadable(msg)
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

    async def _overheard(self, platform: str, text: str) -> None:
        """A group message the adapter does not answer (no mention): nothing is recorded or
        said, but a live link code in it is burnt like anywhere else outside a private chat."""
        msg = InboundMessage(platform=platform, chat_id="overheard", chat_type="group", user_id="overheard",
                             message_id="overheard", text=text)
        await self.linking.screen(msg)

    async def _admit(self, msg: InboundMessage, *, replay: bool = False) -> None:
        try:  # a link code typed where others can read it is burnt, whoever sent it
            await self.linking.screen(msg)
        except Exception:
            log.exception("could not screen a %s message for link codes", msg.platform)
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
            clean = msg.model_copy(update={"text": "", "user_name": "", "user_id": "?",
                                           "reply_to_message_id": None, "attachments": ()})
            self._in_background(self._send_quietly(clean, (
                "Sorry, I can't read that message: it contains invalid characters (broken Unicode). "
                "Please send it again as plain text.")))

    async def _send_quietly(self, msg: InboundMessage, text: str) -> None:
        try:
            await self.send(msg, text, kind="error")
        except Exception:
            log.exception("could not send a refusal")

    def _in_background(self, coro) -> None:
        """Run a reply outside the adapter's sink, so a slow send (e.g. flood control)
        never holds up receiving; stop() waits for these."""
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _refuse_stranger(self, msg: InboundMessage) -> None:
        self.metrics.refused(msg.platform, "unauthorized")
        if msg.chat_type == "dm" and self.cfg.access.unauthorized_dm == "pair":
            code = await self.access.pairing_code(msg.principal)
            text = (f"Hi! I don't know you yet. Your pairing code is {code}. "
                    f"Ask the operator of this bot to approve it with /pair {code}.")
            self._in_background(self._send_and_finish(msg, text, "notice", "unauthorized"))
            return
        if msg.message_id.startswith("interaction-"):
            # a slash command waits visibly for an answer; plain group messages get silence
            self._in_background(self._send_and_finish(
                msg, "Sorry, you're not on this bot's list of users.", "error", "unauthorized"))
            return
        await self.inbox.finish(msg, "unauthorized")

    async def _refuse(self, msg: InboundMessage, outcome: str, text: str, quiet_key: str | None = None) -> None:
        """Tell the person why their message was not taken (rate refusals once a minute)."""
        self.metrics.refused(msg.platform, outcome)
        now = time.monotonic()
        if quiet_key is None or now - self._limit_notified.get(quiet_key, -1e9) >= 60:
            if quiet_key is not None:
                self._limit_notified[quiet_key] = now
            self._in_background(self._send_and_finish(msg, text, "error", outcome))
            return
        await self.inbox.finish(msg, outcome)

    async def _send_and_finish(self, msg: InboundMessage, text: str, kind: str, outcome: str) -> None:
        try:
            await self.send(msg, text, kind=kind)
        finally:
            await self.inbox.finish(msg, outcome)

    # ----- the lane worker ------------------------------------------------------------
    def place_of(self, msg: InboundMessage, lane: Lane) -> ChatPlace:
        return ChatPlace(platform=msg.platform, chat_type=msg.chat_type, shared=lane.kind == "chat",
                         user_name=msg.user_name)

    async def _run_lane(self, key: str, jobs: list[Job]) -> None:
        first, last = jobs[0], jobs[-1]
        lane, place = first.lane, self.place_of(first.msg, first.lane)
        platform, started = first.msg.platform, time.monotonic()
        # ids of this turn go on its log lines explicitly (no context variable)
        tlog = turn_logger(log, turn_id=secrets.token_hex(6), platform=platform, tenant=lane.tenant_id)
        job_kind = "command" if parse_command(first.msg.text) is not None else "turn"
        self.metrics.in_flight.add(1, platform=platform)
        typing = asyncio.create_task(self._keep_typing(last.msg))
        outcome = "replied"
        result: TurnResult | None = None
        try:
            async with self.linking.use(first.msg, lane) as profile:
                for job in jobs:
                    log_text(tlog, self.cfg.logging.include_text, "inbound text", job.msg.text)
                if lane.principal not in profile.principals and lane.kind == "person":
                    await asyncio.to_thread(profile.add_principal, lane.principal)
                command = parse_command(first.msg.text)
                if command is not None:
                    spec, args = command
                    ctx = CommandContext(self, first.msg, lane, place, profile, args,
                                         chat_admin=self._chat_admin_check(first.msg))
                    text, kind = await run_command(spec.name, ctx), "reply"
                else:
                    # attachments and reply quotes, stored in this lane's own profile (gateway/media.py)
                    prepared = [await self.media.prepare(j.msg, self.adapters.get(j.msg.platform), profile.path,
                                                         input_uid(j.msg)) for j in jobs]
                    inputs = [UserInput(uid=input_uid(j.msg), text=p.text, user_name=j.msg.user_name,
                                        meta={"platform": j.msg.platform, "message_id": j.msg.message_id,
                                              "user": j.msg.principal, **p.meta})
                              for j, p in zip(jobs, prepared) if p.answerable]
                    notices = [n for p in prepared for n in p.notices]
                    if inputs:
                        for notice in notices:
                            await self.send(last.msg, notice, kind="notice", reply=False)
                        result: TurnResult = await self.agent.run_turn(profile, lane, place, inputs,
                                                                       notify=_Notifier(self, last.msg))
                        text, kind = result.text, result.kind
                        if kind == "error":
                            outcome = "llm_error"
                    else:  # nothing the model could read: the notices are the answer
                        text, kind, outcome = "\n\n".join(notices) or "I couldn't read that.", "error", "refused"
        except LaneMoved as moved:  # linked or unlinked meanwhile: run it in its new lane
            await self._move_jobs(jobs, moved.lane)
            return
        except Exception:
            tlog.exception("turn failed")
            text, kind, outcome = ("Something went wrong on my side while answering; your message "
                                   "was kept. Please try again."), "error", "error"
        finally:
            typing.cancel()
            self.metrics.in_flight.add(-1, platform=platform)
        sent = await self.send(last.msg, text, kind=kind)
        if sent is None and last.msg.platform in self.adapters:
            outcome = "undelivered" if outcome == "replied" else outcome
        for job in jobs:
            await self.inbox.finish(job.msg, outcome)
        if result is not None and result.kind == "reply" and not result.replayed:
            self._after_reply(last.msg, lane, place, result)
        seconds = time.monotonic() - started
        self.metrics.turn_done(platform, job_kind, outcome, seconds if job_kind == "turn" else None)
        tlog.info("%s %s in %.0f ms", job_kind, outcome, seconds * 1000,
                  extra={"outcome": outcome, "duration_ms": round(seconds * 1000)})

    # ----- background memory review (agent/review.py) ------------------------------------
    def _after_reply(self, msg: InboundMessage, lane: Lane, place: ChatPlace, result: TurnResult) -> None:
        """The reply is out: count the turn and start a review in the background when due."""
        key = (lane.tenant_id, lane.session_key)
        self._active_lanes[key] = (msg, lane, place)
        self._active_lanes.move_to_end(key)
        while len(self._active_lanes) > 1000:
            self._active_lanes.popitem(last=False)
        memory, skills = self.agent.reviewer.note_turn(lane, result.tool_iterations)
        if memory or skills:
            self._in_background(self._review(msg, lane, place, result.session_id, memory, skills))

    async def _review(self, msg: InboundMessage, lane: Lane, place: ChatPlace, session_id: str,
                      memory: bool, skills: bool) -> None:
        try:
            async with self.linking.use(msg, lane) as profile:
                history = await profile.sessions.history(session_id)
                await self.agent.reviewer.review(profile, lane, place, history, memory=memory,
                                                 skills=skills, trigger="nudge")
        except LaneMoved:
            log.info("background review skipped: the lane moved to another profile")
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
            except LaneMoved:
                continue
            except Exception:
                log.exception("memory flush at shutdown failed")
    def _chat_admin_check(self, msg: InboundMessage):
        """The adapter's `is_chat_admin` for this message's sender, if the platform has one."""
        check = getattr(self.adapters.get(msg.platform), "is_chat_admin", None)
        if check is None:
            return None

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
            if not self.lanes.submit(f"{lane.tenant_id}\0{lane.session_key}", Job(job.msg, lane)):
                await self._refuse(job.msg, "busy", "I'm still working on your earlier messages. "
                                                    "Please wait for my answer, then send this again.")

    def _adapters_up(self) -> dict[str, bool | None]:
        from gateway.observability import adapter_state

        return {platform: adapter_state(adapter)[0] for platform, adapter in self.adapters.items()}

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
    async def send(self, msg: InboundMessage, text: str, *, kind: str = "reply", reply: bool = True) -> SentMessage | None:
        """Send `text` into `msg`'s chat, split at the platform limit; the first chunk
        replies to `msg`. Returns the first sent chunk (None if nothing was delivered)."""
        adapter = self.adapters.get(msg.platform)
        if adapter is None:
            log.warning("no adapter for platform %s; reply dropped", msg.platform)
            return None
        first: SentMessage | None = None
        for i, chunk in enumerate(split_text(text, adapter.max_message_length, adapter.measure)):
            out = OutboundMessage(chat_id=msg.chat_id, thread_id=msg.thread_id, text=chunk, kind=kind,
                                  reply_to_message_id=msg.message_id if (reply and i == 0) else None)
            try:
                sent = await adapter.send(out)
            except Exception:
                log.exception("%s send failed", msg.platform)
                return first
            if sent is None:
                return first
            first = first or sent
        return first

    async def safe_edit(self, adapter: Adapter, sent: SentMessage, text: str) -> bool:
        try:
            return await adapter.edit(sent, text)
        except Exception:
            log.debug("edit failed", exc_info=True)
            return False

    # ----- identity links (the /link command) -----------------------------------------
    async def link_command(self, msg: InboundMessage, args: str) -> str:
        return await self.linking.link_command(msg, args)

    async def unlink_command(self, msg: InboundMessage, args: str = "") -> str:
        return await self.linking.unlink_command(msg, args)
