"""Background memory and skill review (seed 2.6): the agent looks back at a conversation
and decides what is worth keeping.

Triggers (counted per lane, in memory): every `memory.nudge_interval` user turns a memory
review, after `skills.creation_nudge_interval` tool iterations a skill review; both run
after the reply was delivered. When a session ends (/new, compression, shutdown) after at
least `memory.flush_min_turns` unreviewed turns, a flush review runs first.

A review replays the conversation (as the model saw it, secrets redacted) to the
auxiliary model (`auxiliary.review`, falling back to `llm`) with one extra instruction and
only the `memory` and `skill_manage` tools of that very lane: same stores, same lane
context (memory mode, visibility, write approval). It never writes to the conversation,
its sessions or its usage. One review at a time per tenant, bounded by
`memory.review_timeout_s`; a failure is logged and counted, never shown in the chat.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from agent.auxiliary import aux_target
from agent.llm import LLMClient, LLMError
from agent.messages import StoredMessage
from agent.metering import BudgetExceeded, Meter
from agent.tools import ToolBox
from core.redact import redact_secrets

if TYPE_CHECKING:
    from agent.profile import Profile
    from agent.prompt import ChatPlace
    from core.lanes import Lane
    from core.settings import AgentSettings

log = logging.getLogger("hermes.review")

REVIEW_MARKER = "[BACKGROUND REVIEW]"
MAX_TRACKED_LANES = 10_000

MEMORY_PROMPT = (
    "Review the conversation above and consider saving to memory if appropriate. Focus on: "
    "1. Has the person revealed things about themselves (who they are, preferences, personal "
    "details worth remembering)? 2. Have they said how you should behave, how they work, or how "
    "they want answers? Save what stands out with the `memory` tool (target 'user' for the "
    "person, 'memory' for your own notes); replace stale entries rather than adding near-duplicates. "
    "Never save secrets such as passwords or keys."
)
SKILL_PROMPT = (
    "Review the conversation above and consider saving or updating a skill. Focus on: was a "
    "non-trivial approach used that took trial and error or a change of course, or did the "
    "person want a different method or outcome? If a matching skill exists, update it with what "
    "was learned; otherwise create one if the approach is reusable (`skill_manage`). A skill is a "
    "procedure shared by everyone who talks to you in this profile: never put personal facts, "
    "names, memory contents or secrets into it."
)
CLOSING = (
    "This is a background review: the person will not see your reply. Use the tools only "
    "if something is worth keeping; otherwise answer 'Nothing to save.' and stop."
)
GROUP_NOTE = (
    "This is a group chat: whatever you save here can be shown to everyone in it, so save "
    "only what the group itself shared."
)

Toolbox = Callable[["Profile", "Lane", "ChatPlace", frozenset[str]], ToolBox]
Wire = Callable[[list[StoredMessage]], list[dict[str, Any]]]


def review_prompt(*, memory: bool, skills: bool, group: bool) -> str:
    parts = [REVIEW_MARKER]
    if memory:
        parts.append(MEMORY_PROMPT)
    if skills:
        parts.append(SKILL_PROMPT)
    if group:
        parts.append(GROUP_NOTE)
    parts.append(CLOSING)
    return "\n\n".join(parts)


def user_turns(history: list[StoredMessage]) -> int:
    """Messages the people wrote in `history` (compaction summaries are not turns)."""
    return sum(1 for m in history if m.role == "user" and not m.meta.get("compressed_summary"))


@dataclass
class _LaneCounts:
    since_memory: int = 0  # user turns since the last memory review
    since_skill: int = 0  # tool iterations since the last skill review
    unreviewed: int = 0  # user turns no review has seen yet
    reviewed: bool = False  # a review of this lane ran in this process


@dataclass
class ReviewState:
    """The per-lane turn counts and per-tenant locks reviews are scheduled by."""

    lanes: OrderedDict[str, _LaneCounts] = field(default_factory=OrderedDict)
    tenant_locks: dict[str, asyncio.Lock] = field(default_factory=dict)


class Reviewer:
    """Schedules and runs reviews for any tenant; per-lane counters and per-tenant locks are
    keyed explicitly by `Lane.key` and tenant_id."""

    def __init__(
        self,
        settings: AgentSettings,
        llm: LLMClient,
        *,
        wire: Wire,
        toolbox: Toolbox,
        meter: Meter | None = None,
        state: ReviewState | None = None,
    ) -> None:
        self.settings = settings
        self.llm = llm
        self.meter = meter or Meter(settings.llm)  # reviews count to the lane's tenant (agent/metering.py)
        self._wire = wire
        self._toolbox = toolbox
        # shared by the agents of every offered model (agent/agents.py): one count per lane,
        # one review at a time per tenant, whichever model it runs with
        self.state = state or ReviewState()
        self.on_outcome: Callable[[str, str], None] | None = None  # (trigger, outcome), e.g. /metrics

    # ----- triggers ------------------------------------------------------------------------
    def _counts(self, lane: Lane) -> _LaneCounts:
        key = lane.key
        counts = self.state.lanes.get(key)
        if counts is None:
            counts = self.state.lanes[key] = _LaneCounts()
            while len(self.state.lanes) > MAX_TRACKED_LANES:
                self.state.lanes.popitem(last=False)
        self.state.lanes.move_to_end(key)
        return counts

    def note_turn(self, lane: Lane, tool_iterations: int) -> tuple[bool, bool]:
        """Count a finished turn; (review memory, review skills) when a nudge is due."""
        if lane.personal_memory != "full":
            return False, False  # nothing may be written from this lane
        counts = self._counts(lane)
        counts.unreviewed += 1
        mem_every, skill_every = self.settings.memory.nudge_interval, self.settings.skills.creation_nudge_interval
        memory = skills = False
        if mem_every > 0 and (self.settings.memory.memory_enabled or self.settings.memory.user_profile_enabled):
            counts.since_memory += 1
            if counts.since_memory >= mem_every:
                memory, counts.since_memory = True, 0
        if skill_every > 0 and self.settings.skills.enabled:
            counts.since_skill += tool_iterations
            if counts.since_skill >= skill_every:
                skills, counts.since_skill = True, 0
        return memory, skills

    def has_unreviewed(self, lane: Lane) -> bool:
        counts = self.state.lanes.get(lane.key)
        return counts is not None and counts.unreviewed > 0

    def flush_due(self, lane: Lane, history: list[StoredMessage]) -> bool:
        """A session of `lane` ends: does it have `flush_min_turns` turns no review has seen?"""
        need = self.settings.memory.flush_min_turns
        if need <= 0 or lane.personal_memory != "full":
            return False
        counts = self.state.lanes.get(lane.key)
        turns = counts.unreviewed if counts is not None and counts.reviewed else user_turns(history)
        return turns >= need

    def session_ended(self, lane: Lane) -> None:
        """The lane starts afresh: nothing of the new session is unreviewed yet."""
        counts = self.state.lanes.get(lane.key)
        if counts is not None:
            counts.unreviewed, counts.reviewed = 0, True

    # ----- running -------------------------------------------------------------------------
    async def review(
        self,
        profile: Profile,
        lane: Lane,
        place: ChatPlace,
        history: list[StoredMessage],
        *,
        memory: bool,
        skills: bool,
        trigger: str,
        wait: bool = False,
    ) -> str:
        """Run one review; returns its outcome (saved, nothing, busy, skipped, timeout, llm_error,
        error). `wait`: queue behind a running review of the tenant instead of skipping."""
        lock = self.state.tenant_locks.setdefault(profile.tenant_id, asyncio.Lock())
        if lock.locked() and not wait:
            outcome = "busy"
        else:
            try:
                async with asyncio.timeout(self.settings.memory.review_timeout_s):
                    async with lock:
                        counts = self._counts(lane)
                        counts.unreviewed, counts.reviewed = 0, True
                        outcome = await self._run(profile, lane, place, history, memory=memory, skills=skills)
            except TimeoutError:
                outcome = "timeout"
                log.warning(
                    "background %s review timed out after %.0fs", trigger, self.settings.memory.review_timeout_s
                )
            except BudgetExceeded:  # nothing is said: the person's next message is told
                outcome = "over_budget"
            except LLMError as err:
                outcome = "llm_error"
                log.warning("background %s review failed: %s", trigger, err.kind)
            except Exception:
                outcome = "error"
                log.exception("background %s review failed", trigger)
        log.info("background %s review: %s", trigger, outcome)
        if self.on_outcome is not None:
            try:
                self.on_outcome(trigger, outcome)
            except Exception:
                log.debug("review outcome hook failed", exc_info=True)
        return outcome

    async def _run(
        self,
        profile: Profile,
        lane: Lane,
        place: ChatPlace,
        history: list[StoredMessage],
        *,
        memory: bool,
        skills: bool,
    ) -> str:
        wanted = frozenset(name for name, on in (("memory", memory), ("skill_manage", skills)) if on)
        toolbox = self._toolbox(profile, lane, place, wanted)
        writable = {
            "memory": toolbox.memory is not None and not toolbox.memory.read_only and toolbox.write_approval != "block",
            "skill_manage": toolbox.skills is not None and not toolbox.skills.read_only,
        }
        wanted = frozenset(name for name in wanted if writable[name])
        if not wanted or not history:
            return "skipped"
        toolbox.only = wanted
        tools = await toolbox.schemas()
        messages = [_redacted(m) for m in self._wire(history)]
        messages.append(
            {
                "role": "user",
                "content": review_prompt(
                    memory="memory" in wanted, skills="skill_manage" in wanted, group=place.chat_type != "dm"
                ),
            }
        )
        payer = await self.meter.payer(profile, lane)
        target = aux_target(self.settings.auxiliary.review, self.settings.llm, self.llm)
        saved = 0
        try:
            for _ in range(self.settings.max_tool_iterations):
                result = await self.meter.chat(payer, target.client, messages, tools=tools, model=target.model)
                if not result.tool_calls:
                    break
                messages.append({"role": "assistant", "content": result.content, "tool_calls": result.tool_calls})
                for call in result.tool_calls:
                    fn = call.get("function") or {}
                    out = await toolbox.call(str(fn.get("name", "")), fn.get("arguments"))
                    saved += _succeeded(out)
                    messages.append({"role": "tool", "tool_call_id": call.get("id"), "content": out})
        finally:
            await target.aclose()
        return "saved" if saved else "nothing"


def _redacted(message: dict[str, Any]) -> dict[str, Any]:
    content = message.get("content")
    if isinstance(content, str):
        return {**message, "content": redact_secrets(content)}
    return message


def _succeeded(result: str) -> int:
    try:
        data = json.loads(result)
    except ValueError:
        return 0
    return int(
        isinstance(data, dict) and data.get("success") is True and "skills" not in data and "content" not in data
    )  # list/view are reads, not saves


__all__ = ["REVIEW_MARKER", "Reviewer", "review_prompt", "user_turns"]
