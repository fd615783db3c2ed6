"""Reminders (docs/concepts.md#reminders): set through the `reminders` tool, kept in the
tenant's profile, delivered once into the chat they were set in, after restarts too."""

from __future__ import annotations

import asyncio
import json
import time
from datetime import datetime
from zoneinfo import ZoneInfo

from agent.reminders import ReminderChat, ReminderStore, ReminderTool, next_occurrence
from core.messages import InboundMessage
from gateway.build import build_gateway
from gateway.runtime import GatewayApp
from tenancy.keys import tenant_dir
from tests.conftest import RecordingAdapter, dm, group, say
from tests.fakes.llm import reply, tool_call
from tests.test_stop_busy import stored, until


def create(**args) -> object:
    return tool_call("reminders", {"action": "create", **args})


def tool_results(fake_llm) -> list[dict]:
    out = []
    for request in fake_llm.requests:
        last = request["messages"][-1]
        if last["role"] == "tool":
            out.append(json.loads(last["content"]))
    return out


async def run_later(cfg, offset_s: float) -> tuple[GatewayApp, RecordingAdapter]:
    """A gateway started `offset_s` seconds in the future (its reminder clock moved on)."""
    adapter = RecordingAdapter()
    app = build_gateway(cfg, [adapter])
    app.reminders.clock = lambda: time.time() + offset_s
    await app.start()
    return app, adapter


async def delivered_later(cfg, offset_s: float, *, count: int = 1) -> RecordingAdapter:
    """Start the gateway `offset_s` later, wait for `count` deliveries, drain and stop it."""
    app, adapter = await run_later(cfg, offset_s)
    try:
        await until(lambda: len(adapter.sent) >= count)
        assert await app.drain(10)
    finally:
        await app.stop()
    return adapter


async def set_reminder(cfg, fake_llm, who, text: str, **args) -> None:
    """One turn in which the model sets a reminder of `text` through the tool."""
    fake_llm.script(create(text=text, **args), reply("Okay, I'll remind you."))
    adapter = RecordingAdapter()
    app = build_gateway(cfg, [adapter])
    await app.start()
    try:
        await say(app, adapter, who(f"please remind me: {text}"))
    finally:
        await app.stop()
    assert tool_results(fake_llm)[-1]["success"] is True


async def test_reminder_set_before_a_restart_is_delivered_once_after_it(config_for, fake_llm):
    cfg = config_for()
    await set_reminder(cfg, fake_llm, lambda t: dm("hal", t), text="water the plants", in_minutes=30)
    adapter = await delivered_later(cfg, 31 * 60)
    assert [(m.chat_id, m.text, m.reply_to_message_id) for m in adapter.sent] == [
        ("dm-hal", "⏰ Reminder: water the plants", None)
    ]
    # a later restart delivers nothing again
    app, adapter = await run_later(cfg, 2 * 3600)
    try:
        assert await app.reminders.tick() == 0
        assert await app.drain(10)
    finally:
        await app.stop()
    assert adapter.sent == []
    msgs = await stored(cfg, "testchat-hal")
    assert [m.content for m in msgs if m.meta.get("reminder")] == ["⏰ Reminder: water the plants"]
    assert await ReminderStore(tenant_dir(cfg.data_dir, "testchat-hal")).all() == []


async def test_a_late_reminder_says_it_is_late(config_for, fake_llm):
    cfg = config_for()
    await set_reminder(cfg, fake_llm, lambda t: dm("ida", t), text="stretch", in_minutes=10)
    adapter = await delivered_later(cfg, 3 * 3600)
    (sent,) = adapter.texts()
    assert sent.startswith("⏰ Reminder: stretch")
    assert "late" in sent and "2 hours ago" in sent


