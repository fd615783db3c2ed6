"""Every answer has a deadline: a model that streams without end is cut at
`llm.answer_timeout_s`, what it wrote is kept flagged as cut, the person is told and the lane
is free again; an answer always carries a `max_tokens`; an empty answer reads as a sentence."""

from __future__ import annotations

import asyncio
import re
import time

from agent.llm import LLMAnswerTimeout, LLMClient
from agent.turn import EMPTY_ANSWER, NO_TOOL_ANSWER
from gateway.build import build_gateway
from tests.conftest import RecordingAdapter, dm
from tests.fakes.llm import endless, hang, reply, tool_call
from tests.test_stop_busy import stored, until

FAST = {"stream_edit_interval_s": 0.1}


async def test_a_model_streaming_without_end_is_cut_at_the_answer_deadline_and_the_lane_is_freed(fake_llm, config_for):
    fake_llm.script(endless("and more", every_s=0.05))
    cfg = config_for(delivery=FAST, llm={"answer_timeout_s": 1.5})
    adapter = RecordingAdapter()
    app = build_gateway(cfg, [adapter])
    await app.start()
    try:
        started = time.monotonic()
        await adapter.sink(dm("ann", "tell me everything"))
        assert await app.drain(10), "the runaway answer still holds the lane"
        assert time.monotonic() - started < 6
        final = adapter.edits[-1][1] if adapter.edits else adapter.texts()[-1]
        assert final.startswith("and more and more")
        assert final.endswith("(The answer was cut: the model was still writing after 1.5 seconds.)")
        before = len(adapter.sent)
        await adapter.sink(dm("ann", "and now?"))  # the lane answers the next message
        assert await app.drain(10)
        assert adapter.texts()[before:] == ["ok: and now?"]
    finally:
        await app.stop()
    cut = [m for m in await stored(cfg, "testchat-ann") if m.meta.get("cut")]
    assert len(cut) == 1 and cut[0].role == "assistant" and cut[0].finish_reason == "deadline"
    assert cut[0].content.startswith("and more") and "cut" not in cut[0].content


async def test_the_deadline_covers_the_whole_answer_not_the_gap_between_bytes(fake_llm):
    fake_llm.script(endless("tick", every_s=0.05))
    client = LLMClient(fake_llm.base_url, "fake-model", timeout_s=10, answer_timeout_s=0.5)
    try:
        seen: list[str] = []
        result = await asyncio.wait_for(
            client.chat([{"role": "user", "content": "go"}], on_text=seen.append), timeout=5
        )
    finally:
        await client.aclose()
    assert result.cut and result.finish_reason == "deadline" and result.tool_calls is None
    assert result.content == seen[-1] and result.content.startswith("tick tick")


async def test_an_answer_with_no_text_by_the_deadline_is_an_error_that_keeps_the_message(fake_llm, config_for):
    fake_llm.script(endless("x", every_s=0.05))
    client = LLMClient(fake_llm.base_url, "fake-model", timeout_s=10, answer_timeout_s=0.5)
    try:
        try:
            await asyncio.wait_for(client.chat([{"role": "user", "content": "go"}]), timeout=5)
        except LLMAnswerTimeout as err:
            assert "kept" in err.user_message and "answer_timeout_s=0.5" in err.detail
        else:
            raise AssertionError("no deadline")
    finally:
        await client.aclose()


async def test_every_answer_is_sent_with_a_max_tokens(fake_llm, config_for):
    adapter = RecordingAdapter()
    app = build_gateway(config_for(llm={"context_length": 8192}), [adapter])
    await app.start()
    try:
        await adapter.sink(dm("bo", "hi"))
        assert await app.drain(10)
    finally:
        await app.stop()
    assert fake_llm.requests[0]["max_tokens"] == 2048  # a quarter of the window, at most 4096


async def test_an_empty_model_answer_reads_as_a_sentence_not_no_answer(fake_llm, config_for):
    fake_llm.script(reply(""))
    adapter = RecordingAdapter()
    app = build_gateway(config_for(delivery={"streaming": "off"}), [adapter])
    await app.start()
    try:
        await adapter.sink(dm("cy", "hello?"))
        assert await app.drain(10)
    finally:
        await app.stop()
    assert adapter.texts() == [EMPTY_ANSWER]


async def test_tool_iterations_used_up_without_an_answer_say_so(fake_llm, config_for):
    fake_llm.script(*[tool_call("session_search", {"query": f"q{i}"}) for i in range(2)], reply(""))
    adapter = RecordingAdapter()
    app = build_gateway(config_for(delivery={"streaming": "off"}, limits={"max_tool_iterations": 2}), [adapter])
    await app.start()
    try:
        await adapter.sink(dm("di", "search a lot"))
        assert await app.drain(10)
    finally:
        await app.stop()
    assert adapter.texts() == [NO_TOOL_ANSWER]


async def test_a_console_message_kept_after_ctrl_c_is_left_to_the_next_chat(fake_llm, config_for, caplog):
    fake_llm.script(hang(30))
    cfg = config_for()
    console = RecordingAdapter("console")
    app = build_gateway(cfg, [console])
    await app.start()
    await console.sink(dm("eve", "are you there?", platform="console"))
    await until(lambda: len(fake_llm.requests) == 1)
    await app.stop(drain_timeout=0)  # as `chat` does after Ctrl-C: the message stays pending
    fake_llm.reset()

    telegram = RecordingAdapter("telegram")
    app = build_gateway(cfg, [telegram])  # `run` serves telegram only
    await app.start()
    try:
        assert await app.drain(10)
    finally:
        await app.stop()
    assert fake_llm.requests == [] and "reply dropped" not in caplog.text

    console = RecordingAdapter("console")
    app = build_gateway(cfg, [console])  # the next chat answers it
    await app.start()
    try:
        assert await app.drain(10)
    finally:
        await app.stop()
    assert console.texts() == ["ok: are you there?"]


async def test_a_long_answer_goes_out_as_one_page_and_the_rest_on_request(fake_llm, config_for):
    answer = " ".join(f"word{i:04d}" for i in range(1500))  # 13,499 characters
    fake_llm.script(answer)
    adapter = RecordingAdapter(max_message_length=400)
    app = build_gateway(config_for(delivery={**FAST, "max_reply_chars": 5000}), [adapter])
    await app.start()
    try:
        await adapter.sink(dm("fay", "count to 1500"))
        assert await app.drain(10)
        first = _shown(adapter)
        assert len(first) <= 5000 + 100 and "send /more for the next part" in first
        assert len(adapter.sent) <= 14, "a draft grew past the first page"
        pages = [first]
        for _ in range(3):  # two more pages, then nothing
            before = len(adapter.sent)
            await adapter.sink(dm("fay", "/more"))
            assert await app.drain(10)
            pages.append("\n".join(out.text for out in adapter.sent[before:]))
    finally:
        await app.stop()
    assert pages[-1] == "There's nothing more of my last answer to send."
    offer = re.compile(r"\(The answer goes on for [\d,]+ more characters: send /more for the next part\.\)")
    words = " ".join(offer.sub("", p) for p in pages[:-1]).split()
    assert words == answer.split(), "every word once, in order"
    assert "send /more" not in pages[-2]


def _shown(adapter: RecordingAdapter) -> str:
    """The reply as the chat shows it now: each message's latest text, joined."""
    shown = {f"bot-{i + 1}": out.text for i, out in enumerate(adapter.sent)}
    for sent, text in adapter.edits:
        shown[sent.message_id] = text
    return "\n".join(shown.values())
