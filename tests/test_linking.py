"""Identity linking from the chat: /link codes, the merge of two people's profiles into one
linked tenant, and /unlink."""

from __future__ import annotations

import json
import re
import time

from gateway.build import build_gateway
from tenancy.keys import link_tenant_id, tenant_dir
from tenancy.merge import combine_entries
from tests.conftest import RecordingAdapter, dm, group, say
from tests.fakes.llm import memory_saving_responder, tool_call
from tests.statedb import open_state_db

SECRET_TG = "alice keeps her bike at dock 17"
SECRET_DC = "alice's cat is called Pixel"
SECRET_CAROL = "carol's pin is 8086"
CODE_RE = re.compile(r"\b([A-Z2-9]{5}-[A-Z2-9]{5})\b")


async def started(cfg, *adapters):
    app = build_gateway(cfg, list(adapters))
    await app.start()
    return app


def code_in(texts: list[str]) -> str:
    for text in texts:
        m = CODE_RE.search(text)
        if m:
            return m.group(1)
    raise AssertionError(f"no code in {texts}")


def routes(path) -> dict[str, str]:
    conn = open_state_db(path / "state.db")
    try:
        return dict(conn.execute("SELECT session_key, session_id FROM routes"))
    finally:
        conn.close()


async def link(app, tg, dc, tg_user="111", dc_user="222") -> None:
    code = code_in(await say(app, tg, dm(tg_user, "/link", platform="telegram")))
    out = await say(app, dc, dm(dc_user, f"/link {code}", platform="discord"))
    assert out and out[0].startswith("Code accepted"), out
    await confirm(app, tg, dm(tg_user, "/link confirm", platform="telegram"))


async def confirm(app, adapter, msg) -> list[str]:
    """The issuer confirms in its private chat; returns the reply after the merge ran."""
    out = await say(app, adapter, msg)
    assert out and out[0].startswith("Confirmed"), out
    await app.linking.wait_idle(30)
    await app.drain()  # the outcome notice goes out through the outbox
    assert await app.drain(30)
    return out


