"""The pure stages of context compression: thresholds, the four pruning passes, boundaries,
tool-pair repair, the role rule, think stripping, the input cap and the static fallback."""

from __future__ import annotations

import json

import pytest

from agent import compression_stages as st
from agent.compression import CompressionState, Compressor, classify_failure
from agent.llm import ContextLengthExceeded, LLMAuthError, LLMBadResponse, LLMError, LLMRateLimited, LLMUnavailable
from agent.messages import StoredMessage
from agent.tokens import TokenCounter


def tok(item: dict) -> int:
    """A predictable token count for tests: chars/4 of content plus tool-call JSON."""
    if item.get("_tokens") is not None:
        return item["_tokens"]
    n = len(st.text_of(item.get("content"))) // 4 + 4
    if item.get("tool_calls"):
        n += len(json.dumps(item["tool_calls"])) // 4
    return n


def sys_(text="system prompt"):
    return {"role": "system", "content": text, "_uid": "s"}


def u(text, uid=None):
    return {"role": "user", "content": text, "_uid": uid or text[:12]}


def a(text, uid=None):
    return {"role": "assistant", "content": text, "_uid": uid or "a-" + text[:10]}


def call(cid, name="session_search", args=None, content=None):
    return {
        "role": "assistant",
        "content": content,
        "_uid": "c-" + cid,
        "tool_calls": [
            {"id": cid, "type": "function", "function": {"name": name, "arguments": json.dumps(args or {"query": "x"})}}
        ],
    }


def res(cid, text, name="session_search"):
    return {"role": "tool", "content": text, "tool_call_id": cid, "name": name, "_uid": "r-" + cid}


# --------------------------------------------------------------------------- thresholds


def test_threshold_defaults_small_context_floor_cap_and_max_tokens():
    # 50% default is raised to 75% below 512K
    assert st.compute_threshold_tokens(context_length=32768, threshold=0.5) == 24576
    # room for the answer is subtracted
    assert st.compute_threshold_tokens(context_length=32768, threshold=0.5, max_tokens=4096) == 24576 - 4096
    # large windows keep the configured 50%
    assert st.compute_threshold_tokens(context_length=1_000_000, threshold=0.5) == 500_000
    # never above 85% of the window
    assert st.compute_threshold_tokens(context_length=1_000_000, threshold=0.95) == 850_000
    assert st.compute_threshold_tokens(context_length=8000, threshold=1.0) == 6800
    # absolute cap: the minimum wins, clamped to the window
    assert st.compute_threshold_tokens(context_length=32768, threshold=0.5, threshold_tokens_cap=10_000) == 10_000
    assert st.compute_threshold_tokens(context_length=32768, threshold=0.5, threshold_tokens_cap=10**9) == 24576
    # always positive
    assert st.compute_threshold_tokens(context_length=1000, threshold=0.5, max_tokens=5000) == 375


def test_per_model_thresholds_longest_substring_wins():
    th = {"glm-5": 0.60, "glm-5.2-1M": 0.40}
    assert st.resolve_model_threshold("glm-5.2-1M-chat", th, 0.5) == 0.40
    assert st.resolve_model_threshold("glm-5.1", th, 0.5) == 0.60
    assert st.resolve_model_threshold("llama3", th, 0.5) == 0.5
    assert (
        st.compute_threshold_tokens(context_length=1_000_000, threshold=0.5, model="glm-5.2-1M", model_thresholds=th)
        == 400_000
    )
    # the small-context floor stacks on a per-model value
    assert (
        st.compute_threshold_tokens(context_length=100_000, threshold=0.5, model="glm-5.2-1M", model_thresholds=th)
        == 75_000
    )


