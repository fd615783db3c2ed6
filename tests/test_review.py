"""Background memory review, flush and skill review end to end: GatewayApp + RecordingAdapter
+ the fake model, which answers review requests with scripted tool calls (docs/concepts.md#how-memory-grows)."""

from __future__ import annotations

import asyncio
import json
import logging
import re
from pathlib import Path

from agent.compression_stages import is_summary_request
from agent.review import GROUP_NOTE
from agent.visibility import GROUP_LANE, Marks
from tenancy.keys import tenant_dir
from tests.conftest import dm, group, say
from tests.conftest import running_gateway as gateway
from tests.fakes.llm import (
    error,
    hang,
    is_review_request,
    last_user_text,
    offered_tools,
    reply,
    tool_call,
    when_reviewing,
)


def memory_file(app, tenant: str, target: str = "user") -> Path:
    return tenant_dir(app.cfg.data_dir, tenant) / "memories" / ("USER.md" if target == "user" else "MEMORY.md")


def entries(app, tenant: str, target: str = "user") -> list[str]:
    path = memory_file(app, tenant, target)
    return [e.strip() for e in path.read_text("utf-8").split("\n§\n")] if path.exists() else []


def reviews(fake_llm) -> list[dict]:
    """The first request of each review (the one without tool results yet)."""
    return [r for r in fake_llm.requests if is_review_request(r) and r["messages"][-1]["role"] == "user"]


def save_first_fact(request: dict):
    """A reviewing model: saves the first 'my ... is ...' sentence it finds in the conversation."""
    for msg in request["messages"]:
        text = msg.get("content") or ""
        m = re.search(r"my (\w+) is (\w+)", text) if msg["role"] == "user" else None
        if m:
            return tool_call(
                "memory", {"action": "add", "target": "user", "content": f"Their {m.group(1)} is {m.group(2)}"}
            )
    return reply("Nothing to save.")


async def test_review_every_n_turns_writes_the_expected_entry_only_in_its_own_tenant(config_for, fake_llm):
    fake_llm.responder = when_reviewing(save_first_fact)
    async with gateway(config_for, memory={"nudge_interval": 3}) as (app, adapter):
        await say(app, adapter, dm("alice", "hi, my cat is Miso"))
        await say(app, adapter, dm("bob", "hello, my dog is Rex"))
        await say(app, adapter, dm("alice", "how are you"))
        assert reviews(fake_llm) == []  # two turns each: not yet
        await say(app, adapter, dm("alice", "tell me a joke"))
        assert len(reviews(fake_llm)) == 1
        assert entries(app, "testchat-alice") == ["Their cat is Miso"]
        assert entries(app, "testchat-bob") == []  # bob's turns were not reviewed with alice's
        review = reviews(fake_llm)[0]
        assert offered_tools(review) == {"memory"}  # only the memory tool (skills are off here)
        assert not any("Rex" in (m.get("content") or "") for m in review["messages"])
        await say(app, adapter, dm("bob", "again"))
        await say(app, adapter, dm("bob", "and again"))
        assert len(reviews(fake_llm)) == 2
        assert entries(app, "testchat-bob") == ["Their dog is Rex"]
        assert entries(app, "testchat-alice") == ["Their cat is Miso"]
        # the conversation was never touched: no review prompt, no review tool call stored
        async with app.profiles.use("testchat-alice") as profile:
            sid = await profile.sessions.route("agent:main:testchat:dm:dm-alice")
            history = await profile.sessions.history(sid)
        assert [m.role for m in history] == ["system"] + ["user", "assistant"] * 3
        assert not any("[BACKGROUND REVIEW]" in (m.content or "") for m in history)
        # nothing of the review reached the chat; it is counted in /metrics
        assert not any("Saved" in t for t in adapter.texts())
        assert app.metrics.reviews.value(kind="nudge", outcome="saved") == 2
        assert 'hermes_memory_reviews_total{kind="nudge",outcome="saved"} 2' in app.metrics.render()