async def test_linking_joins_memory_and_sessions_and_nobody_elses(config_for, fake_llm):
    fake_llm.responder = memory_saving_responder
    cfg = config_for(limits={"rate_limit_per_minute": 100})
    tg, dc = RecordingAdapter("telegram"), RecordingAdapter("discord")
    app = await started(cfg, tg, dc)
    data = cfg.data_dir
    try:
        await say(app, tg, dm("111", f"remember that {SECRET_TG}", platform="telegram"))
        await say(app, dc, dm("222", f"remember that {SECRET_DC}", platform="discord"))
        await say(app, tg, dm("333", f"remember that {SECRET_CAROL}", platform="telegram"))
        tg_route = routes(tenant_dir(data, "telegram-111"))["agent:main:telegram:dm:dm-111"]
        dc_route = routes(tenant_dir(data, "discord-222"))["agent:main:discord:dm:dm-222"]

        code = code_in(await say(app, tg, dm("111", "/link", platform="telegram")))
        out = await say(app, dc, dm("222", f"/link {code}", platform="discord"))
        assert out[0].startswith("Code accepted")
        assert await say(app, tg, dm("111", "/link confirm", platform="telegram"))
        # a message sent while the merge runs waits, then lands in the linked profile
        await tg.sink(dm("111", "sent while linking", platform="telegram"))
        await app.linking.wait_idle(30)
        await app.drain()  # the outcome notice goes out through the outbox
        assert await app.drain(30)
        assert any(t.startswith("Linked:") for t in tg.texts("dm-111"))
        assert any(t.startswith("Linked:") for t in dc.texts("dm-222"))
        assert "ok: sent while linking" in tg.texts("dm-111")

        name = app.links.name_for("telegram:111")
        assert name and name == app.links.name_for("discord:222")
        tenant = link_tenant_id(name)
        linked_dir = tenant_dir(data, tenant)
        saved = json.loads((data / "links.json").read_text())
        assert sorted(saved["links"][name]) == ["discord:222", "telegram:111"]
        # the personal profiles were merged away; carol's is untouched
        assert not tenant_dir(data, "telegram-111").exists()
        assert not tenant_dir(data, "discord-222").exists()
        assert SECRET_CAROL in (tenant_dir(data, "telegram-333") / "memories" / "MEMORY.md").read_text()
        manifest = json.loads((linked_dir / "tenant.json").read_text())
        assert set(manifest["principals"]) == {"telegram:111", "discord:222"}
        # both conversations continue in the sessions they had
        merged_routes = routes(linked_dir)
        assert merged_routes["agent:main:telegram:dm:dm-111"] == tg_route
        assert merged_routes["agent:main:discord:dm:dm-222"] == dc_route

        # the Discord account sees the Telegram account's memory (fresh session snapshot) ...
        await say(app, dc, dm("222", "/new", platform="discord"))
        n = len(fake_llm.requests)
        await say(app, dc, dm("222", "what do you know about me?", platform="discord"))
        blob = json.dumps(fake_llm.requests[n:])
        assert SECRET_TG in blob and SECRET_DC in blob
        assert SECRET_CAROL not in blob
        # ... and can search the Telegram conversation's transcript
        fake_llm.script(tool_call("session_search", {"query": "dock"}))
        await say(app, dc, dm("222", "search my old chats", platform="discord"))
        tool_msgs = [m for m in fake_llm.requests[-1]["messages"] if m["role"] == "tool"]
        assert json.loads(tool_msgs[-1]["content"])["count"] >= 1
        mem = await say(app, tg, dm("111", "/memory", platform="telegram"))
        assert SECRET_TG in mem[0] and SECRET_DC in mem[0] and SECRET_CAROL not in mem[0]
        who = await say(app, tg, dm("111", "/whoami", platform="telegram"))
        assert tenant in who[0] and "discord:222" in who[0]

        # carol sees none of it
        await say(app, tg, dm("333", "/new", platform="telegram"))
        n = len(fake_llm.requests)
        await say(app, tg, dm("333", "what do you know?", platform="telegram"))
        blob = json.dumps(fake_llm.requests[n:])
        assert SECRET_CAROL in blob and SECRET_TG not in blob and SECRET_DC not in blob
    finally:
        await app.stop()
    # nothing of alice is left in carol's profile
    for path in tenant_dir(data, "telegram-333").rglob("*"):
        if path.is_file():
            raw = path.read_bytes()
            assert SECRET_TG.encode() not in raw and SECRET_DC.encode() not in raw


async def test_expired_reused_and_wrong_codes_are_refused(config_for, fake_llm):
    cfg = config_for(limits={"rate_limit_per_minute": 100})
    tg, dc = RecordingAdapter("telegram"), RecordingAdapter("discord")
    app = await started(cfg, tg, dc)
    try:
        # expired
        code = code_in(await say(app, tg, dm("111", "/link", platform="telegram")))
        real = time.time
        app.linking.clock = lambda: real() + 11 * 60
        out = await say(app, dc, dm("222", f"/link {code}", platform="discord"))
        assert "unknown, expired or already used" in out[0]
        app.linking.clock = real
        assert app.links.name_for("discord:222") is None
        # ... and an expired code stays dead even when the clock is right again
        out = await say(app, dc, dm("222", f"/link {code}", platform="discord"))
        assert "unknown, expired or already used" in out[0]

        # used once, then reused by someone else
        code = code_in(await say(app, tg, dm("111", "/link", platform="telegram")))
        out = await say(app, dc, dm("222", f"/link {code.lower()}", platform="discord"))
        assert out[0].startswith("Code accepted")
        await confirm(app, tg, dm("111", "/link confirm", platform="telegram"))
        out = await say(app, dc, dm("999", f"/link {code}", platform="discord"))
        assert "unknown, expired or already used" in out[0]
        assert app.links.name_for("discord:999") is None

        # a new code revokes the previous one; a code can't link an account to itself
        first = code_in(await say(app, tg, dm("444", "/link", platform="telegram")))
        second = code_in(await say(app, tg, dm("444", "/link", platform="telegram")))
        assert "unknown" in (await say(app, dc, dm("555", f"/link {first}", platform="discord")))[0]
        assert "made by this account" in (await say(app, tg, dm("444", f"/link {second}", platform="telegram")))[0]
        # codes are stored only as hashes
        raw = (cfg.data_dir / "gateway.db").read_bytes()
        assert second.replace("-", "").encode() not in raw and second.encode() not in raw
        # only in a private chat
        out = await say(app, tg, group("g1", "444", "/link", platform="telegram"))
        assert "private chat" in out[0]
    finally:
        await app.stop()


