"""`/forget all` with encryption on re-keys the tenant (docs/privacy.md#delete-is-crypto-shredding):
an old backup restored beside the live keyring no longer reveals what was forgotten, the
history kept opens and the person keeps chatting; a crash mid-rekey loses nothing and the
next open finishes it; gateway.db's waiting text follows the new key; plain mode unchanged."""

from __future__ import annotations

import json
import os
import tarfile
from pathlib import Path

import pytest

from agent.rekey import REKEY_FILE
from agent.vault import (
    KEY_FILE,
    KEYRING_DIR,
    Keyring,
    TenantKeys,
    VaultError,
    is_sealed,
    new_master_key,
    parse_master_key,
)
from core.settings import load_config
from gateway.build import build_gateway
from gateway.cli import main as cli_main
from gateway.outbox import reseal_rows
from tenancy.keys import tenant_dir
from tests.conftest import RecordingAdapter, dm, say
from tests.fakes.llm import reply, tool_call
from tests.test_encryption_cli import MASTER_ENV, every_file_holding, write_config

FORGOTTEN = "canary-forget-5e2d-the-green-lantern"
ALICE = "testchat-alice"


@pytest.fixture
def master(monkeypatch: pytest.MonkeyPatch) -> str:
    key = new_master_key()
    monkeypatch.setenv(MASTER_ENV, key)
    return key


def ring_of(data: Path) -> Keyring:
    return Keyring.open(data, parse_master_key(os.environ[MASTER_ENV], MASTER_ENV))


async def chat(conf: Path, *texts: str) -> list[list[str]]:
    """Alice's messages through the real gateway built from `conf`; what it answered to each."""
    adapter = RecordingAdapter("testchat")
    app = build_gateway(load_config(str(conf)), [adapter])
    await app.start()
    try:
        return [await say(app, adapter, dm("alice", text)) for text in texts]
    finally:
        await app.stop()


async def remembered(conf: Path, fake_llm) -> None:
    """Alice's memory holds FORGOTTEN (written by the model, so only memory and the tool call hold it)."""
    fake_llm.script(
        tool_call("memory", {"action": "add", "target": "user", "content": f"keeps {FORGOTTEN}"}), reply("saved")
    )
    await chat(conf, "note what I keep")
    fake_llm.responder = lambda request: reply("noted")
    await chat(conf, "and a second message", "and a third")


def memory_text(data: Path) -> str:
    ring = ring_of(data)
    profile = tenant_dir(data, ALICE)
    key = ring.key_for(ALICE, profile)
    return "".join(
        key.open(p.read_bytes(), p.relative_to(profile).as_posix()).decode()
        for p in sorted((profile / "memories").glob("*.md"))
    )


def history_count(conf: Path, capsys) -> int:
    capsys.readouterr()
    assert cli_main(["profiles", "show", ALICE, "-c", str(conf), "--json"]) == 0
    return int(json.loads(capsys.readouterr().out)["messages"])


async def test_an_old_backup_restored_after_forget_all_cannot_reveal_what_was_forgotten(
    tmp_path, fake_llm, master, capsys
):
    data = tmp_path / "data"
    conf = write_config(tmp_path / "hermes.yaml", data, fake_llm.base_url)
    await remembered(conf, fake_llm)
    assert FORGOTTEN in memory_text(data)
    assert cli_main(["backup", str(tmp_path / "backups"), "-c", str(conf)]) == 0
    (archive,) = (tmp_path / "backups").glob("hermes-backup-*.tar.gz")
    before = history_count(conf, capsys)
    old_key_json = (tenant_dir(data, ALICE) / KEY_FILE).read_text()

    (said,) = await chat(conf, "/forget all")
    assert "erased everything I remembered" in said[0]
    profile = tenant_dir(data, ALICE)
    assert (profile / KEY_FILE).read_text() != old_key_json  # a new data key, under a new slot
    assert not (profile / REKEY_FILE).exists()
    assert {p.name for p in (data / KEYRING_DIR).iterdir()} == {f"{profile.name}.slot", "master.check"}
    assert FORGOTTEN not in memory_text(data)
    # the history kept opens, and the person keeps chatting with it
    assert history_count(conf, capsys) >= before
    fake_llm.responder = lambda request: reply(f"seen {sum(m.get('role') == 'user' for m in request['messages'])}")
    (again,) = await chat(conf, "still there?")
    assert again[-1].startswith("seen ") and int(again[-1].split()[1]) >= 3
    assert history_count(conf, capsys) >= before + 2

    # the old backup, restored into a fresh data dir beside the live keyring: alice's copy opens under no key
    fresh = tmp_path / "fresh"
    fresh.mkdir(mode=0o700)
    (fresh / KEYRING_DIR).mkdir(mode=0o700)
    for slot in (data / KEYRING_DIR).iterdir():
        (fresh / KEYRING_DIR / slot.name).write_bytes(slot.read_bytes())
    fresh_conf = write_config(tmp_path / "fresh.yaml", fresh, fake_llm.base_url)
    capsys.readouterr()
    assert cli_main(["restore", str(archive), "-c", str(fresh_conf)]) == 0
    assert f"not restored: {ALICE}" in capsys.readouterr().out
    assert every_file_holding(fresh, FORGOTTEN) == []
    stage = tmp_path / "unpacked"
    with tarfile.open(archive) as tar:
        tar.extractall(stage, filter="data")
    assert every_file_holding(stage, FORGOTTEN) == []  # sealed in the archive
    with pytest.raises(VaultError):
        ring_of(fresh).key_for(ALICE, stage / "profiles" / profile.name)


