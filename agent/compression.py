"""Context compression of one session, as the Hermes agent does it (seed part one, 1.1-1.9).

Pipeline (pure stages in `agent.compression_stages`): prune old tool output, protect the
head (system prompt + `protect_first_n`, decaying to 0 after the first compression), cut the
tail by token budget, summarise the middle with the auxiliary model (an update of the
previous summary when there is one), and commit:

* `in_place: true`: the summary is appended with `meta.after_uid` (so `history()` reads
  [head, summary, tail]) and the middle is flagged compacted, in one journal write and one
  transaction; the originals stay searchable and exportable.
* `in_place: false`: the session ends and a child starts with [fresh system prompt, head
  copies, summary, tail copies]; the lane's route moves to it in the same transaction that
  ends the parent and flags its middle compacted.

Pruning of messages that are kept (head, tail) is not written over the originals: the
summary message carries `meta.overrides` {uid: {content|tool_calls}} that the wire applies.

Everything that must survive between turns (streaks, cooldown, block, last server prompt
count) is per session, in the store's `compression_state` table; this module keeps no
per-session state of its own.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any

from agent.auxiliary import AuxTarget, aux_target
from agent.compression_stages import (
    INEFFECTIVE_SAVINGS_PCT,
    MIN_MIDDLE_MESSAGES,
    Item,
    align_forward,
    build_fallback_summary,
    build_summary_prompt,
    choose_summary_role,
    compute_threshold_tokens,
    fallback_summary_limit,
    find_tail_cut,
    is_real_user,
    merge_summary_into,
    protect_head_size,
    prune_tool_results,
    sanitize_tool_pairs,
    serialize_for_summary,
    strip_private,
    strip_think,
    summary_budget,
    tail_token_budget,
    text_of,
    unwrap_summary,
    wrap_summary,
)
from agent.context import TurnContext
from agent.llm import (
    LLMAuthError,
    LLMBadResponse,
    LLMClient,
    LLMError,
    LLMRateLimited,
    LLMUnavailable,
    Usage,
)
from agent.media import IMAGE_TOKENS, image_parts, image_refs
from agent.messages import StoredMessage
from agent.metering import BudgetExceeded, Meter, Payer
from agent.prompt import COMPACTION_NOTE, ChatPlace
from agent.sessions import StaleRouteError
from agent.tokens import MESSAGE_OVERHEAD, TokenCounter

if TYPE_CHECKING:
    from core.settings import AgentSettings

log = logging.getLogger("hermes.compression")

PROBE_AFTER_S = 300.0  # a blocked session gets one probe compression after this long
BLOCK_STREAK = 2  # this many ineffective (or fallback) compressions in a row block auto compression
TIMEOUT_COOLDOWN_LADDER = (60.0, 300.0, 900.0)
COOLDOWN_DEFAULT_S = 60.0
COOLDOWN_BAD_RESPONSE_S = 30.0
COOLDOWN_CONFIG_S = 600.0
RETRY_ON_MAIN = frozenset({"not_found", "timeout", "bad_response", "stream"})
ABORT_KINDS = frozenset({"auth", "network"})

NOT_SHORTER = "the summary would not be shorter"
BLOCKED_WARNING = (
    "Automatic compression is paused because the last attempts didn't help; "
    "send /compress to try now or /new to start fresh."
)
_FAILURE_TEXT = {
    "auth": "the summary model rejected our credentials",
    "network": "the summary model could not be reached",
    "timeout": "the summary model timed out",
    "not_found": "the summary model was unavailable",
    "bad_response": "the summary model sent an unreadable reply",
    "stream": "the connection to the summary model dropped",
    "config": "the summary model is misconfigured",
    "cooldown": "the summary model is paused after a recent failure",
    "other": "the summary model refused the request",
}


def wall_clock() -> float:
    """Seconds since the epoch (cooldowns and blocks are stored as wall-clock times so they
    survive restarts). Tests replace this function."""
    return time.time()


def _now() -> float:
    return wall_clock()


@dataclass
class CompressionState:
    """Per-session compression state, persisted in the session store."""

    compressions: int = 0  # completed compressions of this conversation (carried to children)
    ineffective: int = 0  # consecutive compressions that saved < 10% (or could not run)
    fallback_streak: int = 0  # consecutive compressions that used the static fallback summary
    cooldown_until: float = 0.0  # no automatic compression before this (summary-model failure)
    cooldown_kind: str | None = None  # the failure class that started the cooldown
    timeout_failures: int = 0  # consecutive summary timeouts (60 -> 300 -> 900 s ladder)
    blocked_at: float | None = None  # when the current anti-thrash block started
    warned: bool = False  # the person was told about the current block
    last_prompt_tokens: int = 0  # the server's usage.prompt_tokens of the last request
    last_error: str | None = None
    last_savings_pct: float | None = None

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CompressionState:
        state = cls()
        for f in fields(cls):
            if f.name not in data:
                continue
            value = data[f.name]
            default = getattr(state, f.name)
            try:
                if value is None:
                    setattr(
                        state,
                        f.name,
                        None
                        if f.name in ("blocked_at", "last_error", "last_savings_pct", "cooldown_kind")
                        else default,
                    )
                elif isinstance(default, bool):
                    setattr(state, f.name, bool(value))
                elif isinstance(default, int):
                    setattr(state, f.name, int(value))
                elif isinstance(default, float) or f.name in ("blocked_at", "last_savings_pct"):
                    setattr(state, f.name, float(value))
                else:
                    setattr(state, f.name, str(value))
            except (TypeError, ValueError):
                pass
        return state

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def streak_blocked(self) -> bool:
        return self.ineffective >= BLOCK_STREAK or self.fallback_streak >= BLOCK_STREAK


@dataclass
class Outcome:
    """What one compression attempt did."""

    status: str  # "compressed" | "nothing" | "aborted"
    history: list[StoredMessage] | None = None
    session_id: str | None = None
    before: int = 0  # prompt estimate before (tokens)
    after: int = 0  # prompt estimate after (tokens)
    summarised: int = 0  # messages replaced by the summary
    fallback: bool = False  # the static fallback summary was used
    reason: str = ""

    @property
    def compressed(self) -> bool:
        return self.status == "compressed"

    def feedback(self) -> str:
        """The reply to a manual /compress."""
        if self.status == "compressed":
            text = (
                f"Compressed: {self.before:,} → {self.after:,} tokens "
                f"({self.summarised} message{'s' if self.summarised != 1 else ''} summarised)."
            )
            if self.fallback:
                why = self.reason or "the summary model failed"
                text += f" {why[0].upper()}{why[1:]}, so I used a simpler local summary; some details may be missing."
            return text
        if self.status == "nothing" and self.reason == NOT_SHORTER:
            return "Compressing wouldn't make this conversation any shorter right now; nothing was changed."
        if self.status == "nothing":
            return "Nothing to compress yet: the conversation still fits in the recent part I keep word for word."
        return f"Couldn't compress: {self.reason}. Nothing was changed; try again later or send /new to start fresh."


@dataclass
class _Failure:
    kind: str
    abort: bool
    message: str


SystemFactory = Callable[[str, ChatPlace, TurnContext], Awaitable[StoredMessage]]


def classify_failure(err: LLMError) -> str:
    """Map a summary-call error to the seed's failure classes."""
    if isinstance(err, LLMAuthError):
        return "auth"
    if isinstance(err, LLMRateLimited):
        return "timeout"
    if isinstance(err, LLMBadResponse):
        return "bad_response"
    if err.kind == "config":
        return "config"
    if isinstance(err, LLMUnavailable):
        if err.status is None:
            if "timed out" in err.detail:
                return "timeout"
            if "ConnectError" in err.detail:
                return "network"  # no connection at all: a network outage, not a model problem
            return "stream"  # the connection dropped mid-answer
        if err.status in (408, 502, 504):
            return "timeout"
        return "not_found"  # 500/503: the model is unavailable
    if err.status == 404 or err.kind == "not_found":
        return "not_found"
    return "other"


