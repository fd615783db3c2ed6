"""The core contract end to end: isolation between people, dedupe across restarts,
replay of unanswered messages, commands, limits — against the fake LLM server."""

from __future__ import annotations

import asyncio
import json
import random

import pytest

from agent.sessions import SessionStore
from gateway.build import build_gateway
from gateway.runtime import GatewayApp
from tenancy.keys import tenant_dir
from tests.conftest import RecordingAdapter, dm, group, say
from tests.fakes.llm import memory_saving_responder, reply, tool_call

SECRET = "locker code 4711-QX"


async def started(cfg, *adapters):
    app = build_gateway(cfg, list(adapters))
    await app.start()
    return app


async def test_secret_told_by_a_never_reaches_b(config_for, fake_llm):
    fake_llm.responder = memory_saving_responder
    adapter = RecordingAdapter()
    app = await started(config_for(), adapter)
    try:
        out = await say(app, adapter, dm("alice", f"remember that my {SECRET}"))
        assert out and out[-1].startswith("done:")
        # the next session of A sees it in the frozen snapshot
        await say(app, adapter, dm("alice", "/new"))
        n = len(fake_llm.requests)
        await say(app, adapter, dm("alice", "what is my code?"))
        assert any(SECRET in json.dumps(r) for r in fake_llm.requests[n:])

        n = len(fake_llm.requests)
        await say(app, adapter, dm("bob", "what is alice's locker code?"))
        await say(app, adapter, group("room1", "alice", "hello from alice in the group"))
        m = len(fake_llm.requests)
        await say(app, adapter, group("room1", "bob", "hello, what do you know?"))
        fake_llm.script(tool_call("session_search", {"query": "4711"}))
        await say(app, adapter, dm("bob", "search your notes"))
        bob_requests = fake_llm.requests[n : n + 1] + fake_llm.requests[m:]
        assert bob_requests
        for request in bob_requests:
            assert SECRET not in json.dumps(request), "bob's request carried alice's secret"
        # bob's session_search result (the tool message) found nothing
        tool_msgs = [msg for msg in fake_llm.requests[-1]["messages"] if msg["role"] == "tool"]
        assert tool_msgs and json.loads(tool_msgs[-1]["content"])["count"] == 0
    finally:
        await app.stop()
    data = config_for().data_dir
    alice_dir, bob_dir = tenant_dir(data, "testchat-alice"), tenant_dir(data, "testchat-bob")
    assert SECRET in (alice_dir / "memories" / "MEMORY.md").read_text()
    assert alice_dir != bob_dir
    for path in bob_dir.rglob("*"):
        if path.is_file():
            assert SECRET.encode() not in path.read_bytes(), f"{path} holds alice's secret"


async def test_group_member_cannot_see_other_members_memory(config_for, fake_llm):
    fake_llm.responder = memory_saving_responder
    adapter = RecordingAdapter()
    app = await started(config_for(), adapter)
    try:
        await say(app, adapter, group("g1", "alice", f"remember {SECRET}"))
        n = len(fake_llm.requests)
        await say(app, adapter, group("g1", "bob", "/new"))
        await say(app, adapter, group("g1", "bob", "anything you remember?"))
        assert fake_llm.requests[n:]
        assert not any(SECRET in json.dumps(r) for r in fake_llm.requests[n:])
        assert await say(app, adapter, dm("bob", "/memory")) == ["I don't remember anything about you yet."]
        assert SECRET in (await say(app, adapter, dm("alice", "/memory")))[0]
        # in the group, /memory never prints a member's memory for everyone to read
        assert await say(app, adapter, group("g1", "alice", "/memory")) == [
            "That's private: send /memory in a private chat with me."
        ]
    finally:
        await app.stop()


async def test_shared_lane_gets_group_memory_not_personal(config_for, fake_llm):
    fake_llm.responder = memory_saving_responder
    adapter = RecordingAdapter()
    app = await started(config_for(tenancy={"group_sessions_per_user": False}), adapter)
    try:
        await say(app, adapter, dm("alice", f"remember {SECRET}"))
        n = len(fake_llm.requests)
        await say(app, adapter, group("g2", "alice", "hi all"))
        assert not any(SECRET in json.dumps(r) for r in fake_llm.requests[n:])
        # messages in a shared lane carry the sender's name
        assert "[alice]: hi all" in json.dumps(fake_llm.requests[-1])
    finally:
        await app.stop()


