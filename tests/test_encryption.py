"""Per-tenant encryption of the session store (docs/privacy.md): journal lines sealed with
the tenant's key, reconciliation by uid and torn tails on sealed lines, an encrypted
profile opened without its key, and a /link merge of two encrypted profiles."""

from __future__ import annotations

import json
import os
from pathlib import Path

import apsw
import pytest
import yaml

from agent.messages import StoredMessage
from agent.sessions import SessionStore
from agent.sessions.journal import Journal
from agent.vault import KEYRING_DIR, Keyring, TenantKeys, VaultError, is_sealed_line, new_master_key, parse_master_key
from gateway.build import build_gateway
from tenancy.keys import link_tenant_id, tenant_dir
from tenancy.profiles import ProfileDamaged, ProfileManager, journal_records
from tests.conftest import RecordingAdapter, dm, say
from tests.test_crash_recovery import run_gateway
from tests.test_linking import link

CANARY = "canary-7f3a-the-ferry-leaves-at-dawn"
MASTER_ENV = "HERMES_TEST_MASTER_KEY"


def encrypted(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """storage settings for per_tenant encryption, the master key in this process's environment."""
    monkeypatch.setenv(MASTER_ENV, new_master_key())
    return {"fsync": "never", "encryption": "per_tenant", "master_key_env": MASTER_ENV}


def ring(data_dir: Path) -> Keyring:
    return Keyring.open(data_dir, parse_master_key(os.environ[MASTER_ENV], MASTER_ENV))


def bytes_holding(root: Path, needle: str) -> list[str]:
    """Every file under `root` whose bytes hold `needle`."""
    return [str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and needle.encode() in p.read_bytes()]


def journal_lines(profile: Path) -> list[bytes]:
    return [line for j in sorted((profile / "sessions").glob("*.jsonl")) for line in j.read_bytes().splitlines()]


async def test_journal_lines_and_state_db_hold_no_canary_bytes_with_encryption_on(config_for, monkeypatch):
    cfg = config_for(storage=encrypted(monkeypatch))
    adapter = RecordingAdapter("testchat")
    app = build_gateway(cfg, [adapter])
    await app.start()
    try:
        for i in range(3):
            await say(app, adapter, dm("alice", f"note {i}: {CANARY}"))
    finally:
        await app.stop()
    profile = tenant_dir(cfg.data_dir, "testchat-alice")
    lines = journal_lines(profile)
    assert len(lines) >= 6 and all(is_sealed_line(line) for line in lines)
    store_files = [
        p for p in profile.rglob("*") if p.is_file() and (p.name.startswith("state.db") or "sessions" in p.parts)
    ]
    assert store_files and not [p for p in store_files if CANARY.encode() in p.read_bytes()]
    # and the owner's key reads every line back
    key = ring(cfg.data_dir).key_for("testchat-alice", profile)
    texts = [r.get("content") or "" for r in journal_records(profile, key)]
    assert sum(CANARY in t for t in texts) >= 3


def sealed_profile(tmp_path, tenant_id: str):
    """A new encrypted profile directory of `tenant_id` and its data key (a fresh keyring)."""
    profile = tmp_path / "profiles" / tenant_id
    return profile, Keyring.open(tmp_path, os.urandom(32)).key_for(tenant_id, profile, create=True)


async def test_a_sealed_journal_torn_mid_line_is_cut_and_state_db_rebuilt_by_uid(tmp_path):
    profile, key = sealed_profile(tmp_path, "testchat-bob")
    async with SessionStore(profile, fsync="always", key=key) as s:
        sid = await s.start_session("lane-1")
        sent = [await s.append(StoredMessage(sid, "user", f"{CANARY} {i}")) for i in range(5)]
    journal = profile / "sessions" / f"{sid}.jsonl"
    whole = journal.read_bytes()
    # a crash: state.db gone (an un-fsynced WAL lost), the journal's last append torn halfway
    for name in ("state.db", "state.db-wal", "state.db-shm"):
        (profile / name).unlink(missing_ok=True)
    torn = key.seal_line('{"type":"message","uid":"torn"}', f"sessions/{journal.name}")
    journal.write_bytes(whole + torn[: len(torn) // 2].encode())
    async with SessionStore(profile, fsync="always", key=key) as s:
        got = await s.history(sid)
    assert [m.uid for m in got] == [m.uid for m in sent]
    assert [m.content for m in got] == [f"{CANARY} {i}" for i in range(5)]
    assert journal.read_bytes() == whole  # the torn tail cut at the last whole line
    assert CANARY.encode() not in journal.read_bytes() + (profile / "state.db").read_bytes()


async def test_rows_lost_from_an_encrypted_state_db_come_back_from_its_sealed_journal(tmp_path):
    profile, key = sealed_profile(tmp_path, "testchat-carol")
    async with SessionStore(profile, fsync="always", key=key) as s:
        sid = await s.start_session("lane-1")
        sent = [await s.append(StoredMessage(sid, "user", f"hello {i}")) for i in range(4)]
    conn = apsw.Connection(str(profile / "state.db"))
    conn.execute(key.db_pragma()).fetchall()
    conn.execute("DELETE FROM messages WHERE uid IN (?, ?)", (sent[1].uid, sent[3].uid))
    conn.close()
    async with SessionStore(profile, fsync="always", key=key) as s:
        got = await s.history(sid)
    assert sorted((m.uid, m.content) for m in got) == sorted((m.uid, m.content) for m in sent)


async def test_an_encrypted_profile_opened_without_its_key_fails_in_one_sentence_and_cuts_nothing(tmp_path):
    keyring = Keyring.open(tmp_path, os.urandom(32))
    profile = tenant_dir(tmp_path, "testchat-dave")
    key = keyring.key_for("testchat-dave", profile, create=True)
    async with SessionStore(profile, fsync="always", key=key) as s:
        sid = await s.start_session("lane-1")
        await s.append(StoredMessage(sid, "user", CANARY))
    journal = profile / "sessions" / f"{sid}.jsonl"
    before = journal.read_bytes()
    with pytest.raises(VaultError, match="opened without its key"):
        Journal.read(journal, 0)  # what a reconcile without the key would do
    assert journal.read_bytes() == before
    with pytest.raises(VaultError, match="opened without its key"):
        journal_records(profile)  # the admin's reader: a sentence, never the sealed bytes as "no messages"
    # the gateway's manager: encryption off, then another master key, then the key destroyed
    for manager_ring, says in (
        (None, "storage.encryption is off"),
        (keyring, "was destroyed"),
    ):
        if says == "was destroyed":
            keyring.shred("testchat-dave", profile)
        manager = ProfileManager(tmp_path, fsync="never", keys=TenantKeys(manager_ring))
        with pytest.raises(ProfileDamaged) as caught:
            async with manager.use("testchat-dave", kind="person"):
                pass
        assert says in caught.value.problem and "\n" not in caught.value.problem
        assert CANARY not in str(caught.value)
        await manager.close_all()
    assert journal.read_bytes() == before
    with pytest.raises(VaultError, match="not the one"):
        Keyring.open(tmp_path, os.urandom(32))


async def test_a_link_merge_of_two_encrypted_profiles_reseals_their_lines_under_the_link_key(config_for, monkeypatch):
    cfg = config_for(storage=encrypted(monkeypatch), limits={"rate_limit_per_minute": 100})
    tg, dc = RecordingAdapter("telegram"), RecordingAdapter("discord")
    app = build_gateway(cfg, [tg, dc])
    await app.start()
    try:
        await say(app, tg, dm("111", f"telegram says {CANARY}", platform="telegram"))
        await say(app, dc, dm("222", f"discord says {CANARY}", platform="discord"))
        await link(app, tg, dc)
        name = app.links.name_for("telegram:111")
        assert name is not None
        out = await say(app, dc, dm("222", "and now?", platform="discord"))
        assert out
    finally:
        await app.stop()
    tid = link_tenant_id(name)
    profile = tenant_dir(cfg.data_dir, tid)
    keyring = ring(cfg.data_dir)
    key = keyring.key_for(tid, profile)
    contents = [r.get("content") or "" for r in journal_records(profile, key)]
    assert any(c == f"telegram says {CANARY}" for c in contents)
    assert any(c == f"discord says {CANARY}" for c in contents)
    lines = journal_lines(profile)
    assert lines and all(is_sealed_line(line) for line in lines)
    assert not [p for p in bytes_holding(profile, CANARY) if p.startswith(("sessions", "state.db"))]
    # the personal profiles merged away took their keys with them
    assert keyring.tenants() == [profile.name]
    assert not (cfg.data_dir / KEYRING_DIR / f"{tenant_dir(cfg.data_dir, 'telegram-111').name}.slot").exists()


async def test_sigkill_mid_burst_with_encryption_on_then_restart_loses_nothing(tmp_path, fake_llm, monkeypatch):
    """The crash test of tests/test_crash_recovery.py on encrypted profiles: journal and
    state.db agree by uid after a SIGKILL and a restart, every sent reply is stored."""
    storage = encrypted(monkeypatch)  # the child process inherits the master key's variable
    config = tmp_path / "gw.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "data_dir": str(tmp_path / "data"),
                "llm": {"base_url": fake_llm.base_url, "model": "fake", "max_retries": 0},
                "storage": {**storage, "fsync": "batch"},
                "limits": {"rate_limit_per_minute": 1000, "max_queued_turns": 100, "busy_mode": "queue"},
            }
        )
    )
    n = 40
    first = await run_gateway(config, n, kill_after_replies=10)
    assert len(first) >= 10
    second = await run_gateway(config, n, kill_after_replies=None)
    keyring = ring(tmp_path / "data")
    stored: dict[str, tuple[str, str]] = {}
    for profile in sorted((tmp_path / "data" / "profiles").iterdir()):
        key = keyring.key_for(tenant_id_of(profile), profile)
        journal = {r["uid"] for r in journal_records(profile, key) if r.get("type") == "message"}
        conn = apsw.Connection(str(profile / "state.db"))
        try:
            conn.execute(key.db_pragma()).fetchall()
            db = {
                uid: (role, content) for uid, role, content in conn.execute("SELECT uid, role, content FROM messages")
            }
        finally:
            conn.close()
        assert journal == set(db), f"journal and SQLite differ in {profile.name}"
        assert all(is_sealed_line(line) for line in journal_lines(profile))
        assert b"burst-" not in (profile / "state.db").read_bytes()
        stored.update(db)
    users = [c for r, c in stored.values() if r == "user"]
    contents = [c for _, c in stored.values()]
    assert sorted(users) == sorted(f"burst-{i}" for i in range(n))
    for reply in first + second:
        assert reply in contents, f"reply {reply!r} was sent but not stored"


def tenant_id_of(profile: Path) -> str:
    return str(json.loads((profile / "tenant.json").read_text(encoding="utf-8"))["tenant_id"])
