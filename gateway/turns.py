"""The lane worker: one turn at a time per lane (a reminder, a command or an agent turn),
inside the tenant's profile; the answer's chunks and the turn's completion are recorded
together. A turn that fails holds its lane and retries (gateway/faults.py): the message
stays pending, and the person is told once that the answer is late."""

from __future__ import annotations

import asyncio
import errno
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass

from agent.agents import Agents
from agent.attachments import kind_of
from agent.metering import AudioCharge, BudgetExceeded
from agent.profile import Profile
from agent.prompt import ChatPlace
from agent.reminders import ReminderChat
from agent.toolkit import Speaker
from agent.turn import TurnResult, UserInput
from core.backoff import backoff_delay
from core.errors import LaneMoved, LeaseLost, caused_by
from core.lanes import Lane
from core.messages import InboundMessage, OutboundKind, OutboundMessage
from core.protocols import Adapter, ChatAdmins
from core.settings import Config
from core.text import page_text
from gateway.commands import CommandContext, CommandParts, asks_chat_admin, parse_command, run_command, speaker_of
from gateway.confirmations import Confirmations
from gateway.delivery import more_key, more_mark, more_offer
from gateway.faults import MODEL_DOWN_KINDS, ModelDown, damaged_database, damaged_profile, resource_fault, storage_fault
from gateway.inbox import Inbox
from gateway.ingress import BUSY
from gateway.jobs import Background, Job, RunningTurns, input_uid
from gateway.lanes import Lanes
from gateway.linking import Linking
from gateway.logs import log_text, turn_logger
from gateway.media import MediaIntake
from gateway.metrics import Metrics
from gateway.modes import Fencing, Reminders
from gateway.outbox import Deliverer, Draft, Outbox
from gateway.reminders import delivered_message, delivery_text, is_reminder
from gateway.replies import Notifier, Replies
from gateway.reviews import Reviews
from gateway.streaming import StreamingReply
from tenancy.profiles import ProfileManager

log = logging.getLogger("hermes.gateway")

Refuse = Callable[[InboundMessage, str, str], Awaitable[None]]


@dataclass
class Answer:
    """What a lane's turn produced: the text to deliver and the inbox outcome."""

    text: str
    kind: OutboundKind
    outcome: str
    reply: bool = True  # the first chunk replies to the person's message
    result: TurnResult | None = None
    streamer: StreamingReply | None = None  # a streamed draft may already be in the chat


def mergeable(job: Job) -> bool:
    """May join a collected turn: a person's message, not a command or a reminder."""
    return not is_reminder(job.msg) and parse_command(job.msg.text) is None


def place_of(msg: InboundMessage, lane: Lane) -> ChatPlace:
    return ChatPlace(
        platform=msg.platform, chat_type=msg.chat_type, shared=lane.kind == "chat", user_name=msg.user_name
    )


async def close_profile(profiles: ProfileManager, tenant: str) -> None:
    """Close `tenant`'s profile as soon as no turn uses it."""
    for _ in range(600):
        if await profiles.evict(tenant):
            return
        await asyncio.sleep(0.05)
    log.warning("a profile whose lease was lost stayed in use for 30 s")


