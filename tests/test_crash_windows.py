"""SIGKILL in the storage windows the pooled store added: between a turn's two storage
calls (user message stored, answer not yet), and while the group syncer is fsyncing.
After a restart, journal and SQLite agree and nothing that was acknowledged is lost."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import yaml

from agent.sessions import SessionStore
from tests.test_crash_recovery import ROOT, db_messages, journal_uids, run_gateway


async def test_sigkill_between_the_user_message_call_and_the_answer_call(tmp_path, fake_llm):
    asked = asyncio.Event()
    release = asyncio.Event()

    async def hang_on_seven(request):
        last = request["messages"][-1].get("content") or ""
        if last == "burst-7" and not release.is_set():
            asked.set()  # the gateway is inside the turn: user message stored, answer pending
            await asyncio.sleep(3600)
        return None

    fake_llm.responder = hang_on_seven
    config = tmp_path / "gw.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "data_dir": str(tmp_path / "data"),
                "llm": {"base_url": fake_llm.base_url, "model": "fake", "max_retries": 0, "timeout_s": 3600},
                "storage": {"fsync": "batch"},
                "limits": {"rate_limit_per_minute": 1000, "max_queued_turns": 100},
            }
        )
    )
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tests.fakes.burst_gateway",
        str(config),
        "10",
        cwd=ROOT,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        await asyncio.wait_for(asked.wait(), 60)
    finally:
        proc.send_signal(signal.SIGKILL)
        await proc.wait()
    profile = tmp_path / "data" / "profiles"
    stored = {uid: rc for p in profile.iterdir() for uid, rc in db_messages(p).items()}
    assert ("user", "burst-7") in stored.values()  # the first call committed before the model was asked
    assert ("assistant", "ok: burst-7") not in stored.values()

    release.set()
    replies = await run_gateway(config, 10, kill_after_replies=None)
    assert "ok: burst-7" in replies
    everything: dict[str, tuple[str, str]] = {}
    for p in sorted(profile.iterdir()):
        db = db_messages(p)
        assert journal_uids(p) == set(db), f"journal and SQLite differ in {p.name}"
        everything.update(db)
    users = sorted(c for r, c in everything.values() if r == "user")
    assert users == sorted(f"burst-{i}" for i in range(10))  # burst-7 stored once, not twice
    assert [c for r, c in everything.values() if r == "assistant"].count("ok: burst-7") == 1


async def test_sigkill_during_a_group_commit_loses_no_acknowledged_message(tmp_path: Path):
    profile = tmp_path / "profiles" / "t"
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tests.fakes.store_writer",
        str(profile),
        cwd=ROOT,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    acknowledged: list[str] = []
    fsyncs = 0
    assert proc.stdout is not None
    try:
        while True:
            line = (await asyncio.wait_for(proc.stdout.readline(), 60)).decode()
            assert line, "the writer died on its own"
            if line.startswith("STORED "):
                acknowledged += line.split()[1:]
            elif line.startswith("FSYNC"):
                fsyncs += 1
                if fsyncs >= 3 and len(acknowledged) >= 20:
                    break  # the syncer is stalled inside fsync right now
    finally:
        proc.send_signal(signal.SIGKILL)
        await proc.wait()
    async with SessionStore(profile) as store:  # reconciles journal and state.db
        sessions = await store.list_sessions()
        assert len(sessions) == 3
        assert sum(s["input_tokens"] for s in sessions) > 0  # usage rode along with the answers
    db = db_messages(profile)
    assert journal_uids(profile) == set(db)
    assert set(acknowledged) <= set(db)