async def test_reminders_are_capped_per_tenant(config_for, fake_llm):
    cfg = config_for(reminders={"max_per_tenant": 1})
    await set_reminder(cfg, fake_llm, lambda t: dm("jon", t), text="one", in_minutes=5)
    fake_llm.script(create(text="two", in_minutes=5), reply("Sorry."))
    adapter = RecordingAdapter()
    app = build_gateway(cfg, [adapter])
    await app.start()
    try:
        await say(app, adapter, dm("jon", "and another"))
        assert await say(app, adapter, dm("jon", "/reminders")) == [
            "Your reminders:\n"
            + (await ReminderStore(tenant_dir(cfg.data_dir, "testchat-jon")).all())[0].describe()
            + "\nCancel one with /reminders cancel N."
        ]
    finally:
        await app.stop()
    refusal = tool_results(fake_llm)[-1]
    assert refusal["success"] is False and "1 reminders, the most allowed" in refusal["error"]
    assert [r.text for r in await ReminderStore(tenant_dir(cfg.data_dir, "testchat-jon")).all()] == ["one"]


async def test_group_reminder_is_delivered_into_the_group_and_listed_only_there(config_for, fake_llm):
    cfg = config_for()
    await set_reminder(cfg, fake_llm, lambda t: dm("kai", t), text="private dentist", in_minutes=60)
    await set_reminder(cfg, fake_llm, lambda t: group("g9", "kai", t), text="team standup", in_minutes=20)
    adapter = RecordingAdapter()
    app = build_gateway(cfg, [adapter])
    await app.start()
    try:
        (listing,) = await say(app, adapter, group("g9", "kai", "/reminders"))
        assert "team standup" in listing and "dentist" not in listing  # the group never sees DM ones
        (listing,) = await say(app, adapter, dm("kai", "/reminders"))
        assert "team standup" in listing and "dentist" in listing
        assert await say(app, adapter, group("g9", "kai", "/reminders cancel 1")) == ["There's no reminder #1 here."]
        (done,) = await say(app, adapter, dm("kai", "/reminders cancel 1"))
        assert done.startswith("Cancelled: #1") and "dentist" in done
    finally:
        await app.stop()
    adapter = await delivered_later(cfg, 21 * 60)
    assert [(m.chat_id, m.text) for m in adapter.sent] == [("g9", "⏰ Reminder for kai: team standup")]


async def test_times_are_read_in_the_persons_time_zone(tmp_path):
    store = ReminderStore(tmp_path)
    noted: list = []

    async def index(due, lower_only):
        noted.append((due, lower_only))

    now = datetime(2026, 3, 20, 12, 0, tzinfo=ZoneInfo("UTC")).timestamp()
    chat = ReminderChat("telegram", "111", "dm", None, "111", "lea")
    tool = ReminderTool(store, chat, 10, index, group=False, clock=lambda: now)
    refused = json.loads(await tool.handle({"action": "create", "text": "call mum", "at": "2026-03-28 09:00"}))
    assert refused["success"] is False and "time zone" in refused["error"]
    made = json.loads(
        await tool.handle(
            {
                "action": "create",
                "text": "call mum",
                "at": "2026-03-28 09:00",
                "timezone": "Europe/Berlin",
                "repeat": "daily",
            }
        )
    )
    assert made["success"] is True and "09:00 (Europe/Berlin)" in made["created"]
    (reminder,) = await store.all()
    assert reminder.due == datetime(2026, 3, 28, 9, 0, tzinfo=ZoneInfo("Europe/Berlin")).timestamp()
    assert noted[-1] == (reminder.due, False)
    # Berlin moves to summer time on 29 March: the daily reminder stays at 09:00 local
    nxt = next_occurrence(reminder.due, "Europe/Berlin", "daily", reminder.due)
    assert datetime.fromtimestamp(nxt, ZoneInfo("Europe/Berlin")).strftime("%d %H:%M") == "29 09:00"
    assert nxt - reminder.due == 23 * 3600
    bad = json.loads(
        await tool.handle({"action": "create", "text": "x", "at": "2026-03-28 09:00", "timezone": "Mars/Olympus"})
    )
    assert bad["success"] is False and "unknown time zone" in bad["error"]


def private_thread(user: str, text: str) -> InboundMessage:
    """A message in the Discord-style private thread `pt1` of channel `chan`."""
    base = group("chan", user, text, thread_id="pt1")
    return base.model_copy(update={"private_thread": True})