async def test_same_message_twice_across_restart_is_answered_once(config_for, fake_llm):
    cfg = config_for()
    adapter = RecordingAdapter()
    msg = dm("carol", "hello once", message_id="tg-42")
    app = await started(cfg, adapter)
    await say(app, adapter, msg)
    await say(app, adapter, msg)  # duplicate delivery before the restart
    await app.stop()
    assert adapter.texts() == ["ok: hello once"]
    adapter2 = RecordingAdapter()
    app2 = await started(cfg, adapter2)
    try:
        await say(app2, adapter2, msg)  # redelivered after the restart
        assert adapter2.sent == []
        assert len(fake_llm.requests) == 1
    finally:
        await app2.stop()


async def test_unanswered_message_is_replayed_after_restart_and_stored_once(config_for, fake_llm):
    cfg = config_for()
    fake_llm.script(reply("first"))
    adapter = RecordingAdapter()
    app = await started(cfg, adapter)
    # the model hangs: stop the gateway mid-turn (as a crash would leave it)
    from tests.fakes.llm import hang

    fake_llm.script(hang(30))
    await say(app, adapter, dm("dave", "one"))
    await adapter.sink(dm("dave", "two", message_id="two-1"))
    for _ in range(200):
        if len(fake_llm.requests) >= 2:
            break
        await asyncio.sleep(0.02)
    assert len(fake_llm.requests) == 2
    await app.stop(drain_timeout=0.2)
    adapter2 = RecordingAdapter()
    app2 = await started(cfg, adapter2)
    try:
        assert await app2.drain(20)
        assert adapter2.texts() == ["ok: two"]
    finally:
        await app2.stop()
    async with SessionStore(tenant_dir(cfg.data_dir, "testchat-dave")) as store:
        sid = await store.route("agent:main:testchat:dm:dm-dave")
        users = [m.content for m in await store.history(sid) if m.role == "user"]
    assert users == ["one", "two"]


async def test_many_tenants_interleaved_never_mix(config_for, fake_llm):
    """Turns of 30 people run at once with random model latency; every request holds
    only its own person's secret (catches leaked context variables and loose caches)."""
    rng = random.Random(7)

    async def responder(request):
        await asyncio.sleep(rng.random() * 0.05)
        return memory_saving_responder(request)

    fake_llm.responder = responder
    adapter = RecordingAdapter()
    app = await started(config_for(limits={"rate_limit_per_minute": 100}), adapter)
    people = [f"user{i:02d}" for i in range(30)]
    try:
        for text in ("remember secret-{p}-X", "/new", "who am I, {p}?"):
            await asyncio.gather(*(adapter.sink(dm(p, text.format(p=p))) for p in people))
            assert await app.drain(60)
    finally:
        await app.stop()
    assert len(fake_llm.requests) >= 90
    for request in fake_llm.requests:
        blob = json.dumps(request)
        speaker = {p for p in people if p in json.dumps(request["messages"][-1])} or {
            p for p in people if f"secret-{p}-X" in blob
        }
        secrets = {p for p in people if f"secret-{p}-X" in blob}
        assert secrets <= speaker, f"request of {speaker} carried secrets of {secrets - speaker}"
    answered = adapter.texts()
    for p in people:
        assert f"ok: who am I, {p}?" in answered
        assert (
            tenant_dir(config_for().data_dir, f"testchat-{p}") / "memories" / "MEMORY.md"
        ).read_text() == f"secret-{p}-X"


async def test_rate_limit_refuses_with_clear_message(config_for, fake_llm):
    adapter = RecordingAdapter()
    app = await started(config_for(limits={"rate_limit_per_minute": 2}), adapter)
    try:
        await say(app, adapter, dm("erin", "a"))
        await say(app, adapter, dm("erin", "b"))
        out = await say(app, adapter, dm("erin", "c"))
        assert len(out) == 1 and "faster than I can answer" in out[0]
        assert len(fake_llm.requests) == 2
    finally:
        await app.stop()


