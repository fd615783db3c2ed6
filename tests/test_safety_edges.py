"""Edges of "private stays private": broken Unicode at the door, owner-only files, and the
shared-lane commands only a chat's admins may use."""

from __future__ import annotations

import json
import os
import tarfile

import pytest

from core.messages import InboundMessage
from gateway.build import build_gateway
from tests.conftest import RecordingAdapter, dm, group, say


async def test_lone_surrogates_get_a_clear_refusal_and_never_raise_in_the_sink(config_for, fake_llm):
    adapter = RecordingAdapter("testchat")
    app = build_gateway(config_for(), [adapter])
    await app.start()
    try:
        # broken text: refused in words, never stored, never sent to the model
        out = await say(app, adapter, dm("111", "hello \ud800 world"))
        assert len(out) == 1 and "invalid characters" in out[0]
        assert fake_llm.requests == []
        # a broken user name or user id: the same clear refusal
        bad_name = InboundMessage(
            platform="testchat",
            chat_id="dm-111",
            chat_type="dm",
            user_id="111",
            user_name="\udcff",
            message_id="m-bad-name",
            text="hi",
        )
        out = await say(app, adapter, bad_name)
        assert "invalid characters" in out[0]
        bad_user = bad_name.model_copy(update={"user_id": "1\ud834", "user_name": "x", "message_id": "m-bad-user"})
        out = await say(app, adapter, bad_user)
        assert "invalid characters" in out[0]
        # broken chat or message ids: nowhere to answer; dropped with a log line, no exception
        before = len(adapter.sent)
        for field in ("chat_id", "message_id", "thread_id"):
            await adapter.sink(bad_name.model_copy(update={field: "x\udfff", "user_name": "ok"}))
        assert await app.drain(10)
        assert len(adapter.sent) == before
        assert fake_llm.requests == []
        # nothing of it reached gateway.db, and the next good message is answered as usual
        raw = b"".join(p.read_bytes() for p in app.cfg.data_dir.glob("gateway.db*"))
        assert b"m-bad-name" not in raw and b"m-bad-user" not in raw
        out = await say(app, adapter, dm("111", "hello world"))
        assert out == ["ok: hello world"]
        assert json.dumps(fake_llm.requests).count("hello world") >= 1
    finally:
        await app.stop()


def _loose_paths(root) -> list[str]:
    """Everything under `root` that is not owner-only (files 0600, directories 0700)."""
    loose = []
    for path in [root, *root.rglob("*")]:
        if path.is_symlink():
            continue
        mode = path.stat().st_mode & 0o777
        if (path.is_dir() and mode != 0o700) or (path.is_file() and mode != 0o600):
            loose.append(f"{path.relative_to(root)} {oct(mode)}")
    return loose


@pytest.mark.parametrize("umask", [0o022, 0o000])
async def test_every_file_under_data_dir_is_owner_only_whatever_the_umask(config_for, fake_llm, tmp_path, umask):
    """A full tour (DMs, groups, memory, provider notes, /export, /link merge, a burnt code,
    profiles export/restore, backup/restore) under a permissive umask leaves no file
    anyone but the owner can read, in the data directory, the exports or the backups."""
    from gateway.backup import backup_data_dir, restore_data_dir
    from gateway.tenants import export_profile, find_tenant, restore_profile
    from tests.fakes.llm import memory_saving_responder
    from tests.test_linking import code_in, confirm

    old = os.umask(umask)
    try:
        fake_llm.responder = memory_saving_responder
        cfg = config_for(memory={"provider": "local"}, limits={"rate_limit_per_minute": 100})
        tg, dc = RecordingAdapter("telegram"), RecordingAdapter("discord")
        app = build_gateway(cfg, [tg, dc])
        await app.start()
        try:
            await say(app, tg, dm("111", "remember that my pin is 4321", platform="telegram"))
            await say(app, dc, dm("222", "remember that the cat is Pixel", platform="discord"))
            await say(app, tg, group("g1", "111", "remember that the group meets on friday", platform="telegram"))
            await say(app, tg, dm("111", "/export", platform="telegram"))
            code = code_in(await say(app, tg, dm("111", "/link", platform="telegram")))
            await say(app, dc, dm("222", f"/link {code}", platform="discord"))
            await confirm(app, tg, dm("111", "/link confirm", platform="telegram"))
            await say(app, dc, dm("222", "/export", platform="discord"))
        finally:
            await app.stop()
        data = cfg.data_dir
        assert (data / "links.json").exists() and list(data.glob("profiles/*/state.db"))
        assert _loose_paths(data) == []
        out = tmp_path / "out"
        archive = export_profile(cfg, find_tenant(cfg, "telegram:111"), out)
        backup = backup_data_dir(data, tmp_path / "backups")
        assert _loose_paths(out) == [] and _loose_paths(tmp_path / "backups") == []
        with tarfile.open(backup) as tar:
            assert all((m.mode & 0o077) == 0 for m in tar.getmembers())
        with tarfile.open(archive) as tar:
            assert all((m.mode & 0o077) == 0 for m in tar.getmembers())
        restored = tmp_path / "restored"
        restore_data_dir(backup, restored)
        assert _loose_paths(restored) == []
        cfg2 = cfg.model_copy(update={"data_dir": tmp_path / "fresh"})
        restore_profile(cfg2, archive)
        assert _loose_paths(tmp_path / "fresh") == []
    finally:
        os.umask(old)


async def test_shared_lane_new_undo_forget_are_for_chat_admins(config_for, fake_llm):
    cfg = config_for(
        tenancy={"group_sessions_per_user": False},
        access={"admins": ["testchat:boss"]},
        limits={"rate_limit_per_minute": 100},
    )
    adapter = RecordingAdapter("testchat")
    adapter.chat_admins.add(("g1", "mod"))
    app = build_gateway(cfg, [adapter])
    await app.start()
    try:
        await say(app, adapter, group("g1", "bob", "our plan is the blue door"))
        for command in ("/new", "/undo", "/forget"):
            out = await say(app, adapter, group("g1", "bob", command))
            assert "only the chat's admins" in out[0] and command in out[0], out
        # nothing happened: the shared conversation still has bob's turn
        await say(app, adapter, group("g1", "bob", "what was the plan?"))
        assert "blue door" in json.dumps(fake_llm.requests[-1])
        # the chat's own admin (the platform says so) and the gateway's admin may
        assert (await say(app, adapter, group("g1", "mod", "/undo")))[0].startswith("Took back")
        assert (await say(app, adapter, group("g1", "boss", "/forget")))[0].startswith("Done")
        assert (await say(app, adapter, group("g1", "mod", "/new")))[0].startswith("Started a new conversation")
        # a chat admin of another chat is nobody special here
        out = await say(app, adapter, group("g2", "mod", "/new"))
        assert "only the chat's admins" in out[0]
        # a person's own lanes are theirs: /new works in a DM
        assert (await say(app, adapter, dm("bob", "/new")))[0].startswith("Started a new conversation")
    finally:
        await app.stop()


async def test_broken_unicode_from_a_stranger_in_a_group_gets_silence(config_for, fake_llm):
    adapter = RecordingAdapter("testchat")
    app = build_gateway(config_for(access={"allowed_users": ["testchat:111"]}), [adapter])
    await app.start()
    try:
        await adapter.sink(group("g1", "999", "hi \ud800"))
        await adapter.sink(group("g1", "1\udc00", "hi"))
        assert await app.drain(10)
        assert adapter.texts("g1") == []
        out = await say(app, adapter, group("g1", "111", "hi \ud800"))
        assert "invalid characters" in out[0]
    finally:
        await app.stop()