async def test_the_review_runs_after_the_reply_is_delivered(config_for, fake_llm):
    seen_when_reviewing: list[list[str]] = []

    def review(request):
        seen_when_reviewing.append(list(adapter.texts()))
        return reply("Nothing to save.")

    fake_llm.responder = when_reviewing(review, lambda r: reply(f"answer to {last_user_text(r)}"))
    async with gateway(config_for, memory={"nudge_interval": 1}) as (app, adapter):
        await say(app, adapter, dm("carl", "first"))
    assert seen_when_reviewing == [["answer to first"]]


async def test_the_review_uses_the_auxiliary_model(config_for, fake_llm):
    fake_llm.responder = when_reviewing(reply("Nothing to save."))
    async with gateway(config_for, memory={"nudge_interval": 1}, auxiliary={"review": {"model": "aux-small"}}) as (
        app,
        adapter,
    ):
        await say(app, adapter, dm("dora", "hello"))
    [review] = reviews(fake_llm)
    assert review["model"] == "aux-small"
    assert {r["model"] for r in fake_llm.requests if not is_review_request(r)} == {"fake-model"}


async def test_group_lane_review_writes_only_a_shared_entry(config_for, fake_llm):
    """A review of a group lane writes through the very store and lane context a group-lane
    turn uses (so the visibility rules of agent/memory.py make its entries shared)."""
    fake_llm.responder = when_reviewing(save_first_fact)
    async with gateway(config_for, memory={"nudge_interval": 2}) as (app, adapter):
        built = []
        real = app.agent.reviewer._toolbox

        def spy(*args):
            built.append(real(*args))
            return built[-1]

        app.agent.reviewer._toolbox = spy
        await say(app, adapter, dm("erin", "in private: my secret is Hidden"))
        await say(app, adapter, group("g1", "erin", "my team is Falcons"))
        await say(app, adapter, group("g1", "erin", "go team"))
        [review] = reviews(fake_llm)
        assert GROUP_NOTE in review["messages"][-1]["content"]
        # the review saw the group lane's conversation, never the private chat
        assert not any("Hidden" in (m.get("content") or "") for m in review["messages"])
        assert entries(app, "testchat-erin") == ["Their team is Falcons"]
        [box] = built
        assert box.shared and box.search_lane == "agent:main:testchat:group:g1:erin"
        assert box.memory is not None and box.memory.scope is GROUP_LANE  # as a group-lane turn has it
        async with app.profiles.use("testchat-erin") as profile:
            marks = Marks(profile.memory.memory_dir).of("user", ["Their team is Falcons"])
        assert marks == ["shared"]  # written in a group lane: the group may see it, nothing else


async def test_no_review_where_the_lane_may_not_write(config_for, fake_llm):
    fake_llm.responder = when_reviewing(save_first_fact)
    for mode in ("read", "off"):
        async with gateway(config_for, memory={"nudge_interval": 1}, tenancy={"personal_memory_in_groups": mode}) as (
            app,
            adapter,
        ):
            await say(app, adapter, group(f"g-{mode}", "fred", "my car is Tesla"))
            assert reviews(fake_llm) == []
            assert entries(app, "testchat-fred") == []


async def test_shared_lane_review_writes_the_groups_memory_not_a_members(config_for, fake_llm):
    fake_llm.responder = when_reviewing(save_first_fact)
    async with gateway(config_for, memory={"nudge_interval": 1}, tenancy={"group_sessions_per_user": False}) as (
        app,
        adapter,
    ):
        await say(app, adapter, group("g7", "gus", "my band is Owls"))
        assert entries(app, "testchat-chat-g7") == ["Their band is Owls"]
        assert entries(app, "testchat-gus") == []