async def test_too_long_message_is_refused_and_not_sent_to_model(config_for, fake_llm):
    adapter = RecordingAdapter()
    app = await started(config_for(limits={"max_text_length": 100}), adapter)
    try:
        out = await say(app, adapter, dm("fay", "x" * 101))
        assert "at most 100" in out[0]
        assert fake_llm.requests == []
    finally:
        await app.stop()


async def wait_for_text(adapter: RecordingAdapter, part: str, timeout: float = 10.0) -> None:
    for _ in range(int(timeout / 0.02)):
        if any(part in t for t in adapter.texts()):
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"{part!r} never sent; sent: {adapter.texts()}")


async def test_a_model_that_is_down_holds_the_message_tells_once_and_answers_when_it_is_back(
    config_for, fake_llm, tmp_path
):
    from tests.fakes.llm import error

    # three answers of 503 (not the message's fault), then the model is back
    fake_llm.script(error(503, "overloaded"), error(503, "overloaded"), error(503, "overloaded"))
    cfg = config_for(llm={"max_retries": 0}, delivery={"retry_initial_s": 0.05, "retry_max_s": 0.1})
    adapter = RecordingAdapter()
    app = await started(cfg, adapter)
    try:
        await adapter.sink(dm("gus", "are you there?"))
        assert await app.drain(20)
        texts = adapter.texts()
        # told once, truly, then answered: nothing was finished while the model was down
        assert texts == [
            "I can't reach my language model right now; your message is kept and I'll answer as soon as it is back.",
            "ok: are you there?",
        ]
        assert len(fake_llm.requests) == 4
        rows = await app.inbox.db.execute_fetchall("SELECT status, outcome FROM inbound")
        assert rows == [("done", "replied")]
    finally:
        await app.stop()
    async with SessionStore(tenant_dir(cfg.data_dir, "testchat-gus")) as store:
        sid = await store.route("agent:main:testchat:dm:dm-gus")
        assert [m.content for m in await store.history(sid) if m.role == "user"] == ["are you there?"]


async def test_a_conversation_the_provider_refuses_is_finished_with_the_reason(config_for, fake_llm):
    from tests.fakes.llm import error

    refused = error(400, {"error": {"message": "this content is not allowed"}})
    fake_llm.script(refused, refused)  # a streaming request, then the plain one (agent/llm.py falls back)
    adapter = RecordingAdapter()
    app = await started(config_for(llm={"max_retries": 0}), adapter)
    try:
        out = await say(app, adapter, dm("gia", "hello"))
        assert len(out) == 1 and "refused this conversation; send /new" in out[0]
        assert adapter.sent[-1].kind == "error"
        assert len(fake_llm.requests) == 2  # the message's own fault: not asked again later
    finally:
        await app.stop()


async def test_full_lane_answers_busy(config_for, fake_llm):
    from tests.fakes.llm import hang

    adapter = RecordingAdapter()
    app = await started(config_for(limits={"max_queued_turns": 1}), adapter)
    fake_llm.script(hang(0.5, reply("slow")))
    try:
        await adapter.sink(dm("hal", "one"))
        await asyncio.sleep(0.1)  # "one" is running now
        await adapter.sink(dm("hal", "two"))  # queued
        await adapter.sink(dm("hal", "three"))  # lane full
        assert await app.drain(20)
        texts = adapter.texts()
        assert any("still working on your earlier messages" in t for t in texts)
        assert "slow" in texts and "ok: two" in texts
    finally:
        await app.stop()