async def test_a_reminder_set_in_a_private_thread_is_delivered_and_kept_in_that_thread_only(config_for, fake_llm):
    cfg = config_for()
    await set_reminder(cfg, fake_llm, lambda t: private_thread("mia", t), text="secret plan", in_minutes=15)
    adapter = await delivered_later(cfg, 16 * 60)
    assert [(m.chat_id, m.thread_id, m.text) for m in adapter.sent] == [
        ("chan", "pt1", "⏰ Reminder for mia: secret plan")
    ]
    kept = [m.content for m in await stored(cfg, "testchat-chat-pt1") if m.meta.get("reminder")]
    assert kept == ["⏰ Reminder for mia: secret plan"]
    # the parent channel's shared profile (read by every public thread of it) holds nothing of it
    parent = tenant_dir(cfg.data_dir, "testchat-chat-chan")
    assert not parent.exists() or all(
        "secret plan" not in (m.content or "") for m in await stored(cfg, "testchat-chat-chan")
    )


async def test_a_thread_reminder_is_neither_listed_nor_cancelled_from_its_parent_channel(config_for, fake_llm):
    cfg = config_for(tenancy={"thread_sessions_per_user": True})
    in_thread = lambda t: group("g5", "kai", t, thread_id="t1")  # noqa: E731
    await set_reminder(cfg, fake_llm, in_thread, text="thread chore", in_minutes=60)
    fake_llm.script(tool_call("reminders", {"action": "list"}), reply("Here they are."))
    adapter = RecordingAdapter()
    app = build_gateway(cfg, [adapter])
    await app.start()
    try:
        assert await say(app, adapter, group("g5", "kai", "/reminders")) == [
            'No reminders set here. Ask me, e.g. "remind me tomorrow at 9 to call Sam".'
        ]
        assert await say(app, adapter, group("g5", "kai", "/reminders cancel 1")) == ["There's no reminder #1 here."]
        await say(app, adapter, group("g5", "kai", "what reminders do I have?"))
        (listing,) = await say(app, adapter, in_thread("/reminders"))
    finally:
        await app.stop()
    assert tool_results(fake_llm)[-1] == {"success": True, "count": 0, "reminders": []}
    assert "thread chore" in listing
    assert [r.text for r in await ReminderStore(tenant_dir(cfg.data_dir, "testchat-kai")).all()] == ["thread chore"]


async def test_two_members_reminders_for_the_same_minute_in_one_group_are_both_delivered(config_for, fake_llm):
    cfg = config_for()
    at = datetime.fromtimestamp(time.time() + 7200, ZoneInfo("UTC")).strftime("%Y-%m-%d %H:%M")
    for who, text in (("ann", "ann's call"), ("bob", "bob's call")):
        await set_reminder(cfg, fake_llm, lambda t, w=who: group("g7", w, t), text=text, at=at, timezone="UTC")
    adapter = await delivered_later(cfg, 7200 + 30, count=2)  # due at most a minute and a half before
    assert sorted(adapter.texts("g7")) == ["⏰ Reminder for ann: ann's call", "⏰ Reminder for bob: bob's call"]


async def test_an_iso_time_with_an_offset_is_accepted_and_said_back_in_local_time(tmp_path):
    store = ReminderStore(tmp_path)

    async def index(due, lower_only):
        pass

    now = datetime(2026, 12, 1, 12, 0, tzinfo=ZoneInfo("UTC")).timestamp()
    chat = ReminderChat("telegram", "111", "dm", None, "111", "lea")
    tool = ReminderTool(store, chat, 10, index, group=False, clock=lambda: now)
    made = json.loads(await tool.handle({"action": "create", "text": "tea", "at": "2026-12-01T19:37:44+00:00"}))
    assert made["success"] is True and "19:37 (UTC)" in made["created"]
    (first,) = await store.all()
    assert first.due == datetime(2026, 12, 1, 19, 37, 44, tzinfo=ZoneInfo("UTC")).timestamp()
    made = json.loads(await tool.handle({"action": "create", "text": "call", "at": "2026-12-01T21:30:00+05:30"}))
    assert made["success"] is True and "21:30 (UTC+05:30)" in made["created"]
    # with the person's zone known, the same instant is said in it
    made = json.loads(
        await tool.handle(
            {"action": "create", "text": "nap", "at": "2026-12-01T19:00:00Z", "timezone": "Europe/Berlin"}
        )
    )
    assert made["success"] is True and "20:00 (Europe/Berlin)" in made["created"]
    # a repeating one at a fixed offset keeps it
    made = json.loads(
        await tool.handle({"action": "create", "text": "walk", "at": "2026-12-01T18:00:00-03:00", "repeat": "daily"})
    )
    walk = next(r for r in await store.all() if r.text == "walk")
    assert next_occurrence(walk.due, walk.tz, "daily", walk.due) - walk.due == 86400


