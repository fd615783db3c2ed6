"""A profile's state.db written through the store (APSW) reads with the stdlib `sqlite3`,
what the Hermes CLI uses: every table's rows and PRAGMA integrity_check, after a clean
close and after a process killed with its WAL left behind (docs/concepts.md#session-storage)."""

from __future__ import annotations

import json
import signal
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from agent.messages import StoredMessage
from agent.sessions import SessionStore
from agent.sessions import db as session_db
from agent.sessions.codec import row_msg
from tests.statedb import open_state_db

REPO = Path(__file__).resolve().parent.parent
TABLES = ("meta", "sessions", "messages", "routes", "journal_offsets", "compression_state")


async def fill(profile: Path) -> dict[str, Any]:
    """Write every kind of row the store writes; returns the export and each table's rows
    as the store's own connection sees them."""
    async with SessionStore(profile) as s:
        sid, _ = await s.get_or_start("dm:ann", source="telegram", user_id="ann", model="m1")
        sent = [
            StoredMessage(sid, "system", "You are helpful."),
            StoredMessage(sid, "user", "what is the capital of portugal"),
            StoredMessage(
                sid,
                "assistant",
                "",
                tool_calls=[{"id": "c1", "type": "function", "function": {"name": "look", "arguments": "{}"}}],
            ),
            StoredMessage(sid, "tool", "lisbon", tool_call_id="c1", tool_name="look", meta={"k": [1, 2]}),
            StoredMessage(sid, "assistant", "Lisbon ☃ is the capital", token_count=7, finish_reason="stop"),
        ]
        await s.append_many(sent)
        await s.add_usage(sid, 120, 30)
        await s.set_compression_state(sid, {"streak": 2, "cooldown": [1, 2]})
        summary = StoredMessage(sid, "user", "summary: portugal", meta={"compressed_summary": True})
        await s.compact(sid, [sent[1].uid, sent[2].uid], [summary])
        await s.increment_compressions(sid)
        await s.set_summary(sid, "talked about portugal")
        await s.append(StoredMessage(sid, "user", "and spain"))
        assert await s.undo_last_turn(sid) == 1
        child = await s.rotate("dm:ann", sid, "reset")
        await s.append(StoredMessage(child, "user", "a fresh start with a needle"))
        other = await s.start_session("dm:other", route=False)
        await s.end_session(other, "done")
        assert [h["uid"] for h in await s.search("needle")]
        export = await s.export()
        tables = await s._call(lambda c: {t: c.db.execute(f"SELECT * FROM {t} ORDER BY 1").fetchall() for t in TABLES})
    return {"export": export, "tables": tables}


def stdlib_rows(path: Path, uri_ro: bool = False) -> dict[str, Any]:
    """Every table and the FTS index as the stdlib reads them, with integrity_check."""
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True) if uri_ro else sqlite3.connect(path)
    try:
        out: dict[str, Any] = {
            "integrity": conn.execute("PRAGMA integrity_check").fetchone()[0],
            "tables": {t: conn.execute(f"SELECT * FROM {t} ORDER BY 1").fetchall() for t in TABLES},
            "fts": [
                r[0]
                for r in conn.execute(
                    "SELECT m.uid FROM messages_fts JOIN messages m ON m.id = messages_fts.rowid "
                    "WHERE messages_fts MATCH ? ORDER BY m.id",
                    ('"needle"',),
                )
            ],
            "messages": [
                row_msg(r).to_json()
                for r in conn.execute(f"SELECT {session_db.MSG_COLS} FROM messages ORDER BY id").fetchall()
            ],
        }
        if not uri_ro:  # FTS5's own check of the index against the messages (raises if they differ)
            conn.execute("INSERT INTO messages_fts(messages_fts) VALUES ('integrity-check')")
    finally:
        conn.close()
    return out


