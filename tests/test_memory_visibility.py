"""Private stays private: memory visibility, truthful prompts, unsearchable system prompts,
/forget, /memory share|unshare and the memory provider, end to end through the loopback
adapter with a fake model that repeats every canary it can see in its prompt."""

from __future__ import annotations

import json

from agent.providers import LocalNotesProvider
from agent.sessions import SessionStore
from gateway.build import build_gateway
from tenancy.keys import tenant_dir
from tests.conftest import RecordingAdapter, dm, group, say
from tests.fakes.llm import canaries_in, canary_repeater, memory_saving_responder, reply, tool_call


async def started(cfg, *adapters):
    app = build_gateway(cfg, list(adapters))
    await app.start()
    return app


def system_text(request: dict) -> str:
    messages = request.get("messages") or []
    return messages[0]["content"] if messages and messages[0]["role"] == "system" else ""


def tool_result(request: dict) -> dict:
    tools = [m for m in request["messages"] if m["role"] == "tool"]
    return json.loads(tools[-1]["content"])


def profile_dir(cfg, person: str):
    return tenant_dir(cfg.data_dir, f"testchat-{person}")


async def test_private_memory_never_reaches_a_group_prompt(config_for, fake_llm):
    fake_llm.responder = canary_repeater()
    adapter = RecordingAdapter()
    app = await started(config_for(), adapter)
    try:
        out = await say(app, adapter, dm("alice", "remember CANARY-health1 is my health note"))
        assert "CANARY-health1" in out[-1]
        await say(app, adapter, dm("alice", "/new"))
        # the model can see it in her private chat (so the canary model would repeat it) ...
        assert "CANARY-health1" in (await say(app, adapter, dm("alice", "what do you know?")))[-1]
        # ... but never in the group, whatever the mode that loads memory into group lanes
        n = len(fake_llm.requests)
        group_out = await say(app, adapter, group("g1", "alice", "hello everyone"))
        assert group_out and "CANARY" not in group_out[-1]
        assert fake_llm.requests[n:] and not canaries_in(fake_llm.requests[n:])
        assert "seen by everyone" in system_text(fake_llm.requests[-1])
        assert "private to one member" not in system_text(fake_llm.requests[-1])
        status = (await say(app, adapter, group("g1", "alice", "/status")))[0]
        assert "yours alone" not in status and "seen by everyone" in status
    finally:
        await app.stop()
    for mode in ("read", "full"):
        app = await started(config_for(tenancy={"personal_memory_in_groups": mode}), adapter)
        try:
            n = len(fake_llm.requests)
            await say(app, adapter, group("g2", "alice", "/new"))
            out = await say(app, adapter, group("g2", "alice", f"anything to share? ({mode})"))
            assert "CANARY" not in out[-1]
            assert not canaries_in(fake_llm.requests[n:])
        finally:
            await app.stop()


async def test_group_fact_follows_the_person_into_dms(config_for, fake_llm):
    fake_llm.responder = canary_repeater()
    adapter = RecordingAdapter()
    app = await started(config_for(), adapter)
    try:
        await say(app, adapter, group("g1", "alice", "remember CANARY-team7 is our team name"))
        await say(app, adapter, dm("alice", "/new"))
        assert "CANARY-team7" in (await say(app, adapter, dm("alice", "hi")))[-1]
        listing = (await say(app, adapter, dm("alice", "/memory")))[0]
        assert "1. [shared] CANARY-team7" in listing
        # and into her lane in another group, since she said it in front of a group
        assert "CANARY-team7" in (await say(app, adapter, group("g2", "alice", "hi")))[-1]
        # never into anyone else's
        n = len(fake_llm.requests)
        assert "CANARY" not in (await say(app, adapter, group("g1", "bob", "what is the team name?")))[-1]
        assert "CANARY" not in (await say(app, adapter, dm("bob", "hi")))[-1]
        assert not canaries_in(fake_llm.requests[n:])
    finally:
        await app.stop()
    marks = json.loads((profile_dir(config_for(), "alice") / "memories" / "visibility.json").read_text())
    assert list(marks["entries"]["memory"].values()) == ["shared"]


