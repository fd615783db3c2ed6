""" "Kept" means kept: a turn that fails for a reason that is not the message's own fault
leaves it pending, tells the person once and answers it when the fault passes; a profile
that cannot be opened is quarantined (the others served), reported by /healthz, `doctor`
and `profiles list/show`, and `profiles repair` brings it back while the gateway runs.

Every fault is real: damaged files, a directory where a file should be, a descriptor limit
(`resource.setrlimit` in a subprocess), a full filesystem (a small tmpfs, as root)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import sqlite3
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

from gateway.build import build_gateway
from gateway.observability import Observability
from gateway.runtime import GatewayApp
from tenancy.keys import tenant_dir
from tests.conftest import RecordingAdapter, dm
from tests.statedb import open_state_db
from tests.test_faults import fill, free, small_disk, wait_until

FAST = {"retry_initial_s": 0.05, "retry_max_s": 0.2}
LIMITS = {"rate_limit_per_minute": 1000}
HELD = "I can't answer right now; your message is kept and I'll answer as soon as I can."
ROOT = Path(__file__).resolve().parent.parent


def write_config(path: Path, cfg) -> Path:
    path.write_text(
        json.dumps(
            {
                "data_dir": str(cfg.data_dir),
                "llm": {"base_url": cfg.llm.base_url, "model": "fake-model"},
                "storage": {"fsync": "never"},
            }
        ),
        encoding="utf-8",
    )
    return path


async def cli(*args: str) -> subprocess.CompletedProcess[str]:
    """Run `hermes-gateway ARGS` in its own process (the gateway of the test keeps running)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "gateway.cli",
        *args,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=ROOT,
    )
    out, err = await proc.communicate()
    assert proc.returncode is not None
    return subprocess.CompletedProcess(list(args), proc.returncode, out.decode(), err.decode())


def damage_header(profile: Path) -> None:
    with (profile / "state.db").open("r+b") as fh:
        fh.write(b"this is no db!!!")


def garbage_tenant_json(profile: Path) -> None:
    (profile / "tenant.json").write_bytes(b"\xff\xfe\x00{not json")


def list_tenant_json(profile: Path) -> None:
    (profile / "tenant.json").write_text("[1, 2, 3]", encoding="utf-8")


def sessions_replaced_by_a_file(profile: Path) -> None:
    shutil.rmtree(profile / "sessions")
    (profile / "sessions").write_text("oops", encoding="utf-8")


def damage_pages(profile: Path) -> None:
    """Every page of state.db behind the first is noise; its header still reads right.

    Checkpointed first: a close leaves the pages in the WAL, where noise in the main file
    would be overwritten by the next checkpoint, not damage."""
    db = profile / "state.db"
    conn = open_state_db(db)
    try:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
    finally:
        conn.close()
    size = db.stat().st_size
    with db.open("r+b") as fh:
        fh.seek(4096)
        fh.write(os.urandom(size - 4096))


DAMAGES: dict[str, Callable[[Path], None]] = {
    "state.db header": damage_header,
    "state.db pages": damage_pages,
    "tenant.json garbage": garbage_tenant_json,
    "tenant.json a JSON list": list_tenant_json,
    "sessions/ a file": sessions_replaced_by_a_file,
}


async def statuses(app: GatewayApp) -> list[tuple[str, str]]:
    rows = await app.inbox.db.execute_fetchall("SELECT chat_id, status FROM inbound ORDER BY received_at")
    return [(r[0], r[1]) for r in rows]


def db_uids(profile: Path) -> set[str]:
    con = open_state_db(profile / "state.db")
    try:
        return {r[0] for r in con.execute("SELECT uid FROM messages")}
    finally:
        con.close()