async def test_link_codes_and_wrong_guesses_are_rate_limited(config_for, fake_llm):
    cfg = config_for(limits={"rate_limit_per_minute": 100})
    tg, dc = RecordingAdapter("telegram"), RecordingAdapter("discord")
    app = await started(cfg, tg, dc)
    try:
        for _ in range(5):
            code_in(await say(app, tg, dm("111", "/link", platform="telegram")))
        out = await say(app, tg, dm("111", "/link", platform="telegram"))
        assert "in the last hour" in out[0] and not CODE_RE.search(out[0])
        for i in range(10):
            out = await say(app, dc, dm("222", f"/link AAAAA-AAAA{'BCDEFGHJKL'[i]}", platform="discord"))
            assert "unknown" in out[0]
        out = await say(app, dc, dm("222", "/link AAAAA-BBBBB", platform="discord"))
        assert "Too many wrong link codes" in out[0]
    finally:
        await app.stop()


async def test_third_account_joins_existing_link_and_unlink_splits_going_forward(config_for, fake_llm):
    fake_llm.responder = memory_saving_responder
    cfg = config_for(limits={"rate_limit_per_minute": 100})
    tg, dc, tc = RecordingAdapter("telegram"), RecordingAdapter("discord"), RecordingAdapter("testchat")
    app = await started(cfg, tg, dc, tc)
    data = cfg.data_dir
    try:
        await say(app, tg, dm("111", f"remember that {SECRET_TG}", platform="telegram"))
        await say(app, tc, dm("777", "remember that alice also uses testchat"))
        await link(app, tg, dc)
        name = app.links.name_for("telegram:111")
        linked_dir = tenant_dir(data, link_tenant_id(name))
        # a third account joins the existing link (the link profile is merged into in place)
        code = code_in(await say(app, dc, dm("222", "/link", platform="discord")))
        assert (await say(app, tc, dm("777", f"/link {code}")))[0].startswith("Code accepted")
        await confirm(app, dc, dm("222", "/link confirm", platform="discord"))
        assert app.links.name_for("testchat:777") == name
        assert not tenant_dir(data, "testchat-777").exists()
        mem = await say(app, tc, dm("777", "/memory"))
        assert SECRET_TG in mem[0] and "alice also uses testchat" in mem[0]
        assert "agent:main:testchat:dm:dm-777" in routes(linked_dir)

        # unlink the discord account: it starts fresh; the link keeps everything
        out = await say(app, dc, dm("222", "/unlink", platform="discord"))
        assert out[0].startswith("Done")
        assert app.links.name_for("discord:222") is None
        assert "discord:222" not in json.loads((data / "links.json").read_text())["links"][name]
        mem = await say(app, dc, dm("222", "/memory", platform="discord"))
        assert mem == ["I don't remember anything about you yet."]
        assert tenant_dir(data, "discord-222").is_dir()
        mem = await say(app, tg, dm("111", "/memory", platform="telegram"))
        assert SECRET_TG in mem[0]
        assert "isn't linked" in (await say(app, dc, dm("222", "/unlink", platform="discord")))[0]
        # the last two can split; the very last one can't strand the data
        assert (await say(app, tc, dm("777", "/unlink")))[0].startswith("Done")
        out = await say(app, tg, dm("111", "/unlink", platform="telegram"))
        assert "only account left" in out[0]
    finally:
        await app.stop()