async def test_unlink_stops_the_departed_accounts_reminders_and_tells_the_link_in_its_dm(config_for, fake_llm):
    from tests.test_linking import link

    cfg = config_for(limits={"rate_limit_per_minute": 100})
    tg, dc = RecordingAdapter("telegram"), RecordingAdapter("discord")
    app = build_gateway(cfg, [tg, dc])
    await app.start()
    try:
        await say(app, tg, dm("111", "hello", platform="telegram"))
        await link(app, tg, dc)
        link_tenant = app.links.tenant_for("telegram:111")
        fake_llm.script(create(text="dc daily pill", in_minutes=30, repeat="daily"), reply("Okay."))
        await say(app, dc, dm("222", "remind me daily", platform="discord"))
        fake_llm.script(create(text="tg errand", in_minutes=40), reply("Okay."))
        await say(app, tg, dm("111", "remind me", platform="telegram"))
        before = len(tg.sent)
        assert (await say(app, dc, dm("222", "/unlink", platform="discord")))[0].startswith("Done")
        assert await app.drain(10)
        (told,) = tg.texts()[before:]
        assert "dc daily pill" in told and "will not fire" in told and "tg errand" not in told
        assert "dc daily pill" not in "".join(dc.texts())
        assert (await say(app, dc, dm("222", "/reminders", platform="discord")))[0].startswith("No reminders")
        assert "tg errand" in (await say(app, tg, dm("111", "/reminders", platform="telegram")))[0]
    finally:
        await app.stop()
    kept = await ReminderStore(tenant_dir(cfg.data_dir, link_tenant)).all()
    assert [r.text for r in kept] == ["tg errand"]
    later = build_gateway(cfg, [tg, dc])
    later.reminders.clock = lambda: time.time() + 41 * 60
    tg.sent.clear()
    dc.sent.clear()
    await later.start()
    try:
        await until(lambda: tg.sent)
        assert await later.drain(10)
    finally:
        await later.stop()
    assert dc.sent == [] and [m.text for m in tg.sent] == ["⏰ Reminder: tg errand"]  # the pill never fires
    fresh = tenant_dir(cfg.data_dir, "discord-222")
    assert not fresh.exists() or all("dc daily pill" not in (m.content or "") for m in await stored(cfg, "discord-222"))


async def test_a_link_merge_carries_both_profiles_reminders_indexed_and_firing(config_for, fake_llm):
    from tests.test_linking import link

    cfg = config_for(limits={"rate_limit_per_minute": 100})
    await set_reminder(cfg, fake_llm, lambda t: dm("111", t, platform="telegram"), text="tg plants", in_minutes=20)
    await set_reminder(cfg, fake_llm, lambda t: dm("222", t, platform="discord"), text="dc bins", in_minutes=25)
    tg, dc = RecordingAdapter("telegram"), RecordingAdapter("discord")
    app = build_gateway(cfg, [tg, dc])
    await app.start()
    try:
        await link(app, tg, dc)
        link_tenant = app.links.tenant_for("telegram:111")
        (listing,) = await say(app, dc, dm("222", "/reminders", platform="discord"))
        assert "tg plants" in listing and "dc bins" in listing
    finally:
        await app.stop()
    merged = tenant_dir(cfg.data_dir, link_tenant)
    assert sorted(r.text for r in await ReminderStore(merged).all()) == ["dc bins", "tg plants"]
    assert not list(merged.glob("reminders.from-*"))
    tg.sent.clear()
    dc.sent.clear()
    later = build_gateway(cfg, [tg, dc])
    later.reminders.clock = lambda: time.time() + 26 * 60
    await later.start()
    try:
        await until(lambda: tg.sent and dc.sent)
        assert await later.drain(10)
    finally:
        await later.stop()
    assert [m.text.split("\n")[0] for m in tg.sent] == ["⏰ Reminder: tg plants"]
    assert [m.text.split("\n")[0] for m in dc.sent] == ["⏰ Reminder: dc bins"]


