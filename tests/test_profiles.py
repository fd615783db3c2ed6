"""Profiles open lazily, at most `max_open` stay open (LRU), in-use ones are never closed,
and two lanes of one tenant share one open profile safely."""

from __future__ import annotations

import asyncio
import json
import resource
import threading

import pytest

from agent.messages import StoredMessage
from agent.sessions import StoragePool
from core.settings import DEFAULT_MEMORY_BUDGET_MIB
from tenancy import profiles as profiles_mod
from tenancy.keys import tenant_dir
from tenancy.profiles import ProfileDamaged, ProfileManager, open_limit


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


def test_the_open_profiles_are_sized_by_memory_within_the_descriptor_limit_and_the_cap():
    """docs/concepts.md#open-profiles: budget / 272 KiB, within (RLIMIT_NOFILE - reserve) / 5
    descriptors, at most max_open_profiles, at least one."""
    assert open_limit(None, DEFAULT_MEMORY_BUDGET_MIB, 20000) == 286  # the default: under 200 MiB at 1,000 people
    assert open_limit(None, 272, resource.RLIM_INFINITY) == 1024
    assert open_limit(None, 1, 20000) == 3
    assert open_limit(None, 272, 1024) == (1024 - 256) // 5  # the descriptors decide
    assert open_limit(None, 272, 64) == (64 - 32) // 5  # a tiny limit keeps half for the rest
    assert open_limit(10, 272, 20000) == 10  # the hard cap
    assert open_limit(5000, 272, 20000) == 1024  # a cap above the budget does not raise it
    assert open_limit(None, 1, 8) == 1


def test_the_config_keys_size_the_gateways_open_profiles(tmp_path):
    from gateway.build import build_gateway
    from tests.conftest import make_config

    def opened(**sections: object) -> int:
        app = build_gateway(make_config(tmp_path / "data", "http://127.0.0.1:9/v1", **sections), [])
        return app.profiles.max_open

    assert opened() == open_limit(None, DEFAULT_MEMORY_BUDGET_MIB)
    assert opened(storage={"memory_budget_mib": 2}) == 7
    assert opened(tenancy={"max_open_profiles": 3}) == 3
    assert opened(storage={"memory_budget_mib": 2}, tenancy={"max_open_profiles": 100}) == 7


def test_an_encrypted_profile_counts_its_cipher_memory_against_the_budget(tmp_path, monkeypatch):
    """SQLite3 Multiple Ciphers adds ~70 KiB per open connection: with encryption on, the
    same storage.memory_budget_mib keeps fewer profiles open, so the budget still holds."""
    from agent.vault import new_master_key
    from gateway.build import build_gateway
    from tests.conftest import make_config

    monkeypatch.setenv("HERMES_TEST_MASTER_KEY", new_master_key())
    sealed = {"memory_budget_mib": 20, "encryption": "per_tenant", "master_key_env": "HERMES_TEST_MASTER_KEY"}
    plain = build_gateway(
        make_config(tmp_path / "plain", "http://127.0.0.1:9/v1", storage={"memory_budget_mib": 20}), []
    )
    encrypted = build_gateway(make_config(tmp_path / "sealed", "http://127.0.0.1:9/v1", storage=sealed), [])
    assert plain.profiles.max_open == 20 * 1024 // profiles_mod.PROFILE_COST_KIB
    assert encrypted.profiles.max_open == 20 * 1024 // (
        profiles_mod.PROFILE_COST_KIB + profiles_mod.ENCRYPTED_EXTRA_KIB
    )
    assert encrypted.profiles.max_open < plain.profiles.max_open


async def test_a_profile_directory_is_checked_once_per_process_on_the_storage_thread(tmp_path, monkeypatch):
    """The first open checks and lays out the directory inside the pool job that opens
    state.db (no hop of its own); reopening after the LRU closed it skips that; evict()
    (before a profile is deleted or merged) makes the next open check again."""
    checked: list[tuple[str, str]] = []
    real = profiles_mod.profile_problem

    def counting(path, *, deep=False, key=None):
        checked.append((path.name, threading.current_thread().name))
        return real(path, deep=deep, key=key)

    monkeypatch.setattr(profiles_mod, "profile_problem", counting)
    hops: list[str] = []  # default-executor hops
    to_thread = asyncio.to_thread

    def hop(fn, /, *args, **kwargs):
        hops.append(getattr(fn, "__name__", repr(fn)))
        return to_thread(fn, *args, **kwargs)

    monkeypatch.setattr(asyncio, "to_thread", hop)
    pool = StoragePool(2)
    pm = ProfileManager(tmp_path, max_open=1, pool=pool)
    try:
        calls = pool.calls
        async with pm.use("t_a") as a:
            assert pool.calls - calls == 1  # the checks, the layout and state.db: one storage call
            a.add_principal("x:1")
        assert [name for name, _ in checked] == ["t_a"]
        assert checked[0][1].startswith("hermes-storage")
        async with pm.use("t_b"):
            pass
        await asyncio.sleep(0.05)  # the LRU closes t_a in the background
        assert "t_a" not in pm._open
        async with pm.use("t_a") as a:  # reopened: no checks, the principals as they were
            assert a.principals == {"x:1"}
        assert [name for name, _ in checked] == ["t_a", "t_b"]
        assert hops == []  # opening is storage calls only
        await pm.discard_principal("t_a", "x:1")
        async with pm.use("t_b"):
            pass
        await asyncio.sleep(0.05)
        async with pm.use("t_a") as a:  # a principal dropped while it was closed stays dropped
            assert a.principals == set()
        assert json.loads((tenant_dir(tmp_path, "t_a") / "tenant.json").read_text())["principals"] == []
        assert await pm.evict("t_a")
        (tenant_dir(tmp_path, "t_a") / "memories").rmdir()
        async with pm.use("t_a"):  # checked and laid out again
            pass
        assert [name for name, _ in checked] == ["t_a", "t_b", "t_a"]
        assert (tenant_dir(tmp_path, "t_a") / "memories").is_dir()
    finally:
        await pm.close_all()
        pool.shutdown()


async def test_a_damaged_directory_found_by_the_first_open_is_quarantined_and_checked_again(tmp_path):
    path = tenant_dir(tmp_path, "t_d")
    path.mkdir(parents=True)
    (path / "tenant.json").write_text("{not json")
    pm = ProfileManager(tmp_path)
    try:
        with pytest.raises(ProfileDamaged, match=r"tenant\.json is not valid JSON"):
            async with pm.use("t_d"):
                pass
        assert "t_d" in pm.quarantined and pm.open_count == 0
        (path / "tenant.json").unlink()
        async with pm.use("t_d") as d:  # repaired: it opens (checked again) and is released
            assert d.principals == set()
        assert "t_d" not in pm.quarantined
        assert json.loads((path / "tenant.json").read_text())["tenant_id"] == "t_d"
    finally:
        await pm.close_all()