async def test_forgotten_entry_is_in_no_prompt_and_no_search(config_for, fake_llm):
    adapter = RecordingAdapter()
    app = await started(config_for(), adapter)
    try:
        # the entry is written by the model, so only memory (not the chat text) holds it
        fake_llm.script(
            tool_call("memory", {"action": "add", "target": "user", "content": "likes CANARY-blue5"}), reply("saved")
        )
        await say(app, adapter, dm("alice", "note my favourite colour"))
        assert "share" in (await say(app, adapter, dm("alice", "/memory share 1")))[0].lower()
        await say(app, adapter, dm("alice", "/new"))
        await say(app, adapter, dm("alice", "what do you know?"))
        assert "CANARY-blue5" in system_text(fake_llm.requests[-1])
        await say(app, adapter, group("g1", "alice", "hi all"))
        assert "CANARY-blue5" in system_text(fake_llm.requests[-1])

        assert "forgot" in (await say(app, adapter, dm("alice", "/forget 1")))[0]

        # both live sessions rebuild their prompt before the next turn
        n = len(fake_llm.requests)
        await say(app, adapter, dm("alice", "and now?"))
        await say(app, adapter, group("g1", "alice", "and now?"))
        await say(app, adapter, dm("alice", "/new"))
        await say(app, adapter, dm("alice", "fresh start"))
        assert len(fake_llm.requests) == n + 3
        assert not canaries_in(fake_llm.requests[n:])
        # no search finds it: not in the private chat, not in the group lane
        for msg in (dm("alice", "search"), group("g1", "alice", "search")):
            fake_llm.script(tool_call("session_search", {"query": "CANARY-blue5"}), reply("searched"))
            await say(app, adapter, msg)
            assert tool_result(fake_llm.requests[-1])["count"] == 0
        assert "don't remember" in (await say(app, adapter, dm("alice", "/memory")))[0]
    finally:
        await app.stop()


async def test_memory_mode_switch_rebuilds_the_group_prompt(config_for, fake_llm):
    adapter = RecordingAdapter()
    app = await started(config_for(), adapter)
    try:
        fake_llm.script(
            tool_call("memory", {"action": "add", "target": "user", "content": "plays CANARY-oboe3"}), reply("saved")
        )
        await say(app, adapter, group("g1", "alice", "note my instrument"))
        await say(app, adapter, group("g1", "alice", "/new"))
        await say(app, adapter, group("g1", "alice", "hello"))
        assert "CANARY-oboe3" in system_text(fake_llm.requests[-1])
    finally:
        await app.stop()
    app = await started(config_for(tenancy={"personal_memory_in_groups": "off"}), adapter)
    try:
        n = len(fake_llm.requests)
        await say(app, adapter, group("g1", "alice", "hello again"))
        assert len(fake_llm.requests) == n + 1 and not canaries_in(fake_llm.requests[n:])
        assert "memory" not in [t["function"]["name"] for t in fake_llm.requests[-1].get("tools") or []]
        # the old prompt is kept (flagged), never rewritten; only one prompt is live
        store = app.profiles
        async with store.use("testchat-alice") as profile:
            sid = await profile.sessions.route("agent:main:testchat:group:g1:alice")
            live = [m for m in await profile.sessions.history(sid) if m.role == "system"]
            every = [m for m in await profile.sessions.history(sid, include_inactive=True) if m.role == "system"]
        assert len(live) == 1 and len(every) == 2 and "CANARY-oboe3" not in live[0].content
    finally:
        await app.stop()
    app = await started(config_for(tenancy={"personal_memory_in_groups": "read"}), adapter)
    try:
        await say(app, adapter, group("g1", "alice", "and back"))
        assert "CANARY-oboe3" in system_text(fake_llm.requests[-1])
        assert "read-only" in system_text(fake_llm.requests[-1])
    finally:
        await app.stop()