class Turns:
    """Runs the jobs of a lane (`run_lane`, the handler of `lanes`)."""

    def __init__(
        self,
        cfg: Config,
        adapters: Mapping[str, Adapter],
        agents: Agents,
        linking: Linking,
        profiles: ProfileManager,
        media: MediaIntake,
        metrics: Metrics,
        inbox: Inbox,
        outbox: Outbox,
        deliverer: Deliverer,
        replies: Replies,
        reviews: Reviews,
        reminders: Reminders,
        commands: CommandParts,
        running: RunningTurns,
        background: Background,
        refuse: Refuse,
        *,
        confirmations: Confirmations,
        fencing: Fencing | None = None,
    ) -> None:
        self.cfg = cfg
        self.confirmations = confirmations  # tool calls that wait for the person's press
        self._ask_chat_admin = asks_chat_admin(cfg.tools)  # once, not on every turn
        self.adapters = adapters
        self.agents = agents
        self.linking = linking
        self.profiles = profiles
        self.media = media
        self.metrics = metrics
        self.inbox = inbox
        self.outbox = outbox
        self.deliverer = deliverer
        self.replies = replies
        self.reviews = reviews
        self.reminders = reminders
        self.commands = commands
        self.running = running
        self.background = background
        self.refuse = refuse  # a moved job whose new lane is full is refused as busy
        self.fencing = fencing  # cluster mode: lost leases and an unreachable database
        # busy_mode collect/interrupt: messages queued behind a running turn are answered together
        self.lanes: Lanes[Job] = Lanes(
            self.run_lane,
            max_queued=cfg.limits.max_queued_turns,
            coalesce=mergeable if cfg.limits.busy_mode != "queue" else None,
            coalesce_wait_s=cfg.limits.coalesce_burst_ms / 1000,
        )
        self.stopping = asyncio.Event()  # set by the runtime's stop(): held lanes stop waiting to retry

    async def run_lane(self, key: str, jobs: list[Job]) -> None:
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
                delay = backoff_delay(failures, self.cfg.delivery.retry_initial_s, self.cfg.delivery.retry_max_s)
                await self._turn_failed(exc, last, failures, delay, tlog)
                try:  # a stop ends the wait
                    await asyncio.wait_for(self.stopping.wait(), delay)
                except TimeoutError:
                    pass
                if self.stopping.is_set():  # pending in gateway.db, answered after the next start
                    tlog.info("stopping; the failed turn's messages stay pending for the next start")
                    return
        outcome, result = answer.outcome, answer.result
        if result is not None and result.kind == "reply" and not result.replayed and not result.interrupted:
            self.reviews.after_reply(
                last.msg, lane, place_of(last.msg, lane), result, last_chunk=chunk_ids[-1] if chunk_ids else None
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
        # cluster mode: PostgreSQL unreachable is a storage fault too (the lane waits and retries)
        fault = storage_fault(exc) or (self.fencing.database_fault(exc) if self.fencing is not None else None)
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

    async def _answer(self, key: str, jobs: list[Job], tlog: logging.LoggerAdapter) -> Answer:
        """Run the reminder, command or agent turn of `jobs`. Raises LaneMoved, LeaseLost and
        every other failure: the caller keeps the messages pending and retries the turn."""
        first, last = jobs[0], jobs[-1]
        lane, place = first.lane, place_of(first.msg, first.lane)
        platform = first.msg.platform
        reminder = is_reminder(first.msg)
        self.metrics.in_flight.add(1, platform=platform)
        typing = asyncio.create_task(self.replies.keep_typing(last.msg))
        command = None if reminder else parse_command(first.msg.text)
        streamer: StreamingReply | None = None
        try:
            async with self.linking.use(first.msg, lane) as profile:
                if lane.principal not in profile.principals and lane.kind == "person":
                    await asyncio.to_thread(profile.add_principal, lane.principal)
                if reminder:
                    text = await self._record_reminder(profile, lane, place, first.msg)
                    return Answer(text, "notice", "replied", reply=False)
                if command is not None:
                    spec, args = command
                    ctx = CommandContext(
                        self.commands,
                        first.msg,
                        lane,
                        place,
                        profile,
                        args,
                        chat_admin=self._chat_admin_check(first.msg),
                    )
                    return Answer(await run_command(spec.name, ctx), "reply", "replied")
                # attachments and reply quotes, stored in this lane's own profile (gateway/media.py)
                charge = await self._audio_charge(profile, lane, jobs)
                agent = await self.agents.of(profile)  # the model the tenant chose (agent/agents.py)
                try:
                    prepared = [
                        await self.media.prepare(
                            j.msg,
                            self.adapters.get(j.msg.platform),
                            profile.store_files,
                            input_uid(j.msg),
                            profile.guard,
                            charge,
                            vision=agent.settings.llm.vision,
                        )
                        for j in jobs
                    ]
                except BudgetExceeded as over:  # no transcription over the budget: said once per period
                    return Answer(over.text if over.say else "", "notice", "over_budget")
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
                    return Answer("\n\n".join(notices) or "I couldn't read that.", "error", "refused")
                for notice in notices:
                    await self.replies.send(last.msg, notice, kind="notice", reply=False)
                speaker = await self._speaker(jobs, place)
                stop = self.running.begin(key)
                streamer = await self.replies.streaming_reply(last.msg, [j.msg for j in jobs])
                try:
                    result = await agent.run_turn(
                        profile,
                        lane,
                        place,
                        inputs,
                        notify=Notifier(self.replies, last.msg),
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
                        speaker=speaker,
                        confirm=self.confirmations.gate_for(last.msg, key, stop),
                    )
                finally:
                    self.running.end(key, stop)
                    await streamer.close() if streamer is not None else None
                if result.kind == "covered":  # a replayed part of a coalesced batch: answered already
                    return Answer("", "reply", "coalesced", result=result)
                if result.kind == "refused":  # budget used up: said once per period, else finished quietly
                    return Answer(result.text, "notice", "over_budget", result=result)
                if result.kind == "error":
                    if result.error == "no_descriptors":  # ours, not the model's: shed idle profiles, retry
                        raise OSError(errno.EMFILE, "too many open files (no socket to the model)")
                    if result.error in MODEL_DOWN_KINDS and platform != "console":
                        # not the message's fault: held and retried (the console's person reads the error)
                        raise ModelDown(result.error or "")
                    return Answer(result.text, "error", "llm_error", result=result, streamer=streamer)
                if result.interrupted:  # the partial answer (if any) is shown marked as stopped
                    text = f"{result.text}\n\n(stopped)" if result.text else ""
                    return Answer(text, "reply", "stopped", result=result, streamer=streamer)
                text = await self._first_page(lane, result.text)
                return Answer(text, "reply", "replied", result=result, streamer=streamer)
        except (LaneMoved, LeaseLost):
            raise
        except Exception as exc:
            if caused_by(exc, LeaseLost):  # a store or tool wrapped it
                raise LeaseLost(str(exc)) from exc
            raise
        finally:
            typing.cancel()
            self.metrics.in_flight.add(-1, platform=platform)

    async def _audio_charge(self, profile: Profile, lane: Lane, jobs: list[Job]) -> AudioCharge | None:
        """Transcription's price for this lane's tenant, when it has one and audio came."""
        price = self.cfg.transcription.price_per_minute
        audio = any(kind_of(a.type, a.name, a.mime_type) == "audio" for j in jobs for a in j.msg.attachments)
        if not price or not audio:
            return None
        meter = self.agents.default.meter  # one meter for every model
        return AudioCharge(meter, await meter.payer(profile, lane), price)

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
        self, msg: InboundMessage, answer: Answer, finish: Sequence[tuple[InboundMessage, str]]
    ) -> list[int]:
        """Record the answer (and the turn's completion) in the outbox; its chunk ids. A
        streamed draft in the chat is edited into the final text, in the same transaction."""
        streamer = answer.streamer
        if streamer is None or not streamer.started:
            return await self.replies.send(msg, answer.text, kind=answer.kind, reply=answer.reply, finish=finish)
        drafts = []
        for i, (handle, chunk) in enumerate(streamer.placement(answer.text or "(stopped)")):
            drafts.append(
                Draft(
                    platform=msg.platform,
                    chat_id=msg.chat_id,
                    thread_id=msg.thread_id,
                    text=chunk,
                    kind=answer.kind,
                    # an edit whose draft cannot be edited is sent new, replying as the draft did
                    reply_to=msg.message_id if (answer.reply and i == 0) else None,
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
            await self.replies.send(msg, text, kind="notice", reply=False)
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

    async def _record_reminder(self, profile: Profile, lane: Lane, place: ChatPlace, msg: InboundMessage) -> str:
        """Keep a due reminder in the lane's history (once, by its uid), return its text."""
        session_id = await (await self.agents.of(profile)).open_session(profile, lane, place)
        history = await profile.sessions.history(session_id)
        stored = delivered_message(session_id, msg, delivery_text(msg, self.reminders.clock()))
        for m in history:
            if m.uid == stored.uid:
                return m.content or stored.content or ""
        await profile.sessions.append(stored)
        return stored.content or ""

    async def _speaker(self, jobs: list[Job], place: ChatPlace) -> Speaker:
        """Who the turn's tools serve: a batch of several people's messages gets only what
        every one of them may use (gateway/commands.py `speaker_of`)."""
        senders = {j.msg.principal: j.msg for j in jobs}
        checks = [self._chat_admin_check(m) for m in senders.values()]
        return await speaker_of(self.commands.access, list(senders), place, checks, self._ask_chat_admin)

    def _chat_admin_check(self, msg: InboundMessage) -> Callable[[], Awaitable[bool]] | None:
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
                await self.refuse(job.msg, "busy", BUSY)

    def _fenced_turn(self, key: str, lane: Lane, lost: LeaseLost, tlog: logging.LoggerAdapter) -> None:
        """A turn whose tenant lease went: nothing of it was committed; the lane's queued
        jobs are dropped (their messages stay pending for the lease's new holder) and the
        profile is closed."""
        dropped = self.lanes.discard(key)
        tlog.warning("turn stopped, nothing committed: %s", lost, extra={"event": "turn_fenced", "dropped": dropped})
        if self.fencing is not None:
            self.fencing.fenced()
        self.background.run(close_profile(self.profiles, lane.tenant_id))