def test_memory_merge_sets_aside_oldest_entries_of_the_larger_side():
    a = [f"a{i}-" + "x" * 40 for i in range(10)]
    b = [f"b{i}-" + "y" * 40 for i in range(3)]
    kept, dropped = combine_entries([a, [*b, a[0]]], 400, "2026-01-01")
    assert len("\n§\n".join(kept)) <= 400
    assert kept[0].startswith("(Accounts linked 2026-01-01")
    assert all(e in kept for e in b), "the smaller side keeps its entries"
    assert dropped and dropped == a[: len(dropped)], "the oldest of the larger side go first"
    assert kept.count(a[-1]) == 1
    kept, dropped = combine_entries([["one"], ["two", "one"]], 100, "x")
    assert kept == ["one", "two"] and dropped == []


async def test_link_code_posted_in_group_is_burnt(config_for, fake_llm):
    cfg = config_for(limits={"rate_limit_per_minute": 100}, access={"allowed_users": ["telegram:111", "discord:666"]})
    tg, dc = RecordingAdapter("telegram"), RecordingAdapter("discord")
    app = await started(cfg, tg, dc)
    try:
        # alice pastes her code into a group (lower case, no dash, inside a sentence) ...
        code = code_in(await say(app, tg, dm("111", "/link", platform="telegram")))
        await say(
            app,
            tg,
            group("g1", "111", f"oops here is my code {code.lower().replace('-', '')} sorry", platform="telegram"),
        )
        await app.linking.wait_idle(10)
        # ... the code is dead at once and alice is told in her private chat, not in the group
        notices = [t for t in tg.texts("dm-111") if "cancelled" in t]
        assert len(notices) == 1 and code not in notices[0]
        assert not any("cancelled" in t for t in tg.texts("g1"))
        out = await say(app, dc, dm("666", f"/link {code}", platform="discord"))
        assert "unknown, expired or already used" in out[0]
        assert app.links.name_for("discord:666") is None

        # a code seen in a group is burnt whoever posts it, even someone the bot ignores
        code = code_in(await say(app, tg, dm("111", "/link", platform="telegram")))
        await say(app, dc, group("chan", "999", f"look: {code}", platform="discord"))
        await app.linking.wait_idle(10)
        assert dc.texts("chan") == []  # the stranger gets no answer ...
        assert sum("cancelled" in t for t in tg.texts("dm-111")) == 2  # ... but the code died
        out = await say(app, dc, dm("666", f"/link {code}", platform="discord"))
        assert "unknown, expired or already used" in out[0]
        # /link CODE sent in a group (a slash command in a channel) is burnt too
        code = code_in(await say(app, tg, dm("111", "/link", platform="telegram")))
        out = await say(app, dc, group("chan", "666", f"/link {code}", platform="discord"))
        assert "private chat" in out[0]
        out = await say(app, dc, dm("666", f"/link {code}", platform="discord"))
        assert "unknown, expired or already used" in out[0]
        # ordinary group text that merely looks like a code burns nothing
        code = code_in(await say(app, tg, dm("111", "/link", platform="telegram")))
        await say(app, tg, group("g1", "111", "STRENGTHEN the WALLS-TWICE please", platform="telegram"))
        await app.linking.wait_idle(10)
        assert sum("cancelled" in t for t in tg.texts("dm-111")) == 3
        out = await say(app, dc, dm("666", f"/link {code}", platform="discord"))
        assert out[0].startswith("Code accepted")
    finally:
        await app.stop()