def test_tail_budget_and_summary_budget():
    assert st.tail_token_budget(3000, 0.20) == 600
    assert st.tail_token_budget(3000, 0.01) == 300  # ratio floored at 10%
    assert st.summary_budget(100_000, 1_000_000) == 10_000  # ceiling
    assert st.summary_budget(1_000, 32_768) == 2_000  # floor
    assert st.summary_budget(50_000, 4_000) == 400  # small windows: at most 10% of the window


# --------------------------------------------------------------------------- pruning


def test_pass1_dedupes_identical_tool_results_keeping_the_newest():
    big = "x" * 500
    items = [sys_(), u("q"), call("c1"), res("c1", big), u("q2"), call("c2"), res("c2", big), u("last")]
    out, stats = st.prune_tool_results(items, protect_tail_count=20, protect_tail_tokens=None, tokens=tok)
    assert stats.duplicates == 1
    assert out[3]["content"] == st.DUPLICATE_PLACEHOLDER and out[6]["content"] == big
    assert items[3]["content"] == big  # input untouched


def test_pass2_summarises_old_tool_results_only_before_the_protected_tail():
    old = json.dumps({"success": True, "count": 3, "results": ["r" * 300]})
    items = [sys_(), u("q1"), call("c1", args={"query": "cats"}), res("c1", old)]
    items += [u(f"filler {i}") for i in range(3)]
    items += [call("c2"), res("c2", "y" * 300 + "recent")]
    out, stats = st.prune_tool_results(items, protect_tail_count=2, protect_tail_tokens=None, tokens=tok)
    assert stats.summarised == 1
    assert out[3]["content"].startswith("[session_search] query='cats' -> 3 results")
    assert out[-1]["content"].endswith("recent")  # inside the tail: kept
    short = [sys_(), u("q"), call("c1"), res("c1", "short result"), u("a"), u("b"), u("c")]
    _, stats = st.prune_tool_results(short, protect_tail_count=1, protect_tail_tokens=None, tokens=tok)
    assert stats.summarised == 0  # under min_prune_chars (200)


def test_pass3_truncates_long_tool_arguments_as_valid_json():
    items = [
        sys_(),
        u("q"),
        call("c1", name="memory", args={"action": "add", "content": "z" * 2000}),
        res("c1", "ok"),
        u("a"),
        u("b"),
        u("c"),
    ]
    out, stats = st.prune_tool_results(items, protect_tail_count=3, protect_tail_tokens=None, tokens=tok)
    assert stats.args_truncated == 1
    args = json.loads(out[2]["tool_calls"][0]["function"]["arguments"])
    assert args["action"] == "add" and args["content"].endswith("...[truncated]") and len(args["content"]) < 300
    assert st.shrink_tool_args("not json {") == "not json {"


def test_pass4_demotes_bulky_tool_output_inside_an_oversized_tail():
    items = [sys_(), u("q")]
    for i in range(4):
        items += [call(f"c{i}"), res(f"c{i}", f"{i}" * 4000)]
    items += [u("what now?")]
    out, stats = st.prune_tool_results(items, protect_tail_count=20, protect_tail_tokens=600, tokens=tok)
    assert stats.pressure >= 1
    tail_tokens = sum(tok(it) for it in out[stats.boundary :])
    assert tail_tokens <= 900
    assert out[-1]["content"] == "what now?"


def test_prune_tokens_saved_and_idempotent():
    items = [sys_(), u("q")]
    for i in range(10):
        items += [call(f"c{i}"), res(f"c{i}", f"result {i} " + "w" * 1000)]
    items += [u("done?")]
    out, _stats = st.prune_tool_results(items, protect_tail_count=4, protect_tail_tokens=None, tokens=tok)
    assert sum(tok(it) for it in out) < sum(tok(it) for it in items) / 2
    again, stats2 = st.prune_tool_results(out, protect_tail_count=4, protect_tail_tokens=None, tokens=tok)
    assert stats2.total == 0 and [x["content"] for x in again] == [x["content"] for x in out]


# --------------------------------------------------------------------------- boundaries


