"""Profiles open lazily, at most `max_open` stay open (LRU), in-use ones are never closed,
and two lanes of one tenant share one open profile safely."""

from __future__ import annotations

import asyncio
import json

from agent.messages import StoredMessage
from tenancy.keys import tenant_dir
from tenancy.profiles import ProfileManager


async def test_least_recently_used_idle_profile_is_closed(tmp_path):
    pm = ProfileManager(tmp_path, max_open=2)
    async with pm.use("t_a"):
        pass
    async with pm.use("t_b"):
        pass
    async with pm.use("t_a"):  # t_a is now the most recently used
        pass
    async with pm.use("t_c") as c:
        assert c.tenant_id == "t_c"
    await asyncio.sleep(0)  # let the background close run
    assert pm.open_count == 2
    assert set(pm._open) == {"t_a", "t_c"}
    await pm.close_all()
    assert pm.open_count == 0


async def test_profile_in_use_is_never_closed_and_reopen_after_eviction_works(tmp_path):
    pm = ProfileManager(tmp_path, max_open=1)
    async with pm.use("busy") as busy:
        sid, _ = await busy.sessions.get_or_start("k")
        async with pm.use("other"):
            pass
        # "busy" was in use: still open and writable
        await busy.sessions.append(StoredMessage(session_id=sid, role="user", content="still here"))
    for i in range(20):  # churn: evicted profiles reopen while their close may be running
        async with pm.use(f"t{i % 3}") as p:
            sid, _ = await p.sessions.get_or_start("k")
            await p.sessions.append(StoredMessage(session_id=sid, role="user", content=f"m{i}"))
    async with pm.use("busy") as busy:
        sid = await busy.sessions.route("k")
        assert [m.content for m in await busy.sessions.history(sid)] == ["still here"]
    await pm.close_all()


async def test_two_lanes_of_one_tenant_write_concurrently(tmp_path):
    pm = ProfileManager(tmp_path, max_open=4)

    async def lane(key: str, n: int) -> None:
        async with pm.use("alice") as p:
            sid, _ = await p.sessions.get_or_start(key)
            for i in range(n):
                await p.sessions.append(StoredMessage(session_id=sid, role="user", content=f"{key}-{i}"))
                await asyncio.sleep(0)

    await asyncio.gather(lane("dm", 30), lane("group", 30))
    async with pm.use("alice") as p:
        for key in ("dm", "group"):
            sid = await p.sessions.route(key)
            assert [m.content for m in await p.sessions.history(sid)] == [f"{key}-{i}" for i in range(30)]
    await pm.close_all()


async def test_profile_layout_and_manifest(tmp_path):
    pm = ProfileManager(tmp_path)
    async with pm.use("telegram-111") as p:
        p.add_principal("telegram:111")
        p.add_principal("telegram:111")
    await pm.close_all()
    path = tenant_dir(tmp_path, "telegram-111")
    assert {c.name for c in path.iterdir()} >= {"tenant.json", "memories", "sessions", "provider", "state.db"}
    manifest = json.loads((path / "tenant.json").read_text())
    assert manifest["principals"] == ["telegram:111"] and manifest["schema_version"] == 1