async def test_commands_new_status_whoami_forget(config_for, fake_llm):
    fake_llm.responder = memory_saving_responder
    adapter = RecordingAdapter()
    app = await started(config_for(), adapter)
    try:
        await say(app, adapter, dm("ivy", "remember I like tea"))
        who = (await say(app, adapter, dm("ivy", "/whoami")))[0]
        assert "testchat:ivy" in who and "testchat-ivy" in who
        status = (await say(app, adapter, dm("ivy", "/status")))[0]
        assert "Messages:" in status
        assert "I like tea" in (await say(app, adapter, dm("ivy", "/memory")))[0]
        await say(app, adapter, dm("ivy", "/forget all"))
        assert "don't remember" in (await say(app, adapter, dm("ivy", "/memory")))[0]
        assert "new conversation" in (await say(app, adapter, dm("ivy", "/reset")))[0]
        helptext = (await say(app, adapter, dm("ivy", "/help")))[0]
        assert "/new" in helptext and "/pair" not in helptext
    finally:
        await app.stop()


async def test_unknown_dm_user_gets_pairing_code_and_admin_approves(config_for, fake_llm):
    adapter = RecordingAdapter()
    cfg = config_for(access={"allowed_users": [], "admins": ["testchat:boss"]})
    app = await started(cfg, adapter)
    try:
        out = await say(app, adapter, dm("stranger", "hi"))
        assert "pairing code" in out[0]
        code = out[0].split("pairing code is ")[1].split(".")[0]
        assert fake_llm.requests == []
        assert "Approved testchat:stranger" in (await say(app, adapter, dm("boss", f"/pair {code}")))[0]
        assert await say(app, adapter, dm("stranger", "hi again")) == ["ok: hi again"]
        # a group message from an unknown user is ignored silently
        assert await say(app, adapter, group("g", "nobody", "hello")) == []
    finally:
        await app.stop()


async def test_a_refused_api_key_holds_the_message_says_so_to_the_operator_and_answers_once_fixed(
    config_for, fake_llm, monkeypatch, caplog
):
    monkeypatch.setenv("HG_FAKE_KEY", "sk-wrong-key-123")
    fake_llm.set_api_key("sk-right")
    adapter = RecordingAdapter()
    cfg = config_for(llm={"api_key_env": "HG_FAKE_KEY"}, delivery={"retry_initial_s": 0.05, "retry_max_s": 0.1})
    app = await started(cfg, adapter)
    try:
        await adapter.sink(dm("kim", "hello?"))
        await wait_for_text(adapter, "I can't reach my language model")
        assert "an operator needs to fix the API key" in caplog.text  # the operator is told what to fix
        assert "sk-wrong" not in caplog.text and all("sk-wrong" not in t for t in adapter.texts())
        fake_llm.set_api_key("sk-wrong-key-123")  # the operator fixed the key at the provider
        assert await app.drain(20)
        assert adapter.texts()[-1] == "ok: hello?"
        assert sum("I can't reach my language model" in t for t in adapter.texts()) == 1  # told once
    finally:
        await app.stop()


async def test_gateway_db_forgets_old_answered_ids_but_not_pending_ones(tmp_path):
    import time as _time

    from gateway.inbox import Inbox

    inbox = Inbox(tmp_path / "gateway.db")
    await inbox.open()
    try:
        old, fresh, pending = dm("a", "1"), dm("a", "2"), dm("a", "3")
        for m in (old, fresh, pending):
            assert await inbox.record(m)
        await inbox.finish(old, "replied")
        await inbox.finish(fresh, "replied")
        await inbox.db.execute(
            "UPDATE inbound SET received_at=? WHERE message_id IN (?, ?)",
            (_time.time() - 30 * 86400, old.message_id, pending.message_id),
        )
        assert await inbox.prune(14 * 86400) == 1
        assert await inbox.status("testchat", old.chat_id, old.message_id) is None
        assert await inbox.status("testchat", fresh.chat_id, fresh.message_id) == "done"
        assert [m.message_id for m in await inbox.pending()] == [pending.message_id]
    finally:
        await inbox.close()