def test_head_protection_and_forward_alignment_past_tool_results():
    items = [sys_(), u("q"), call("c1"), res("c1", "r"), a("answer"), u("q2")]
    assert st.protect_head_size(items, 3) == 4
    assert st.protect_head_size(items, 0) == 1
    assert st.align_forward(items, 3) == 4  # never start the middle on a tool result
    assert st.align_forward(items, 2) == 2


def test_tail_cut_never_splits_a_tool_group_and_keeps_the_last_user():
    items = [sys_()]
    for i in range(12):
        items += [
            u(f"question {i} " + "q" * 200),
            call(f"c{i}"),
            res(f"c{i}", "r" * 300),
            a(f"answer {i} " + "a" * 200),
        ]
    items += [u("latest question")]
    for budget in (50, 100, 200, 400, 800):
        cut = st.find_tail_cut(items, 1, budget=budget, protect_last_n=20, min_tail_user_messages=1, tokens=tok)
        assert 1 < cut < len(items)
        assert items[cut]["role"] != "tool"
        assert not (items[cut - 1].get("tool_calls"))  # the assistant's results are on its side
        assert any(it is items[-1] for it in items[cut:])
    # the backward alignment itself
    group_at = items.index(next(it for it in items if it.get("_uid") == "c-c5"))
    assert st.align_backward(items, group_at + 1) == group_at


def test_tail_has_a_message_floor_and_min_tail_user_messages():
    items = [sys_()] + [m for i in range(10) for m in (u(f"u{i} " + "x" * 400), a(f"a{i} " + "y" * 400))]
    items.append(u("final"))
    cut = st.find_tail_cut(items, 1, budget=10, protect_last_n=20, min_tail_user_messages=1, tokens=tok)
    assert len(items) - cut >= 8  # min(protect_last_n, 8) even though the budget is tiny
    cut3 = st.find_tail_cut(items, 1, budget=10, protect_last_n=3, min_tail_user_messages=5, tokens=tok)
    assert sum(1 for it in items[cut3:] if st.is_real_user(it)) >= 5


def test_summary_messages_do_not_count_as_real_users():
    summary = {"role": "user", "content": "sum", "_summary": True}
    assert not st.is_real_user(summary) and st.is_real_user(u("hi"))


# --------------------------------------------------------------------------- tool pairs


def test_sanitize_repairs_orphans_on_both_sides():
    items = [
        sys_(),
        res("gone", "orphan result"),
        u("q"),
        call("c1"),
        res("c1", "r1"),
        {
            "role": "assistant",
            "content": None,
            "_uid": "multi",
            "tool_calls": [
                {"id": "c2", "type": "function", "function": {"name": "memory", "arguments": "{}"}},
                {"id": "c3", "type": "function", "function": {"name": "memory", "arguments": "{}"}},
            ],
        },
        res("c2", "r2"),
        u("next"),
        call("c4"),
    ]
    out = st.sanitize_tool_pairs(items)
    roles = [(it["role"], it.get("tool_call_id")) for it in out]
    assert ("tool", "gone") not in roles
    multi = next(it for it in out if it.get("_uid") == "multi")
    assert [c["id"] for c in multi["tool_calls"]] == ["c2"]
    last = out[-1]
    assert "tool_calls" not in last and last["content"] == st.TOOL_CALL_REMOVED
    assert items[-1].get("tool_calls")  # input untouched


# --------------------------------------------------------------------------- the summary message


@pytest.mark.parametrize(
    "head,tail,survives,expected",
    [
        ("system", "user", True, ("user", True)),  # right after the system prompt: user, merged
        ("system", "assistant", True, ("user", False)),
        (None, "assistant", True, ("user", False)),
        ("user", "user", True, ("assistant", False)),
        ("user", "assistant", True, ("assistant", True)),  # both collide: merge
        ("assistant", "user", True, ("user", True)),
        ("assistant", "assistant", True, ("user", False)),
        ("tool", "user", True, ("assistant", False)),
        ("user", "assistant", False, ("user", False)),  # no real user anywhere: must be user
    ],
)
def test_summary_role_rule(head, tail, survives, expected):
    assert st.choose_summary_role(head, tail, user_survives=survives) == expected


