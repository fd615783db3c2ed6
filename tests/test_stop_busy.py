"""/stop and busy behaviour (docs/concepts.md#stopping-and-busy-lanes): /stop ends the lane's running turn
without leaving anything half-written; limits.busy_mode decides what happens to messages
that arrive while a turn runs (collect, queue, interrupt)."""

from __future__ import annotations

import asyncio

import pytest

from agent.sessions import SessionStore
from agent.turn import STOPPED_MARKER
from core.settings import ConfigError
from gateway.build import build_gateway
from gateway.runtime import GatewayApp
from tenancy.keys import tenant_dir
from tests.conftest import RecordingAdapter, dm, make_config
from tests.fakes.llm import default_responder, last_user_text, tool_call


class Gate:
    """A model responder that holds the first request whose last user text contains `hold`
    until `release()`; the others get the default answer at once."""

    def __init__(self, hold: str) -> None:
        self.hold = hold
        self.held = False
        self.event = asyncio.Event()

    async def __call__(self, request):
        if not self.held and self.hold in last_user_text(request) and request["messages"][-1]["role"] == "user":
            self.held = True
            await self.event.wait()
        return default_responder(request)

    def release(self) -> None:
        self.event.set()


async def until(cond, timeout: float = 10.0) -> None:
    """Wait for a condition the test cannot await directly (bounded, not a timing assertion)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond():
        assert loop.time() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


async def started(cfg, adapter) -> GatewayApp:
    app = build_gateway(cfg, [adapter])
    await app.start()
    return app


async def stored(cfg, tenant: str) -> list:
    """Every message of the tenant's sessions, straight from its state.db."""
    async with SessionStore(tenant_dir(cfg.data_dir, tenant)) as store:
        out = []
        for info in await store.list_sessions():
            out += await store.history(info["id"], include_inactive=True)
        return out


def assert_no_orphan_tool_calls(messages) -> None:
    answered = {m.tool_call_id for m in messages if m.role == "tool" and m.active}
    for m in messages:
        if m.role == "assistant" and m.tool_calls and m.active:
            for call in m.tool_calls:
                assert call["id"] in answered, f"tool call {call['id']} has no result"


async def test_stop_ends_the_running_turn_and_the_next_message_starts_cleanly(config_for, fake_llm):
    gate = Gate("write me an epic")
    fake_llm.responder = gate
    cfg = config_for(delivery={"streaming": "off"})
    adapter = RecordingAdapter()
    app = await started(cfg, adapter)
    try:
        await adapter.sink(dm("ann", "write me an epic"))
        await until(lambda: len(fake_llm.requests) == 1)
        await adapter.sink(dm("ann", "/stop"))  # answered at once, not behind the running turn
        assert await app.drain(10)
        assert adapter.texts() == ["Stopped."]
        await adapter.sink(dm("ann", "hello again"))
        assert await app.drain(10)
        assert adapter.texts()[-1] == "ok: hello again"
        assert fake_llm.violations == []
        rows = await app.inbox.db.execute_fetchall("SELECT status FROM inbound")
        assert {r[0] for r in rows} == {"done"}
        assert await _say_stop(app, adapter) == "There's nothing to stop right now."
    finally:
        gate.release()
        await app.stop()
    msgs = await stored(cfg, "testchat-ann")
    assert [m.content for m in msgs if m.role == "user"] == ["write me an epic", "hello again"]
    assert [(m.content, m.meta.get("interrupted")) for m in msgs if m.role == "assistant"] == [
        (STOPPED_MARKER, True),
        ("ok: hello again", None),
    ]


async def _say_stop(app, adapter) -> str:
    before = len(adapter.sent)
    await adapter.sink(dm("ann", "/stop"))
    assert await app.drain(10)
    return adapter.texts()[before]


async def test_stop_between_tool_calls_leaves_no_orphan_tool_call(config_for, fake_llm):
    gate = Gate("never mind")  # never matches: the held request is the one after the tool result
    hold = asyncio.Event()

    async def after_tool(request):
        await hold.wait()
        return default_responder(request)

    fake_llm.script(tool_call("session_search", {"query": "plans"}), after_tool)
    fake_llm.responder = gate
    cfg = config_for(delivery={"streaming": "off"})
    adapter = RecordingAdapter()
    app = await started(cfg, adapter)
    try:
        await adapter.sink(dm("ben", "look up my plans"))
        await until(lambda: len(fake_llm.requests) == 2)
        await adapter.sink(dm("ben", "/stop"))
        assert await app.drain(10)
        assert adapter.texts() == ["Stopped."]
        assert await _say(app, adapter, dm("ben", "and now?")) == "ok: and now?"
        assert fake_llm.violations == []
    finally:
        hold.set()
        await app.stop()
    msgs = await stored(cfg, "testchat-ben")
    assert any(m.tool_calls for m in msgs), "the tool call of the stopped turn is kept"
    assert_no_orphan_tool_calls(msgs)


async def _say(app, adapter, msg) -> str:
    before = len(adapter.sent)
    await adapter.sink(msg)
    assert await app.drain(10)
    return adapter.texts()[before]


async def _busy_run(config_for, fake_llm, mode: str) -> tuple[RecordingAdapter, list]:
    gate = Gate("first")
    fake_llm.responder = gate
    cfg = config_for(limits={"busy_mode": mode}, delivery={"streaming": "off"})
    adapter = RecordingAdapter()
    app = await started(cfg, adapter)
    try:
        await adapter.sink(dm("cy", "first"))
        await until(lambda: len(fake_llm.requests) == 1)
        await adapter.sink(dm("cy", "second"))
        if mode != "interrupt":  # (a third message would interrupt the second turn in turn)
            await adapter.sink(dm("cy", "third"))
        if mode != "interrupt":
            gate.release()
        assert await app.drain(10)
        assert fake_llm.violations == []
        return adapter, fake_llm.requests[:]
    finally:
        gate.release()
        await app.stop()


async def test_busy_mode_collect_answers_waiting_messages_together(config_for, fake_llm):
    adapter, requests = await _busy_run(config_for, fake_llm, "collect")
    assert len(requests) == 2
    assert adapter.texts() == ["ok: first", "ok: second\n\nthird"]


async def test_busy_mode_queue_answers_waiting_messages_one_by_one(config_for, fake_llm):
    adapter, requests = await _busy_run(config_for, fake_llm, "queue")
    assert len(requests) == 3
    assert adapter.texts() == ["ok: first", "ok: second", "ok: third"]


async def test_busy_mode_interrupt_stops_the_running_turn(config_for, fake_llm):
    adapter, requests = await _busy_run(config_for, fake_llm, "interrupt")
    # the first turn was stopped unanswered; the next turn answers both messages
    assert len(requests) == 2
    assert adapter.texts() == ["ok: second"]
    assert [m["content"] for m in requests[1]["messages"][1:]] == ["first", STOPPED_MARKER, "second"]


def test_busy_mode_queue_refuses_burst_coalescing(tmp_path):
    with pytest.raises(ConfigError, match="coalesce_burst_ms"):
        make_config(tmp_path, "http://127.0.0.1:1/v1", limits={"busy_mode": "queue", "coalesce_burst_ms": 200})
