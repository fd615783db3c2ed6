"""A gateway process killed with SIGKILL mid-burst, then restarted: journal and SQLite
agree, and every message that got a reply is stored with its reply."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import sys
from pathlib import Path

import yaml

from tests.statedb import open_state_db

ROOT = Path(__file__).resolve().parents[1]


def journal_uids(profile: Path) -> set[str]:
    uids = set()
    for path in (profile / "sessions").glob("*.jsonl"):
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # a torn last line is repaired when the profile opens
            if rec.get("type") == "message":
                uids.add(rec["uid"])
    return uids


def db_messages(profile: Path) -> dict[str, tuple[str, str]]:
    con = open_state_db(profile / "state.db")
    try:
        return {uid: (role, content) for uid, role, content in con.execute("SELECT uid, role, content FROM messages")}
    finally:
        con.close()


async def run_gateway(config: Path, n: int, *, kill_after_replies: int | None) -> list[str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tests.fakes.burst_gateway",
        str(config),
        str(n),
        cwd=ROOT,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    replies: list[str] = []
    assert proc.stdout is not None
    try:
        while True:
            line = await asyncio.wait_for(proc.stdout.readline(), 60)
            if not line:
                break
            text = line.decode().rstrip("\n")
            if text.startswith("SENT "):
                replies.append(text.split(" ", 2)[2])
                if kill_after_replies is not None and len(replies) >= kill_after_replies:
                    # what it printed before the kill is in the pipe still: those replies
                    # reached the "platform" and are read on (until EOF) like the others
                    proc.send_signal(signal.SIGKILL)
                    kill_after_replies = None
    finally:
        await proc.wait()
    return replies


async def test_sigkill_mid_burst_then_restart_loses_nothing(tmp_path, fake_llm):
    rng = random.Random(3)

    async def slowish(request):
        await asyncio.sleep(rng.random() * 0.03)
        return None  # the default "ok: <text>"

    fake_llm.responder = slowish
    config = tmp_path / "gw.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "data_dir": str(tmp_path / "data"),
                "llm": {"base_url": fake_llm.base_url, "model": "fake", "max_retries": 0},
                "storage": {"fsync": "batch"},
                # queue: one answer per message, so every message's answer can be checked
                "limits": {"rate_limit_per_minute": 1000, "max_queued_turns": 100, "busy_mode": "queue"},
            }
        )
    )
    n = 60
    first = await run_gateway(config, n, kill_after_replies=15)
    assert len(first) >= 15
    second = await run_gateway(config, n, kill_after_replies=None)

    profiles = sorted((tmp_path / "data" / "profiles").iterdir())
    assert len(profiles) == 5
    stored: dict[str, tuple[str, str]] = {}
    for profile in profiles:
        db = db_messages(profile)
        assert journal_uids(profile) == set(db), f"journal and SQLite differ in {profile.name}"
        stored.update(db)
    contents = [content for role, content in stored.values()]
    users = [c for r, c in stored.values() if r == "user"]
    for reply in first + second:
        assert reply.startswith("ok: burst-")
        asked = reply[len("ok: ") :]
        assert asked in users, f"{asked} got a reply but is not stored"
        assert reply in contents, f"reply {reply!r} was sent but not stored"
    # every message of the burst was stored exactly once and answered at least once
    assert sorted(users) == sorted(f"burst-{i}" for i in range(n))
    answered = {r[len("ok: ") :] for r in first + second}
    assert answered == {f"burst-{i}" for i in range(n)}
