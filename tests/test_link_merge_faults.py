"""A /link merge that fails or is cut short by a shutdown leaves every profile exactly as
it was (or finishes), and both accounts are told the outcome."""

from __future__ import annotations

import asyncio
import hashlib
import threading
import time

import gateway.linking as linking_mod
import tenancy.merge as merge_mod
from gateway.build import build_gateway
from tenancy.keys import link_tenant_id, tenant_dir
from tests.conftest import RecordingAdapter, dm, say
from tests.fakes.llm import memory_saving_responder
from tests.test_linking import code_in, link, routes, started


def snapshot(path) -> dict[str, str]:
    """Every file of a profile by content hash (state.db as its SQL dump)."""
    import sqlite3

    out = {}
    for f in sorted(path.rglob("*")):
        if not f.is_file() or f.name.endswith(("-wal", "-shm", ".lock")):
            continue
        if f.name == "state.db":
            con = sqlite3.connect(f)
            try:
                data = "\n".join(con.iterdump()).encode()
            finally:
                con.close()
        else:
            data = f.read_bytes()
        out[str(f.relative_to(path))] = hashlib.sha256(data).hexdigest()
    return out


async def _linked_and_third(app, cfg, tg, dc, tc):
    """Telegram 111 and Discord 222 linked, testchat 777 with a note of its own, both
    profiles closed: (the link's dir, 777's dir, a snapshot of both)."""
    await say(app, tc, dm("777", "remember that carol uses testchat"))
    await link(app, tg, dc)
    name = app.links.name_for("telegram:111")
    linked_dir = tenant_dir(cfg.data_dir, link_tenant_id(name))
    carol_dir = tenant_dir(cfg.data_dir, "testchat-777")
    await app.profiles.evict(link_tenant_id(name))
    await app.profiles.evict("testchat-777")
    return linked_dir, carol_dir, (snapshot(linked_dir), snapshot(carol_dir))


async def test_failed_merge_into_an_existing_link_leaves_both_profiles_as_they_were(config_for, fake_llm, monkeypatch):
    fake_llm.responder = memory_saving_responder
    cfg = config_for(limits={"rate_limit_per_minute": 100})
    tg, dc, tc = RecordingAdapter("telegram"), RecordingAdapter("discord"), RecordingAdapter("testchat")
    app = await started(cfg, tg, dc, tc)
    try:
        await say(app, tg, dm("111", "remember that the bike is at dock 17", platform="telegram"))
        linked_dir, carol_dir, before = await _linked_and_third(app, cfg, tg, dc, tc)

        real = linking_mod.merge_profiles

        def copies_then_fails(*args, **kwargs):
            real(*args, **kwargs)  # everything copied ...
            raise OSError("disk trouble")  # ... then the merge fails

        monkeypatch.setattr(linking_mod, "merge_profiles", copies_then_fails)
        code = code_in(await say(app, dc, dm("222", "/link", platform="discord")))
        assert (await say(app, tc, dm("777", f"/link {code}")))[0].startswith("Code accepted")
        assert (await say(app, dc, dm("222", "/link confirm", platform="discord")))[0].startswith("Confirmed")
        await app.linking.wait_idle(30)
        assert await app.drain(10)
        assert app.links.name_for("testchat:777") is None
        assert (snapshot(linked_dir), snapshot(carol_dir)) == before
        assert not [p for p in (cfg.data_dir / "profiles").iterdir() if p.name.startswith(".link")]
        told = [t for t in tc.texts() + dc.texts() if t.startswith("Linking didn't work")]
        assert len(told) == 2 and "nothing was changed" in told[0]
        # and the accounts still work as before
        out = await say(app, tc, dm("777", "/memory"))
        assert "carol uses testchat" in out[0] and "dock 17" not in out[0]
    finally:
        await app.stop()


