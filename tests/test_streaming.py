"""Streaming replies (docs/concepts.md#streaming-replies): the model streams over SSE, the answer is
edited into one chat message as it grows and ends formatted; /stop mid-stream keeps the
partial answer flagged `interrupted`; servers that cannot stream still answer."""

from __future__ import annotations

import json

import pytest

from agent.sessions import SessionStore
from core.text import split_text
from gateway.build import build_gateway
from tenancy.keys import tenant_dir
from tests.conftest import RecordingAdapter, dm, make_config
from tests.fakes.llm import FakeLLM, paused, reply, tool_call
from tests.fakes.telegram_api import FakeTelegram
from tests.test_stop_busy import assert_no_orphan_tool_calls, stored, until
from tests.test_telegram_e2e import TOKEN, TOKEN_ENV, gateway, tg_config

FAST = {"stream_edit_interval_s": 0.1}  # the edit pace, shortened so the tests run quickly


@pytest.fixture
async def tg(monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    async with FakeTelegram(token=TOKEN, bot_username="hermes_test_bot") as fake:
        yield fake


async def test_streamed_reply_is_edited_in_place_and_ends_formatted(tg, fake_llm, config_for):
    answer = "Here is **the plan**: first we pack, then we drive north, then we rest."
    fake_llm.script(paused(answer, after_chars=12))
    async with gateway(tg_config(config_for, tg, {"delivery": FAST})) as (app, _adapter):
        tg.push_private(111, "what's the plan?")
        await tg.wait_sent(1, 111)
        draft = tg.sent_messages(111)[0]
        assert draft["text"].startswith("Here is") and draft["text"].endswith("…")
        assert "drive north" not in draft["text"]  # shown while the model was still writing
        fake_llm.resume_streams()
        assert await app.drain(10)
        sent = tg.sent_messages(111)
    assert len(sent) == 1, "the answer stays in one message"
    edits = tg.calls_of("editMessageText")
    assert edits and {int(e["message_id"]) for e in edits} == {sent[0]["message_id"]}
    final = edits[-1]
    assert final["parse_mode"] == "HTML" and "<b>the plan</b>" in final["text"]
    assert sent[0]["text"] == answer.replace("**", "")  # the visible final text, no cursor
    assert fake_llm.requests[0]["stream"] is True
    assert fake_llm.requests[0]["stream_options"] == {"include_usage": True}


async def test_long_streamed_answer_continues_in_further_messages(fake_llm, config_for):
    answer = " ".join(f"word{i}" for i in range(60))  # ~ 400 chars, limit 120
    fake_llm.script(paused(answer, after_chars=200, chunk_chars=20))
    adapter = RecordingAdapter(max_message_length=120)
    app = build_gateway(config_for(delivery=FAST), [adapter])
    await app.start()
    try:
        await adapter.sink(dm("dee", "count for me"))
        await until(lambda: len(adapter.sent) >= 2)  # the draft already spilled over the limit
        fake_llm.resume_streams()
        assert await app.drain(10)
    finally:
        await app.stop()
    shown = {}
    for i, out in enumerate(adapter.sent):
        shown[f"bot-{i + 1}"] = out.text
    for sent, text in adapter.edits:
        shown[sent.message_id] = text
    expected = split_text(answer, 120, len)
    assert list(shown.values()) == expected
    assert adapter.sent[0].reply_to_message_id is not None
    assert all(out.reply_to_message_id is None for out in adapter.sent[1:])


async def test_stop_mid_stream_leaves_an_interrupted_message_and_no_orphan_tool_call(fake_llm, config_for):
    fake_llm.script(
        tool_call("session_search", {"query": "trip"}),
        paused("Partial answer that goes on and on about the trip", after_chars=16),
    )
    cfg = config_for(delivery=FAST)
    adapter = RecordingAdapter()
    app = build_gateway(cfg, [adapter])
    await app.start()
    try:
        await adapter.sink(dm("eve", "tell me about my trip"))
        await until(lambda: len(adapter.sent) >= 1)  # the draft is in the chat
        await adapter.sink(dm("eve", "/stop"))
        assert await app.drain(10)
        assert adapter.texts()[-1] == "Stopped."
        assert adapter.edits[-1][1] == "Partial answer t\n\n(stopped)"
        before = len(adapter.sent)
        await adapter.sink(dm("eve", "fine, something else"))
        assert await app.drain(10)
        assert adapter.texts()[before:] == ["ok: fine, something else"]
        assert fake_llm.violations == []
    finally:
        fake_llm.resume_streams()
        await app.stop()
    msgs = await stored(cfg, "testchat-eve")
    interrupted = [m for m in msgs if m.meta.get("interrupted")]
    assert [(m.role, m.content, m.finish_reason) for m in interrupted] == [
        ("assistant", "Partial answer t", "interrupted")
    ]
    assert_no_orphan_tool_calls(msgs)
    # the next turn's request carried the partial answer as what the assistant said
    last = fake_llm.requests[-1]["messages"]
    assert {"role": "assistant", "content": "Partial answer t"} in last


@pytest.mark.parametrize("server", ["reject", "ignore"])
async def test_streaming_falls_back_when_the_server_does_not_stream(tmp_path, server):
    async with FakeLLM(streaming=server) as llm:
        llm.script(reply("first answer"), reply("second answer"))
        adapter = RecordingAdapter()
        app = build_gateway(make_config(tmp_path / "data", llm.base_url, delivery=FAST), [adapter])
        await app.start()
        try:
            for text in ("one", "two"):
                await adapter.sink(dm("fay", text))
                assert await app.drain(10)
        finally:
            await app.stop()
        assert adapter.texts() == ["first answer", "second answer"]
        if server == "reject":  # refused once, then asked without streaming from then on
            assert llm.statuses == [400, 200, 200]
            assert [bool(r.get("stream")) for r in llm.requests] == [True, False, False]
        else:
            assert llm.statuses == [200, 200]


async def test_usage_is_recorded_when_streaming(fake_llm, config_for):
    fake_llm.script(paused("a streamed answer with usage", after_chars=1000))  # never pauses
    cfg = config_for(delivery=FAST)
    adapter = RecordingAdapter()
    app = build_gateway(cfg, [adapter])
    await app.start()
    try:
        await adapter.sink(dm("gus", "how much?"))
        assert await app.drain(10)
    finally:
        await app.stop()
    assert adapter.texts() == ["a streamed answer with usage"]
    assert adapter.edits == []  # a quick answer arrives whole: no draft, no edits
    usage = json.loads(fake_llm.streamed[0][-1])["usage"]  # the final chunk carries it
    assert usage["prompt_tokens"] > 0
    async with SessionStore(tenant_dir(cfg.data_dir, "testchat-gus")) as store:
        (info,) = await store.list_sessions()
    assert (info["input_tokens"], info["output_tokens"]) == (usage["prompt_tokens"], usage["completion_tokens"])


async def test_streamed_reply_is_edited_in_place_on_discord(fake_llm, config_for):
    from adapters.discord_bot import DiscordAdapter
    from tests.fakes.discord_api import FakeDiscord

    answer = "Streaming on Discord works: one message, edited as the words arrive."
    fake_llm.script(paused(answer, after_chars=10))
    async with FakeDiscord() as fake:
        alice = fake.add_user("alice")
        cfg = config_for(
            delivery=FAST,
            platforms={"discord": {"enabled": True, "api_base": fake.api_base, "gateway_url": fake.gateway_url}},
        )
        adapter = DiscordAdapter(cfg.platforms.discord, fake.token, ready_timeout=10, guild_ready_timeout=0.05)
        app = build_gateway(cfg, [adapter])
        await app.start()
        try:
            fake.push_dm(alice, "stream please")
            channel = fake.dm_channels[alice]
            await fake.wait_until(lambda: len(fake.sent_messages(channel)) >= 1, 10)
            assert fake.sent_messages(channel)[0]["content"].endswith("…")
            fake_llm.resume_streams()
            assert await app.drain(10)
            (sent,) = fake.sent_messages(channel)
        finally:
            await app.stop(drain_timeout=5)
    assert sent["content"] == answer
    assert sent.get("edits"), "the draft was edited into the answer"


async def test_a_final_text_that_cannot_be_edited_in_is_sent_anew():
    import asyncio

    from core.messages import SentMessage
    from gateway.streaming import StreamingReply

    sent: list[str] = []
    refuse_edits = False

    async def send(chunk: str, first: bool) -> SentMessage:
        sent.append(chunk)
        return SentMessage(chat_id="c", message_id=str(len(sent)))

    async def edit(message: SentMessage, chunk: str) -> bool:
        return not refuse_edits

    reply_ = StreamingReply(send, edit, lambda t: split_text(t, 4000, len), interval_s=0.1)
    reply_.feed("the beginning")
    while not reply_.started:
        await asyncio.sleep(0.02)
    refuse_edits = True  # e.g. the message was deleted meanwhile
    first = await reply_.finish("the beginning and the end")
    assert sent == ["the beginning …", "the beginning and the end"]
    assert first is not None and first.message_id == "2"


async def test_llm_client_assembles_streamed_tool_calls_and_usage(fake_llm):
    from agent.llm import LLMClient

    fake_llm.script(
        tool_call(
            "memory",
            {"action": "add", "target": "user", "content": "likes tea"},
            call_id="call_abc",
            content="Saving that.",
        )
    )
    seen: list[str] = []
    async with LLMClient(fake_llm.base_url, "fake-model", max_retries=0) as client:
        result = await client.chat([{"role": "user", "content": "I like tea"}], on_text=seen.append)
    assert len(fake_llm.streamed) == 1 and len(fake_llm.streamed[0]) > 4  # really streamed
    assert result.tool_calls == [
        {
            "id": "call_abc",
            "type": "function",
            "function": {
                "name": "memory",
                "arguments": json.dumps({"action": "add", "target": "user", "content": "likes tea"}),
            },
        }
    ]
    assert result.content == "Saving that." and seen[-1] == "Saving that."
    assert result.finish_reason == "tool_calls"
    assert result.usage is not None and result.usage.completion_tokens > 0
