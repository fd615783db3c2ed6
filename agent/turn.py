"""One turn of one tenant's agent: persist the input, call the model with tools, persist
every message (user, assistant, tool) through the session store's dual write."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from agent.compression import Compressor
from agent.llm import ContextLengthExceeded, LLMClient, LLMError
from agent.memory import MemoryStore
from agent.messages import StoredMessage
from agent.prompt import ChatPlace, build_system_prompt
from agent.tokens import TokenCounter
from agent.tools import ToolBox
from gateway.config import Config
from tenancy.keys import Lane
from tenancy.profiles import Profile

log = logging.getLogger("hermes.agent")

# (kind, text): kind is "progress" / "progress_done" (routine: shown only with
# compression.progress_notices; the second edits the first in place where possible),
# "warning" or "error" (always shown)
Notify = Callable[[str, str], Awaitable[None]]


async def _no_notice(kind: str, text: str) -> None:
    return None


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
    kind: str  # "reply" | "error" | "covered" (answered as part of a later message's turn)
    session_id: str
    replayed: bool = False


@dataclass
class TurnContext:
    """Everything one turn works on; passed explicitly, never stored globally."""

    profile: Profile
    lane: Lane
    place: ChatPlace
    session_id: str  # the live session; compression with in_place: false moves it to a child
    memory: MemoryStore | None
    notify: Notify
    compression_state: Any = None  # the session's CompressionState, loaded once per turn
    compressions: int = 0  # automatic compressions run in this turn (<= compression.max_attempts)


class Agent:
    """Runs turns for any tenant; holds no per-tenant state itself."""

    def __init__(self, cfg: Config, llm: LLMClient, tokens: TokenCounter) -> None:
        self.cfg = cfg
        self.llm = llm
        self.tokens = tokens
        self.compression = Compressor(cfg, llm, tokens, system_factory=self.system_message)

    # ----- sessions -------------------------------------------------------------------
    def lane_memory(self, profile: Profile, lane: Lane) -> MemoryStore | None:
        """The memory store this lane may use: the profile's, a read-only view, or none."""
        mem_cfg = self.cfg.memory
        if not (mem_cfg.memory_enabled or mem_cfg.user_profile_enabled):
            return None
        if lane.personal_memory == "off":
            return None
        if lane.personal_memory == "read":
            return MemoryStore(profile.path, mem_cfg.memory_char_limit, mem_cfg.user_char_limit, read_only=True)
        return profile.memory

    async def system_message(self, session_id: str, place: ChatPlace, memory: MemoryStore | None) -> StoredMessage:
        """A fresh system prompt with a frozen snapshot of the memory files as they are now."""
        snapshot = await memory.load_snapshot() if memory is not None else None
        if snapshot is not None:
            snapshot = type(snapshot)(
                memory=snapshot.memory if self.cfg.memory.memory_enabled else (),
                user=snapshot.user if self.cfg.memory.user_profile_enabled else (),
            )
        text = build_system_prompt(
            agent_name=self.cfg.agent_name, place=place, snapshot=snapshot,
            memory_char_limit=self.cfg.memory.memory_char_limit,
            user_char_limit=self.cfg.memory.user_char_limit,
            memory_writable=memory is not None and not memory.read_only,
        )
        msg = StoredMessage(session_id=session_id, role="system", content=text)
        self.tokens.count_message(msg)
        return msg

    async def open_session(self, profile: Profile, lane: Lane, place: ChatPlace) -> str:
        """The lane's live session, started (with its system prompt) if there is none."""
        session_id, created = await profile.sessions.get_or_start(
            lane.session_key, source=place.platform, user_id=lane.principal, model=self.cfg.llm.model)
        if created:
            await profile.sessions.append(await self.system_message(session_id, place, self.lane_memory(profile, lane)))
        return session_id

    async def new_session(self, profile: Profile, lane: Lane, place: ChatPlace, reason: str = "new") -> str:
        """End the lane's session (if any) and route the lane to a fresh one (/new)."""
        old = await profile.sessions.route(lane.session_key)
        kwargs = dict(source=place.platform, user_id=lane.principal, model=self.cfg.llm.model)
        if old is None:
            session_id = await profile.sessions.start_session(lane.session_key, **kwargs)
        else:
            session_id = await profile.sessions.rotate(lane.session_key, old, reason, **kwargs)
        await profile.sessions.append(await self.system_message(session_id, place, self.lane_memory(profile, lane)))
        return session_id

    def threshold_tokens(self) -> int:
        """Prompt tokens at which automatic compression starts (see agent/compression.py)."""
        return self.compression.threshold_tokens()

    async def compress_now(self, profile: Profile, lane: Lane, place: ChatPlace, focus: str | None = None) -> str:
        """Manual /compress [focus <topic>]: compress the lane's session now (ignoring cooldowns
        and the anti-thrash block) and say what happened."""
        session_id = await profile.sessions.route(lane.session_key)
        if session_id is None:
            return "There's no conversation to compress yet."
        ctx = TurnContext(profile=profile, lane=lane, place=place, session_id=session_id,
                          memory=self.lane_memory(profile, lane), notify=_no_notice)
        history = await profile.sessions.history(session_id)
        outcome = await self.compression.compress_guarded(ctx, history, trigger="manual", focus=focus)
        return outcome.feedback()

    # ----- the turn -------------------------------------------------------------------
    async def run_turn(self, profile: Profile, lane: Lane, place: ChatPlace, inputs: list[UserInput],
                       notify: Notify = _no_notice) -> TurnResult:
        session_id = await self.open_session(profile, lane, place)
        store = profile.sessions
        history = await store.history(session_id)
        known = {m.uid for m in history} | {m.meta.get("copied_from") for m in history}
        fresh = [i for i in inputs if i.uid not in known]
        if not fresh:
            if self._followed_by_user(history, inputs[-1].uid):
                # a replayed part of a coalesced batch: the batch's last message carries its answer
                return TurnResult("", "covered", session_id, replayed=True)
            replay = self._answer_after(history, inputs[-1].uid)
            if replay is not None:
                return TurnResult(replay, "reply", session_id, replayed=True)
        new_msgs = []
        for item in fresh:
            content = f"[{item.user_name}]: {item.text}" if place.shared and item.user_name else item.text
            msg = StoredMessage(session_id=session_id, role="user", content=content, uid=item.uid,
                                meta=dict(item.meta))
            self.tokens.count_message(msg)
            new_msgs.append(msg)
        if new_msgs:
            await store.append_many(new_msgs)
            history.extend(new_msgs)
        ctx = TurnContext(profile=profile, lane=lane, place=place, session_id=session_id,
                          memory=self.lane_memory(profile, lane), notify=notify)
        try:
            text = await self._tool_loop(ctx, history)
        except LLMError as err:
            log.warning("turn failed: llm %s", err.kind)
            return TurnResult(err.user_message, "error", ctx.session_id)
        if profile.provider is not None and lane.personal_memory == "full":
            user_text = "\n".join(i.text for i in inputs)
            try:
                await profile.provider.sync_turn(user_text, text)
            except Exception:  # a provider must never break a turn
                log.exception("memory provider sync_turn failed")
        return TurnResult(text, "reply", ctx.session_id)

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
    def _answer_after(history: list[StoredMessage], uid: str) -> str | None:
        """The final assistant answer already stored after message `uid`, if any."""
        seen = False
        answer = None
        for m in history:
            if uid in (m.uid, m.meta.get("copied_from")):
                seen = True
            elif seen and m.role == "user":
                answer = None
            elif seen and m.role == "assistant" and not m.tool_calls and m.content:
                answer = m.content
        return answer

    async def _tool_loop(self, ctx: TurnContext, history: list[StoredMessage]) -> str:
        toolbox = ToolBox(sessions=ctx.profile.sessions, memory=ctx.memory,
                          search_lane=None if ctx.place.chat_type == "dm" else ctx.lane.session_key)
        store = ctx.profile.sessions
        max_iter = self.cfg.limits.max_tool_iterations
        for iteration in range(max_iter + 1):
            tools = toolbox.schemas() if iteration < max_iter else None
            result = await self._call_llm(ctx, history, tools)
            if result.usage is not None:
                await store.add_usage(ctx.session_id, result.usage.prompt_tokens, result.usage.completion_tokens)
            assistant = StoredMessage(
                session_id=ctx.session_id, role="assistant", content=result.content,
                tool_calls=result.tool_calls if tools else None, finish_reason=result.finish_reason)
            self.tokens.count_message(assistant)
            if not assistant.tool_calls:
                text = (result.content or "").strip() or "(no answer)"
                assistant.content = text
                await store.append(assistant)
                history.append(assistant)
                return text
            outputs = [assistant]
            for call in assistant.tool_calls:
                fn = call.get("function", {})
                name, args = fn.get("name", ""), fn.get("arguments")
                out = await toolbox.call(name, args)
                if name == "memory" and ctx.profile.provider is not None:
                    await self._provider_memory_write(ctx, args, out)
                tool_msg = StoredMessage(session_id=ctx.session_id, role="tool", content=out,
                                         tool_call_id=call.get("id"), tool_name=name)
                self.tokens.count_message(tool_msg)
                outputs.append(tool_msg)
            await store.append_many(outputs)
            history.extend(outputs)
        return "(no answer)"  # unreachable: the last iteration offers no tools

    async def _provider_memory_write(self, ctx: TurnContext, args: Any, result: str) -> None:
        """Mirror a successful built-in memory write to the external provider."""
        try:
            if not json.loads(result).get("success"):
                return
            data = json.loads(args) if isinstance(args, str) else dict(args or {})
            await ctx.profile.provider.on_memory_write(
                str(data.get("action", "")), str(data.get("target", "")), str(data.get("content", "")))
        except Exception:
            log.exception("memory provider on_memory_write failed")

    async def _call_llm(self, ctx: TurnContext, history: list[StoredMessage], tools: list[dict] | None):
        """One model request for the current history.

        Before it, the prompt (estimate, or the server's last count) is checked against the
        compression threshold; a context-length error compresses and retries. Together at
        most `compression.max_attempts` compressions per turn. `history` is replaced in place
        by the compressed one (and `ctx.session_id` moves when a child session starts)."""
        comp = self.compression
        max_attempts = self.cfg.compression.max_attempts
        while True:
            wire = comp.wire(history)
            if ctx.compressions < max_attempts:
                outcome = await comp.before_request(ctx, history, wire)
                if outcome is not None and outcome.compressed:
                    ctx.compressions += 1
                    history[:] = outcome.history or []
                    wire = comp.wire(history)
            try:
                result = await self.llm.chat(wire, tools=tools, max_tokens=self.cfg.llm.max_tokens)
            except ContextLengthExceeded as err:
                if comp.enabled and ctx.compressions < max_attempts:
                    ctx.compressions += 1
                    outcome = await comp.compress_guarded(ctx, history, trigger="context")
                    if outcome.compressed:
                        history[:] = outcome.history or []
                        continue
                err.user_message = (
                    "This conversation has grown too long for the model. Send /compress to shrink "
                    "it or /new to start a fresh one (your memory is kept).")
                raise
            await comp.after_response(ctx, result.usage)
            return result