def test_wrap_unwrap_and_merge():
    content = st.wrap_summary("## Goals\n- x")
    assert content.startswith(st.SUMMARY_PREFIX) and content.endswith(st.SUMMARY_END_MARKER)
    assert st.unwrap_summary(content) == "## Goals\n- x"
    merged = st.merge_summary_into(u("what next?"), content, user_leading=True)
    assert merged["content"].startswith(st.SUMMARY_PREFIX) and merged["content"].endswith("what next?")
    merged = st.merge_summary_into(a("earlier answer"), content, user_leading=False)
    assert merged["content"].startswith(st.MERGED_PRIOR_CONTEXT_HEADER)
    assert merged["content"].endswith(st.SUMMARY_END_MARKER)
    assert st.unwrap_summary(merged["content"]) == "## Goals\n- x"


@pytest.mark.parametrize(
    "raw,clean",
    [
        ("<think>plan the answer</think>## Goals\n- g", "## Goals\n- g"),
        ("<THINKING a=1>x\ny</THINKING>\n\nbody", "body"),
        ("body before <think>unterminated reasoning", "body before"),
        ("stray reasoning without an opening tag</think>the summary", "the summary"),
        ("<reasoning>r</reasoning>a<think>b</think>c", "ac"),
        ("no tags at all", "no tags at all"),
    ],
)
def test_think_blocks_are_stripped(raw, clean):
    assert st.strip_think(raw) == clean


def test_serialization_skips_summaries_strips_think_and_shows_tool_calls():
    items = [
        u("hello"),
        {"role": "assistant", "content": "<think>hidden</think>visible", "_uid": "x"},
        call("c1", args={"query": "trip"}),
        res("c1", "found 2"),
        {"role": "user", "content": "OLD SUMMARY", "_summary": True},
    ]
    text = st.serialize_for_summary(items)
    assert "[USER]: hello" in text and "[ASSISTANT]: visible" in text and "hidden" not in text
    assert 'session_search({"query": "trip"})' in text and "[TOOL RESULT session_search]: found 2" in text
    assert "OLD SUMMARY" not in text
    long = st.serialize_for_summary([u("x" * 10_000)])
    assert "...[truncated]..." in long and len(long) < 6_100


def test_summary_input_is_capped_at_160k_chars():
    text = "A" * 100_000 + "B" * 100_000 + "C" * 100_000
    out = st.bound_summary_input(text)
    assert len(out) <= st.SUMMARY_INPUT_MAX_CHARS
    assert out.startswith("A" * 1000) and out.endswith("C" * 1000)
    assert "omitted" in out and "chars from the middle" in out
    head = out.index("\n\n...[summary")
    assert abs(head - 0.45 * st.SUMMARY_INPUT_MAX_CHARS) < 200
    assert st.bound_summary_input("short") == "short"
    prompt = st.build_summary_prompt(text, previous_summary=None, focus=None, budget_tokens=2000)
    assert len(prompt) < st.SUMMARY_INPUT_MAX_CHARS + 5_000


def test_summary_prompt_update_and_focus():
    p = st.build_summary_prompt("[USER]: hi", previous_summary="## Goals\n- old", focus="travel", budget_tokens=2000)
    assert "PREVIOUS SUMMARY:\n## Goals\n- old" in p and "NEW TURNS TO INCORPORATE:\n[USER]: hi" in p
    assert 'FOCUS TOPIC: "travel"' in p
    assert "## Facts About the Person" in p and "## Open Questions" in p and "## Pending Work" in p
    assert st.is_summary_request([{"role": "user", "content": p}])
    assert not st.is_summary_request([{"role": "user", "content": "hello"}])


