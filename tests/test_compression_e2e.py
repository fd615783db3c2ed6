"""Context compression end to end: GatewayApp + RecordingAdapter + the fake LLM server, with
a small context window so compression happens within a few turns."""

from __future__ import annotations

import json
from contextlib import asynccontextmanager

import pytest

from agent import compression as compression_mod
from agent.compression import BLOCKED_WARNING
from agent.compression_stages import (
    SUMMARY_END_MARKER,
    compute_threshold_tokens,
    is_summary_request,
)
from tests.conftest import dm, running_gateway, say
from tests.fakes.llm import error, message_text, prompt_chars, reply, tool_call, tool_calls

CTX = 4000  # llm.context_length in these tests
THRESHOLD = compute_threshold_tokens(context_length=CTX, threshold=0.5)  # 0.75 floor -> 3000
KEY = "agent:main:testchat:dm:dm-{}"
FILLER = "lorem ipsum dolor sit amet consectetur adipiscing elit sed do eiusmod tempor "  # 78 chars


def words(n_chars: int, tag: str = "") -> str:
    text = (tag + " " if tag else "") + FILLER * (n_chars // len(FILLER) + 1)
    return text[:n_chars]


def summary_requests(fake_llm) -> list[dict]:
    return [r for r in fake_llm.requests if is_summary_request(r.get("messages") or [])]


def chat_requests(fake_llm) -> list[dict]:
    return [r for r in fake_llm.requests if not is_summary_request(r.get("messages") or [])]


def summary_text(request: dict) -> str:
    return message_text(request["messages"][0])


class Model:
    """A scripted model: summary requests get numbered summaries (or the given failures),
    chat requests get `reply_text`."""

    def __init__(self, reply_text: str = "ok") -> None:
        self.reply_text = reply_text
        self.summaries = 0
        self.summary_failure = None  # a Response to answer summary requests with, or None
        self.fail_model: str | None = None  # summary requests for this model get summary_failure

    def __call__(self, request: dict):
        if is_summary_request(request.get("messages") or []):
            if self.summary_failure is not None and (
                self.fail_model is None or request.get("model") == self.fail_model
            ):
                return self.summary_failure
            self.summaries += 1
            return reply(f"<think>scratch work</think>## Goals\n- SUMMARY-{self.summaries}")
        return reply(self.reply_text)


def gateway(config_for, **sections):
    """A running gateway with this file's small context window."""
    sections["llm"] = {"context_length": CTX, **sections.get("llm", {})}
    return running_gateway(config_for, **sections)


@asynccontextmanager
async def store_of(app, user: str):
    async with app.profiles.use(f"testchat-{user}") as profile:
        yield profile.sessions


async def live_history(app, user: str, **kw):
    async with store_of(app, user) as store:
        sid = await store.route(KEY.format(user))
        return sid, await store.history(sid, **kw)


async def chat(app, adapter, user: str, texts) -> list[str]:
    out = []
    for t in texts:
        out += await say(app, adapter, dm(user, t))
    return out


# --------------------------------------------------------------------------- trigger


async def test_compression_triggers_at_the_computed_threshold_not_before(config_for, fake_llm):
    model = Model()
    fake_llm.responder = model
    async with gateway(config_for) as (app, adapter):
        assert app.agent.threshold_tokens() == THRESHOLD == 3000
        await chat(app, adapter, "ann", [f"message {i} {words(1000)}" for i in range(9)])
        assert summary_requests(fake_llm) == []

        def next_estimate(text: str) -> int:
            last = chat_requests(fake_llm)[-1]
            return (prompt_chars(last) + len("ok") + len(text)) // 4

        # fill to exactly one token under the threshold
        text = "y" * (4 * (THRESHOLD - 1) - prompt_chars(chat_requests(fake_llm)[-1]) - len("ok"))
        assert next_estimate(text) == THRESHOLD - 1
        await say(app, adapter, dm("ann", text))
        assert summary_requests(fake_llm) == [], "compressed before reaching the threshold"
        assert prompt_chars(chat_requests(fake_llm)[-1]) // 4 == THRESHOLD - 1
        # now exactly at the threshold: compressed before the request
        sent_before = len(chat_requests(fake_llm))
        text = "z" * (4 * THRESHOLD - prompt_chars(chat_requests(fake_llm)[-1]) - len("ok"))
        assert next_estimate(text) == THRESHOLD and text
        await say(app, adapter, dm("ann", text))
        assert len(summary_requests(fake_llm)) == 1
        after = chat_requests(fake_llm)[sent_before:]
        assert len(after) == 1
        # the summary was made before that request, and the request carries it
        assert fake_llm.requests.index(summary_requests(fake_llm)[0]) < fake_llm.requests.index(after[0])
        assert any(SUMMARY_END_MARKER in message_text(m) for m in after[0]["messages"])
        assert prompt_chars(after[0]) // 4 < THRESHOLD * 0.8
        assert fake_llm.violations == []


async def test_server_prompt_count_after_a_response_triggers_compression(config_for, fake_llm):
    model = Model()
    fake_llm.responder = model
    async with gateway(config_for) as (app, adapter):
        await chat(app, adapter, "bea", [f"note {i}: {words(300)}" for i in range(6)])
        assert summary_requests(fake_llm) == []
        # the server counts one token under: nothing happens on the next turn
        fake_llm.script(reply("ok", usage={"prompt_tokens": THRESHOLD - 1}))
        await chat(app, adapter, "bea", ["short", "short again"])
        assert summary_requests(fake_llm) == []
        # the server counts the threshold (e.g. tool schemas the estimate misses): compress next
        fake_llm.script(reply("ok", usage={"prompt_tokens": THRESHOLD}))
        await say(app, adapter, dm("bea", "short"))
        assert summary_requests(fake_llm) == []
        await say(app, adapter, dm("bea", "and now?"))
        assert len(summary_requests(fake_llm)) == 1
        _sid, history = await live_history(app, "bea")
        assert sum(1 for m in history if m.meta.get("compressed_summary")) == 1


# --------------------------------------------------------------------------- pipeline


async def test_summary_request_gets_the_middle_not_head_or_tail_and_tool_pairs_stay_whole(config_for, fake_llm):
    model = Model()

    def responder(request):
        msgs = request["messages"]
        if not is_summary_request(msgs) and msgs[-1]["role"] == "user" and "SEARCH" in msgs[-1]["content"]:
            query = msgs[-1]["content"].split()[-1]
            if "TWICE" in msgs[-1]["content"]:  # two calls in one message: a group of two results
                return tool_calls([("session_search", {"query": query}), ("memory", {"action": "remove"})])
            return tool_call("session_search", {"query": query})
        return model(request)

    fake_llm.responder = responder
    async with gateway(config_for) as (app, adapter):
        # the head (system + 3 messages) ends inside a tool group: the cut must move past it
        texts = ["HEAD-0 SEARCH TWICE HEAD-0", f"HEAD-1 {words(150)}"]
        texts += [f"MID-{i} {words(800)}" if i % 3 else f"MID-{i} SEARCH MID-{i}" for i in range(30)]
        for t in texts:
            await say(app, adapter, dm("cai", t))
            if summary_requests(fake_llm):
                break
        assert len(summary_requests(fake_llm)) == 1, "the history should have crossed the threshold"
        request_text = summary_text(summary_requests(fake_llm)[0])
        async with store_of(app, "cai") as store:
            sid = await store.route(KEY.format("cai"))
            every = await store.history(sid, include_inactive=True)
            live = await store.history(sid)
        compacted = [m for m in every if m.compacted]
        kept = [m for m in live if not m.meta.get("compressed_summary")]
        assert compacted and kept
        system_prompt = kept[0].content
        assert kept[0].role == "system" and system_prompt[:60] not in request_text
        for m in compacted:
            marker = (m.content or "").split(" ")[0]
            if marker.startswith(("MID-", "HEAD-")):
                assert marker in request_text
        for m in kept[1:]:
            marker = (m.content or "").split(" ")[0]
            if marker.startswith(("MID-", "HEAD-")):
                assert f"{marker} " not in request_text, f"kept message {marker} was sent to the summariser"
        # head protection: the first three messages (and the rest of their tool group) survive
        assert [m.role for m in kept[1:5]] == ["user", "assistant", "tool", "tool"]
        # a cut never separates a tool call from its result: both sides share the same fate
        fate = {c["id"]: m.compacted for m in every if m.role == "assistant" for c in m.tool_calls or []}
        for m in every:
            if m.role == "tool":
                assert fate[m.tool_call_id] == m.compacted, f"tool result {m.tool_call_id} split from its call"
        # no request ever held an orphan tool call or tool result (the fake checks strictly)
        assert fake_llm.violations == []
        for request in chat_requests(fake_llm):
            pending: set[str] = set()
            for msg in request["messages"]:
                if msg["role"] == "tool":
                    assert msg["tool_call_id"] in pending
                    pending.discard(msg["tool_call_id"])
                else:
                    assert not pending
                    pending = {c["id"] for c in msg.get("tool_calls") or []}
            assert not pending
        # the summary sits between head and tail, ends with the END line, think block stripped
        summary = next(m for m in live if m.meta.get("compressed_summary"))
        assert live.index(summary) == 5  # system, HEAD-0, its tool call, two results
        assert summary.content.rstrip().endswith(SUMMARY_END_MARKER)
        assert "scratch work" not in summary.content and "SUMMARY-1" in summary.content
        # the system prompt got the note on the wire, not in storage
        last = chat_requests(fake_llm)[-1]["messages"]
        assert "compacted into a handoff summary" in last[0]["content"]
        assert "compacted into a handoff summary" not in system_prompt
        # originals are still found by session_search and exported
        found = await store_search(app, "cai", compacted[-1].content.split(" ")[0])
        assert any(h["compacted"] for h in found)
        out = await say(app, adapter, dm("cai", "/export"))
        assert "Exported" in out[0]
        async with app.profiles.use("testchat-cai") as profile:
            (export_file,) = (profile.path / "exports").glob("export-*.json")
        exported = {m["uid"]: m for sess in json.loads(export_file.read_text())["sessions"] for m in sess["messages"]}
        assert all(exported[m.uid]["compacted"] and exported[m.uid]["content"] == m.content for m in compacted)


async def store_search(app, user, query):
    async with store_of(app, user) as store:
        return await store.search(query)


async def test_second_compression_updates_the_first_summary(config_for, fake_llm):
    model = Model()
    fake_llm.responder = model
    async with gateway(config_for) as (app, adapter):
        texts = [f"HEAD-{i} {words(120)}" for i in range(2)] + [f"turn-{i} {words(900)}" for i in range(30)]
        for t in texts:
            await say(app, adapter, dm("dan", t))
            if len(summary_requests(fake_llm)) == 2:
                break
        first, second = summary_requests(fake_llm)[:2]
        assert "PREVIOUS SUMMARY" not in summary_text(first)
        assert "PREVIOUS SUMMARY:\n## Goals\n- SUMMARY-1" in summary_text(second)
        # protect_first_n decayed to 0: the old head is summarised the second time
        assert "HEAD-0" in summary_text(second) and "HEAD-0" not in summary_text(first)
        sid, live = await live_history(app, "dan")
        summaries = [m for m in live if m.meta.get("compressed_summary")]
        assert len(summaries) == 1 and "SUMMARY-2" in summaries[0].content
        assert live[0].role == "system" and live[1] is summaries[0]
        _, every = await live_history(app, "dan", include_inactive=True)
        old = [m for m in every if m.meta.get("compressed_summary") and "SUMMARY-1" in m.content]
        assert len(old) == 1 and old[0].compacted
        async with store_of(app, "dan") as store:
            assert (await store.session_info(sid))["compressions"] == 2
            assert "SUMMARY-2" in (await store.session_info(sid))["summary"]
        assert fake_llm.violations == []


# --------------------------------------------------------------------------- failures


async def fill_until_summary_request(app, adapter, fake_llm, user, n=30, size=900):
    before = len(summary_requests(fake_llm))
    for i in range(n):
        await say(app, adapter, dm(user, f"fill-{i} {words(size)}"))
        if len(summary_requests(fake_llm)) > before:
            return
    raise AssertionError("no compression happened")


async def test_auxiliary_model_failure_retries_on_the_main_model(config_for, fake_llm):
    model = Model()
    model.summary_failure = error(404, {"error": {"message": "model aux-model does not exist"}})
    model.fail_model = "aux-model"
    fake_llm.responder = model
    async with gateway(config_for, auxiliary={"compression": {"model": "aux-model"}}) as (app, adapter):
        await fill_until_summary_request(app, adapter, fake_llm, "eve")
        sreqs = summary_requests(fake_llm)
        assert [r["model"] for r in sreqs] == ["aux-model", "fake-model"]
        assert "max_tokens" not in sreqs[0] and "max_tokens" not in sreqs[1]
        assert "tools" not in sreqs[1]
        _sid, live = await live_history(app, "eve")
        summary = next(m for m in live if m.meta.get("compressed_summary"))
        assert "SUMMARY-1" in summary.content and not summary.meta["fallback"]
        assert not any("simpler local summary" in t for t in adapter.texts())


async def test_summary_failure_on_both_models_uses_the_static_fallback_and_says_so(config_for, fake_llm):
    model = Model()
    model.summary_failure = error(503, {"error": {"message": "overloaded"}})
    fake_llm.responder = model
    async with gateway(config_for, auxiliary={"compression": {"model": "aux-model"}}) as (app, adapter):
        await fill_until_summary_request(app, adapter, fake_llm, "fay")
        assert {r["model"] for r in summary_requests(fake_llm)} == {"aux-model", "fake-model"}
        sid, live = await live_history(app, "fay")
        summary = next(m for m in live if m.meta.get("compressed_summary"))
        assert summary.meta["fallback"] and "Recovered locally" in summary.content
        assert "fill-2" in summary.content and "fill-0" not in summary.content  # the middle, not the head
        assert len(summary.content) <= 2000 + len(SUMMARY_END_MARKER) + 2  # 8,000 cap, 5% of a small window
        # failures are always shown, even with progress notices off (the default)
        warnings = [m for m in adapter.sent if "simpler local summary" in m.text]
        assert len(warnings) == 1 and warnings[0].kind == "error"
        assert not any("Compressing the conversation" in t for t in adapter.texts())
        async with store_of(app, "fay") as store:
            state = await store.compression_state(sid)
        assert state["fallback_streak"] == 1 and state["cooldown_until"] > 0


@pytest.mark.parametrize("case", ["auth", "network", "abort_flag"])
async def test_abort_keeps_messages_untouched_and_warns(config_for, fake_llm, case):
    model = Model()
    sections: dict = {}
    if case == "auth":
        model.summary_failure = error(401, {"error": {"message": "bad key"}})
    elif case == "network":
        sections["auxiliary"] = {"compression": {"base_url": "http://127.0.0.1:9/v1"}}
    else:
        model.summary_failure = error(500, {"error": {"message": "boom"}})
        sections["compression"] = {"abort_on_summary_failure": True}
    fake_llm.responder = model
    async with gateway(config_for, llm={"max_retries": 0}, **sections) as (app, adapter):
        before = len(fake_llm.requests)
        for i in range(30):
            await say(app, adapter, dm("gus", f"fill-{i} {words(900)}"))
            if any("couldn't compress" in t for t in adapter.texts()):
                break
        assert any("I couldn't compress this conversation" in t for t in adapter.texts())
        _, every = await live_history(app, "gus", include_inactive=True)
        assert not any(m.compacted for m in every)
        assert not any(m.meta.get("compressed_summary") for m in every)
        if case == "auth":
            assert "rejected our credentials" in adapter.texts()[-2]
        assert len(fake_llm.requests) > before


async def test_anti_thrash_blocks_warns_once_then_probes(config_for, fake_llm, monkeypatch):
    clock = [1_000_000.0]
    monkeypatch.setattr(compression_mod, "wall_clock", lambda: clock[0])
    model = Model()
    model.summary_failure = error(500, {"error": {"message": "summary backend down"}})
    fake_llm.responder = model
    async with gateway(config_for, llm={"max_retries": 0}) as (app, adapter):
        # two fallback compressions in a row (the second one after the 60 s cooldown)
        await fill_until_summary_request(app, adapter, fake_llm, "hal")
        n, c = len(summary_requests(fake_llm)), len(chat_requests(fake_llm))
        for i in range(14):  # the cooldown holds automatic compression back, even over the threshold
            await say(app, adapter, dm("hal", f"cool-{i} {words(900)}"))
        assert len(summary_requests(fake_llm)) == n
        assert any(prompt_chars(r) // 4 >= THRESHOLD for r in chat_requests(fake_llm)[c:])
        assert not any(t == BLOCKED_WARNING for t in adapter.texts())  # a cooldown is not a block
        clock[0] += 61
        await say(app, adapter, dm("hal", "after the cooldown"))
        assert len(summary_requests(fake_llm)) == n + 1
        sid, _ = await live_history(app, "hal")
        async with store_of(app, "hal") as store:
            state = await store.compression_state(sid)
        assert state["fallback_streak"] == 2 and state["blocked_at"] == clock[0]
        # blocked: over the threshold, but no more summary attempts; the person is told once
        clock[0] += 61  # past the cooldown too, so only the block holds it back
        n, c = len(summary_requests(fake_llm)), len(chat_requests(fake_llm))
        for i in range(12):
            await say(app, adapter, dm("hal", f"more-{i} {words(900)}"))
        assert len(summary_requests(fake_llm)) == n
        over = [r for r in chat_requests(fake_llm)[c:] if prompt_chars(r) // 4 >= THRESHOLD]
        assert len(over) >= 3, "the blocked conversation should have stayed over the threshold"
        assert [t for t in adapter.texts() if t == BLOCKED_WARNING] == [BLOCKED_WARNING]
        # after 300 s one probe runs; the summary model works again, so the block lifts
        model.summary_failure = None
        clock[0] += 300
        await say(app, adapter, dm("hal", "probe time"))
        assert len(summary_requests(fake_llm)) == n + 1
        sid, live = await live_history(app, "hal")
        async with store_of(app, "hal") as store:
            state = await store.compression_state(sid)
        assert state["fallback_streak"] == 0 and state["blocked_at"] is None and not state["warned"]
        assert any("SUMMARY-" in (m.content or "") for m in live if m.meta.get("compressed_summary"))


async def test_failed_probe_blocks_again_without_a_second_warning(config_for, fake_llm, monkeypatch):
    clock = [2_000_000.0]
    monkeypatch.setattr(compression_mod, "wall_clock", lambda: clock[0])
    model = Model()
    model.summary_failure = error(500, {"error": {"message": "down"}})
    fake_llm.responder = model
    async with gateway(config_for, llm={"max_retries": 0}) as (app, adapter):
        await fill_until_summary_request(app, adapter, fake_llm, "ian")
        clock[0] += 61
        await fill_until_summary_request(app, adapter, fake_llm, "ian")
        clock[0] += 301
        n = len(summary_requests(fake_llm))
        await fill_until_summary_request(app, adapter, fake_llm, "ian")  # the probe (fails again)
        assert len(summary_requests(fake_llm)) == n + 1
        sid, _ = await live_history(app, "ian")
        async with store_of(app, "ian") as store:
            state = await store.compression_state(sid)
        assert state["fallback_streak"] == 3 and state["blocked_at"] == clock[0]
        clock[0] += 61  # past the probe's cooldown: only the renewed block holds
        await chat(app, adapter, "ian", [f"after-{i} {words(900)}" for i in range(6)])
        assert len(summary_requests(fake_llm)) == n + 1
        assert sum(t == BLOCKED_WARNING for t in adapter.texts()) == 1


# --------------------------------------------------------------------------- sessions


async def test_in_place_false_starts_a_routed_child_and_the_parent_keeps_everything(config_for, fake_llm):
    model = Model()
    fake_llm.responder = model
    async with gateway(config_for, compression={"in_place": False}) as (app, adapter):
        await say(app, adapter, dm("jo", "hello"))
        parent, _ = await live_history(app, "jo")
        await fill_until_summary_request(app, adapter, fake_llm, "jo")
        async with store_of(app, "jo") as store:
            child = await store.route(KEY.format("jo"))
            assert child and child != parent
            info = await store.session_info(child)
            assert info["parent_session_id"] == parent and info["compressions"] == 1
            pinfo = await store.session_info(parent)
            assert pinfo["end_reason"] == "compression" and pinfo["ended_at"] is not None
            parent_all = await store.history(parent, include_inactive=True)
            child_live = await store.history(child)
        # the parent keeps all its messages (the middle flagged compacted), the child starts
        # with a fresh system prompt, the summary, the tail copies and this turn's answer
        users = [m.content for m in parent_all if m.role == "user"]
        assert users[:3] == ["hello", f"fill-0 {words(900)}", f"fill-1 {words(900)}"]
        assert any(m.compacted for m in parent_all)
        assert child_live[0].role == "system"
        assert child_live[-1].role == "assistant" and child_live[-1].content == "ok"
        assert sum(1 for m in child_live if m.meta.get("compressed_summary")) == 1
        copied = [m for m in child_live if m.meta.get("copied_from")]
        parent_uids = {m.uid for m in parent_all}
        assert copied and all(m.meta["copied_from"] in parent_uids for m in copied)
        # a message right after the compression lands in the live child session
        await say(app, adapter, dm("jo", "after the split"))
        async with store_of(app, "jo") as store:
            assert (await store.history(child))[-2].content == "after the split"
            assert "after the split" not in [m.content for m in await store.history(parent, include_inactive=True)]
        assert fake_llm.violations == []


async def test_message_arriving_during_a_rotating_compression_lands_in_the_child(config_for, fake_llm):
    import asyncio

    model = Model()
    release = asyncio.Event()
    summary_seen = asyncio.Event()

    async def responder(request):
        if is_summary_request(request["messages"]):
            summary_seen.set()
            await release.wait()  # the summary model is slow: compression is in progress
        return model(request)

    fake_llm.responder = responder
    async with gateway(config_for, compression={"in_place": False}) as (app, adapter):
        await chat(app, adapter, "quinn", [f"early-{i} {words(400)}" for i in range(8)])
        parent, _ = await live_history(app, "quinn")
        fake_llm.script(reply("ok", usage={"prompt_tokens": THRESHOLD}))  # next turn compresses
        await say(app, adapter, dm("quinn", "one more"))
        await adapter.sink(dm("quinn", "this turn compresses"))
        await asyncio.wait_for(summary_seen.wait(), 10)
        await adapter.sink(dm("quinn", "sent during compression"))  # queued in the lane meanwhile
        release.set()
        assert await app.drain(20)
        async with store_of(app, "quinn") as store:
            child = await store.route(KEY.format("quinn"))
            child_users = [m.content for m in await store.history(child) if m.role == "user"]
            parent_users = [m.content for m in await store.history(parent, include_inactive=True) if m.role == "user"]
        assert child != parent
        assert child_users[-2:] == ["this turn compresses", "sent during compression"]
        assert "sent during compression" not in parent_users
        assert adapter.texts()[-2:] == ["ok", "ok"]


# --------------------------------------------------------------------------- notices and commands


@pytest.mark.parametrize("notices", [True, False])
async def test_progress_notices_only_when_enabled(config_for, fake_llm, notices):
    model = Model()
    fake_llm.responder = model
    async with gateway(config_for, compression={"progress_notices": notices}) as (app, adapter):
        await fill_until_summary_request(app, adapter, fake_llm, "kim")
        started = [m for m in adapter.sent if m.text.startswith("Compressing the conversation")]
        done = [text for _, text in adapter.edits if text.startswith("Conversation compressed:")]
        if notices:
            assert len(started) == 1 and started[0].kind == "notice"
            assert len(done) == 1 and "→" in done[0]
            before, after = (int(x.replace(",", "").split()[0]) for x in done[0].split(":")[1].split("→"))
            assert before >= THRESHOLD > after
        else:
            assert started == [] and done == []
            assert all(t.startswith("ok") for t in adapter.texts())


async def test_progress_done_is_sent_as_a_new_message_where_edits_are_impossible(config_for, fake_llm):
    model = Model()
    fake_llm.responder = model
    async with gateway(config_for, compression={"progress_notices": True}) as (app, adapter):
        adapter.can_edit = False
        await fill_until_summary_request(app, adapter, fake_llm, "lou")
        assert any(t.startswith("Conversation compressed:") for t in adapter.texts())
        assert adapter.edits == []


async def test_manual_compress_with_focus_and_usage(config_for, fake_llm):
    model = Model()
    fake_llm.responder = model
    async with gateway(config_for) as (app, adapter):
        out = await say(app, adapter, dm("max", "/compress"))
        assert out == ["There's no conversation to compress yet."]
        await chat(app, adapter, "max", ["hi"])
        out = await say(app, adapter, dm("max", "/compress"))
        assert out[0].startswith("Nothing to compress yet")
        await chat(app, adapter, "max", [f"cats and dogs {i} {words(400)}" for i in range(7)])
        assert summary_requests(fake_llm) == []
        usage = (await say(app, adapter, dm("max", "/usage")))[0]
        assert f"of {CTX:,} tokens" in usage and f"compression at {THRESHOLD:,}" in usage
        assert "Compressions so far: 0" in usage
        out = await say(app, adapter, dm("max", "/compress focus cats"))
        assert out[0].startswith("Compressed: ") and "messages summarised" in out[0]
        assert 'FOCUS TOPIC: "cats"' in summary_text(summary_requests(fake_llm)[-1])
        usage = (await say(app, adapter, dm("max", "/usage")))[0]
        assert "Compressions so far: 1" in usage
        # manual feedback is the only message: no progress notices for /compress
        assert not any(t.startswith("Compressing the conversation") for t in adapter.texts())


async def test_context_length_error_compresses_and_retries(config_for, fake_llm):
    model = Model()
    fake_llm.responder = model
    async with gateway(config_for) as (app, adapter):
        await chat(app, adapter, "ned", [f"part-{i} {words(700)}" for i in range(9)])
        assert summary_requests(fake_llm) == []
        fake_llm.context_length = 1500  # the server's real window is smaller than configured
        out = await say(app, adapter, dm("ned", "still there?"))
        assert out[-1] == "ok"
        assert 400 in fake_llm.statuses and len(summary_requests(fake_llm)) >= 1
        assert prompt_chars(chat_requests(fake_llm)[-1]) // 4 <= 1500


async def test_context_length_error_gives_up_after_max_attempts(config_for, fake_llm):
    model = Model()
    fake_llm.responder = model
    async with gateway(config_for, compression={"max_attempts": 2}) as (app, adapter):
        await chat(app, adapter, "oli", [f"part-{i} {words(700)}" for i in range(6)])
        fake_llm.context_length = 20  # nothing fits
        n = len(summary_requests(fake_llm))
        out = await say(app, adapter, dm("oli", "hello?"))
        assert "too long" in out[-1] and adapter.sent[-1].kind == "error"
        assert len(summary_requests(fake_llm)) - n <= 2


async def test_memory_provider_sees_the_middle_before_compression(config_for, fake_llm):
    model = Model()
    fake_llm.responder = model
    async with gateway(config_for, memory={"provider": "local"}) as (app, adapter):
        await fill_until_summary_request(app, adapter, fake_llm, "pam")
        _, every = await live_history(app, "pam", include_inactive=True)
        async with app.profiles.use("testchat-pam") as profile:
            notes = (profile.path / "provider" / "notes.jsonl").read_text().splitlines()
        pre = [json.loads(line) for line in notes if '"pre_compress"' in line]
        compacted_users = [m.content for m in every if m.compacted and m.role == "user"]
        assert compacted_users and {p["content"] for p in pre if p["role"] == "user"} == set(compacted_users)


async def test_an_unexpected_compression_error_never_breaks_the_turn(config_for, fake_llm, monkeypatch):
    model = Model()
    fake_llm.responder = model
    async with gateway(config_for) as (app, adapter):

        def broken(*a, **k):
            raise RuntimeError("bug in a stage")

        monkeypatch.setattr(compression_mod, "find_tail_cut", broken)
        for i in range(20):
            out = await say(app, adapter, dm("rae", f"fill-{i} {words(900)}"))
            assert out[-1] == "ok"
            if any("internal error" in t for t in adapter.texts()):
                break
        assert any("internal error" in t for t in adapter.texts())
        await chat(app, adapter, "rae", [f"more-{i} {words(900)}" for i in range(4)])
        assert sum("internal error" in t for t in adapter.texts()) == 2  # then blocked, not repeated
        assert sum(t == BLOCKED_WARNING for t in adapter.texts()) == 1
        _, every = await live_history(app, "rae", include_inactive=True)
        assert not any(m.compacted for m in every)
        assert (await say(app, adapter, dm("rae", "/compress")))[0].startswith("Couldn't compress")