@pytest.mark.parametrize("damage", list(DAMAGES), ids=list(DAMAGES))
async def test_a_damaged_profile_is_quarantined_the_others_are_served_and_a_repair_answers_its_messages(
    tmp_path, config_for, fake_llm, damage, caplog
):
    cfg = config_for(delivery=FAST, limits=LIMITS)
    conf = write_config(tmp_path / "hermes.yaml", cfg)
    adapter = RecordingAdapter()
    app = build_gateway(cfg, [adapter])
    await app.start()
    ann = tenant_dir(cfg.data_dir, "testchat-ann")
    try:
        await adapter.sink(dm("ann", "hello"))
        await wait_until(lambda: "ok: hello" in adapter.texts())
        assert await app.drain(10)
        before = db_uids(ann)
        assert await app.profiles.evict("testchat-ann")  # closed, as after a restart
        DAMAGES[damage](ann)

        with caplog.at_level(logging.INFO, logger="hermes.profiles"):
            await adapter.sink(dm("ann", "are you still there"))
            await wait_until(lambda: HELD in adapter.texts())
            await adapter.sink(dm("bob", "hi"))  # everyone else is served meanwhile
            await wait_until(lambda: "ok: hi" in adapter.texts())
            await asyncio.sleep(1.0)  # several retries of ann's turn
            assert ("dm-ann", "pending") in await statuses(app)
            assert "testchat-ann" in app.profiles.quarantined
            healthy, body = await Observability(app.observed(), "127.0.0.1:0").health()
            assert healthy and body["status"] == "degraded" and body["checks"]["profiles"]["quarantined"] == 1

            shown = await cli("profiles", "show", "testchat-ann", "-c", str(conf))
            assert shown.returncode == 0, shown.stderr
            assert "Traceback" not in shown.stderr and "damaged" in shown.stdout
            listed = await cli("profiles", "list", "-c", str(conf))
            assert listed.returncode == 0 and "damaged" in listed.stdout, listed.stderr
            repaired = await cli("profiles", "repair", "testchat-ann", "-c", str(conf))
            assert repaired.returncode == 0, repaired.stderr
            assert "repaired testchat-ann" in repaired.stdout

            await wait_until(lambda: "ok: are you still there" in adapter.texts())
            assert await app.drain(10)
        quarantine_lines = [r.getMessage() for r in caplog.records if "is damaged" in r.getMessage()]
        assert len(quarantine_lines) == 1, quarantine_lines
        assert "testchat-ann" in quarantine_lines[0] and "profiles repair testchat-ann" in quarantine_lines[0]
        assert not app.profiles.quarantined
        _, body = await Observability(app.observed(), "127.0.0.1:0").health()
        assert body["checks"]["profiles"]["quarantined"] == 0
    finally:
        await app.stop()
    assert adapter.texts("dm-ann") == ["ok: hello", HELD, "ok: are you still there"]  # told once
    assert [s for _, s in await_statuses(cfg.data_dir)] == ["done", "done", "done"]
    assert before <= db_uids(ann)  # nothing the profile held was lost
    assert list(ann.glob("*.damaged-*")), "the damaged file is kept beside its replacement"
    manifest = json.loads((ann / "tenant.json").read_text(encoding="utf-8"))
    assert manifest["tenant_id"] == "testchat-ann" and "testchat:ann" in manifest["principals"]


def await_statuses(data_dir: Path) -> list[tuple[str, str]]:
    con = sqlite3.connect(data_dir / "gateway.db")
    try:
        return [(r[0], r[1]) for r in con.execute("SELECT chat_id, status FROM inbound ORDER BY received_at")]
    finally:
        con.close()


async def test_a_turn_that_fails_for_another_reason_is_held_told_once_and_answered_when_the_fault_is_gone(
    config_for, fake_llm
):
    cfg = config_for(delivery=FAST, limits=LIMITS)
    cat = tenant_dir(cfg.data_dir, "testchat-cat")
    (cat / "memories" / "MEMORY.md").mkdir(parents=True)  # a directory where the memory file belongs
    adapter = RecordingAdapter()
    app = build_gateway(cfg, [adapter])
    await app.start()
    try:
        await adapter.sink(dm("cat", "good morning"))
        await wait_until(lambda: HELD in adapter.texts())
        await asyncio.sleep(1.0)  # several retries
        assert await statuses(app) == [("dm-cat", "pending")]
        (cat / "memories" / "MEMORY.md").rmdir()  # the operator fixes it
        await wait_until(lambda: "ok: good morning" in adapter.texts())
        assert await app.drain(10)
    finally:
        await app.stop()
    assert adapter.texts() == [HELD, "ok: good morning"]
    assert await_statuses(cfg.data_dir) == [("dm-cat", "done")]