@pytest.mark.parametrize("k", [0, 1, 2, 3, -1])  # -1: after every file, before gateway.db and key.json
async def test_a_crash_after_k_files_of_a_rekey_loses_nothing_and_the_next_open_finishes_it(
    tmp_path, fake_llm, master, capsys, k
):
    data = tmp_path / "data"
    conf = write_config(tmp_path / "hermes.yaml", data, fake_llm.base_url)
    await remembered(conf, fake_llm)
    profile = tenant_dir(data, ALICE)
    kept = memory_text(data)
    before = history_count(conf, capsys)
    old_slot = (data / KEYRING_DIR / f"{profile.name}.slot").read_bytes()

    class Crash(Exception):
        pass

    def crash_after(done: int) -> None:
        if done >= k:
            raise Crash

    def rows(old, new) -> None:
        if k == -1:
            raise Crash
        reseal_rows(data / "gateway.db", old, new)

    keys = TenantKeys(ring_of(data), rows=rows)
    keys.begin_rekey(ALICE, profile)
    if k != 0:  # k == 0: the crash right after the marker, before any file
        with pytest.raises(Crash):
            keys.rekey(ALICE, profile, progress=crash_after if k > 0 else None)
    assert (profile / REKEY_FILE).exists()
    sealed = [p for p in profile.rglob("*") if p.is_file() and is_sealed(p.read_bytes())]
    assert sealed  # memory files and the like, some under either key now

    # meanwhile a reader outside the gateway refuses it in one sentence, never half-read
    capsys.readouterr()
    assert cli_main(["profiles", "show", ALICE, "-c", str(conf), "--json"]) != 0
    assert "profile is being re-keyed (after /forget all)" in capsys.readouterr().err
    # a new gateway: the profile's open finishes the rekey before anything else
    fake_llm.responder = lambda request: reply("here")
    (said,) = await chat(conf, "hello after the crash")
    assert said == ["here"]
    assert not (profile / REKEY_FILE).exists()
    assert (data / KEYRING_DIR / f"{profile.name}.slot").read_bytes() != old_slot
    assert not (data / KEYRING_DIR / f"{profile.name}.slot-next").exists()
    assert memory_text(data) == kept
    assert history_count(conf, capsys) == before + 2


async def test_a_message_waiting_in_gateway_db_opens_after_a_rekey(tmp_path, fake_llm, master):
    data = tmp_path / "data"
    conf = write_config(tmp_path / "hermes.yaml", data, fake_llm.base_url)
    await remembered(conf, fake_llm)
    cfg = load_config(str(conf))
    app = build_gateway(cfg, [RecordingAdapter("testchat")])
    await app.start()
    try:  # a message recorded as pending (sealed with alice's key), as a crash mid-turn leaves it
        inbox = app.inbox
        msg = dm("alice", "waiting text", message_id="w1")
        assert await inbox.record(msg)
    finally:
        await app.stop()
    profile = tenant_dir(data, ALICE)
    keys = TenantKeys(ring_of(data), rows=lambda old, new: reseal_rows(data / "gateway.db", old, new))
    keys.begin_rekey(ALICE, profile)
    assert keys.rekey(ALICE, profile) is not None
    # the restarted gateway replays it, readable under the new key
    adapter = RecordingAdapter("testchat")
    fake_llm.responder = lambda request: reply("answered the waiting one")
    app = build_gateway(load_config(str(conf)), [adapter])
    await app.start()
    try:
        assert await app.drain(20)
        assert "answered the waiting one" in [m.text for m in adapter.sent]
    finally:
        await app.stop()


async def test_forget_all_in_plain_mode_keeps_no_keyring_and_erases_memory_as_before(config_for, fake_llm):
    cfg = config_for()
    adapter = RecordingAdapter("testchat")
    app = build_gateway(cfg, [adapter])
    await app.start()
    try:
        fake_llm.script(
            tool_call("memory", {"action": "add", "target": "user", "content": f"keeps {FORGOTTEN}"}), reply("saved")
        )
        await say(app, adapter, dm("alice", "note what I keep"))
        assert "erased everything I remembered" in (await say(app, adapter, dm("alice", "/forget all")))[0]
    finally:
        await app.stop()
    profile = tenant_dir(cfg.data_dir, ALICE)
    assert not (cfg.data_dir / KEYRING_DIR).exists()
    assert not (profile / KEY_FILE).exists() and not (profile / REKEY_FILE).exists()
    assert FORGOTTEN not in "".join(p.read_text() for p in (profile / "memories").glob("*.md"))
