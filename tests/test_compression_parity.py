"""Compression behaviours checked against the upstream Hermes compressor (docs/concepts.md#context-compression):
redaction of the static fallback, the cooldown's cause, the threshold floor, usage reset."""

from __future__ import annotations

import pytest

from agent import compression as compression_mod
from agent.compression import CompressionState, Compressor
from agent.compression_stages import (
    build_fallback_summary,
    compute_threshold_tokens,
    is_summary_request,
    serialize_for_summary,
)
from agent.tokens import TokenCounter
from agent.turn import Agent
from core.settings import AgentSettings, ConfigError, parse_config
from gateway.build import build_gateway
from tests.conftest import RecordingAdapter, dm, say
from tests.fakes.llm import reply

GH_TOKEN = "ghp_0123456789abcdefghijABCDEFGHIJ012345"
SK_KEY = "sk-proj-abcdefghijklmnopqrstuvwx1234"


def _turns() -> list[dict]:
    return [
        {"role": "user", "content": "deploy with my token please", "_uid": "u1"},
        {
            "role": "assistant",
            "content": None,
            "_uid": "a1",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "shell", "arguments": f'{{"cmd": "export GH={GH_TOKEN}"}}'},
                }
            ],
        },
        {
            "role": "tool",
            "tool_call_id": "c1",
            "_uid": "t1",
            "content": f"error: push failed for {GH_TOKEN}; config api_key={SK_KEY} Authorization: Bearer abcdef0123456789",
        },
        {"role": "assistant", "content": f"I saw your key {SK_KEY} in the logs", "_uid": "a2"},
    ]


def test_static_fallback_summary_redacts_tokens_and_keys() -> None:
    body = build_fallback_summary(_turns(), reason="the summary model timed out")
    assert GH_TOKEN not in body and SK_KEY not in body and "abcdef0123456789" not in body
    assert "[REDACTED]" in body
    assert "push failed" in body  # the rest of the error survives


def test_summary_input_redacts_tokens_and_keys() -> None:
    text = serialize_for_summary(_turns())
    assert GH_TOKEN not in text and SK_KEY not in text and "[REDACTED]" in text


def _compressor(**sections) -> Compressor:
    cfg = parse_config(sections)
    return Compressor(AgentSettings.from_config(cfg), None, TokenCounter(None), system_factory=None)  # type: ignore[arg-type]


@pytest.mark.parametrize("cause, aborts", [("auth", True), ("network", True), ("timeout", False), ("not_found", False)])
async def test_compression_cooldown_remembers_why_it_started(monkeypatch, cause: str, aborts: bool) -> None:
    monkeypatch.setattr(compression_mod, "wall_clock", lambda: 1000.0)
    comp = _compressor()
    state = CompressionState(cooldown_until=1060.0, cooldown_kind=cause)
    turns = [{"role": "user", "content": f"turn {i}", "_uid": f"u{i}"} for i in range(4)]
    body, fallback, failure = await comp._summarize(turns, None, None, state, "context", 100, None)
    assert failure is not None
    assert failure.abort is aborts
    assert (body is None) is aborts and fallback is (not aborts)
    assert CompressionState.from_dict(state.to_dict()).cooldown_kind == cause  # persisted with the state


def test_threshold_cannot_collapse_when_max_tokens_is_most_of_the_window() -> None:
    # 75% of 32768 = 24576; a max_tokens of 30000 used to leave a threshold of 1 token
    assert compute_threshold_tokens(context_length=32768, threshold=0.5, max_tokens=30000) == 12288
    cfg = parse_config({"llm": {"context_length": 32768, "max_tokens": 24576}})
    assert Agent(AgentSettings.from_config(cfg), llm=None, tokens=TokenCounter(None)).threshold_tokens() == 12288  # type: ignore[arg-type]


def test_max_tokens_not_smaller_than_the_window_is_refused_naming_the_key() -> None:
    with pytest.raises(ConfigError) as err:
        parse_config({"llm": {"context_length": 8192, "max_tokens": 8192}})
    assert "llm" in str(err.value) and "max_tokens" in str(err.value)


async def test_a_response_without_usage_resets_the_prompt_token_count(config_for, fake_llm) -> None:
    ctx_len = 4000
    threshold = compute_threshold_tokens(context_length=ctx_len, threshold=0.5)
    adapter = RecordingAdapter()
    app = build_gateway(config_for(llm={"context_length": ctx_len}, limits={"rate_limit_per_minute": 1000}), [adapter])
    await app.start()
    try:
        await say(app, adapter, dm("una", "hello"))
        fake_llm.script(reply("ok", usage={"prompt_tokens": threshold}))  # the server's count: at the threshold
        await say(app, adapter, dm("una", "second"))
        fake_llm.script(reply("ok", usage=False))  # a server that sends no usage (the next request)
        async with app.profiles.use("testchat-una") as profile:
            sid = await profile.sessions.route("agent:main:testchat:dm:dm-una")
            assert (await profile.sessions.compression_state(sid))["last_prompt_tokens"] == threshold
        # the stale count still triggers once (it was true for the last request) ...
        fake_llm.responder = lambda req: reply("SUMMARY") if is_summary_request(req["messages"]) else None
        await say(app, adapter, dm("una", "third"))
        async with app.profiles.use("testchat-una") as profile:
            sid = await profile.sessions.route("agent:main:testchat:dm:dm-una")
            state = await profile.sessions.compression_state(sid)
        assert state["last_prompt_tokens"] == 0  # ... but a response without usage resets it
    finally:
        await app.stop()