async def test_a_command_on_a_full_disk_is_held_and_answered_when_space_returns(tmp_path, config_for, fake_llm):
    data = tmp_path / "data"
    with small_disk(data / "profiles") as disk:
        cfg = config_for(delivery=FAST, limits=LIMITS)
        adapter = RecordingAdapter()
        app = build_gateway(cfg, [adapter])
        await app.start()
        try:
            await adapter.sink(dm("ann", "hello"))
            await wait_until(lambda: "ok: hello" in adapter.texts())
            assert await app.drain(10)
            fill(disk)
            await adapter.sink(dm("ann", "/new"))  # ends the session: a journal write
            await wait_until(lambda: any("I can't save anything right now" in t for t in adapter.texts()))
            await asyncio.sleep(0.5)
            assert ("dm-ann", "pending") in await statuses(app)
            free(disk)
            await wait_until(lambda: len(adapter.texts()) >= 3)
            assert await app.drain(10)
        finally:
            await app.stop()
        texts = adapter.texts()
        assert len(texts) == 3 and "disk full" in texts[1], texts
        assert texts[2].startswith("Started a new conversation"), texts
        assert [s for _, s in await_statuses(data)] == ["done", "done"]


DESCRIPTOR_LIMITED = textwrap.dedent(
    """
    import asyncio, json, logging, resource, sys
    from pathlib import Path

    from gateway.build import build_gateway
    from gateway.runtime import GatewayApp
    from tests.conftest import RecordingAdapter, dm, make_config

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)

    async def main(data: str, url: str, people: int, limit: int) -> None:
        cfg = make_config(
            Path(data), url, delivery={"retry_initial_s": 0.05, "retry_max_s": 0.5},
            limits={"rate_limit_per_minute": 1000},
        )
        adapter = RecordingAdapter()
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
        app = build_gateway(cfg, [adapter])
        await app.start()
        for i in range(people):
            await adapter.sink(dm(f"p{i}", f"hello {i}"))
        for _ in range(1200):  # until everyone has an answer (or an apology), at most 120 s
            answered = {m.chat_id for m in adapter.sent if not m.text.startswith("I can't answer right now")}
            if len(answered) == people:
                break
            await asyncio.sleep(0.1)
        await app.drain(30)
        await app.stop()
        print(json.dumps([[m.chat_id, m.text] for m in adapter.sent]))

    asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])))
    """
)


@pytest.mark.timeout(300)
async def test_a_descriptor_limit_with_many_new_people_drops_nobody(tmp_path, fake_llm):
    people, data = 120, tmp_path / "data"
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        DESCRIPTOR_LIMITED,
        str(data),
        fake_llm.base_url,
        str(people),
        "64",
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=ROOT,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 240)
    assert proc.returncode == 0, err.decode()[-3000:]
    assert "too many open files" in err.decode(), "the limit was never hit: the test proves nothing"
    sent: dict[str, list[str]] = {}
    for chat, text in json.loads(out):
        sent.setdefault(chat, []).append(text)
    for i in range(people):
        texts = sent.get(f"dm-p{i}", [])
        assert texts.count(f"ok: hello {i}") == 1, (i, texts)
        assert set(texts) <= {f"ok: hello {i}", HELD}, (i, texts)  # at most the one notice besides
    assert [s for _, s in await_statuses(data)] == ["done"] * people