async def test_system_prompts_are_never_searchable(config_for, fake_llm):
    adapter = RecordingAdapter()
    app = await started(config_for(), adapter)
    try:
        fake_llm.script(
            tool_call("memory", {"action": "add", "target": "memory", "content": "code CANARY-srch9"}), reply("saved")
        )
        await say(app, adapter, dm("alice", "keep a note"))
        await say(app, adapter, dm("alice", "/new"))
        await say(app, adapter, dm("alice", "hi"))
        assert "CANARY-srch9" in system_text(fake_llm.requests[-1])
        fake_llm.script(tool_call("session_search", {"query": "CANARY-srch9"}), reply("searched"))
        await say(app, adapter, dm("alice", "search"))
        assert tool_result(fake_llm.requests[-1])["count"] == 0
    finally:
        await app.stop()
    # the database indexed the prompt (as older versions did); search still leaves it out
    store = SessionStore(profile_dir(config_for(), "alice"))
    await store.open()
    try:
        db = store._require_db()  # the store's own connection, used by this test alone
        rows = db.execute(
            "SELECT count(*) FROM messages_fts JOIN messages m ON m.id = messages_fts.rowid "
            "WHERE messages_fts MATCH '\"CANARY-srch9\"' AND m.role = 'system'"
        ).fetchone()
        assert rows[0] >= 1
        assert await store.search("CANARY-srch9") == []
        assert await store.search("helpful assistant") == []
    finally:
        await store.close()


async def test_memory_share_and_unshare_change_who_sees_an_entry(config_for, fake_llm):
    fake_llm.responder = memory_saving_responder
    adapter = RecordingAdapter()
    app = await started(config_for(), adapter)
    try:
        await say(app, adapter, dm("alice", "remember CANARY-first1"))
        await say(app, adapter, dm("alice", "remember CANARY-second2"))
        listing = (await say(app, adapter, dm("alice", "/memory")))[0]
        assert "1. [private] CANARY-first1" in listing and "2. [private] CANARY-second2" in listing
        await say(app, adapter, group("g1", "alice", "hi"))
        assert not canaries_in(fake_llm.requests[-1])

        assert "Shared" in (await say(app, adapter, dm("alice", "/memory share 2")))[0]
        assert "2. [shared] CANARY-second2" in (await say(app, adapter, dm("alice", "/memory")))[0]
        await say(app, adapter, group("g1", "alice", "/new"))
        await say(app, adapter, group("g1", "alice", "hi"))
        assert canaries_in(system_text(fake_llm.requests[-1])) == {"CANARY-second2"}

        assert "Private again" in (await say(app, adapter, dm("alice", "/memory unshare 2")))[0]
        await say(app, adapter, group("g1", "alice", "still there?"))
        assert not canaries_in(fake_llm.requests[-1])  # rebuilt before the turn

        # bad input gets a clear answer and changes nothing
        assert "no entry 9" in (await say(app, adapter, dm("alice", "/memory share 9")))[0]
        assert "Usage" in (await say(app, adapter, dm("alice", "/memory frobnicate")))[0]
        assert "private chat" in (await say(app, adapter, group("g1", "alice", "/memory share 1")))[0]
        assert "[private] CANARY-second2" in (await say(app, adapter, dm("alice", "/memory")))[0]
    finally:
        await app.stop()