class Compressor:
    """Compression for any session; holds configuration only (no per-session state)."""

    def __init__(
        self,
        settings: AgentSettings,
        llm: LLMClient,
        tokens: TokenCounter,
        *,
        system_factory: SystemFactory,
        meter: Meter | None = None,
    ) -> None:
        self.settings = settings
        self.llm = llm
        self.meter = meter or Meter(settings.llm)  # summaries count to the lane's tenant (agent/metering.py)
        self.tokens = tokens
        self._system_factory = system_factory
        self.on_outcome: Callable[[str], None] | None = None  # e.g. a metrics counter
        # the memory flush (agent/review.py): runs before on_pre_compress, as the seed orders it
        self.on_flush: Callable[[TurnContext, list[StoredMessage]], Awaitable[None]] | None = None

    # ----- configuration -----------------------------------------------------------------
    @property
    def enabled(self) -> bool:
        return self.settings.compression.enabled

    def threshold_tokens(self) -> int:
        c, llm = self.settings.compression, self.settings.llm
        return compute_threshold_tokens(
            context_length=llm.context_length,
            threshold=c.threshold,
            max_tokens=llm.max_tokens,
            model=llm.model,
            model_thresholds=c.model_thresholds,
            threshold_tokens_cap=c.threshold_tokens,
        )

    def tail_budget(self) -> int:
        return tail_token_budget(self.threshold_tokens(), self.settings.compression.target_ratio)

    # ----- tokens --------------------------------------------------------------------------
    def _tok(self, item: Item) -> int:
        """Tokens of an item: the stored message's cached count, recounted only when changed."""
        cached = item.get("_tokens")
        if cached is not None:
            return cached
        n = self.tokens.count_text(text_of(item.get("content"))) + MESSAGE_OVERHEAD
        n += IMAGE_TOKENS * len(item.get("_images") or ())
        if item.get("tool_calls"):
            n += self.tokens.count_text(json.dumps(item["tool_calls"], ensure_ascii=False, separators=(",", ":")))
        item["_tokens"] = n
        return n

    @staticmethod
    def estimate(wire: list[dict[str, Any]]) -> int:
        """The seed's pre-request estimate: characters / 4 of the wire messages."""
        return TokenCounter.estimate_rough(wire)

    def context_tokens(self, history: list[StoredMessage]) -> int:
        """Tokens of the active history from cached per-message counts (no re-encoding)."""
        return sum(self._tok(it) for it in self.view(history))

    # ----- the wire ----------------------------------------------------------------------
    def view(self, history: list[StoredMessage]) -> list[Item]:
        """The history as items, with the overrides of compression summaries applied."""
        overrides: dict[str, dict[str, Any]] = {}
        for m in history:
            if m.meta.get("compressed_summary") and isinstance(m.meta.get("overrides"), dict):
                overrides.update(m.meta["overrides"])
        items: list[Item] = []
        for m in history:
            d: Item = m.to_openai()
            d["_uid"] = m.uid
            d["_summary"] = bool(m.meta.get("compressed_summary"))
            d["_msg"] = m
            d["_tokens"] = self.tokens.count_message(m)
            d["_images"] = image_refs(m.meta)
            ov = overrides.get(m.uid)
            if isinstance(ov, dict):
                if "content" in ov:
                    d["content"] = ov["content"]
                if "images" in ov:
                    d["_images"] = image_refs({"images": ov["images"]})
                if "tool_calls" in ov:
                    if ov["tool_calls"]:
                        d["tool_calls"] = ov["tool_calls"]
                    else:
                        d.pop("tool_calls", None)
                d["_tokens"] = None
            items.append(d)
        return items

    def finalize(self, items: list[Item]) -> list[dict[str, Any]]:
        """Wire messages: the compaction note on the system prompt, summary roles chosen by
        their neighbours (merged into the next message when both roles would collide), orphan
        tool calls/results repaired, private keys removed."""
        if not any(it.get("_summary") for it in items):
            return [self._wire_item(it) for it in sanitize_tool_pairs(items)]
        out = list(items)
        if out and out[0].get("role") == "system":
            system = dict(out[0])
            content = text_of(system.get("content"))
            if COMPACTION_NOTE not in content:
                system["content"] = f"{content}\n\n{COMPACTION_NOTE}" if content else COMPACTION_NOTE
            out[0] = system
        user_survives = any(is_real_user(it) for it in out)
        result: list[Item] = []
        pending: str | None = None
        for idx, it in enumerate(out):
            if it.get("_summary"):
                prev_role = result[-1].get("role") if result else None
                nxt = out[idx + 1] if idx + 1 < len(out) else None
                next_role = nxt.get("role") if nxt is not None and not nxt.get("_summary") else None
                role, merge = choose_summary_role(prev_role, next_role, user_survives=user_survives)
                if merge and next_role in ("user", "assistant"):
                    pending = text_of(it.get("content"))
                    continue
                result.append({**it, "role": role})
                continue
            if pending is not None:
                it = merge_summary_into(it, pending, user_leading=it.get("role") == "user")
                pending = None
            result.append(it)
        return [self._wire_item(it) for it in sanitize_tool_pairs(result)]

    def _wire_item(self, it: Item) -> dict[str, Any]:
        """The wire form of an item: with `llm.vision`, a message's stored images become
        image parts (placeholder URLs that `agent.media.inline_images` fills in)."""
        if it.get("_images") and self.settings.llm.vision:
            it = {**it, "content": image_parts(text_of(it.get("content")), it["_images"])}
        return strip_private(it)

    def wire(self, history: list[StoredMessage]) -> list[dict[str, Any]]:
        return self.finalize(self.view(history))

    # ----- state -------------------------------------------------------------------------
    async def state(self, ctx: TurnContext) -> CompressionState:
        if ctx.compression_state is None:
            ctx.compression_state = CompressionState.from_dict(
                await ctx.profile.sessions.compression_state(ctx.session_id)
            )
        return ctx.compression_state

    async def _save(self, ctx: TurnContext, state: CompressionState) -> None:
        try:
            await ctx.profile.sessions.set_compression_state(ctx.session_id, state.to_dict())
        except Exception:  # soft state: never break a turn over it
            log.exception("could not save compression state")

    @staticmethod
    async def _notify(ctx: TurnContext, kind: str, text: str) -> None:
        try:
            await ctx.notify(kind, text)
        except Exception:
            log.exception("compression notice failed")

    def _count(self, outcome: str) -> None:
        if self.on_outcome is not None:
            try:
                self.on_outcome(outcome)
            except Exception:
                log.debug("compression outcome hook failed", exc_info=True)

    @staticmethod
    def block_reason(state: CompressionState, now: float | None = None) -> str | None:
        """None, "cooldown", "blocked" or "probe" (blocked, but 300 s passed: try once)."""
        now = _now() if now is None else now
        if state.cooldown_until > now:
            return "cooldown"
        if state.streak_blocked:
            if state.blocked_at is not None and now - state.blocked_at >= PROBE_AFTER_S:
                return "probe"
            return "blocked"
        return None

    @staticmethod
    def _update_block(state: CompressionState) -> None:
        now = _now()
        if state.streak_blocked:
            if state.blocked_at is None or now - state.blocked_at >= PROBE_AFTER_S:
                state.blocked_at = now  # a new block, or a failed probe: wait again
        else:
            state.blocked_at = None
            state.warned = False

    # ----- triggers ----------------------------------------------------------------------
    async def before_request(
        self, ctx: TurnContext, history: list[StoredMessage], wire: list[dict[str, Any]]
    ) -> Outcome | None:
        """Compress when the prompt (estimate, or the server's last count) reached the threshold."""
        if not self.enabled:
            return None
        state = await self.state(ctx)
        tokens = max(self.estimate(wire), state.last_prompt_tokens)
        if tokens < self.threshold_tokens():
            return None
        reason = self.block_reason(state)
        if reason == "cooldown":
            log.info("compression deferred: summary model cooling down")
            return None
        if reason == "blocked":
            if state.blocked_at is None or not state.warned:
                state.blocked_at = state.blocked_at or _now()
                warn, state.warned = not state.warned, True
                await self._save(ctx, state)
                if warn:  # once per block: the person learns what to do
                    await self._notify(ctx, "warning", BLOCKED_WARNING)
            return None
        if reason == "probe":
            log.info("compression blocked for %.0fs: probing once", PROBE_AFTER_S)
        return await self.compress_guarded(ctx, history, trigger="auto")

    async def compress_guarded(
        self, ctx: TurnContext, history: list[StoredMessage], *, trigger: str, focus: str | None = None
    ) -> Outcome:
        """`compress`, but an unexpected error leaves the conversation as it was (and says so)
        instead of failing the turn."""
        try:
            return await self.compress(ctx, history, trigger=trigger, focus=focus)
        except BudgetExceeded:  # the turn says it (agent/turn.py)
            raise
        except Exception:
            log.exception("compression failed unexpectedly (%s); conversation left unchanged", trigger)
            self._count("error")
            if trigger != "manual":
                state = ctx.compression_state
                if state is not None:  # counts as ineffective: repeats end in a block
                    state.ineffective += 1
                    self._update_block(state)
                    await self._save(ctx, state)
                await self._notify(ctx, "progress_done", "Compression skipped; nothing was changed.")
                await self._notify(
                    ctx,
                    "warning",
                    "I couldn't compress this conversation because of an "
                    "internal error; nothing was changed. Send /new if replies start failing.",
                )
            return Outcome("aborted", reason="an internal error occurred")

    async def after_response(self, ctx: TurnContext, usage: Usage | None) -> None:
        """The server's prompt count becomes the session's last_prompt_tokens; a response
        without usage resets it (a stale count must not trigger the next compression)."""
        if not self.enabled:
            return
        count = usage.prompt_tokens if usage is not None and usage.prompt_tokens > 0 else 0
        state = await self.state(ctx)
        if state.last_prompt_tokens != count:
            state.last_prompt_tokens = count
            await self._save(ctx, state)

    # ----- the pipeline --------------------------------------------------------------------
    async def compress(
        self, ctx: TurnContext, history: list[StoredMessage], *, trigger: str, focus: str | None = None
    ) -> Outcome:
        """One compression. `trigger`: "auto" (threshold), "context" (the server said the
        prompt is too long) or "manual" (/compress: ignores cooldown and blocks)."""
        ccfg = self.settings.compression
        store = ctx.profile.sessions
        state = await self.state(ctx)
        manual = trigger == "manual"
        if manual:
            state.cooldown_until = 0.0
            state.timeout_failures = 0
        items = self.view(history)
        before = self.estimate(self.finalize(items))  # same measure as `after` (the trigger may use the server's count)
        decayed = state.compressions > 0 or any(it["_summary"] for it in items)
        head_n = protect_head_size(items, 0 if decayed else ccfg.protect_first_n)
        if len(items) <= head_n + MIN_MIDDLE_MESSAGES + 1:
            return await self._no_progress(ctx, state, trigger, "too few messages", before)

        # stage 1: prune; stages 2-3: boundaries
        budget = self.tail_budget()
        pruned, stats = prune_tool_results(
            items,
            protect_tail_count=ccfg.protect_last_n,
            protect_tail_tokens=budget,
            tokens=self._tok,
            min_prune_chars=ccfg.min_prune_chars,
        )
        start = align_forward(pruned, head_n)
        end = find_tail_cut(
            pruned,
            start,
            budget=budget,
            protect_last_n=ccfg.protect_last_n,
            min_tail_user_messages=ccfg.min_tail_user_messages,
            tokens=self._tok,
        )
        turns = [it for it in pruned[start:end] if not it.get("_summary")]
        if start >= end or not turns:
            return await self._no_progress(ctx, state, trigger, "nothing between head and tail", before)
        previous = next((unwrap_summary(text_of(it.get("content"))) for it in reversed(items) if it["_summary"]), None)
        log.info(
            "compressing session (%s): %d tokens, head %d, middle %d, tail %d messages, %d pruned",
            trigger,
            before,
            start,
            end - start,
            len(items) - end,
            stats.total,
        )
        if not manual:
            await self._notify(ctx, "progress", f"Compressing the conversation ({before:,} tokens)…")
        await self._flush(ctx, history)
        await self._pre_compress(ctx, items[start:end])

        # stages 4-5: the summary (an update of the previous one), with its failure layers
        middle_tokens = sum(self._tok(it) for it in turns)
        body, fallback, failure = await self._summarize(
            turns, previous, focus, state, trigger, middle_tokens, ctx.payer
        )
        if body is None:
            assert failure is not None
            if not manual:
                state.ineffective += 1
                self._update_block(state)
            await self._save(ctx, state)
            self._count("aborted")
            if not manual:
                await self._notify(ctx, "progress_done", "Compression skipped; nothing was changed.")
                await self._notify(
                    ctx,
                    "warning",
                    (
                        f"I couldn't compress this conversation: {failure.message}. Nothing was changed; "
                        "send /compress to try again or /new to start fresh."
                    ),
                )
            return Outcome("aborted", before=before, reason=failure.message)

        # commit (unless the result would not be smaller: then nothing changes)
        head, tail = pruned[:start], pruned[end:]
        role, _merge = choose_summary_role(
            head[-1].get("role") if head else None,
            tail[0].get("role") if tail else None,
            user_survives=any(is_real_user(it) for it in head + tail),
        )
        prospective = self.estimate(
            self.finalize([*head, {"role": role, "content": wrap_summary(body), "_summary": True}, *tail])
        )
        if prospective >= before:
            log.info("compression would not shrink the prompt (%d -> %d tokens); nothing changed", before, prospective)
            if not manual:
                await self._notify(ctx, "progress_done", "Compression skipped; nothing was changed.")
            return await self._no_progress(ctx, state, trigger, NOT_SHORTER, before)
        meta: dict[str, Any] = {
            "compressed_summary": True,
            "trigger": trigger,
            "compression": state.compressions + 1,
            "summarised": len(turns),
            "fallback": fallback,
            "has_user_turn": any(is_real_user(it) for it in items),
        }
        compacted = [it["_uid"] for it in items[start:end]]
        old_sid = ctx.session_id
        try:
            if ccfg.in_place:
                overrides = self._overrides(head + tail)
                if overrides:
                    meta["overrides"] = overrides
                if head:
                    meta["after_uid"] = head[-1]["_uid"]
                summary = StoredMessage(session_id=old_sid, role=role, content=wrap_summary(body), meta=meta)
                self.tokens.count_message(summary)
                await store.compact(old_sid, compacted, [summary], reason="compression")
                new_sid = old_sid
                await store.increment_compressions(old_sid)
            else:
                new_sid = await self._rotate(ctx, head, tail, role, body, meta, compacted)
                ctx.session_id = new_sid  # the route moved: whatever fails next, the turn writes here
                await store.increment_compressions(old_sid)
                await store.increment_compressions(new_sid, by=state.compressions + 1)
        except StaleRouteError:
            log.warning("compression of %s abandoned: the lane moved meanwhile", old_sid)
            await self._notify(ctx, "progress_done", "Compression skipped; nothing was changed.")
            return Outcome("aborted", before=before, reason="the conversation changed meanwhile")
        try:
            await store.set_summary(new_sid, body)
        except Exception:
            log.exception("could not store the session summary text")
        new_history = await store.history(new_sid)
        after = self.estimate(self.wire(new_history))
        savings = (before - after) * 100.0 / before if before > 0 else 0.0
        state.compressions += 1
        state.last_prompt_tokens = 0  # the server's last count was for the longer prompt
        state.fallback_streak = state.fallback_streak + 1 if fallback else 0
        state.ineffective = state.ineffective + 1 if savings < INEFFECTIVE_SAVINGS_PCT else 0
        state.last_savings_pct = round(savings, 1)
        self._update_block(state)
        ctx.session_id = new_sid
        await self._save(ctx, state)
        self._count("fallback" if fallback else "ok")
        log.info(
            "compressed session %s -> %s: %d -> %d tokens (%.0f%% saved, %d messages summarised%s)",
            old_sid,
            new_sid,
            before,
            after,
            savings,
            len(turns),
            ", static fallback" if fallback else "",
        )
        if not manual:
            await self._notify(ctx, "progress_done", f"Conversation compressed: {before:,} → {after:,} tokens.")
            if fallback:
                await self._notify(
                    ctx,
                    "warning",
                    (
                        f"Earlier messages were condensed with a simpler local summary because {failure.message if failure else 'the summary model failed'}; "
                        "some details may be missing. Send /compress later to retry."
                    ),
                )
        return Outcome(
            "compressed",
            history=new_history,
            session_id=new_sid,
            before=before,
            after=after,
            summarised=len(turns),
            fallback=fallback,
            reason=failure.message if failure else "",
        )

    async def _no_progress(
        self, ctx: TurnContext, state: CompressionState, trigger: str, why: str, before: int
    ) -> Outcome:
        log.info("compression found nothing to do (%s): %s", trigger, why)
        if trigger != "manual":  # a manual /compress on a short chat must not block automation
            state.ineffective += 1
            self._update_block(state)
        await self._save(ctx, state)  # also keeps a cooldown or reset made on the way
        self._count("nothing")
        return Outcome("nothing", before=before, after=before, reason=why)

    @staticmethod
    def _overrides(kept: list[Item]) -> dict[str, dict[str, Any]]:
        """Pruned forms of kept messages, stored on the summary instead of over the originals."""
        out: dict[str, dict[str, Any]] = {}
        for it in kept:
            m: StoredMessage = it["_msg"]
            ov: dict[str, Any] = {}
            if it.get("content") != m.content:
                ov["content"] = it.get("content")
            if (it.get("tool_calls") or None) != (m.tool_calls or None):
                ov["tool_calls"] = it.get("tool_calls") or None
            if "_images" in it and it["_images"] != image_refs(m.meta):
                ov["images"] = it["_images"]
            if ov:
                out[m.uid] = ov
        return out

    def _copy(self, it: Item, session_id: str) -> StoredMessage:
        m: StoredMessage = it["_msg"]
        meta = {k: v for k, v in m.meta.items() if k not in ("after_uid", "overrides")}
        meta["copied_from"] = m.meta.get("copied_from", m.uid)
        if "_images" in it:  # pruned images stay out of the child too
            if it["_images"]:
                meta["images"] = it["_images"]
            else:
                meta.pop("images", None)
        return StoredMessage(
            session_id=session_id,
            role=m.role,
            content=it.get("content"),
            tool_call_id=m.tool_call_id,
            tool_calls=(it.get("tool_calls") or None) if m.role == "assistant" else m.tool_calls,
            tool_name=m.tool_name,
            timestamp=m.timestamp,
            token_count=self._tok(it),
            finish_reason=m.finish_reason,
            meta=meta,
        )

    async def _rotate(
        self,
        ctx: TurnContext,
        head: list[Item],
        tail: list[Item],
        role: str,
        body: str,
        meta: dict[str, Any],
        compacted: list[str],
    ) -> str:
        """in_place: false — end the session, start its child with the compressed history."""
        sid = ctx.session_id
        system = await self._system_factory(sid, ctx.place, ctx)
        child: list[StoredMessage] = [system]
        child.extend(self._copy(it, sid) for it in head if it.get("role") != "system")
        meta["after_uid"] = child[-1].uid
        summary = StoredMessage(session_id=sid, role=role, content=wrap_summary(body), meta=meta)
        self.tokens.count_message(summary)
        child.append(summary)
        child.extend(self._copy(it, sid) for it in tail)
        return await ctx.profile.sessions.rotate(
            ctx.lane.session_key, sid, "compression", carry=child, compact_uids=compacted
        )

    async def _flush(self, ctx: TurnContext, history: list[StoredMessage]) -> None:
        if self.on_flush is None:
            return
        try:
            await self.on_flush(ctx, history)
        except Exception:  # a memory review must never break compression
            log.exception("memory flush before compression failed")

    async def _pre_compress(self, ctx: TurnContext, middle: list[Item]) -> None:
        provider = ctx.profile.provider
        access = ctx.provider_access  # nothing from a read/off group lane is stored
        if provider is None or not access.write:
            return
        try:
            await provider.on_pre_compress(
                [strip_private(it) for it in middle if not it.get("_summary")], visibility=access.mark
            )
        except Exception:  # a provider must never break compression
            log.exception("memory provider on_pre_compress failed")

    # ----- the summary model -----------------------------------------------------------------
    async def _summarize(
        self,
        turns: list[Item],
        previous: str | None,
        focus: str | None,
        state: CompressionState,
        trigger: str,
        middle_tokens: int,
        payer: Payer | None = None,
    ) -> tuple[str | None, bool, _Failure | None]:
        """(body, used_fallback, failure); body None means abort (messages untouched)."""
        failure: _Failure | None
        if trigger != "manual" and state.cooldown_until > _now():
            # the cooldown remembers why it started: after auth or network failures a
            # fallback summary would only hide the outage, so the abort is kept
            cause = state.cooldown_kind or "cooldown"
            failure = _Failure("cooldown", cause in ABORT_KINDS, _FAILURE_TEXT.get(cause, _FAILURE_TEXT["cooldown"]))
        else:
            prompt = build_summary_prompt(
                serialize_for_summary(turns),
                previous_summary=previous,
                focus=focus,
                budget_tokens=summary_budget(middle_tokens, self.settings.llm.context_length),
            )
            text, failure = await self._ask_summary(prompt, state, payer)
            if text is not None:
                state.cooldown_until = 0.0
                state.cooldown_kind = None
                state.timeout_failures = 0
                state.last_error = None
                return text, False, None
        assert failure is not None
        if failure.abort or self.settings.compression.abort_on_summary_failure:
            failure.abort = True
            return None, False, failure
        limit = fallback_summary_limit(self.settings.llm.context_length)
        return (
            build_fallback_summary(turns, previous_summary=previous, reason=failure.message, max_chars=limit),
            True,
            failure,
        )

    def _summary_target(self) -> AuxTarget:
        return aux_target(self.settings.auxiliary.compression, self.settings.llm, self.llm)

    async def _ask(self, payer: Payer | None, client: LLMClient, model: str | None, prompt: str) -> str:
        # no tools and, on purpose, no max_tokens: the cap must never cut a summary
        result = await self.meter.chat(payer, client, [{"role": "user", "content": prompt}], model=model)
        text = strip_think(result.content or "")
        if not text:
            raise LLMBadResponse("the summary model returned an empty summary")
        return text

    async def _ask_summary(
        self, prompt: str, state: CompressionState, payer: Payer | None = None
    ) -> tuple[str | None, _Failure | None]:
        target = self._summary_target()
        try:
            try:
                return await self._ask(payer, target.client, target.model, prompt), None
            except LLMError as err:
                kind = classify_failure(err)
                if target.distinct and kind in RETRY_ON_MAIN:
                    log.warning("summary model failed (%s: %s); retrying once with the main model", kind, err.detail)
                    try:
                        return await self._ask(payer, self.llm, None, prompt), None
                    except LLMError as err2:
                        err, kind = err2, classify_failure(err2)
                return None, self._record_failure(state, err, kind)
        finally:
            await target.aclose()

    @staticmethod
    def _record_failure(state: CompressionState, err: LLMError, kind: str) -> _Failure:
        """Layer 2: a cooldown during which automatic compression does not run."""
        if kind == "timeout":
            state.timeout_failures += 1
            cooldown = TIMEOUT_COOLDOWN_LADDER[min(state.timeout_failures, len(TIMEOUT_COOLDOWN_LADDER)) - 1]
        elif kind in ("bad_response", "stream"):
            cooldown = COOLDOWN_BAD_RESPONSE_S
        elif kind == "config":
            cooldown = COOLDOWN_CONFIG_S
        else:
            cooldown = COOLDOWN_DEFAULT_S
        state.cooldown_until = _now() + cooldown
        state.cooldown_kind = kind
        state.last_error = err.detail[:220]
        log.warning(
            "summary generation failed (%s: %s); automatic compression paused for %.0fs", kind, err.detail, cooldown
        )
        return _Failure(kind, kind in ABORT_KINDS, _FAILURE_TEXT.get(kind, _FAILURE_TEXT["other"]))