async def test_doctor_names_each_damaged_profile_and_deep_finds_what_the_cheap_checks_cannot(
    tmp_path, config_for, fake_llm
):
    from gateway.tenants import check_profiles
    from tenancy.profiles import journal_records

    cfg = config_for(limits=LIMITS)
    conf = write_config(tmp_path / "hermes.yaml", cfg)
    adapter = RecordingAdapter()
    app = build_gateway(cfg, [adapter])
    await app.start()
    try:
        for who in ("ann", "bob"):
            for n in range(30):  # a few pages of messages
                await adapter.sink(dm(who, f"{who} says {n} " + "words " * 40))
                assert await app.drain(30)
    finally:
        await app.stop()
    assert check_profiles(cfg, deep=True)[0]
    bob = tenant_dir(cfg.data_dir, "testchat-bob") / "state.db"
    with bob.open("r+b") as fh:  # the header stays whole; pages behind it do not
        fh.seek(4096 * 2)
        fh.write(os.urandom(4096 * 4))
    ok, detail = check_profiles(cfg)
    assert ok, detail  # cheap checks read only the header
    ok, detail = check_profiles(cfg, deep=True)
    assert not ok and "testchat-bob" in detail and "testchat-ann" not in detail, detail

    damage_header(tenant_dir(cfg.data_dir, "testchat-ann"))
    doctor = await cli("doctor", "-c", str(conf))
    assert doctor.returncode == 1, doctor.stdout + doctor.stderr
    line = next(x for x in doctor.stdout.splitlines() if "profiles:" in x)
    assert line.startswith("[FAIL] profiles: 1 of 2 profiles damaged: testchat-ann (state.db"), line
    assert "profiles repair" in line
    deep = await cli("doctor", "--deep", "-c", str(conf))
    line = next(x for x in deep.stdout.splitlines() if "profiles:" in x)
    assert "2 of 2 profiles damaged" in line and "testchat-bob" in line, line

    for who in ("ann", "bob"):
        repaired = await cli("profiles", "repair", f"testchat-{who}", "-c", str(conf))
        assert repaired.returncode == 0, repaired.stderr
    ok, detail = check_profiles(cfg, deep=True)
    assert ok, detail
    journal = {r["uid"] for r in journal_records(bob.parent) if r.get("type") == "message"}
    assert len(journal) > 5 and db_uids(bob.parent) == journal  # rebuilt from the journal, whole
    again = await cli("profiles", "repair", "testchat-bob", "-c", str(conf))
    assert again.returncode == 0 and "not damaged" in again.stdout


async def test_backup_keeps_a_damaged_profile_as_found_and_export_says_to_repair_it_first(
    tmp_path, config_for, fake_llm
):
    cfg = config_for(limits=LIMITS)
    conf = write_config(tmp_path / "hermes.yaml", cfg)
    adapter = RecordingAdapter()
    app = build_gateway(cfg, [adapter])
    await app.start()
    try:
        for who in ("ann", "bob"):
            await adapter.sink(dm(who, f"hello from {who}"))
            assert await app.drain(10)
    finally:
        await app.stop()
    damage_header(tenant_dir(cfg.data_dir, "testchat-ann"))
    backup = await cli("backup", str(tmp_path / "backups"), "-c", str(conf))
    assert backup.returncode == 0, backup.stderr
    assert "testchat-ann is damaged and copied as found" in backup.stdout
    exported = await cli("profiles", "export", "testchat-ann", "-o", str(tmp_path), "-c", str(conf))
    assert exported.returncode == 1 and "Traceback" not in exported.stderr
    assert "profiles repair testchat-ann" in exported.stderr, exported.stderr


async def test_a_held_lane_does_not_hold_up_a_stop_and_its_message_is_answered_after_the_restart(
    tmp_path, config_for, fake_llm
):
    cfg = config_for(limits=LIMITS)  # the default backoff: up to a minute between tries
    conf = write_config(tmp_path / "hermes.yaml", cfg)
    adapter = RecordingAdapter()
    app = build_gateway(cfg, [adapter])
    await app.start()
    ann = tenant_dir(cfg.data_dir, "testchat-ann")
    try:
        await adapter.sink(dm("ann", "hello"))
        assert await app.drain(10)
        assert await app.profiles.evict("testchat-ann")
        damage_header(ann)
        await adapter.sink(dm("ann", "still there?"))
        await wait_until(lambda: HELD in adapter.texts())
    finally:
        started = asyncio.get_running_loop().time()
        await app.stop()
        stopped_in = asyncio.get_running_loop().time() - started
    assert stopped_in < 5, f"stop waited {stopped_in:.1f} s for a lane that cannot be answered"
    assert await_statuses(cfg.data_dir)[-1] == ("dm-ann", "pending")
    repaired = await cli("profiles", "repair", "testchat-ann", "-c", str(conf))
    assert repaired.returncode == 0, repaired.stderr
    adapter = RecordingAdapter()
    app = build_gateway(cfg, [adapter])
    await app.start()
    try:
        await wait_until(lambda: "ok: still there?" in adapter.texts())
        assert await app.drain(10)
    finally:
        await app.stop()
    assert [s for _, s in await_statuses(cfg.data_dir)] == ["done", "done"]