async def test_flush_runs_on_new_after_6_turns_and_not_after_5(config_for, fake_llm):
    fake_llm.responder = when_reviewing(save_first_fact)
    async with gateway(config_for, memory={"flush_min_turns": 6}) as (app, adapter):
        await say(app, adapter, dm("hana", "my city is Lyon"))
        for i in range(4):
            await say(app, adapter, dm("hana", f"turn {i}"))
        await say(app, adapter, dm("hana", "/new"))  # 5 turns: no flush
        assert reviews(fake_llm) == []
        await say(app, adapter, dm("hana", "my city is Paris"))
        for i in range(5):
            await say(app, adapter, dm("hana", f"more {i}"))
        await say(app, adapter, dm("hana", "/new"))  # 6 turns: one flush, on the ending session
        [review] = reviews(fake_llm)
        assert "Lyon" not in json.dumps(review["messages"])
        assert entries(app, "testchat-hana") == ["Their city is Paris"]
        assert app.metrics.reviews.value(kind="flush", outcome="saved") == 1
        # the flush ran first: the new session's frozen prompt already has the entry
        await say(app, adapter, dm("hana", "hello again"))
        assert "Their city is Paris" in fake_llm.requests[-1]["messages"][0]["content"]


async def test_flush_at_shutdown_reviews_sessions_with_enough_unreviewed_turns(config_for, fake_llm):
    fake_llm.responder = when_reviewing(save_first_fact)
    async with gateway(config_for, memory={"flush_min_turns": 2}) as (app, adapter):
        await say(app, adapter, dm("ivan", "my boat is Wave"))
        await say(app, adapter, dm("ivan", "bye"))
        await say(app, adapter, dm("jo", "my boat is Reef"))  # one turn: not flushed
    assert len(reviews(fake_llm)) == 1
    assert entries(app, "testchat-ivan") == ["Their boat is Wave"]
    assert entries(app, "testchat-jo") == []


async def test_compression_runs_the_flush_before_on_pre_compress(config_for, fake_llm):
    order: list[str] = []

    def model(request):
        if is_summary_request(request["messages"]):
            order.append("summary")
            return reply("## Goals\n- SUMMARY")
        if is_review_request(request) and request["messages"][-1]["role"] == "user":
            notes = tenant_dir(app.cfg.data_dir, "testchat-kim") / "provider" / "notes.jsonl"
            text = notes.read_text("utf-8") if notes.exists() else ""
            order.append("review:pre_compress_done" if "pre_compress" in text else "review")
            return save_first_fact(request)
        if is_review_request(request):
            return reply("Saved.")
        return reply("ok")

    fake_llm.responder = model
    async with gateway(
        config_for,
        llm={"context_length": 4000},
        memory={"flush_min_turns": 3, "provider": "local"},
        compression={"in_place": False},
    ) as (app, adapter):
        await say(app, adapter, dm("kim", "my horse is Comet " + "x" * 1500))
        for i in range(12):
            await say(app, adapter, dm("kim", f"turn {i} " + "lorem ipsum " * 120))
            if "summary" in order:
                break
        assert order[:2] == ["review", "summary"], order
        assert entries(app, "testchat-kim") == ["Their horse is Comet"]
        notes = (tenant_dir(app.cfg.data_dir, "testchat-kim") / "provider" / "notes.jsonl").read_text("utf-8")
        assert "pre_compress" in notes


async def test_a_failed_review_is_logged_and_counted_never_shown(config_for, fake_llm, caplog):
    fake_llm.responder = when_reviewing(error(500, {"error": {"message": "boom"}}))
    async with gateway(config_for, memory={"nudge_interval": 1}, llm={"max_retries": 0}) as (app, adapter):
        with caplog.at_level(logging.WARNING, logger="hermes.review"):
            sent = await say(app, adapter, dm("lea", "hello"))
        assert sent == ["ok: hello"]
        assert app.metrics.reviews.value(kind="nudge", outcome="llm_error") == 1
        assert any("review failed" in r.getMessage() for r in caplog.records)
        assert adapter.texts() == ["ok: hello"]