async def test_link_needs_issuer_confirmation(config_for, fake_llm):
    fake_llm.responder = memory_saving_responder
    cfg = config_for(limits={"rate_limit_per_minute": 100})
    tg, dc = RecordingAdapter("telegram"), RecordingAdapter("discord")
    app = await started(cfg, tg, dc)
    data = cfg.data_dir
    try:
        await say(app, tg, dm("111", f"remember that {SECRET_TG}", platform="telegram"))
        # mallory got hold of alice's code and redeems it: nothing is linked yet
        code = code_in(await say(app, tg, dm("111", "/link", platform="telegram")))
        out = await say(app, dc, dm("666", f"/link {code}", platform="discord", name="mallory"))
        assert out[0].startswith("Code accepted") and "confirm" in out[0]
        await app.linking.wait_idle(30)
        assert app.links.name_for("discord:666") is None and app.links.name_for("telegram:111") is None
        # alice is asked in her private chat, naming the account that wants in
        ask = tg.texts("dm-111")[-1]
        assert "discord:666 (mallory) wants to join your identity" in ask and "/link confirm" in ask
        # mallory cannot confirm for alice, and alice cannot confirm from a group
        assert "No account is waiting" in (await say(app, dc, dm("666", "/link confirm", platform="discord")))[0]
        assert "private chat" in (await say(app, tg, group("g1", "111", "/link confirm", platform="telegram")))[0]
        assert app.links.name_for("discord:666") is None
        # alice denies: mallory is told, nothing is linked, and the request is gone
        out = await say(app, tg, dm("111", "/link deny", platform="telegram"))
        assert out[0].startswith("Declined")
        assert any("declined" in t for t in dc.texts("dm-666"))
        assert "No account is waiting" in (await say(app, tg, dm("111", "/link confirm", platform="telegram")))[0]
        await say(app, dc, dm("666", "what do you know about me?", platform="discord"))
        assert SECRET_TG not in json.dumps(fake_llm.requests[-1])
        assert app.links.as_dict() == {}
        assert tenant_dir(data, "telegram-111").is_dir()

        # a request expires with the code's lifetime
        code = code_in(await say(app, tg, dm("111", "/link", platform="telegram")))
        await say(app, dc, dm("222", f"/link {code}", platform="discord"))
        real = time.time
        app.linking.clock = lambda: real() + 11 * 60
        assert "No account is waiting" in (await say(app, tg, dm("111", "/link confirm", platform="telegram")))[0]
        app.linking.clock = real

        # alice's own second account, confirmed by alice: linked
        code = code_in(await say(app, tg, dm("111", "/link", platform="telegram")))
        await say(app, dc, dm("222", f"/link {code}", platform="discord"))
        await confirm(app, tg, dm("111", "/link confirm", platform="telegram"))
        assert app.links.name_for("discord:222") == app.links.name_for("telegram:111") is not None
        assert any(t.startswith("Linked:") for t in dc.texts("dm-222"))
    finally:
        await app.stop()


