"""Faults injected for real: a full disk (a small tmpfs), gateway.db locked by another
writer beyond the busy timeout, a flapping model endpoint. Each is answered with a clear
message, loses nothing, writes nothing half, and passes by itself when the fault does."""

from __future__ import annotations

import asyncio
import errno
import os
import sqlite3
import subprocess
from contextlib import contextmanager
from pathlib import Path

import pytest

from gateway.build import build_gateway
from tests.conftest import RecordingAdapter, dm, say
from tests.fakes.llm import disconnect, error, memory_saving_responder, reply
from tests.statedb import integrity_of
from tests.test_crash_recovery import db_messages, journal_uids

# long answers stay one message here: these tests write more than the disk's slack in one turn
FAST = {"retry_initial_s": 0.05, "retry_max_s": 0.2, "max_reply_chars": 50_000}
NOTICE = "I can't save anything right now"


@contextmanager
def small_disk(path: Path, size: str = "4m"):
    """A real filesystem of `size` at `path` (tmpfs; needs root, else the test is skipped)."""
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def fill(disk: Path) -> Path:
    """Fill `disk` until the kernel answers ENOSPC; returns the filler file."""
    filler = disk / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:
        for size in (65536, 512, 1):  # down to the last byte
            try:
                while True:
                    os.write(fd, b"\0" * size)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC
    finally:
        os.close(fd)
    return filler


def free(disk: Path) -> None:
    (disk / "filler").unlink()


async def wait_until(predicate, timeout: float = 20) -> None:
    async def poll() -> None:
        while not predicate():
            await asyncio.sleep(0.02)

    await asyncio.wait_for(poll(), timeout)


def consistent(data: Path) -> None:
    for profile in (data / "profiles").iterdir():
        if (profile / "state.db").exists():
            assert journal_uids(profile) == set(db_messages(profile)), f"journal and SQLite differ in {profile.name}"
    for db in data.rglob("*.db"):
        assert integrity_of(db) == "ok", db


async def test_disk_full_while_storing_a_turn_is_told_then_answered_when_space_returns(tmp_path, config_for, fake_llm):
    data = tmp_path / "data"
    with small_disk(data / "profiles") as disk:
        adapter = RecordingAdapter(max_message_length=30000)
        app = build_gateway(config_for(delivery=FAST), [adapter])
        await app.start()
        try:
            assert await say(app, adapter, dm("ann", "hello")) == ["ok: hello"]
            fill(disk)
            long = "second " + "x" * 12000  # more than any slack left in a page
            await adapter.sink(dm("ann", long))
            await wait_until(lambda: any(NOTICE in t for t in adapter.texts()))
            consistent(data)  # nothing half-written while the disk is full
            assert await app.inbox.db.execute_fetchall("SELECT status FROM inbound ORDER BY received_at") == [
                ("done",),
                ("pending",),
            ]
            free(disk)
            await wait_until(lambda: any(t.startswith("ok: second") for t in adapter.texts()))
            assert await app.drain(20)
        finally:
            await app.stop()
        texts = adapter.texts()
        assert texts[0] == "ok: hello" and NOTICE in texts[1] and "disk full" in texts[1]
        assert [t for t in texts if t.startswith("ok: second")] == [f"ok: {long}"[: len(texts[2])]]
        assert len(texts) == 3
        consistent(data)


async def test_disk_full_while_writing_memory_leaves_the_memory_file_whole(tmp_path, config_for, fake_llm):
    data = tmp_path / "data"
    with small_disk(data / "profiles") as disk:
        adapter = RecordingAdapter(max_message_length=30000)
        app = build_gateway(config_for(delivery=FAST), [adapter])
        await app.start()
        try:
            fake_llm.responder = memory_saving_responder
            await say(app, adapter, dm("ann", "remember that the tea is green"))
            mem = next((data / "profiles").glob("*/memories/MEMORY.md"))
            before = mem.read_text()
            assert "tea is green" in before

            def fill_then_save(request):  # the disk fills up while the model decides to save
                if request["messages"][-1]["role"] == "user":
                    fill(disk)
                return memory_saving_responder(request)

            fake_llm.responder = fill_then_save
            await adapter.sink(dm("ann", "remember that the door code is 7777"))
            await wait_until(lambda: any(NOTICE in t for t in adapter.texts()))
            assert mem.read_text() == before  # the old file, whole: never a half-written one
            fake_llm.responder = memory_saving_responder
            free(disk)
            await wait_until(lambda: len(adapter.texts()) >= 3)
            assert await app.drain(20)
        finally:
            await app.stop()
        assert mem.read_text().count("door code") == 1 and "tea is green" in mem.read_text()
        assert adapter.texts()[-1].startswith("done:")
        assert not fake_llm.violations
        consistent(data)