# --------------------------------------------------------------------------- static fallback


def test_static_fallback_is_built_from_the_middle_and_capped_at_8000_chars():
    turns = []
    for i in range(200):
        turns += [
            u(f"question {i}: how do I fix /etc/app{i}/config.yaml? " + "q" * 900),
            call(f"c{i}", name="memory", args={"action": "add", "target": "user", "content": "c" * 50}),
            res(f"c{i}", json.dumps({"success": False, "error": f"Memory full {i}"}), name="memory"),
            a(f"I saved it, see https://example.com/doc{i} " + "a" * 900),
        ]
    body = st.build_fallback_summary(turns, previous_summary="P" * 20_000, reason="the summary model timed out")
    full = st.SUMMARY_PREFIX + "\n" + body
    assert len(full) <= 8000
    assert "question 0" in body and "memory" in body and "/etc/app0/config.yaml" in body
    assert "Memory full 0" in body and "https://example.com/doc0" in body
    assert "PPPP" in body and len(body) < 8000
    small = st.build_fallback_summary(turns[:8], max_chars=2000)
    assert len(st.SUMMARY_PREFIX) + 1 + len(small) <= 2000 and "question 0" in small
    assert st.fallback_summary_limit(4000) == 2000 and st.fallback_summary_limit(1_000_000) == 8000


# --------------------------------------------------------------------------- failure classes and state


@pytest.mark.parametrize(
    "err,kind",
    [
        (LLMAuthError("HTTP 401", status=401), "auth"),
        (LLMUnavailable("cannot reach http://x: ConnectError: refused"), "network"),
        (LLMUnavailable("cannot reach http://x: RemoteProtocolError: Server disconnected"), "stream"),
        (LLMUnavailable("timed out talking to http://x (ReadTimeout)"), "timeout"),
        (LLMUnavailable("HTTP 503", status=503), "not_found"),
        (LLMUnavailable("HTTP 504", status=504), "timeout"),
        (LLMRateLimited("HTTP 429", status=429), "timeout"),
        (LLMBadResponse("non-JSON body"), "bad_response"),
        (LLMError("HTTP 404", status=404, kind="not_found"), "not_found"),
        (LLMError("bad url", kind="config"), "config"),
        (ContextLengthExceeded("too long", status=400), "other"),
    ],
)
def test_failure_classification(err, kind):
    assert classify_failure(err) == kind


def test_block_reason_cooldown_block_and_probe():
    s = CompressionState()
    assert Compressor.block_reason(s, now=1000) is None
    s.cooldown_until = 1060
    assert Compressor.block_reason(s, now=1000) == "cooldown"
    s.cooldown_until, s.fallback_streak, s.blocked_at = 0, 2, 1000
    assert Compressor.block_reason(s, now=1299) == "blocked"
    assert Compressor.block_reason(s, now=1300) == "probe"
    s.fallback_streak, s.ineffective = 0, 2
    assert Compressor.block_reason(s, now=1100) == "blocked"
    assert CompressionState.from_dict({"ineffective": "3", "blocked_at": None, "junk": 1}).ineffective == 3


# --------------------------------------------------------------------------- the wire


def _compressor() -> Compressor:
    from core.settings import AgentSettings, parse_config

    cfg = AgentSettings.from_config(parse_config({"llm": {"context_length": 4000}}))

    async def system_factory(*a):  # pragma: no cover - not used here
        raise AssertionError

    return Compressor(cfg, llm=None, tokens=TokenCounter(None), system_factory=system_factory)  # type: ignore[arg-type]


