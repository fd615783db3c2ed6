"""Who may use which tool, and calls that wait for the person's press (docs/concepts.md#tools).

Real gateway, real registry of questions; the adapter here is the loopback test adapter
with buttons (`ButtonAdapter`): its `ask` records the question and a test presses by
calling the gateway's answerer, as the Telegram and Discord adapters do on a press
(tests/test_confirm_buttons.py checks those against the fake platforms)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from core.messages import ConfirmAnswerer, ConfirmRequest, SentMessage
from core.protocols import Confirms
from core.settings import parse_config
from gateway.build import build_gateway
from tests.conftest import RecordingAdapter, dm, group, running_gateway, say
from tests.fakes.llm import offered_tools, reply, tool_call


class ButtonAdapter(RecordingAdapter):
    """The recording adapter with buttons: questions are kept, presses go to the answerer."""

    def __init__(self) -> None:
        super().__init__()
        self.answerer: ConfirmAnswerer | None = None
        self.asked: list[ConfirmRequest] = []
        self.settled: list[tuple[str, str]] = []

    async def ask(self, request: ConfirmRequest) -> SentMessage | None:
        self.asked.append(request)
        return SentMessage(platform=self.platform, chat_id=request.chat_id, message_id=f"q{len(self.asked)}")

    async def settle(self, request: ConfirmRequest, sent: SentMessage, outcome: str) -> None:
        self.settled.append((request.token, outcome))

    async def press(self, user_id: str, allow: bool, index: int = -1) -> str:
        assert self.answerer is not None, "the gateway sets the answerer before start"
        return await self.answerer(self.asked[index].token, user_id, allow)


def tool_results(request: dict[str, Any]) -> list[dict[str, Any]]:
    return [json.loads(m["content"]) for m in request.get("messages", []) if m.get("role") == "tool"]


async def wait_asked(adapter: ButtonAdapter, n: int = 1, timeout: float = 10) -> None:
    async with asyncio.timeout(timeout):
        while len(adapter.asked) < n:
            await asyncio.sleep(0.01)


async def test_a_group_lane_is_never_offered_a_dm_tool_and_a_call_made_anyway_is_refused(config_for, fake_llm):
    fake_llm.script(reply("in the dm"), tool_call("session_search", {"query": "secret"}), reply("done"))
    async with running_gateway(config_for, tools={"session_search": {"allow": "dm"}}) as (app, adapter):
        await say(app, adapter, dm("ada", "hello"))
        assert "session_search" in offered_tools(fake_llm.requests[-1])
        await say(app, adapter, group("g1", "ada", "search for it"))
        group_requests = fake_llm.requests[1:]
        assert all("session_search" not in offered_tools(r) for r in group_requests)
        [result] = tool_results(group_requests[-1])
        assert result["success"] is False and "direct message" in result["error"]
        assert 'hermes_tool_calls_total{tool="session_search",outcome="refused"} 1' in app.metrics.render()


async def test_the_same_call_in_a_dm_runs(config_for, fake_llm):
    fake_llm.script(tool_call("session_search", {"query": "hello"}), reply("found it"))
    async with running_gateway(config_for, tools={"session_search": {"allow": "dm"}}) as (app, adapter):
        assert await say(app, adapter, dm("ada", "hello there")) == ["found it"]
        [result] = tool_results(fake_llm.requests[-1])
        assert result["success"] is True
        assert 'hermes_tool_calls_total{tool="session_search",outcome="ok"} 1' in app.metrics.render()


@pytest.mark.parametrize(
    ("allow", "who", "where", "offered"),
    [
        ("owner", "boss", "dm", True),
        ("owner", "ada", "dm", False),
        ("owner", "boss", "group", False),
        ("admin", "boss", "group", True),
        ("admin", "ada", "dm", False),
        ("chat_admin", "ada", "dm", True),
        ("chat_admin", "ada", "group", False),  # the test platform has no chat admins
        ("chat_admin", "boss", "group", True),
        ("everyone", "ada", "group", True),
    ],
)
async def test_each_tier_offers_the_tool_to_exactly_its_people(config_for, fake_llm, allow, who, where, offered):
    fake_llm.script(reply("ok"))
    sections = {"tools": {"session_search": {"allow": allow}}, "access": {"admins": ["testchat:boss"]}}
    async with running_gateway(config_for, **sections) as (app, adapter):
        msg = dm(who, "hi") if where == "dm" else group("g1", who, "hi")
        await say(app, adapter, msg)
        assert ("session_search" in offered_tools(fake_llm.requests[-1])) is offered


async def confirm_gateway(config_for, **tools: Any):
    adapter = ButtonAdapter()
    sections = {"tools": {"session_search": {"confirm": True}, **tools}, "limits": {"rate_limit_per_minute": 1000}}
    app = build_gateway(config_for(**sections), [adapter])
    await app.start()
    return app, adapter


async def test_a_confirm_tool_waits_for_the_persons_press_and_runs_when_allowed(config_for, fake_llm):
    fake_llm.script(tool_call("session_search", {"query": "plans"}), reply("here they are"))
    app, adapter = await confirm_gateway(config_for)
    try:
        assert isinstance(adapter, Confirms)
        turn = asyncio.ensure_future(say(app, adapter, dm("ada", "find my plans")))
        await wait_asked(adapter)
        question = adapter.asked[0]
        assert question.user_id == "ada" and question.chat_id == "dm-ada"
        assert "session_search" in question.text and "plans" in question.text
        await asyncio.sleep(0.2)
        assert not turn.done() and len(fake_llm.requests) == 1, "nothing runs before the press"
        assert await adapter.press("ada", allow=True) == "ok"
        assert await turn == ["here they are"]
        [result] = tool_results(fake_llm.requests[-1])
        assert result["success"] is True
        assert adapter.settled == [(question.token, "Allowed.")]
        assert await adapter.press("ada", allow=True, index=0) == "expired"
    finally:
        await app.stop()


async def test_someone_elses_press_is_refused_and_the_askers_deny_stops_the_call(config_for, fake_llm):
    fake_llm.script(tool_call("session_search", {"query": "x"}), reply("understood"))
    app, adapter = await confirm_gateway(config_for)
    try:
        turn = asyncio.ensure_future(say(app, adapter, group("g1", "ada", "search")))
        await wait_asked(adapter)
        assert await adapter.press("bob", allow=True) == "not_yours"
        await asyncio.sleep(0.1)
        assert not turn.done()
        assert await adapter.press("ada", allow=False) == "ok"
        await turn
        [result] = tool_results(fake_llm.requests[-1])
        assert result["success"] is False and "did not allow" in result["error"]
        assert adapter.settled[-1][1] == "Denied."
        assert 'hermes_tool_calls_total{tool="session_search",outcome="denied"} 1' in app.metrics.render()
    finally:
        await app.stop()


async def test_no_answer_in_time_means_deny(config_for, fake_llm):
    fake_llm.script(tool_call("session_search", {"query": "x"}), reply("ok then"))
    app, adapter = await confirm_gateway(config_for, confirm_timeout_s=1)
    try:
        assert await say(app, adapter, dm("ada", "search")) == ["ok then"]
        [result] = tool_results(fake_llm.requests[-1])
        assert result["success"] is False and "no answer in time" in result["error"]
        assert adapter.settled[-1][1] == "No answer: denied."
    finally:
        await app.stop()


async def test_stop_during_the_wait_denies_the_call(config_for, fake_llm):
    fake_llm.script(tool_call("session_search", {"query": "x"}), reply("stopped it"))
    app, adapter = await confirm_gateway(config_for)
    try:
        turn = asyncio.ensure_future(say(app, adapter, dm("ada", "search")))
        await wait_asked(adapter)
        await adapter.sink(dm("ada", "/stop"))
        await turn
        assert adapter.settled[-1][1] == "Stopped: denied."
        assert all(r["success"] is False for r in tool_results(fake_llm.requests[-1]))
    finally:
        await app.stop()


async def test_a_chat_without_buttons_denies_a_confirm_call(config_for, fake_llm):
    fake_llm.script(tool_call("session_search", {"query": "x"}), reply("no then"))
    sections = {"tools": {"session_search": {"confirm": True}}}
    async with running_gateway(config_for, **sections) as (app, adapter):
        assert not isinstance(adapter, Confirms)
        assert await say(app, adapter, dm("ada", "search")) == ["no then"]
        [result] = tool_results(fake_llm.requests[-1])
        assert result["success"] is False and "buttons" in result["error"]


async def test_tools_lists_what_the_speaker_may_use_here(config_for, fake_llm):
    sections = {"tools": {"session_search": {"allow": "dm", "confirm": True}}}
    async with running_gateway(config_for, **sections) as (app, adapter):
        [in_dm] = await say(app, adapter, dm("ada", "/tools"))
        assert "session_search" in in_dm and "(I ask you first)" in in_dm and "memory" in in_dm
        [in_group] = await say(app, adapter, group("g1", "ada", "/tools"))
        assert "session_search" not in in_group
        assert "only offered in a direct message" in in_group
    assert fake_llm.requests == []


def test_cluster_mode_accepts_confirmations_since_a_press_on_any_node_counts():
    # the questions live in PostgreSQL there (tests/test_cluster_signals.py presses across nodes)
    data = {
        "cluster": {"postgres_dsn_env": "PG_DSN"},
        "tools": {"web_fetch": {"enabled": True, "confirm": True}, "session_search": {"confirm": True}},
    }
    cfg = parse_config(data)
    assert cfg.cluster.enabled and cfg.tools.web_fetch.confirm and cfg.tools.session_search.confirm
    assert parse_config({**data, "reminders": {"enabled": True}}).reminders_on  # docs/cluster.md#reminders


async def test_a_restart_during_the_wait_asks_again_and_never_runs_the_call_unasked(config_for, fake_llm):
    fake_llm.script(
        tool_call("session_search", {"query": "x"}), tool_call("session_search", {"query": "x"}), reply("ok")
    )
    cfg = config_for(tools={"session_search": {"confirm": True}}, limits={"rate_limit_per_minute": 1000})
    first = ButtonAdapter()
    app = build_gateway(cfg, [first])
    await app.start()
    await first.sink(dm("ada", "search please"))
    await wait_asked(first)
    await app.stop(drain_timeout=0.5)  # the process goes while the question waits
    assert first.settled == [] or all(outcome != "Allowed." for _, outcome in first.settled)
    assert not any(m.get("role") == "tool" for r in fake_llm.requests for m in r["messages"])
    second = ButtonAdapter()
    app = build_gateway(cfg, [second])
    await app.start()
    try:
        await wait_asked(second)  # the pending message is answered again: it asks again
        assert second.asked[0].token != first.asked[0].token
        assert await first.press("ada", allow=True) == "expired" and len(second.settled) == 0
        assert await second.press("ada", allow=True) == "ok"
        assert await app.drain(10)
        [result] = tool_results(fake_llm.requests[-1])
        assert result["success"] is True
        assert second.texts("dm-ada")[-1] == "ok"
    finally:
        await app.stop()