async def test_gateway_db_on_a_full_disk_refuses_intake_then_recovers(tmp_path, config_for, fake_llm):
    data = tmp_path / "data"
    with small_disk(data, size="8m") as disk:
        adapter = RecordingAdapter(max_message_length=30000)
        app = build_gateway(config_for(delivery=FAST), [adapter])
        await app.start()
        try:
            assert await say(app, adapter, dm("bo", "hi")) == ["ok: hi"]
            fill(disk)
            msg = dm("bo", "while full " + "y" * 12000)
            with pytest.raises(sqlite3.OperationalError, match="full"):
                await adapter.sink(msg)  # not acknowledged: the platform delivers it again
            free(disk)
            assert await say(app, adapter, msg) == [f"ok: {msg.text}"]
            assert await say(app, adapter, msg) == []  # the redelivery after that is a duplicate
        finally:
            await app.stop()
        consistent(data)


async def test_gateway_db_locked_beyond_the_busy_timeout_delays_the_answer_and_loses_nothing(config_for, fake_llm):
    adapter = RecordingAdapter(max_message_length=30000)
    app = build_gateway(config_for(delivery=FAST), [adapter])
    await app.start()
    await app.inbox.db.execute("PRAGMA busy_timeout=100")  # the real 5 s, shortened
    other = sqlite3.connect(app.cfg.data_dir / "gateway.db", isolation_level=None, check_same_thread=False)
    try:

        async def lock_then_answer(request):
            other.execute("BEGIN IMMEDIATE")  # another writer holds gateway.db from now on
            return reply("the answer")

        fake_llm.responder = lock_then_answer
        await adapter.sink(dm("cy", "question"))
        await wait_until(lambda: any(NOTICE in t for t in adapter.texts()))
        assert "database locked" in adapter.texts()[0]
        other.execute("COMMIT")
        fake_llm.responder = None
        await wait_until(lambda: "the answer" in adapter.texts())
        assert await app.drain(20)
        assert adapter.texts().count("the answer") == 1
        assert len(fake_llm.requests) == 1  # the stored answer was recorded again, not asked again
        rows = await app.inbox.db.execute_fetchall("SELECT status FROM inbound")
        assert rows == [("done",)]
    finally:
        if other.in_transaction:
            other.execute("ROLLBACK")
        other.close()
        await app.stop()


async def test_flapping_model_endpoint_is_ridden_out_and_an_outage_is_told_without_losing_the_message(
    config_for, fake_llm
):
    adapter = RecordingAdapter(max_message_length=30000)
    app = build_gateway(config_for(llm={"max_retries": 3}, delivery=FAST), [adapter])
    await app.start()
    try:
        fake_llm.script(
            error(500, "boom"), error(429, "slow", headers={"Retry-After": "0.1"}), disconnect(), reply("steady again")
        )
        assert await say(app, adapter, dm("di", "are you there")) == ["steady again"]
        fake_llm.script(*[error(503, "down")] * 4)  # every retry of one call: an outage
        out = await say(app, adapter, dm("di", "my plant is called Fern"))
        # told once that the answer waits, then answered when the model is back
        assert len(out) == 2 and "Fern" not in out[0] and "I'll answer as soon as it is back" in out[0]
        assert out[1] == "ok: my plant is called Fern"
        n = len(fake_llm.requests)
        await say(app, adapter, dm("di", "what is my plant called?"))
        assert "my plant is called Fern" in str(fake_llm.requests[n]["messages"])  # the input was kept
    finally:
        await app.stop()