async def test_a_review_is_bounded_by_its_timeout(config_for, fake_llm):
    fake_llm.responder = when_reviewing(hang(30, reply("late")))
    async with gateway(config_for, memory={"nudge_interval": 1, "review_timeout_s": 0.3}) as (app, adapter):
        assert await say(app, adapter, dm("max", "hello")) == ["ok: hello"]
        assert app.metrics.reviews.value(kind="nudge", outcome="timeout") == 1


async def test_one_review_at_a_time_per_tenant(config_for, fake_llm):
    release = asyncio.Event()

    async def slow_review(request):
        await release.wait()
        return reply("Nothing to save.")

    fake_llm.responder = when_reviewing(slow_review)
    async with gateway(config_for, memory={"nudge_interval": 1}) as (app, adapter):
        first, second = dm("nina", "one"), group("g2", "nina", "two")  # two lanes, one tenant
        await adapter.sink(first)
        await adapter.sink(second)
        while len(reviews(fake_llm)) < 1 or app.metrics.reviews.value(kind="nudge", outcome="busy") < 1:
            await asyncio.sleep(0.02)
        release.set()
        assert await app.drain(20)
        assert len(reviews(fake_llm)) == 1
        assert app.metrics.reviews.value(kind="nudge", outcome="busy") == 1


async def test_skill_review_after_n_tool_iterations_creates_a_skill_in_the_index(config_for, fake_llm):
    def model(request):
        if is_review_request(request):
            if request["messages"][-1]["role"] == "tool":
                return reply("Saved.")
            assert "skill_manage" in offered_tools(request)
            return tool_call(
                "skill_manage",
                {
                    "action": "create",
                    "name": "brew-tea",
                    "description": "How to brew green tea",
                    "content": "1. Water at 80C\n2. Steep 2 minutes",
                },
            )
        msgs = request["messages"]
        if msgs[-1]["role"] == "tool":
            return reply("found it")
        if "search" in last_user_text(request):
            return tool_call("session_search", {"query": "tea"})
        return reply("ok")

    fake_llm.responder = model
    async with gateway(config_for, skills={"creation_nudge_interval": 2}) as (app, adapter):
        await say(app, adapter, dm("olga", "search please"))  # 1 tool iteration
        assert reviews(fake_llm) == []
        await say(app, adapter, dm("olga", "search again"))  # 2: a skill review
        assert len(reviews(fake_llm)) == 1
        skill = tenant_dir(app.cfg.data_dir, "testchat-olga") / "skills" / "brew-tea" / "SKILL.md"
        assert "Steep 2 minutes" in skill.read_text("utf-8")
        await say(app, adapter, dm("olga", "/new"))
        await say(app, adapter, dm("olga", "hi"))
        assert "- brew-tea: How to brew green tea" in fake_llm.requests[-1]["messages"][0]["content"]


async def test_zero_turns_off_nudges_and_flush(config_for, fake_llm):
    fake_llm.responder = when_reviewing(save_first_fact)
    async with gateway(
        config_for, memory={"nudge_interval": 0, "flush_min_turns": 0}, skills={"creation_nudge_interval": 0}
    ) as (app, adapter):
        for i in range(12):
            await say(app, adapter, dm("pia", f"my pet is Rex{i}"))
        await say(app, adapter, dm("pia", "/new"))
    assert reviews(fake_llm) == []
    assert entries(app, "testchat-pia") == []


async def test_the_review_cannot_use_other_tools(config_for, fake_llm):
    fake_llm.responder = when_reviewing(tool_call("session_search", {"query": "anything"}))
    async with gateway(config_for, memory={"nudge_interval": 1}) as (app, adapter):
        await say(app, adapter, dm("quin", "hello"))
        results = [m for r in fake_llm.requests if is_review_request(r) for m in r["messages"] if m["role"] == "tool"]
        assert results and all("only memory can be used here" in m["content"] for m in results)
        assert app.metrics.reviews.value(kind="nudge", outcome="nothing") == 1
