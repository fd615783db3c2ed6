"""One turn of one tenant's agent: persist the input, call the model with tools, persist
every message (user, assistant, tool) through the session store's dual write."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from agent.compression import Compressor
from agent.context import Notify, OnText, TurnContext
from agent.llm import ChatResult, ContextLengthExceeded, LLMClient, LLMError
from agent.media import inline_images
from agent.memory import MemoryStore
from agent.messages import StoredMessage
from agent.metering import BudgetExceeded, Meter, StoreLedger, estimate_stored_tokens
from agent.persona import BY_PERSON, lane_persona
from agent.profile import Profile
from agent.prompt import ChatPlace, build_system_prompt
from agent.provenance import prompt_sources, record, tool_run
from agent.providers import ProviderAccess, provider_access
from agent.reminders import ReminderChat, ReminderStore, ReminderTool
from agent.review import Reviewer, ReviewState
from agent.sessions import WriteRefused
from agent.skills import SkillStore, render_skill_index
from agent.tokens import TokenCounter
from agent.toolkit import DEFAULT_SERVICES, ConfirmGate, Speaker, ToolServices
from agent.tools import ToolBox
from agent.visibility import RULES_VERSION, lane_scope
from core.lanes import Lane
from core.settings import AgentSettings

log = logging.getLogger("hermes.agent")


async def _no_notice(kind: str, text: str) -> None:
    return None


STOPPED_MARKER = "[stopped by the user before answering]"
EMPTY_ANSWER = "The model sent an empty answer; please ask again, perhaps in other words."
NO_TOOL_ANSWER = (
    "The model used its tools for this request as many times as allowed without writing an answer; "
    "please ask again, perhaps in smaller steps."
)


def cut_notice(seconds: float) -> str:
    """What the person reads under an answer the deadline ended (docs/operator-guide.md#runaway-answers-and-long-replies)."""
    return f"(The answer was cut: the model was still writing after {seconds:g} seconds.)"


class TurnInterrupted(Exception):
    """The turn's stop event fired while the model was generating."""


@dataclass(frozen=True)
class UserInput:
    """One person's message entering a turn; `uid` is derived from the platform message,
    so a message replayed after a crash is stored once."""

    uid: str
    text: str
    user_name: str = ""
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class TurnResult:
    text: str
    kind: str  # "reply" | "error" | "covered" (answered as part of a later message's turn) | "refused" (budget)
    session_id: str
    replayed: bool = False
    tool_iterations: int = 0  # model requests of this turn that called tools (skill nudges)
    interrupted: bool = False  # stopped by /stop or busy_mode interrupt; `text` is the partial answer
    error: str | None = None  # kind "error": the LLMError kind ("unavailable", "bad_request", ...)


class Agent:
    """Runs turns for any tenant; holds no per-tenant state itself."""

    def __init__(
        self,
        settings: AgentSettings,
        llm: LLMClient,
        tokens: TokenCounter,
        *,
        meter: Meter | None = None,
        review_state: ReviewState | None = None,
        tools: ToolServices = DEFAULT_SERVICES,
    ) -> None:
        self.settings = settings
        self.tools = tools  # the tool rules and the shared web and MCP clients (agent/toolkit.py)
        self.llm = llm
        self.tokens = tokens
        # every model call goes through the meter: budgets, ledger, fair share (agent/metering.py)
        self.meter = meter or Meter(settings.llm)
        self.compression = Compressor(settings, llm, tokens, system_factory=self._system_for, meter=self.meter)
        self.compression.on_flush = self._flush_before_compression
        self.reviewer = Reviewer(
            settings,
            llm,
            wire=self.compression.wire,
            toolbox=self._review_toolbox,
            meter=self.meter,
            state=review_state,
        )
        # set by the gateway: records a tenant's next reminder due time in its index
        self.reminder_index: Callable[[str, float | None, bool], Awaitable[None]] | None = None

    # ----- sessions -------------------------------------------------------------------
    def lane_memory(self, profile: Profile, lane: Lane) -> MemoryStore | None:
        """The memory store this lane may use: the profile's, a view limited to the entries
        the lane's audience may see (read-only under `read`), or none."""
        mem_cfg = self.settings.memory
        if not (mem_cfg.memory_enabled or mem_cfg.user_profile_enabled):
            return None
        if lane.personal_memory == "off":
            return None
        scope = lane_scope(lane.kind, lane.private)
        if lane.personal_memory == "read" or scope is not profile.memory.scope:
            return MemoryStore(
                profile.path,
                mem_cfg.memory_char_limit,
                mem_cfg.user_char_limit,
                read_only=lane.personal_memory == "read",
                scope=scope,
                guard=profile.memory.guard,
                files=profile.memory.files,
            )
        return profile.memory

    def lane_skills(self, profile: Profile, lane: Lane) -> SkillStore | None:
        """Skills follow the lane's memory mode: written in `full`, only read in `read`, none in `off`."""
        if lane.personal_memory == "off" or not self.settings.skills.enabled:
            return None
        return SkillStore(
            profile.path, read_only=lane.personal_memory != "full", guard=profile.guard, files=profile.files
        )

    def toolbox(
        self,
        profile: Profile,
        lane: Lane,
        place: ChatPlace,
        memory: MemoryStore | None,
        chat: ReminderChat | None = None,
        *,
        speaker: Speaker | None = None,
        confirm: ConfirmGate | None = None,
    ) -> ToolBox:
        """The tools of a turn (and of a review) in this lane, bound to the tenant's stores
        and to who speaks (`speaker`, else as the place says: a DM or not)."""
        group = place.chat_type != "dm"
        return ToolBox(
            sessions=profile.sessions,
            memory=memory,
            search_lane=lane.session_key if group else None,
            skills=self.lane_skills(profile, lane),
            shared=group or place.shared,
            write_approval=self.settings.memory.write_approval,
            reminders=self._reminder_tool(profile, chat, group),
            services=self.tools,
            speaker=speaker if speaker is not None else Speaker(dm=not group and not place.shared),
            tenant=profile.tenant_id,
            confirm=confirm,
            agent_name=self.settings.agent_name,
        )

    def _reminder_tool(self, profile: Profile, chat: ReminderChat | None, group: bool) -> ReminderTool | None:
        hook = self.reminder_index
        if chat is None or hook is None or not self.settings.reminders.enabled:
            return None
        tenant = profile.tenant_id

        async def index(due: float | None, lower_only: bool) -> None:
            await hook(tenant, due, lower_only)

        return ReminderTool(
            ReminderStore(profile.store_files, profile.guard),
            chat,
            self.settings.reminders.max_per_tenant,
            index,
            group,
        )

    def _review_toolbox(self, profile: Profile, lane: Lane, place: ChatPlace, only: frozenset[str]) -> ToolBox:
        box = self.toolbox(profile, lane, place, self.lane_memory(profile, lane))
        box.only = only
        return box

    async def _system_for(self, session_id: str, place: ChatPlace, ctx: TurnContext) -> StoredMessage:
        return await self.system_message(
            session_id,
            place,
            ctx.memory,
            self.lane_skills(ctx.profile, ctx.lane),
            await self.lane_persona(ctx.profile, ctx.lane, place),
        )

    async def lane_persona(self, profile: Profile, lane: Lane, place: ChatPlace) -> tuple[str, str] | None:
        """The persona this lane's prompt gets: a person's own text only in their DM."""
        private = lane.kind == "person" and place.chat_type == "dm"
        return lane_persona(await profile.persona(), self.settings.personas, private=private)

    def _prompt_rule(self, place: ChatPlace, memory: MemoryStore | None, persona: tuple[str, str] | None) -> str:
        """Everything besides the entries that decides what a snapshot holds: when it
        changes (memory mode, visibility rule, audience) the session's prompt is rebuilt."""
        mode = "off" if memory is None else "read" if memory.read_only else "full"
        scope = memory.scope.name if memory is not None else "-"
        mem = self.settings.memory
        place_hash = hashlib.sha256(place.describe().encode("utf-8", "surrogatepass")).hexdigest()[:12]
        rule = (
            f"v{RULES_VERSION}|{mode}|{scope}|m{int(mem.memory_enabled)}u{int(mem.user_profile_enabled)}|{place_hash}"
        )
        if persona is not None:  # only then: a prompt without one keeps the rule it had
            rule += "|p" + hashlib.sha256("\0".join(persona).encode("utf-8", "surrogatepass")).hexdigest()[:12]
        return rule

    async def system_message(
        self,
        session_id: str,
        place: ChatPlace,
        memory: MemoryStore | None,
        skills: SkillStore | None = None,
        persona: tuple[str, str] | None = None,
    ) -> StoredMessage:
        """A fresh system prompt with a frozen snapshot of the memory files (and the skill
        index this place may see) as they are now."""
        mem = self.settings.memory
        snapshot = await memory.load_snapshot() if memory is not None else None
        if snapshot is not None:
            snapshot = type(snapshot)(
                memory=snapshot.memory if mem.memory_enabled else (),
                user=snapshot.user if mem.user_profile_enabled else (),
                keys=snapshot.keys,
                memory_keys=snapshot.memory_keys if mem.memory_enabled else (),
                user_keys=snapshot.user_keys if mem.user_profile_enabled else (),
            )
        skill_index = None
        listed: list[str] = []
        if skills is not None:
            infos = await skills.index(shared_only=place.chat_type != "dm")
            skill_index = render_skill_index(infos)
            listed = [s.name for s in infos]
        text = build_system_prompt(
            agent_name=self.settings.agent_name,
            place=place,
            snapshot=snapshot,
            memory_char_limit=mem.memory_char_limit,
            user_char_limit=mem.user_char_limit,
            memory_writable=memory is not None and not memory.read_only and mem.write_approval != "block",
            skill_index=skill_index,
            skills_writable=skills is not None and not skills.read_only,
            persona=persona,
        )
        stamp = {
            "rule": self._prompt_rule(place, memory, persona),
            "keys": sorted(snapshot.keys) if snapshot is not None else [],
        }
        # what the prompt holds, as references: every answer's provenance starts from them
        sources = prompt_sources(snapshot, listed, persona, own_persona=persona is not None and persona[0] == BY_PERSON)
        msg = StoredMessage(
            session_id=session_id, role="system", content=text, meta={"memory_stamp": stamp, "sources": sources}
        )
        self.tokens.count_message(msg)
        return msg

    async def open_session(self, profile: Profile, lane: Lane, place: ChatPlace) -> str:
        """The lane's live session, started (with its system prompt) if there is none."""
        session_id, created = await profile.sessions.get_or_start(
            lane.session_key, source=place.platform, user_id=lane.principal, model=self.settings.llm.model
        )
        if created:
            await profile.sessions.append(await self._fresh_system(session_id, profile, lane, place))
        return session_id

    async def _fresh_system(self, session_id: str, profile: Profile, lane: Lane, place: ChatPlace) -> StoredMessage:
        return await self.system_message(
            session_id,
            place,
            self.lane_memory(profile, lane),
            self.lane_skills(profile, lane),
            await self.lane_persona(profile, lane, place),
        )

    async def _refresh_prompt(
        self, profile: Profile, lane: Lane, place: ChatPlace, session_id: str, history: list[StoredMessage]
    ) -> bool:
        """Rebuild the session's system prompt when its snapshot was taken under another
        memory mode, visibility rule or persona, or holds an entry since forgotten or unshared.
        The new prompt is appended and the old one flagged (nothing rewritten in place);
        new entries alone do not rebuild it, so the prompt prefix stays stable.
        True when it was rebuilt (the caller reloads the history)."""
        system = next((m for m in history if m.role == "system"), None)
        memory = self.lane_memory(profile, lane)
        persona = await self.lane_persona(profile, lane, place)
        stamp = system.meta.get("memory_stamp") if system is not None else None
        if isinstance(stamp, dict) and stamp.get("rule") == self._prompt_rule(place, memory, persona):
            keys = set(stamp.get("keys") or [])
            if not keys:
                return False
            live = await memory.load_snapshot() if memory is not None else None
            if live is not None and keys <= live.keys:
                return False
        fresh = await self.system_message(session_id, place, memory, self.lane_skills(profile, lane), persona)
        if system is not None:
            fresh.meta["replaces"] = system.uid
        await profile.sessions.compact(
            session_id, [system.uid] if system is not None else [], [fresh], reason="prompt_rebuild"
        )
        log.info("system prompt rebuilt (memory mode, visibility, persona or forgotten entry)")
        return True

    async def new_session(self, profile: Profile, lane: Lane, place: ChatPlace, reason: str = "new") -> str:
        """End the lane's session (if any) and route the lane to a fresh one (/new)."""
        old = await profile.sessions.route(lane.session_key)
        kwargs: dict[str, Any] = {"source": place.platform, "user_id": lane.principal, "model": self.settings.llm.model}
        if old is None:
            session_id = await profile.sessions.start_session(lane.session_key, **kwargs)
        else:
            await self.flush(profile, lane, place, await profile.sessions.history(old))
            session_id = await profile.sessions.rotate(lane.session_key, old, reason, **kwargs)
            self.reviewer.session_ended(lane)
        await profile.sessions.append(await self._fresh_system(session_id, profile, lane, place))
        return session_id

    async def flush(self, profile: Profile, lane: Lane, place: ChatPlace, history: list[StoredMessage]) -> None:
        """A session ends: review it once first when it has `memory.flush_min_turns` turns no
        review has seen (bounded by the review timeout; a failure never stops the caller)."""
        if self.reviewer.flush_due(lane, history):
            await self.reviewer.review(
                profile, lane, place, history, memory=True, skills=False, trigger="flush", wait=True
            )

    async def _flush_before_compression(self, ctx: TurnContext, history: list[StoredMessage]) -> None:
        await self.flush(ctx.profile, ctx.lane, ctx.place, history)

    def threshold_tokens(self) -> int:
        """Prompt tokens at which automatic compression starts (see agent/compression.py)."""
        return self.compression.threshold_tokens()

    async def compress_now(self, profile: Profile, lane: Lane, place: ChatPlace, focus: str | None = None) -> str:
        """Manual /compress [focus <topic>]: compress the lane's session now (ignoring cooldowns
        and the anti-thrash block) and say what happened."""
        session_id = await profile.sessions.route(lane.session_key)
        if session_id is None:
            return "There's no conversation to compress yet."
        ctx = TurnContext(
            profile=profile,
            lane=lane,
            place=place,
            session_id=session_id,
            memory=self.lane_memory(profile, lane),
            notify=_no_notice,
            provider_access=self.provider_access(lane),
            payer=await self.meter.payer(profile, lane),
        )
        history = await profile.sessions.history(session_id)
        try:
            outcome = await self.compression.compress_guarded(ctx, history, trigger="manual", focus=focus)
        except BudgetExceeded as over:
            return over.text
        return outcome.feedback()

    # ----- the turn -------------------------------------------------------------------
    async def run_turn(
        self,
        profile: Profile,
        lane: Lane,
        place: ChatPlace,
        inputs: list[UserInput],
        notify: Notify = _no_notice,
        *,
        stop: asyncio.Event | None = None,
        on_text: OnText | None = None,
        chat: ReminderChat | None = None,
        speaker: Speaker | None = None,
        confirm: ConfirmGate | None = None,
    ) -> TurnResult:
        """Answer `inputs`. `stop` ends the turn early (the partial answer is kept, flagged
        `interrupted`); `on_text` makes the model stream and gets the answer so far;
        `speaker` decides which tools are offered and `confirm` asks the person to allow a
        call (docs/concepts.md#tools)."""
        session_id = await self.open_session(profile, lane, place)
        payer = await self.meter.payer(profile, lane)
        # over the budget: nothing is stored, no model call is made (docs/concepts.md#budgets);
        # a ledger in the profile checks in the write of the person's message, below
        ledger = payer.ledger
        if not isinstance(ledger, StoreLedger):
            try:
                await self.meter.check(payer)
            except BudgetExceeded as over:
                return _refused(over, "", session_id)
        store = profile.sessions
        history = await store.history(session_id)
        if await self._refresh_prompt(profile, lane, place, session_id, history):
            history = await store.history(session_id)
        known = {m.uid for m in history} | {m.meta.get("copied_from") for m in history}
        fresh = [i for i in inputs if i.uid not in known]
        taken = [i.uid for i in inputs if i.uid in known]
        # the inputs stored before were taken by turns that crashed before their answers were
        # recorded (an input is only replayed while pending, and an answer is recorded with its
        # input's completion), so every answer stored after them is unsent: all go out, in order
        earlier = "\n\n".join(self._stored_answers(history, set(taken)))
        resume = False
        if taken and not fresh:
            if self._followed_by_user(history, taken[-1]):
                # the batch's last message was collected with a later one, whose turn answers it
                if not earlier:
                    return TurnResult("", "covered", session_id, replayed=True)
                return TurnResult(earlier, "reply", session_id, replayed=True)
            if self._answer_after(history, taken[-1]) is not None:
                return TurnResult(earlier, "reply", session_id, replayed=True)
            # the last one was never answered (crashed mid-turn): answered below, after `earlier`
        elif taken:
            # new inputs were collected with the stored ones: if the last stored one was never
            # answered (crashed mid tool loop), it is finished first, then the new ones answered
            resume = self._answer_after(history, taken[-1]) is None and not self._followed_by_user(history, taken[-1])
        ctx = TurnContext(
            profile=profile,
            lane=lane,
            place=place,
            session_id=session_id,
            memory=self.lane_memory(profile, lane),
            notify=notify,
            stop=stop,
            on_text=on_text,
            chat=chat,
            provider_access=self.provider_access(lane),
            payer=payer,
            speaker=speaker,
            confirm=confirm,
        )
        if resume:
            try:
                earlier = _joined(earlier, await self._tool_loop(ctx, history))
            except BudgetExceeded as over:
                return _refused(over, earlier, ctx.session_id)
            except LLMError as err:
                log.warning("turn failed: llm %s", err.kind)
                return TurnResult(_joined(earlier, err.user_message), "error", ctx.session_id, error=err.kind)
            if ctx.interrupted:
                return TurnResult(
                    earlier, "reply", ctx.session_id, tool_iterations=ctx.tool_iterations, interrupted=True
                )
        new_msgs = []
        for item in fresh:
            content = f"[{item.user_name}]: {item.text}" if place.shared and item.user_name else item.text
            msg = StoredMessage(session_id=session_id, role="user", content=content, uid=item.uid, meta=dict(item.meta))
            self.tokens.count_message(msg)
            new_msgs.append(msg)
        if new_msgs:
            # the first call's reservation rides in this write: one storage call, not two
            ahead = None
            if isinstance(ledger, StoreLedger):
                max_out = self.settings.llm.answer_max_tokens()
                ahead = self.meter.ahead(payer, self.llm, estimate_stored_tokens([*history, *new_msgs]), max_out)
            try:
                await store.append_many(new_msgs, gate=ledger.reserving(ahead) if ahead is not None else None)
            except WriteRefused:
                assert ahead is not None
                try:
                    await self.meter.refuse(payer, ahead)
                except BudgetExceeded as over:
                    return _refused(over, earlier, session_id)
            history.extend(new_msgs)
            ctx.reserved = ahead
        try:
            ctx.recall = await self._prefetch(ctx, "\n".join(i.text for i in fresh or inputs))
            text = await self._tool_loop(ctx, history)
        except BudgetExceeded as over:
            return _refused(over, earlier, ctx.session_id)
        except LLMError as err:
            log.warning("turn failed: llm %s", err.kind)
            return TurnResult(_joined(earlier, err.user_message), "error", ctx.session_id, error=err.kind)
        finally:
            if ctx.reserved is not None:  # no call used it (stopped, or failed before the call)
                reserved, ctx.reserved = ctx.reserved, None
                await self.meter.release(payer, reserved)
        if ctx.interrupted:
            text = _joined(earlier, text)
            return TurnResult(text, "reply", ctx.session_id, tool_iterations=ctx.tool_iterations, interrupted=True)
        if profile.provider is not None and ctx.provider_access.write:
            user_text = "\n".join(i.text for i in inputs)
            try:
                await profile.provider.sync_turn(user_text, text, visibility=ctx.provider_access.mark)
            except Exception:  # a provider must never break a turn
                log.exception("memory provider sync_turn failed")
        return TurnResult(_joined(earlier, text), "reply", ctx.session_id, tool_iterations=ctx.tool_iterations)

    def provider_access(self, lane: Lane) -> ProviderAccess:
        """What `lane` may do with its tenant's memory provider (mode and audience)."""
        return provider_access(lane.personal_memory, lane_scope(lane.kind, lane.private))

    async def _prefetch(self, ctx: TurnContext, query: str) -> str:
        """The provider's recall for this turn's input, limited to what the lane may see."""
        provider, access = ctx.profile.provider, ctx.provider_access
        if provider is None or not access.read or not query.strip():
            return ""
        try:
            return (await provider.prefetch(query, shared_only=access.shared_only) or "").strip()
        except Exception:  # a provider must never break a turn
            log.exception("memory provider prefetch failed")
            return ""

    def _wire(self, ctx: TurnContext, history: list[StoredMessage]) -> list[dict[str, Any]]:
        """The request messages; the turn's recall rides on the last user message (never stored)."""
        wire = self.compression.wire(history)
        if ctx.recall:
            for i in range(len(wire) - 1, -1, -1):
                if wire[i].get("role") == "user" and isinstance(wire[i].get("content"), str):
                    wire[i] = {**wire[i], "content": f"{wire[i]['content']}\n\n[Recalled from memory:\n{ctx.recall}]"}
                    break
        return wire

    @staticmethod
    def _followed_by_user(history: list[StoredMessage], uid: str) -> bool:
        """True when a later user message follows message `uid` before any answer."""
        seen = False
        for m in history:
            if uid in (m.uid, m.meta.get("copied_from")):
                seen = True
            elif seen and m.role == "user":
                return True
            elif seen and m.role == "assistant" and not m.tool_calls and m.content:
                return False
        return False

    @staticmethod
    def _stored_answers(history: list[StoredMessage], uids: set[str]) -> list[str]:
        """The final answers stored after any of the messages `uids`, in history order: for
        each, the last one before the next user message (as `_answer_after` finds it)."""
        answers: dict[int, str] = {}
        owner: int | None = None
        for i, m in enumerate(history):
            if m.role == "user":
                owner = i if (m.uid in uids or m.meta.get("copied_from") in uids) else None
            elif owner is not None and m.role == "assistant" and not m.tool_calls and m.content:
                answers[owner] = m.content
        return list(answers.values())

    @staticmethod
    def _answer_after(history: list[StoredMessage], uid: str) -> str | None:
        """The final assistant answer already stored after message `uid` (before the next
        user message), if any."""
        seen = False
        answer = None
        for m in history:
            if uid in (m.uid, m.meta.get("copied_from")):
                seen = True
            elif seen and m.role == "user":
                return answer
            elif seen and m.role == "assistant" and not m.tool_calls and m.content:
                answer = m.content
        return answer

    async def _tool_loop(self, ctx: TurnContext, history: list[StoredMessage]) -> str:
        toolbox = self.toolbox(
            ctx.profile, ctx.lane, ctx.place, ctx.memory, ctx.chat, speaker=ctx.speaker, confirm=ctx.confirm
        )
        store = ctx.profile.sessions
        max_iter = self.settings.max_tool_iterations
        for iteration in range(max_iter + 1):
            tools = await toolbox.schemas() if iteration < max_iter else None
            try:
                if ctx.stop is not None and ctx.stop.is_set():
                    raise TurnInterrupted()
                result = await self._call_llm(ctx, history, tools)
            except TurnInterrupted:
                return await self._keep_partial(ctx, history)
            if result.usage is not None:
                await store.add_usage(ctx.session_id, result.usage.prompt_tokens, result.usage.completion_tokens)
            assistant = StoredMessage(
                session_id=ctx.session_id,
                role="assistant",
                content=result.content,
                tool_calls=result.tool_calls if tools else None,
                finish_reason=result.finish_reason,
            )
            self.tokens.count_message(assistant)
            if not assistant.tool_calls:
                text = (result.content or "").strip()
                if not text:
                    text = NO_TOOL_ANSWER if iteration == max_iter and iteration > 0 else EMPTY_ANSWER
                    assistant.meta["no_answer"] = True
                assistant.content = text
                if result.cut:  # kept as written, flagged; the person is told it was cut
                    assistant.meta["cut"] = True
                assistant.meta["provenance"] = self._provenance(ctx, history)
                await store.append(assistant)  # the turn's last write: the provenance rides in it
                history.append(assistant)
                if result.cut:
                    return f"{text}\n\n{cut_notice(self.settings.llm.answer_timeout_s)}"
                return text
            ctx.tool_iterations += 1
            outputs = [assistant]
            for call in assistant.tool_calls:
                fn = call.get("function", {})
                name, args = fn.get("name", ""), fn.get("arguments")
                out, outcome = await toolbox.run(name, args)
                ctx.runs.append(tool_run(name, outcome, out))
                if name == "memory" and ctx.profile.provider is not None:
                    await self._provider_memory_write(ctx, args, out)
                tool_msg = StoredMessage(
                    session_id=ctx.session_id, role="tool", content=out, tool_call_id=call.get("id"), tool_name=name
                )
                self.tokens.count_message(tool_msg)
                outputs.append(tool_msg)
            await store.append_many(outputs)
            history.extend(outputs)
            ctx.partial = ""
        return "(no answer)"  # unreachable: the last iteration offers no tools

    def _provenance(self, ctx: TurnContext, history: list[StoredMessage]) -> dict[str, Any]:
        """What went into the answer about to be stored (references only; it rides in the
        answer's own write, docs/concepts.md#why-an-answer-said-what-it-said); the tool runs
        recorded so far belong to it, the next answer of the turn starts afresh."""
        runs, ctx.runs = ctx.runs, []
        return record(history, runs, scope=lane_scope(ctx.lane.kind, ctx.lane.private), recalled=bool(ctx.recall))

    async def _keep_partial(self, ctx: TurnContext, history: list[StoredMessage]) -> str:
        """The turn was stopped: store what the model had written so far (flagged
        `interrupted`, never a tool call, so no call is left without its result)."""
        ctx.interrupted = True
        text = ctx.partial.strip()
        # without a partial answer a marker is stored, so the next turn does not answer the
        # stopped request as if it were still open
        msg = StoredMessage(
            session_id=ctx.session_id,
            role="assistant",
            content=text or STOPPED_MARKER,
            finish_reason="interrupted",
            meta={"interrupted": True, "provenance": self._provenance(ctx, history)},
        )
        self.tokens.count_message(msg)
        await ctx.profile.sessions.append(msg)  # the turn's last write
        history.append(msg)
        return text

    async def _model_call(
        self, ctx: TurnContext, request: list[dict[str, Any]], tools: list[dict] | None
    ) -> ChatResult:
        """The HTTP request alone, raced against the stop event: stopping cancels only the
        request (nothing is being written then), never a store write."""
        kwargs: dict[str, Any] = {}
        if ctx.on_text is not None:
            ctx.partial = ""
            report = ctx.on_text

            def on_text(text: str) -> None:
                ctx.partial = text
                report(text)

            kwargs["on_text"] = on_text
        reserved, ctx.reserved = ctx.reserved, None
        call = asyncio.ensure_future(
            self.meter.chat(
                ctx.payer,
                self.llm,
                request,
                notify=ctx.notify,
                reserved=reserved,
                tools=tools,
                max_tokens=self.settings.llm.answer_max_tokens(),
                **kwargs,
            )
        )
        if ctx.stop is None:
            return await call
        stopper = asyncio.ensure_future(ctx.stop.wait())
        try:
            await asyncio.wait({call, stopper}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopper.cancel()
            if not call.done():
                call.cancel()
                with contextlib.suppress(BaseException):
                    await call
        if call.cancelled():
            raise TurnInterrupted()
        return call.result()

    async def _provider_memory_write(self, ctx: TurnContext, args: Any, result: str) -> None:
        """Mirror a successful built-in memory write to the external provider."""
        if ctx.profile.provider is None or not ctx.provider_access.write:  # the caller checks the provider
            return
        try:
            if not json.loads(result).get("success"):
                return
            data = json.loads(args) if isinstance(args, str) else dict(args or {})
            action = str(data.get("action", ""))
            text = data.get("old_text") if action == "remove" else data.get("content")
            await ctx.profile.provider.on_memory_write(
                action, str(data.get("target", "")), str(text or ""), visibility=ctx.provider_access.mark
            )
        except Exception:
            log.exception("memory provider on_memory_write failed")

    async def _call_llm(self, ctx: TurnContext, history: list[StoredMessage], tools: list[dict] | None) -> ChatResult:
        """One model request for the current history.

        Before it, the prompt (estimate, or the server's last count) is checked against the
        compression threshold; a context-length error compresses and retries. Together at
        most `compression.max_attempts` compressions per turn. `history` is replaced in place
        by the compressed one (and `ctx.session_id` moves when a child session starts)."""
        comp = self.compression
        max_attempts = self.settings.compression.max_attempts
        while True:
            wire = self._wire(ctx, history)
            if ctx.compressions < max_attempts:
                outcome = await comp.before_request(ctx, history, wire)
                if outcome is not None and outcome.compressed:
                    ctx.compressions += 1
                    history[:] = outcome.history or []
                    wire = self._wire(ctx, history)
            try:
                # stored images become data: URLs only now, read from this profile's media/
                request = await inline_images(wire, ctx.profile.store_files)
                result = await self._model_call(ctx, request, tools)
            except ContextLengthExceeded as err:
                if comp.enabled and ctx.compressions < max_attempts:
                    ctx.compressions += 1
                    outcome = await comp.compress_guarded(ctx, history, trigger="context")
                    if outcome.compressed:
                        history[:] = outcome.history or []
                        continue
                err.user_message = (
                    "This conversation has grown too long for the model. Send /compress to shrink "
                    "it or /new to start a fresh one (your memory is kept)."
                )
                raise
            await comp.after_response(ctx, result.usage)
            return result


def _refused(over: BudgetExceeded, earlier: str, session_id: str) -> TurnResult:
    """The budget is used up: said once per period, later messages finished quietly."""
    return TurnResult(_joined(earlier, over.text if over.say else ""), "refused", session_id)


def _joined(earlier: str, text: str) -> str:
    """An answer stored earlier but never sent, ahead of this turn's answer."""
    return f"{earlier}\n\n{text}" if earlier and text else earlier or text