async def test_unlink_removes_principal_and_admin_resolves_live_link(config_for, fake_llm, tmp_path):
    from gateway.runlock import AdminError
    from gateway.tenants import delete_tenant, find_tenant

    fake_llm.responder = memory_saving_responder
    cfg = config_for(limits={"rate_limit_per_minute": 100})
    tg, dc, tc = RecordingAdapter("telegram"), RecordingAdapter("discord"), RecordingAdapter("testchat")
    app = await started(cfg, tg, dc, tc)
    data = cfg.data_dir
    try:
        await say(app, tg, dm("111", f"remember that {SECRET_TG}", platform="telegram"))
        await link(app, tg, dc)
        code = code_in(await say(app, tg, dm("111", "/link", platform="telegram")))
        await say(app, tc, dm("777", f"/link {code}"))
        await confirm(app, tg, dm("111", "/link confirm", platform="telegram"))
        name = app.links.name_for("telegram:111")
        tenant = link_tenant_id(name)
        linked_dir = tenant_dir(data, tenant)
        assert set(json.loads((linked_dir / "tenant.json").read_text())["principals"]) == {
            "telegram:111",
            "discord:222",
            "testchat:777",
        }
        # /unlink is private, and only names accounts of the caller's own link
        assert "private chat" in (await say(app, tg, group("g1", "111", "/unlink discord:222", platform="telegram")))[0]
        assert (
            "isn't one of this link's accounts"
            in (await say(app, tg, dm("111", "/unlink telegram:999", platform="telegram")))[0]
        )
        # alice removes an account from her link, from another account of it
        out = await say(app, tg, dm("111", "/unlink discord:222", platform="telegram"))
        assert out[0].startswith("Done: discord:222 is no longer part")
        assert app.links.name_for("discord:222") is None
        assert sorted(json.loads((data / "links.json").read_text())["links"][name]) == ["telegram:111", "testchat:777"]
        assert set(json.loads((linked_dir / "tenant.json").read_text())["principals"]) == {
            "telegram:111",
            "testchat:777",
        }
        # the removed account sees nothing of the link any more
        n = len(fake_llm.requests)
        await say(app, dc, dm("222", "what do you know about me?", platform="discord"))
        assert SECRET_TG not in json.dumps(fake_llm.requests[n:])
        mem = await say(app, dc, dm("222", "/memory", platform="discord"))
        assert SECRET_TG not in mem[0]
        await say(app, dc, dm("222", "remember that bob now owns this account", platform="discord"))
    finally:
        await app.stop()
    # admin tools follow the live link: discord:222 is its own tenant now, even when the
    # link's tenant.json still lists it (as an older version's /unlink left it)
    manifest = json.loads((linked_dir / "tenant.json").read_text())
    manifest["principals"].append("discord:222")
    (linked_dir / "tenant.json").write_text(json.dumps(manifest))
    assert find_tenant(cfg, "discord:222").tenant_id == "discord-222"
    assert find_tenant(cfg, "testchat:777").tenant_id == tenant
    # deleting the link removes its current members' data only
    report = delete_tenant(cfg, find_tenant(cfg, "telegram:111"))
    assert set(report.principals) == {"telegram:111", "testchat:777"}
    assert not linked_dir.exists()
    assert "bob now owns this account" in (tenant_dir(data, "discord-222") / "memories" / "MEMORY.md").read_text()
    assert find_tenant(cfg, "discord:222").tenant_id == "discord-222"
    try:
        find_tenant(cfg, "telegram:111")
    except AdminError:
        pass
    else:
        raise AssertionError("a deleted link still resolves")


async def test_whoami_in_a_group_never_shows_linked_accounts(config_for, fake_llm):
    cfg = config_for(limits={"rate_limit_per_minute": 100})
    tg, dc = RecordingAdapter("telegram"), RecordingAdapter("discord")
    app = await started(cfg, tg, dc)
    try:
        await link(app, tg, dc)
        tenant = app.links.tenant_for("telegram:111")
        out = await say(app, tg, group("g1", "111", "/whoami", platform="telegram"))
        assert "telegram:111" in out[0] and "private chat" in out[0]
        assert "discord:222" not in out[0] and tenant not in out[0]
        # a shared thread reads it too
        out = await say(app, tg, group("g1", "111", "/whoami", platform="telegram", thread_id="7"))
        assert "discord:222" not in out[0] and tenant not in out[0]
        out = await say(app, tg, dm("111", "/whoami", platform="telegram"))
        assert "discord:222" in out[0] and tenant in out[0]
    finally:
        await app.stop()