async def test_burst_coalesces_into_one_turn_when_enabled(config_for, fake_llm):
    adapter = RecordingAdapter()
    app = await started(config_for(limits={"coalesce_burst_ms": 300}), adapter)
    try:
        for text in ("first part", "second part", "third part"):
            await adapter.sink(dm("lou", text))
        assert await app.drain(20)
        assert len(fake_llm.requests) == 1
        users = [m["content"] for m in fake_llm.requests[0]["messages"] if m["role"] == "user"]
        assert users == ["first part\n\nsecond part\n\nthird part"]  # one user turn on the wire
        assert adapter.texts() == ["ok: first part\n\nsecond part\n\nthird part"]
        rows = await app.inbox.db.execute_fetchall("SELECT status FROM inbound")
        assert [r[0] for r in rows] == ["done", "done", "done"]
    finally:
        await app.stop()


async def test_group_lane_session_search_never_reaches_private_chats(config_for, fake_llm):
    adapter = RecordingAdapter()
    app = await started(config_for(tenancy={"personal_memory_in_groups": "off"}), adapter)
    try:
        await say(app, adapter, dm("alice", "my private word is zebra42"))
        await say(app, adapter, group("g3", "alice", "zebra talk in the group"))
        fake_llm.script(tool_call("session_search", {"query": "zebra42 zebra"}))
        await say(app, adapter, group("g3", "alice", "what did I say about zebras?"))
        tool_msgs = [m for m in fake_llm.requests[-1]["messages"] if m["role"] == "tool"]
        result = json.loads(tool_msgs[-1]["content"])
        assert result["count"] >= 1
        assert "zebra42" not in tool_msgs[-1]["content"]  # the DM stays out of the group lane
        # in the DM the same search covers everything the person said
        fake_llm.script(tool_call("session_search", {"query": "zebra42"}))
        await say(app, adapter, dm("alice", "search please"))
        tool_msgs = [m for m in fake_llm.requests[-1]["messages"] if m["role"] == "tool"]
        assert "zebra42" in tool_msgs[-1]["content"]
    finally:
        await app.stop()


async def test_failure_after_recording_lets_the_redelivery_through(config_for, fake_llm):
    adapter = RecordingAdapter()
    app = await started(config_for(), adapter)
    real = app.access.is_allowed
    calls = []

    async def flaky(principal):
        calls.append(principal)
        if len(calls) == 1:
            raise RuntimeError("database is locked")
        return await real(principal)

    app.access.is_allowed = flaky
    try:
        msg = dm("nia", "are you there?", message_id="tg-7")
        with pytest.raises(RuntimeError):
            await adapter.sink(msg)  # the adapter sees the failure and does not acknowledge
        assert await say(app, adapter, msg) == ["ok: are you there?"]  # the platform redelivers
    finally:
        await app.stop()


async def test_replayed_backlog_is_never_refused_as_busy(config_for, fake_llm):
    from gateway.inbox import Inbox

    cfg = config_for(limits={"max_queued_turns": 2, "busy_mode": "queue"})  # one answer each
    inbox = Inbox(cfg.data_dir / "gateway.db")
    await inbox.open()
    backlog = [dm("oz", f"queued {i}", message_id=f"q{i}") for i in range(6)]
    for msg in backlog:
        assert await inbox.record(msg)  # left pending, as by a crash or a stop mid-burst
    await inbox.close()
    adapter = RecordingAdapter()
    app = await started(cfg, adapter)
    try:
        assert await app.drain(20)
        assert adapter.texts() == [f"ok: queued {i}" for i in range(6)]
    finally:
        await app.stop()


async def collect_three_and_die(app: GatewayApp, adapter: RecordingAdapter, user: str, died: asyncio.Event) -> None:
    """`user` gets "zero" answered, then sends three messages collected into one turn; the
    test's fault hook sets `died` where the process would die, and the app is stopped."""
    try:
        await say(app, adapter, dm(user, "zero", message_id=f"{user}-0"))
        for i, text in enumerate(("remember one", "two", "three"), start=1):
            await adapter.sink(dm(user, text, message_id=f"{user}-{i}"))
        await asyncio.wait_for(died.wait(), 20)
    finally:
        await app.stop(drain_timeout=0.2)


async def restart_and_drain(cfg) -> str:
    """Start the gateway again on `cfg`, let it replay and drain; what it sent, one per line."""
    adapter = RecordingAdapter()
    app = await started(cfg, adapter)
    try:
        assert await app.drain(20)
    finally:
        await app.stop()
    return "\n".join(adapter.texts())