async def test_shutdown_mid_merge_finishes_the_merge_and_both_accounts_are_told(config_for, fake_llm, monkeypatch):
    cfg = config_for(limits={"rate_limit_per_minute": 100})
    tg, dc = RecordingAdapter("telegram"), RecordingAdapter("discord")
    app = await started(cfg, tg, dc)
    await say(app, tg, dm("111", "hello from telegram", platform="telegram"))
    await say(app, dc, dm("222", "hello from discord", platform="discord"))
    real = linking_mod.merge_profiles
    merging = threading.Event()

    def slow(*args, **kwargs):
        merging.set()
        time.sleep(0.5)
        real(*args, **kwargs)

    monkeypatch.setattr(linking_mod, "merge_profiles", slow)
    code = code_in(await say(app, tg, dm("111", "/link", platform="telegram")))
    assert (await say(app, dc, dm("222", f"/link {code}", platform="discord")))[0].startswith("Code accepted")
    assert (await say(app, tg, dm("111", "/link confirm", platform="telegram")))[0].startswith("Confirmed")
    while not merging.is_set():
        await asyncio.sleep(0.01)
    await app.stop(drain_timeout=0.05)  # shutdown cuts in mid-merge

    tg2, dc2 = RecordingAdapter("telegram"), RecordingAdapter("discord")
    app = build_gateway(cfg, [tg2, dc2])
    await app.start()
    try:
        assert await app.drain(10)
        name = app.links.name_for("telegram:111")
        assert name is not None and app.links.name_for("discord:222") == name
        told = [t for t in tg.texts() + dc.texts() + tg2.texts() + dc2.texts() if t.startswith("Linked:")]
        assert len(told) == 2
        assert not tenant_dir(cfg.data_dir, "telegram-111").exists()
        linked = routes(tenant_dir(cfg.data_dir, link_tenant_id(name)))
        assert {"agent:main:telegram:dm:dm-111", "agent:main:discord:dm:dm-222"} <= set(linked)
    finally:
        await app.stop()


async def _third_account_joins(app, dc, tc) -> None:
    code = code_in(await say(app, dc, dm("222", "/link", platform="discord")))
    assert (await say(app, tc, dm("777", f"/link {code}")))[0].startswith("Code accepted")
    await say(app, dc, dm("222", "/link confirm", platform="discord"))  # the merge may crash meanwhile
    await app.linking.wait_idle(30)
    assert await app.drain(10)


class _Crash(BaseException):
    """The process dies here (nothing after this line of the merge runs)."""


async def test_crash_after_the_swap_before_the_link_is_recorded_is_undone_on_the_next_start(
    config_for, fake_llm, monkeypatch
):
    fake_llm.responder = memory_saving_responder
    cfg = config_for(limits={"rate_limit_per_minute": 100})
    tg, dc, tc = RecordingAdapter("telegram"), RecordingAdapter("discord"), RecordingAdapter("testchat")
    app = await started(cfg, tg, dc, tc)
    linked_dir, carol_dir, before = await _linked_and_third(app, cfg, tg, dc, tc)

    async def merge_then_die(self, plan):
        await self._merge(plan)  # swapped in ...
        raise _Crash()  # ... and the process is gone before the link is recorded

    monkeypatch.setattr(linking_mod.Linking, "_merge_and_link", merge_then_die)
    await _third_account_joins(app, dc, tc)
    assert (linked_dir / merge_mod.PENDING_MARKER).exists()  # the crash state on disk
    await app.stop()
    monkeypatch.undo()

    tc2 = RecordingAdapter("testchat")
    app = build_gateway(cfg, [RecordingAdapter("telegram"), RecordingAdapter("discord"), tc2])
    await app.start()
    try:
        assert await app.drain(10)
        assert app.links.name_for("testchat:777") is None
        assert (snapshot(linked_dir), snapshot(carol_dir)) == before
        assert not [p for p in (cfg.data_dir / "profiles").iterdir() if p.name.startswith(".link")]
        assert any("restarted meanwhile" in t for t in tc2.texts())
    finally:
        await app.stop()


async def test_crash_after_the_link_is_recorded_finishes_the_merge_on_the_next_start(config_for, fake_llm, monkeypatch):
    cfg = config_for(limits={"rate_limit_per_minute": 100})
    tg, dc, tc = RecordingAdapter("telegram"), RecordingAdapter("discord"), RecordingAdapter("testchat")
    app = await started(cfg, tg, dc, tc)
    await say(app, tc, dm("777", "hello from carol"))
    await link(app, tg, dc)
    name = app.links.name_for("telegram:111")
    linked_dir = tenant_dir(cfg.data_dir, link_tenant_id(name))

    def die(self):
        raise _Crash()  # the link is recorded; the process dies before tidying up

    monkeypatch.setattr(merge_mod.Swap, "forget", die)
    await _third_account_joins(app, dc, tc)
    await app.stop()
    monkeypatch.undo()
    assert (linked_dir / merge_mod.PENDING_MARKER).exists()

    tc2 = RecordingAdapter("testchat")
    app = build_gateway(cfg, [RecordingAdapter("telegram"), RecordingAdapter("discord"), tc2])
    await app.start()
    try:
        assert await app.drain(10)
        assert app.links.name_for("testchat:777") == name
        assert not (linked_dir / merge_mod.PENDING_MARKER).exists()
        assert not [p for p in (cfg.data_dir / "profiles").iterdir() if p.name.startswith(".link")]
        assert "agent:main:testchat:dm:dm-777" in routes(linked_dir)
        assert not tenant_dir(cfg.data_dir, "testchat-777").exists()
        assert any(t.startswith("Linked:") for t in tc2.texts())
    finally:
        await app.stop()