async def test_link_merge_keeps_each_entrys_visibility(config_for, fake_llm):
    from tests.fakes.llm import canaries_in, canary_repeater

    fake_llm.responder = canary_repeater()
    cfg = config_for(limits={"rate_limit_per_minute": 100})
    tg, dc = RecordingAdapter("telegram"), RecordingAdapter("discord")
    app = await started(cfg, tg, dc)
    try:
        await say(app, tg, group("g1", "111", "remember CANARY-tgshared1", platform="telegram"))
        await say(app, tg, dm("111", "remember CANARY-tgprivate2", platform="telegram"))
        await say(app, dc, group("chan", "222", "remember CANARY-dcshared3", platform="discord"))
        await say(app, dc, dm("222", "remember CANARY-dcprivate4", platform="discord"))
        await link(app, tg, dc)
        listing = (await say(app, tg, dm("111", "/memory", platform="telegram")))[0]
        for canary, vis in (
            ("tgshared1", "shared"),
            ("tgprivate2", "private"),
            ("dcshared3", "shared"),
            ("dcprivate4", "private"),
        ):
            assert f"[{vis}] CANARY-{canary}" in listing, listing
        # a new group lane of either account loads the shared entries of both, never a private one
        n = len(fake_llm.requests)
        await say(app, dc, group("chan2", "222", "hello", platform="discord"))
        seen = canaries_in(fake_llm.requests[n:])
        assert seen == {"CANARY-tgshared1", "CANARY-dcshared3"}, seen
        name = app.links.name_for("telegram:111")
        memories = tenant_dir(cfg.data_dir, link_tenant_id(name)) / "memories"
        assert not list(memories.glob("visibility.from-*"))
    finally:
        await app.stop()


def test_merge_keeps_an_entry_private_when_any_copy_was_private():
    from agent.visibility import entry_key
    from tenancy.merge import combine_marks

    lists = [["both", "only-a"], ["both", "only-b"]]
    marks = [
        {"memory": {entry_key("memory", "both"): "shared", entry_key("memory", "only-a"): "shared"}},
        {"memory": {entry_key("memory", "only-b"): "shared"}},
    ]
    out = combine_marks("memory", ["both", "only-a", "only-b"], lists, marks)
    assert out == {entry_key("memory", "only-a"): "shared", entry_key("memory", "only-b"): "shared"}


async def test_forget_right_after_a_link_merge_erases_the_entry(config_for, fake_llm):
    """A merge into an existing link is the store's own write: the next /forget N (or memory
    tool write) is not refused as a hand edit, and the entry leaves every prompt."""
    from tests.fakes.llm import canaries_in, canary_repeater

    fake_llm.responder = canary_repeater()
    cfg = config_for(limits={"rate_limit_per_minute": 100})
    tg, dc, tc = RecordingAdapter("telegram"), RecordingAdapter("discord"), RecordingAdapter("testchat")
    app = await started(cfg, tg, dc, tc)
    try:
        await link(app, tg, dc)
        await say(app, dc, dm("222", "remember CANARY-link0", platform="discord"))  # the link's own write
        await say(app, tc, dm("777", "remember CANARY-joiner1"))
        code = code_in(await say(app, tg, dm("111", "/link", platform="telegram")))
        await say(app, tc, dm("777", f"/link {code}"))
        await confirm(app, tg, dm("111", "/link confirm", platform="telegram"))  # merged into the link
        listing = (await say(app, dc, dm("222", "/memory", platform="discord")))[0]
        assert "2. [private] CANARY-joiner1" in listing
        out = await say(app, dc, dm("222", "remember CANARY-after2", platform="discord"))
        assert "Entry added" in out[-1], out
        out = await say(app, dc, dm("222", "/forget 2", platform="discord"))
        assert out[0].startswith("Done: I forgot"), out
        await say(app, tc, dm("777", "/new"))
        n = len(fake_llm.requests)
        await say(app, tc, dm("777", "what do you know?"))
        assert "CANARY-joiner1" not in canaries_in(fake_llm.requests[n:])
    finally:
        await app.stop()