async def test_a_collected_answer_stored_before_a_crash_is_sent_after_restart_with_a_later_message(
    config_for, fake_llm
):
    """Single node: a turn answered several collected messages in the profile, and the
    process died before recording that answer, while a later message was already accepted.
    The replay collects them all: the stored answer is sent with the later message's."""
    cfg = config_for(limits={"coalesce_burst_ms": 300, "rate_limit_per_minute": 1000})
    fake_llm.responder = memory_saving_responder
    adapter = RecordingAdapter()
    app = await started(cfg, adapter)
    real_record = app.outbox.record
    died = asyncio.Event()

    async def record_then_die(drafts, *, finish=(), source=None):
        if len(finish) > 1 and not died.is_set():
            await adapter.sink(dm("erin", "four", message_id="erin-4"))  # accepted meanwhile
            died.set()
            await asyncio.sleep(3600)  # the process is gone before the answer is recorded
        return await real_record(drafts, finish=finish, source=source)

    app.outbox.record = record_then_die  # type: ignore[method-assign]
    await collect_three_and_die(app, adapter, "erin", died)
    assert adapter.texts() == ["ok: zero"]
    asked = len(fake_llm.requests)
    sent = await restart_and_drain(cfg)
    assert "done:" in sent and "ok: four" in sent, sent
    assert len(fake_llm.requests) == asked + 1  # only "four" was asked: the stored answer was reused


async def test_a_collected_turn_cut_short_after_a_tool_call_is_finished_after_restart_before_a_later_message(
    config_for, fake_llm
):
    """The crash came after the tool result, before the answer: the replay finishes that
    turn first (its answer is sent), then answers the message that arrived meanwhile."""
    cfg = config_for(limits={"coalesce_burst_ms": 300, "rate_limit_per_minute": 1000})
    adapter = RecordingAdapter()
    app = await started(cfg, adapter)
    died = asyncio.Event()

    async def die_after_the_tool(request):
        if request["messages"][-1].get("role") == "tool" and not died.is_set():
            await adapter.sink(dm("fred", "four", message_id="fred-4"))  # accepted meanwhile
            died.set()
            await asyncio.sleep(3600)  # the process is gone before the answer
        return memory_saving_responder(request)

    fake_llm.responder = die_after_the_tool
    await collect_three_and_die(app, adapter, "fred", died)
    sent = await restart_and_drain(cfg)
    assert "done:" in sent and "ok: four" in sent, sent


async def test_a_warm_turn_costs_two_storage_calls_and_keeps_its_page_cache(config_for, fake_llm):
    """Two storage calls a turn (docs/concepts.md#session-storage): one stores the person's message with the
    model call's estimate reserved in the budget ledger (one transaction), one stores the answer (with
    usage, the ledger's count and compression state); no call throws the page cache away (the open
    profiles' memory is bounded by memory, docs/concepts.md#open-profiles), so the next turn finds its pages."""
    fake_llm.script(reply("first"), reply("second"))
    adapter = RecordingAdapter()
    app = build_gateway(config_for(), [adapter])
    await app.start()
    try:
        assert await say(app, adapter, dm("ada", "hello")) == ["first"]  # opens the profile
        store = app.profiles._open["testchat-ada"].sessions
        assert store._db is not None
        statements: list[str] = []
        store._db.exec_trace = lambda _cur, sql, _bindings: statements.append(sql) or True  # True: run it
        calls = app.storage_pool.calls
        assert await say(app, adapter, dm("ada", "and again")) == ["second"]
        assert app.storage_pool.calls - calls == 2
        assert [s for s in statements if "INTO budget_pending" in s], "the estimate was reserved"
        assert not [s for s in statements if s.lstrip().upper().startswith("CREATE")]
        assert not [s for s in statements if "shrink_memory" in s]
        writes = [s for s in statements if s.startswith("INSERT")]
        assert sum(s.startswith("INSERT INTO messages") or "INTO messages(" in s for s in writes) >= 2
    finally:
        await app.stop()