async def test_existing_entries_migrate_as_private(config_for, fake_llm):
    cfg = config_for()
    mem_dir = profile_dir(cfg, "alice") / "memories"
    mem_dir.mkdir(parents=True)
    original = "old note CANARY-legacy1\n§\nanother CANARY-legacy2"
    (mem_dir / "MEMORY.md").write_text(original)
    (mem_dir / "USER.md").write_text("name is CANARY-legacy3")
    adapter = RecordingAdapter()
    app = await started(cfg, adapter)
    try:
        fake_llm.responder = canary_repeater()
        out = await say(app, adapter, group("g1", "alice", "hi"))
        assert "CANARY" not in out[-1] and not canaries_in(fake_llm.requests[-1])
        out = await say(app, adapter, dm("alice", "hi"))
        assert {"CANARY-legacy1", "CANARY-legacy2", "CANARY-legacy3"} <= canaries_in(out[-1])
        listing = (await say(app, adapter, dm("alice", "/memory")))[0]
        assert listing.count("[private]") == 3 and "[shared]" not in listing
        # a new entry written in the group is shared; the file keeps the Hermes format
        fake_llm.responder = memory_saving_responder
        await say(app, adapter, group("g1", "alice", "remember CANARY-new4"))
    finally:
        await app.stop()
    assert (mem_dir / "MEMORY.md").read_text() == original + "\n§\nCANARY-new4"
    assert (mem_dir / "USER.md").read_text() == "name is CANARY-legacy3"


async def test_group_lane_memory_tool_cannot_see_private_entries(config_for, fake_llm):
    adapter = RecordingAdapter()
    app = await started(config_for(), adapter)
    try:
        fake_llm.responder = memory_saving_responder
        await say(app, adapter, dm("alice", "remember CANARY-hidden1 secret"))
        # a group-lane replace aimed at the private entry finds nothing and lists nothing private
        fake_llm.script(
            tool_call("memory", {"action": "remove", "target": "memory", "old_text": "CANARY"}), reply("tried")
        )
        await say(app, adapter, group("g1", "alice", "drop it"))
        result = tool_result(fake_llm.requests[-1])
        assert result["success"] is False and not canaries_in(result)
        # /forget in a group lane erases only what the group could see
        await say(app, adapter, group("g1", "alice", "remember CANARY-public2"))
        assert "shared with groups" in (await say(app, adapter, group("g1", "alice", "/forget all")))[0]
        listing = (await say(app, adapter, dm("alice", "/memory")))[0]
        assert "CANARY-hidden1" in listing and "CANARY-public2" not in listing
    finally:
        await app.stop()


async def test_provider_obeys_memory_mode_and_visibility(config_for, fake_llm):
    fake_llm.responder = canary_repeater()
    adapter = RecordingAdapter()
    cfg = config_for(memory={"provider": "local"})
    notes = profile_dir(cfg, "alice") / "provider" / "notes.jsonl"
    app = await started(cfg, adapter)
    try:
        await say(app, adapter, dm("alice", "my garden password hint is CANARY-rose8"))
        # prefetch is wired in: the private chat recalls it on a related question ...
        await say(app, adapter, dm("alice", "/new"))
        assert "CANARY-rose8" in (await say(app, adapter, dm("alice", "what about my garden?")))[-1]
        # ... a group lane never does
        n = len(fake_llm.requests)
        assert "CANARY" not in (await say(app, adapter, group("g1", "alice", "how is the garden?")))[-1]
        assert not canaries_in(fake_llm.requests[n:])
        # group talk under full is stored as shared and may be recalled in groups
        await say(app, adapter, group("g1", "alice", "the garden party code is CANARY-party2"))
        await say(app, adapter, group("g2", "alice", "/new"))
        assert "CANARY-party2" in (await say(app, adapter, group("g2", "alice", "when is the garden party?")))[-1]
    finally:
        await app.stop()
    records = [json.loads(line) for line in notes.read_text().splitlines()]
    assert {r["visibility"] for r in records if "CANARY-rose8" in json.dumps(r)} == {"private"}
    assert {r["visibility"] for r in records if "CANARY-party2" in r.get("user", "")} == {"shared"}
    for mode in ("read", "off"):
        app = await started(
            config_for(memory={"provider": "local"}, tenancy={"personal_memory_in_groups": mode}), adapter
        )
        try:
            await say(app, adapter, group("g1", "alice", f"group chatter CANARY-{mode}9 here"))
        finally:
            await app.stop()
        assert f"CANARY-{mode}9" not in notes.read_text()


