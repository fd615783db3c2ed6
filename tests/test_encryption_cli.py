"""The operator's side of per-tenant encryption (docs/privacy.md): a wrong master key refused
at start, `keys rotate`, delete as crypto-shredding against an old backup, and the plain
profile `profiles export` / `profiles decrypt` give the owner and the Hermes CLI."""

from __future__ import annotations

import asyncio
import json
import os
import sqlite3
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from agent.vault import KEY_FILE, KEYRING_DIR, Keyring, is_sealed, new_master_key, parse_master_key
from gateway.build import build_gateway
from gateway.cli import main as cli_main
from tenancy.keys import tenant_dir
from tests.conftest import RecordingAdapter, dm, say
from tests.fakes.llm import Response, reply

ROOT = Path(__file__).resolve().parents[1]
ALICE_CANARY = "canary-alice-4c1e-the-red-bicycle"
BOB_CANARY = "canary-bob-9d2b-the-blue-kettle"
MASTER_ENV = "HERMES_TEST_MASTER_KEY"


def quiet(request: dict) -> Response:
    """A reply that never repeats the person's words (so only what they sent holds a canary)."""
    return reply("noted")


def write_config(path: Path, data_dir: Path, llm_url: str, *, telegram: bool = False, **storage: str) -> Path:
    cfg = {
        "data_dir": str(data_dir),
        "llm": {"base_url": llm_url, "model": "fake-model", "max_retries": 0, "timeout_s": 5},
        "storage": {"fsync": "never", "encryption": "per_tenant", "master_key_env": MASTER_ENV, **storage},
        "memory": {"nudge_interval": 0, "flush_min_turns": 0},
    }
    if telegram:  # `run` needs a platform; the key check comes before it connects
        cfg["platforms"] = {
            "telegram": {"enabled": True, "token_env": "HERMES_TEST_TG_TOKEN", "base_url": "http://127.0.0.1:9"}
        }
    path.write_text(json.dumps(cfg), encoding="utf-8")
    return path


async def traffic(conf: Path, *people: tuple[str, str]) -> None:
    """Each (user, text) through the real gateway built from the config file."""
    from core.settings import load_config

    cfg = load_config(str(conf))
    adapter = RecordingAdapter("testchat")
    app = build_gateway(cfg, [adapter])
    await app.start()
    try:
        for user, text in people:
            await say(app, adapter, dm(user, text))
    finally:
        await app.stop()


def every_file_holding(root: Path, needle: str) -> list[str]:
    return [str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and needle.encode() in p.read_bytes()]