async def test_every_table_the_store_writes_reads_the_same_with_the_stdlib(tmp_path: Path) -> None:
    profile = tmp_path / "p"
    written = await fill(profile)
    assert (profile / "state.db-wal").exists()  # a close leaves the WAL: no checkpoint, no fsync
    read = stdlib_rows(profile / "state.db", uri_ro=True)
    assert read["integrity"] == "ok"
    assert read["tables"] == {t: [tuple(r) for r in rows] for t, rows in written["tables"].items()}
    assert all(read["tables"][t] for t in TABLES), "every table holds rows"
    exported = [m for s in written["export"]["sessions"] for m in s["messages"]]
    assert sorted(read["messages"], key=lambda m: m["uid"]) == sorted(exported, key=lambda m: m["uid"])
    needle = [m["uid"] for m in exported if "needle" in (m["content"] or "")]
    assert read["fts"] == needle
    # a stdlib writer's close checkpoints; the store then opens it as it left it
    assert stdlib_rows(profile / "state.db")["integrity"] == "ok"
    async with SessionStore(profile) as s:
        assert (await s.export())["sessions"] == written["export"]["sessions"]


KILLED = textwrap.dedent(
    """
    import asyncio, os, signal, sys
    sys.path.insert(0, {repo!r})
    from agent.messages import StoredMessage
    from agent.sessions import SessionStore

    async def main():
        s = await SessionStore({profile!r}, "batch").open()
        sid, _ = await s.get_or_start("dm:ann")
        for i in range(40):
            await s.append(StoredMessage(sid, "user", f"message {{i}} with a needle"))
        await s.set_compression_state(sid, {{"streak": 1}})
        await s.append(StoredMessage(sid, "assistant", "last"))
        os.kill(os.getpid(), signal.SIGKILL)  # no close, no checkpoint

    asyncio.run(main())
    """
)


async def test_a_killed_process_leaves_a_wal_the_stdlib_reads_whole(tmp_path: Path) -> None:
    profile = tmp_path / "p"
    proc = subprocess.run(
        [sys.executable, "-c", KILLED.format(repo=str(REPO), profile=str(profile))], capture_output=True, timeout=60
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()
    assert (profile / "state.db-wal").stat().st_size > 0
    read = stdlib_rows(profile / "state.db", uri_ro=True)
    assert read["integrity"] == "ok"
    contents = [m["content"] for m in read["messages"]]
    assert contents == [f"message {i} with a needle" for i in range(40)] + ["last"]
    assert len(read["fts"]) == 40
    assert [json.loads(r[1]) for r in read["tables"]["compression_state"]] == [{"streak": 1}]
    async with SessionStore(profile) as s:  # and the store reopens it with nothing lost
        sid = await s.route("dm:ann")
        assert sid is not None
        assert [m.content for m in await s.history(sid)] == contents


async def test_the_wal_a_close_leaves_stays_bounded_however_much_is_written(tmp_path: Path) -> None:
    profile = tmp_path / "p"
    for _ in range(4):  # open, write ~1 MiB, close without a checkpoint, again
        async with SessionStore(profile, "never") as s:
            sid, _ = await s.get_or_start("dm:ann")
            for i in range(100):
                await s.append(StoredMessage(sid, "user", f"turn {i} " + "word " * 400))
        limit = session_db.WAL_SIZE_LIMIT + session_db.WAL_AUTOCHECKPOINT_PAGES * 4096 // 4
        assert (profile / "state.db-wal").stat().st_size <= limit
    assert stdlib_rows(profile / "state.db")["integrity"] == "ok"


def test_the_suite_refuses_a_stdlib_open_of_a_state_db_apsw_holds(tmp_path: Path) -> None:
    """Two SQLite libraries on one file in one process drop each other's locks (a bus error
    when the stdlib's close cuts APSW's -shm): the guard says so at the open instead."""
    path = tmp_path / "state.db"
    held = open_state_db(path)
    try:
        held.execute("CREATE TABLE t(x)")
        with pytest.raises(RuntimeError, match="one SQLite library per file"):
            sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    finally:
        held.close()
    sqlite3.connect(path).close()  # once APSW has let go, the stdlib may read it