async def test_local_provider_filters_by_visibility_and_forgets(tmp_path):
    provider = LocalNotesProvider()
    await provider.initialize("t", tmp_path)
    await provider.sync_turn("alpha secret CANARY-p1", "ok", visibility="private")
    await provider.sync_turn("alpha public CANARY-s1", "ok", visibility="shared")
    assert canaries_in(await provider.prefetch("alpha", shared_only=True)) == {"CANARY-s1"}
    assert canaries_in(await provider.prefetch("alpha")) == {"CANARY-p1", "CANARY-s1"}
    await provider.on_memory_write("remove", "memory", "public CANARY-s1", visibility="private")
    assert canaries_in(await provider.prefetch("alpha")) == {"CANARY-p1"}
    # records written before visibility existed count as private
    with open(tmp_path / "provider" / "notes.jsonl", "a") as fh:
        fh.write(json.dumps({"kind": "turn", "user": "alpha legacy CANARY-old1", "assistant": "x"}) + "\n")
    assert "CANARY-old1" not in await provider.prefetch("alpha", shared_only=True)


async def test_pre_compress_stores_nothing_from_a_group_lane_under_read(config_for, fake_llm):
    adapter = RecordingAdapter()
    filler = " ".join(f"word{i}" for i in range(300))
    # chat requests offer tools; the summary request does not and gets a short summary
    fake_llm.responder = lambda request: "ok" if request.get("tools") else "the summary"
    for mode, expected in (("read", set()), ("full", {"shared"})):
        cfg = config_for(memory={"provider": "local"}, tenancy={"personal_memory_in_groups": mode})
        app = await started(cfg, adapter)
        try:
            chat_id = f"room-{mode}"
            for i in range(8):
                await say(app, adapter, group(chat_id, "alice", f"part {i} CANARY-c{mode}{i} {filler}"))
            out = await say(app, adapter, group(chat_id, "alice", "/compress"))
            assert out[0].startswith("Compressed"), out
        finally:
            await app.stop()
        notes = profile_dir(cfg, "alice") / "provider" / "notes.jsonl"
        records = [json.loads(line) for line in notes.read_text().splitlines()] if notes.exists() else []
        pre = [r for r in records if r["kind"] == "pre_compress" and f"CANARY-c{mode}" in r["content"]]
        assert {r["visibility"] for r in pre} == expected


async def test_rebuilt_system_prompt_leads_the_history_and_keeps_summary_anchors(tmp_path):
    from agent.messages import StoredMessage

    profile = tmp_path / "profiles" / "t"
    async with SessionStore(profile) as s:
        sid = await s.start_session("lane")
        msgs = await s.append_many(
            [StoredMessage(sid, "system", "old prompt")]
            + [StoredMessage(sid, role, f"{role[0]}{i}") for i in range(4) for role in ("user", "assistant")]
        )
        # an in-place compression anchored right after the system prompt
        summary = StoredMessage(sid, "user", "the summary", meta={"compressed_summary": True, "after_uid": msgs[0].uid})
        await s.compact(sid, [m.uid for m in msgs[1:5]], [summary])
        fresh = StoredMessage(sid, "system", "new prompt", meta={"replaces": msgs[0].uid})
        await s.compact(sid, [msgs[0].uid], [fresh], reason="prompt_rebuild")
        expected = ["new prompt", "the summary", "u2", "a2", "u3", "a3"]
        assert [m.content for m in await s.history(sid)] == expected
    drop = [profile / n for n in ("state.db", "state.db-wal", "state.db-shm")]
    for path in drop:
        path.unlink(missing_ok=True)
    async with SessionStore(profile) as s:  # rebuilt from the journal alone
        assert [m.content for m in await s.history(sid)] == expected
        assert await s.search("prompt") == []