def test_wire_applies_overrides_note_role_and_merge_without_touching_storage():
    comp = _compressor()
    sid = "s1"
    system = StoredMessage(sid, "system", "You are Hermes.")
    u1 = StoredMessage(sid, "user", "first question")
    tc = StoredMessage(
        sid,
        "assistant",
        None,
        tool_calls=[
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "memory", "arguments": '{"content": "' + "z" * 900 + '"}'},
            }
        ],
    )
    tr = StoredMessage(sid, "tool", "x" * 900, tool_call_id="c1", tool_name="memory")
    summary = StoredMessage(
        sid,
        "assistant",
        st.wrap_summary("## Goals\n- g"),
        meta={
            "compressed_summary": True,
            "after_uid": system.uid,
            "overrides": {tr.uid: {"content": "[memory] add on user (900 chars result)"}},
        },
    )
    latest = StoredMessage(sid, "user", "latest question")
    wire = comp.wire([system, summary, u1, tc, tr, latest])
    assert "compacted into a handoff summary" in wire[0]["content"]
    assert system.content == "You are Hermes."  # storage untouched
    # right after the system prompt the summary must be a user message; the next message is
    # a user message too, so the summary is merged into it (no two users in a row)
    assert wire[1]["role"] == "user" and wire[1]["content"].startswith(st.SUMMARY_PREFIX)
    assert wire[1]["content"].endswith("first question")
    assert wire[3]["content"] == "[memory] add on user (900 chars result)" and tr.content == "x" * 900
    roles = [m["role"] for m in wire]
    assert roles == ["system", "user", "assistant", "tool", "user"]
    assert all(not k.startswith("_") for m in wire for k in m)
    # an orphan result left by a cut is repaired on the wire
    wire2 = comp.wire([system, summary, tr, latest])
    assert [m["role"] for m in wire2] == ["system", "user", "user"] or [m["role"] for m in wire2] == ["system", "user"]
    assert not any(m["role"] == "tool" for m in wire2)


def test_context_tokens_use_cached_counts_without_reencoding():
    comp = _compressor()
    msgs = [StoredMessage("s", "user", "hello " * 50, token_count=7) for _ in range(5)]
    assert comp.context_tokens(msgs) == 35  # the cached counts, not a recount


def test_summary_failure_cooldowns_follow_the_seed_ladder(monkeypatch):
    from agent import compression as comp_mod

    monkeypatch.setattr(comp_mod, "wall_clock", lambda: 1000.0)
    state = CompressionState()
    timeout = LLMUnavailable("timed out talking to http://x (ReadTimeout)")
    cooldowns = []
    for _ in range(4):
        f = Compressor._record_failure(state, timeout, classify_failure(timeout))
        cooldowns.append(state.cooldown_until - 1000.0)
        assert not f.abort
    assert cooldowns == [60.0, 300.0, 900.0, 900.0]
    Compressor._record_failure(state, LLMBadResponse("x"), "bad_response")
    assert state.cooldown_until == 1030.0
    f = Compressor._record_failure(state, LLMAuthError("HTTP 403", status=403), "auth")
    assert f.abort and state.cooldown_until == 1060.0
    Compressor._record_failure(state, LLMError("bad url", kind="config"), "config")
    assert state.cooldown_until == 1600.0


def test_agent_threshold_uses_per_model_thresholds_and_the_cap():
    from agent.turn import Agent
    from core.settings import AgentSettings, parse_config

    cfg = parse_config(
        {
            "llm": {"model": "glm-5.2-1M", "context_length": 1_000_000, "max_tokens": 8000},
            "compression": {"model_thresholds": {"glm-5.2": 0.4}},
        }
    )
    agent = Agent(AgentSettings.from_config(cfg), llm=None, tokens=TokenCounter(None))  # type: ignore[arg-type]
    assert agent.threshold_tokens() == 400_000 - 8000
    cfg = parse_config({"llm": {"context_length": 1_000_000}, "compression": {"threshold_tokens": 120_000}})
    assert Agent(AgentSettings.from_config(cfg), llm=None, tokens=TokenCounter(None)).threshold_tokens() == 120_000  # type: ignore[arg-type]