def run_cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """The real command line in a child process."""
    return subprocess.run(
        [sys.executable, "-m", "gateway.cli", *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture
def master(monkeypatch: pytest.MonkeyPatch) -> str:
    key = new_master_key()
    monkeypatch.setenv(MASTER_ENV, key)
    return key


async def test_a_wrong_or_missing_master_key_is_refused_at_start_in_one_sentence(tmp_path, fake_llm, master):
    fake_llm.responder = quiet
    conf = write_config(tmp_path / "hermes.yaml", tmp_path / "data", fake_llm.base_url, telegram=True)
    await traffic(conf, ("alice", f"hello {ALICE_CANARY}"))
    env = {"HERMES_TEST_TG_TOKEN": "123456:AAEfakeTOKENfor-encryption"}
    cases = [
        ({MASTER_ENV: new_master_key()}, "is not the one"),
        ({MASTER_ENV: "not a key"}, "does not hold a master key"),
        ({MASTER_ENV: ""}, "is not set"),
    ]
    for extra, says in cases:
        for verb in ("run", "doctor"):
            done = await asyncio.to_thread(run_cli, verb, "-c", str(conf), env={**env, **extra})
            out = (done.stdout + done.stderr).strip()
            assert done.returncode == 1, (verb, out)
            assert says in out and len(out.splitlines()) == 1 and "Traceback" not in out, (verb, out)
            assert ALICE_CANARY not in out


async def test_rotate_rewraps_every_key_then_the_new_key_opens_and_the_old_is_refused(
    tmp_path, fake_llm, master, monkeypatch, capsys
):
    fake_llm.responder = quiet
    data = tmp_path / "data"
    conf = write_config(tmp_path / "hermes.yaml", data, fake_llm.base_url)
    await traffic(conf, ("alice", f"one {ALICE_CANARY}"), ("bob", f"two {BOB_CANARY}"))
    alice = tenant_dir(data, "testchat-alice")
    db_before = (alice / "state.db").read_bytes()
    journals_before = {p.name: p.read_bytes() for p in (alice / "sessions").glob("*.jsonl")}
    new = new_master_key()
    monkeypatch.setenv("HERMES_TEST_NEW_KEY", new)
    assert cli_main(["keys", "rotate", "-c", str(conf), "--new-key-env", "HERMES_TEST_NEW_KEY"]) == 0
    said = capsys.readouterr().out
    assert "re-wrapped 2 data keys" in said and "storage.master_key_env: HERMES_TEST_NEW_KEY" in said
    # no data rewritten: the database and journals are byte for byte what they were
    assert (alice / "state.db").read_bytes() == db_before
    assert {p.name: p.read_bytes() for p in (alice / "sessions").glob("*.jsonl")} == journals_before
    # the old key is refused, in one sentence
    assert cli_main(["profiles", "list", "-c", str(conf)]) == 1
    assert "is not the one" in capsys.readouterr().err
    # the new key opens everyone: the gateway answers from the history it reads
    monkeypatch.setenv(MASTER_ENV, new)
    assert cli_main(["profiles", "show", "testchat-alice", "-c", str(conf), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["messages"] >= 2 and "damaged" not in shown
    await traffic(conf, ("alice", "still there?"))
    ring = Keyring.open(data, parse_master_key(new, "new"))
    from tenancy.profiles import journal_records

    texts = [r.get("content") or "" for r in journal_records(alice, ring.key_for("testchat-alice", alice))]
    assert f"one {ALICE_CANARY}" in texts and "still there?" in texts
    # rotating twice with the key in use is refused
    assert cli_main(["keys", "rotate", "-c", str(conf), "--new-key-env", MASTER_ENV]) == 1


async def test_a_restored_old_backup_after_a_delete_cannot_reveal_the_deleted_tenant(
    tmp_path, fake_llm, master, capsys
):
    fake_llm.responder = quiet
    data = tmp_path / "data"
    conf = write_config(tmp_path / "hermes.yaml", data, fake_llm.base_url)
    await traffic(conf, ("alice", f"remember {ALICE_CANARY}"), ("bob", f"remember {BOB_CANARY}"))
    assert cli_main(["backup", str(tmp_path / "backups"), "-c", str(conf)]) == 0
    assert "holds no keyring" in capsys.readouterr().out
    (archive,) = (tmp_path / "backups").glob("hermes-backup-*.tar.gz")
    with tarfile.open(archive) as tar:
        names = tar.getnames()
        manifest = json.loads(tar.extractfile("BACKUP.json").read())  # type: ignore[union-attr]
    assert manifest["encrypted"] is True
    assert not [n for n in names if n.split("/")[0] == KEYRING_DIR]
    assert ALICE_CANARY.encode() not in archive.read_bytes()  # compressed, but state.db is ciphertext anyway

    assert cli_main(["profiles", "delete", "testchat-alice", "--yes", "-c", str(conf)]) == 0
    assert "key was destroyed first" in capsys.readouterr().out
    # the operator restores the old backup next to the live keyring (which no longer has alice)
    live_ring = tmp_path / "keyring-kept"
    os.replace(data / KEYRING_DIR, live_ring)
    os.replace(data, tmp_path / "data-old")
    data.mkdir(mode=0o700)
    os.replace(live_ring, data / KEYRING_DIR)
    assert cli_main(["restore", str(archive), "-c", str(conf)]) == 0
    said = capsys.readouterr().out
    assert "restored 1 profile" in said
    assert "not restored: testchat-alice: its key was destroyed (deleted after this backup)" in said
    assert every_file_holding(data, ALICE_CANARY) == []
    assert not tenant_dir(data, "testchat-alice").exists()
    # bob restores and opens normally
    assert cli_main(["profiles", "show", "testchat-bob", "-c", str(conf), "--json"]) == 0
    bob = json.loads(capsys.readouterr().out)
    assert bob["messages"] >= 2 and "damaged" not in bob
    await traffic(conf, ("bob", "back again"))
    # and even the backup's own copy of alice cannot be opened with the live keyring
    stage = tmp_path / "unpacked"
    with tarfile.open(archive) as tar:
        tar.extractall(stage, filter="data")
    ring = Keyring.open(data, parse_master_key(master, "env"))
    from agent.vault import VaultError

    with pytest.raises(VaultError, match=r"^testchat-alice's key was destroyed"):
        ring.key_for("testchat-alice", stage / "profiles" / tenant_dir(data, "testchat-alice").name)


async def test_export_and_decrypt_give_a_plain_profile_the_stdlib_reads_with_the_canary(
    tmp_path, fake_llm, master, capsys
):
    fake_llm.responder = quiet
    data = tmp_path / "data"
    conf = write_config(tmp_path / "hermes.yaml", data, fake_llm.base_url)
    await traffic(conf, ("alice", f"my secret is {ALICE_CANARY}"), ("alice", "/export"))
    alice = tenant_dir(data, "testchat-alice")
    assert every_file_holding(alice, ALICE_CANARY) == [] or all(
        not p.startswith(("sessions", "state.db", "exports")) for p in every_file_holding(alice, ALICE_CANARY)
    )
    out = tmp_path / "plain"
    assert cli_main(["profiles", "decrypt", "testchat-alice", str(out), "-c", str(conf)]) == 0
    assert "unencrypted" in capsys.readouterr().out
    assert (
        cli_main(["profiles", "export", "testchat-alice", "-o", str(tmp_path / "alice.tar.gz"), "-c", str(conf)]) == 0
    )
    unpacked = tmp_path / "export"
    with tarfile.open(tmp_path / "alice.tar.gz") as tar:
        tar.extractall(unpacked, filter="data")
    for profile in (out, unpacked / "profile"):
        assert not (profile / KEY_FILE).exists()
        sealed = [p for p in profile.rglob("*") if p.is_file() and is_sealed(p.read_bytes())]
        assert sealed == []
        conn = sqlite3.connect(profile / "state.db")  # the Hermes CLI's library
        try:
            assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
            rows = conn.execute("SELECT content FROM messages_fts WHERE messages_fts MATCH ?", ('"secret"',)).fetchall()
            assert any(ALICE_CANARY in (r[0] or "") for r in rows)
        finally:
            conn.close()
        lines = [
            json.loads(line) for j in (profile / "sessions").glob("*.jsonl") for line in j.read_text().splitlines()
        ]
        assert any(ALICE_CANARY in (r.get("content") or "") for r in lines)
        exports = list((profile / "exports").glob("*.json"))
        assert exports and ALICE_CANARY in exports[0].read_text(encoding="utf-8")
    # decrypt refuses a directory that already holds something
    assert cli_main(["profiles", "decrypt", "testchat-alice", str(out), "-c", str(conf)]) == 1


def test_keys_new_prints_a_master_key_without_any_config(tmp_path):
    done = run_cli("-c", str(tmp_path / "absent.yaml"), "keys", "new", env={})
    assert done.returncode == 0, done.stderr
    assert len(parse_master_key(done.stdout, "keys new")) == 32