async def test_group_view_writes_keep_hidden_entries_in_place(tmp_path):
    from agent.memory import MemoryStore
    from agent.visibility import GROUP_LANE, Marks

    private = MemoryStore(tmp_path)
    in_group = MemoryStore(tmp_path, scope=GROUP_LANE)
    await private.add("memory", "private one")
    await in_group.add("memory", "shared two")
    await private.add("memory", "private three")
    assert await in_group.entries("memory") == ["shared two"]
    assert (await in_group.replace("memory", "two", "shared TWO"))["success"]
    assert (await in_group.replace("memory", "private", "leak"))["success"] is False
    assert await private.entries("memory") == ["private one", "shared TWO", "private three"]
    # a replace in a private chat makes the entry private (it may fold private facts in)
    assert (await private.replace("memory", "TWO", "shared 2 plus private detail"))["success"]
    assert await in_group.entries("memory") == []
    assert await private.set_visibility("memory", "shared 2 plus private detail", "shared")
    await in_group.clear()
    assert await private.entries("memory") == ["private one", "private three"]
    marks = Marks(tmp_path / "memories")
    assert marks.of("memory", await private.entries("memory")) == ["private", "private"]
    assert (tmp_path / "memories" / "MEMORY.md").read_text() == "private one\n§\nprivate three"


async def test_export_shows_each_entry_with_its_visibility(config_for, fake_llm, tmp_path):
    import tarfile

    from gateway.tenants import export_profile, find_tenant

    fake_llm.responder = memory_saving_responder
    cfg = config_for()
    adapter = RecordingAdapter()
    app = await started(cfg, adapter)
    try:
        await say(app, adapter, dm("alice", "remember CANARY-mine1"))
        await say(app, adapter, group("g1", "alice", "remember CANARY-ours2"))
        out = (await say(app, adapter, dm("alice", "/export")))[0]
        assert out.startswith("Exported")
    finally:
        await app.stop()
    exports = sorted((profile_dir(cfg, "alice") / "exports").glob("export-*.json"))
    memory = json.loads(exports[-1].read_text())["memory"]["memory"]
    assert memory == [
        {"entry": "CANARY-mine1", "visibility": "private"},
        {"entry": "CANARY-ours2", "visibility": "shared"},
    ]
    # the operator's archive carries the marks beside the memory files
    archive = export_profile(cfg, find_tenant(cfg, "testchat:alice"), tmp_path / "out")
    with tarfile.open(archive) as tar:
        marks = json.loads(tar.extractfile("profile/memories/visibility.json").read())
    assert list(marks["entries"]["memory"].values()) == ["shared"]


async def test_unshared_entry_is_never_recalled_in_a_group_lane(config_for, fake_llm):
    """The provider hears /memory unshare: what was said in a group and saved as shared is
    not recalled in a group lane any more once the person made it private."""
    fake_llm.responder = canary_repeater()
    adapter = RecordingAdapter()
    cfg = config_for(memory={"provider": "local"})
    app = await started(cfg, adapter)
    try:
        await say(app, adapter, group("g1", "alice", "remember CANARY-cake3 is the garden cake"))
        await say(app, adapter, group("g2", "alice", "/new"))
        assert "CANARY-cake3" in (await say(app, adapter, group("g2", "alice", "what about the garden?")))[-1]
        listing = (await say(app, adapter, dm("alice", "/memory")))[0]
        assert "1. [shared] CANARY-cake3" in listing
        assert "Private again" in (await say(app, adapter, dm("alice", "/memory unshare 1")))[0]
        await say(app, adapter, group("g2", "alice", "/new"))
        n = len(fake_llm.requests)
        assert "CANARY" not in (await say(app, adapter, group("g2", "alice", "what about the garden?")))[-1]
        assert not canaries_in(fake_llm.requests[n:])
        # the private chat still recalls it; sharing it again lets groups recall it again
        await say(app, adapter, dm("alice", "/new"))
        assert "CANARY-cake3" in (await say(app, adapter, dm("alice", "the garden?")))[-1]
        await say(app, adapter, dm("alice", "/memory share 1"))
        await say(app, adapter, group("g2", "alice", "/new"))
        assert "CANARY-cake3" in (await say(app, adapter, group("g2", "alice", "what about the garden?")))[-1]
    finally:
        await app.stop()