async def test_deleting_a_person_removes_the_reminders_they_set_in_a_shared_thread(config_for, fake_llm):
    from gateway.tenants import delete_tenant, find_tenant

    cfg = config_for()
    in_thread = lambda who: lambda t: group("g3", who, t, thread_id="t9")  # noqa: E731
    await set_reminder(cfg, fake_llm, lambda t: dm("alice", t), text="alice private", in_minutes=50)
    await set_reminder(cfg, fake_llm, in_thread("alice"), text="alice in thread", in_minutes=30)
    await set_reminder(cfg, fake_llm, in_thread("bob"), text="bob in thread", in_minutes=40)
    shared = tenant_dir(cfg.data_dir, "testchat-chat-g3")
    assert sorted(r.text for r in await ReminderStore(shared).all()) == ["alice in thread", "bob in thread"]
    await asyncio.to_thread(delete_tenant, cfg, find_tenant(cfg, "testchat:alice"))
    assert [r.text for r in await ReminderStore(shared).all()] == ["bob in thread"]
    adapter = await delivered_later(cfg, 45 * 60)
    assert [m.text.split("\n")[0] for m in adapter.sent] == ["⏰ Reminder for bob: bob in thread"]


async def test_a_private_thread_reminder_stored_before_the_flag_was_kept_still_goes_to_the_thread(config_for, fake_llm):
    cfg = config_for()
    await set_reminder(cfg, fake_llm, lambda t: private_thread("mia", t), text="old plan", in_minutes=15)
    store = tenant_dir(cfg.data_dir, "testchat-chat-pt1") / "reminders.json"
    data = json.loads(store.read_text("utf-8"))
    for r in data["reminders"]:  # as an older version wrote it
        r["chat"].pop("private_thread")
        r["chat"].pop("lane")
    store.write_text(json.dumps(data), "utf-8")
    await delivered_later(cfg, 16 * 60)
    kept = [m.content for m in await stored(cfg, "testchat-chat-pt1") if m.meta.get("reminder")]
    assert kept == ["⏰ Reminder for mia: old plan"]
    assert not tenant_dir(cfg.data_dir, "testchat-chat-chan").exists()


async def test_in_a_group_the_cap_refusal_names_no_count_of_reminders_it_cannot_see(tmp_path):
    store = ReminderStore(tmp_path)

    async def index(due, lower_only):
        pass

    private = ReminderTool(store, ReminderChat("t", "dm-1", "dm", None, "1", "lea"), 1, index, group=False)
    assert json.loads(await private.handle({"action": "create", "text": "dm one", "in_minutes": 5}))["success"]
    in_group = ReminderTool(
        store, ReminderChat("t", "g1", "group", None, "1", "lea", lane="g1:1"), 1, index, group=True
    )
    refused = json.loads(await in_group.handle({"action": "create", "text": "team", "in_minutes": 5}))
    assert refused["success"] is False and "private chat" in refused["error"]
    assert "1 reminders" not in refused["error"] and not any(ch.isdigit() for ch in refused["error"])
    assert json.loads(await in_group.handle({"action": "list"})) == {"success": True, "count": 0, "reminders": []}
    refused = json.loads(await private.handle({"action": "create", "text": "dm two", "in_minutes": 5}))
    assert "1 reminders, the most allowed" in refused["error"]
