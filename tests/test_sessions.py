"""SessionStore: JSONL journal + SQLite dual write, reconciliation, search, isolation."""

from __future__ import annotations

import asyncio
import errno
import json
import os
import sqlite3
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import apsw
import pytest

import agent.sessions as sessions_mod
import agent.sessions.db as session_db
import agent.sessions.journal as journal_mod
from agent.messages import StoredMessage
from agent.sessions import (
    DatabaseWriteError,
    JournalWriteError,
    SessionStore,
    SessionStoreError,
    StaleRouteError,
    UnknownSessionError,
)
from agent.sessions.codec import msg_row
from agent.sessions.journal import Journal
from tests.statedb import open_state_db

ODD = (
    "héllo 🌍 e\u0301 \u200b zero-width, \u202eRTL\u202c עברית العربية 𝔘𝔫𝔦"
    ' \x00 nul \t tab \\ " quote'
    " \u2028 ls \u2029 ps \x85 nel \r\n crlf \ufeff bom \U0010ffff"
)


# ---------------------------------------------------------------- helpers


def jpath(profile: Path, sid: str) -> Path:
    return profile / "sessions" / f"{sid}.jsonl"


def jlines(profile: Path, sid: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in jpath(profile, sid).read_text("utf-8").splitlines() if line.strip()]


def journal_uids(profile: Path, *, tolerant: bool = False) -> list[str]:
    """Message uids in every journal; `tolerant` skips garbled lines (the store skips them too)."""
    out: list[str] = []
    for p in sorted((profile / "sessions").glob("*.jsonl")):
        for line in p.read_bytes().split(b"\n"):
            if not line:
                continue
            try:
                d = json.loads(line.decode("utf-8"))
            except ValueError:
                if tolerant:
                    continue
                raise
            if d["type"] == "message":
                out.append(d["uid"])
    return out


@contextmanager
def db(profile: Path) -> Iterator[apsw.Connection]:
    """The profile's state.db in one transaction, closed after (APSW, as the store opens it)."""
    conn = open_state_db(profile / "state.db")
    try:
        with conn:
            yield conn
    finally:
        conn.close()


def db_uids(profile: Path) -> list[str]:
    with db(profile) as c:
        return [r[0] for r in c.execute("SELECT uid FROM messages ORDER BY id")]


async def on_connection(s: SessionStore, what: Any) -> Any:
    """Run SQL (or a function of the connection) on the store's own connection, in its turn."""
    fn = (lambda db: db.execute(what)) if isinstance(what, str) else what
    return await s._call(lambda c: fn(c.db))


def assert_consistent(profile: Path) -> None:
    j, d = journal_uids(profile), db_uids(profile)
    assert len(j) == len(set(j)), "duplicate message lines in the journal"
    assert set(j) == set(d)


def offsets(profile: Path) -> dict[str, int]:
    with db(profile) as c:
        return dict(c.execute('SELECT session_id, "offset" FROM journal_offsets'))


def msgs(sid: str, n: int, role: str = "user", prefix: str = "m") -> list[StoredMessage]:
    return [StoredMessage(session_id=sid, role=role, content=f"{prefix}{i}") for i in range(n)]


@pytest.fixture
def profile(tmp_path: Path) -> Path:
    return tmp_path / "profiles" / "tenant-a"


# ---------------------------------------------------------------- round trip


async def test_round_trip_tool_calls_and_unicode(profile: Path) -> None:
    async with SessionStore(profile) as s:
        sid = await s.start_session("telegram:dm:1", source="telegram", user_id="1", model="m")
        tool_calls = [{"id": "call_1", "type": "function", "function": {"name": "memory", "arguments": '{"a": "ü"}'}}]
        sent = [
            StoredMessage(sid, "system", "you are hermes"),
            StoredMessage(sid, "user", ODD, meta={"platform_msg_id": 42, "nested": [1, {"k": "✓"}]}),
            StoredMessage(sid, "assistant", None, tool_calls=tool_calls, token_count=17, finish_reason="tool_calls"),
            StoredMessage(sid, "tool", '{"ok": true}', tool_call_id="call_1", tool_name="memory"),
            StoredMessage(sid, "assistant", "done ✅", finish_reason="stop"),
        ]
        stored = await s.append_many(sent[:2])
        for m in sent[2:]:
            stored.append(await s.append(m))
        assert [m.to_json() for m in stored] == [m.to_json() for m in sent]
        hist = await s.history(sid)
        assert [m.to_json() for m in hist] == [m.to_json() for m in sent]
        assert hist[2].to_openai()["tool_calls"] == tool_calls
        assert (await s.session_info(sid))["message_count"] == 5
    raw = jpath(profile, sid).read_bytes()
    assert "🌍".encode() in raw and "עברית".encode() in raw  # ensure_ascii=False
    # str.splitlines() also splits on U+2028/U+2029/U+0085: the journal must escape them
    assert len(jlines(profile, sid)) == 1 + len(sent)
    assert_consistent(profile)
    async with SessionStore(profile) as s:
        assert [m.to_json() for m in await s.history(sid)] == [m.to_json() for m in sent]


async def test_journal_line_is_flushed_before_sqlite_insert(profile: Path) -> None:
    seen: list[bool] = []
    async with SessionStore(profile) as s:
        sid = await s.start_session("k")
        path = jpath(profile, sid)

        def peek(uid: str) -> int:
            seen.append(uid in path.read_text("utf-8"))
            return 0

        await on_connection(s, lambda db: db.create_scalar_function("peek", peek, 1))
        await on_connection(s, "CREATE TEMP TRIGGER t AFTER INSERT ON messages BEGIN SELECT peek(new.uid); END")
        await s.append_many(msgs(sid, 3))
    assert seen == [True, True, True]


async def test_lone_surrogates_and_huge_content_round_trip(profile: Path) -> None:
    big = ("abc ☃ " * 180_000)[:1_000_000] + " needle-word"
    async with SessionStore(profile) as s:
        sid = await s.start_session("k")
        stored = await s.append(StoredMessage(sid, "user", "bad \ud800 half, good \U0001f600"))
        assert stored.content == "bad \ufffd half, good \U0001f600"
        await s.append(StoredMessage(sid, "assistant", big))
        hits = await s.search("needle")
        assert [h["session_id"] for h in hits] == [sid]
    async with SessionStore(profile) as s:
        hist = await s.history(sid)
        assert hist[0].content == stored.content
        assert hist[1].content == big
    assert_consistent(profile)


async def test_append_is_idempotent_by_uid(profile: Path) -> None:
    async with SessionStore(profile) as s:
        sid = await s.start_session("k")
        m = StoredMessage(sid, "user", "once")
        await s.append(m)
        await s.append(m)
        await s.append_many([m, m])
        assert len(await s.history(sid)) == 1
        assert (await s.session_info(sid))["message_count"] == 1
    assert journal_uids(profile) == [m.uid]


async def test_bad_session_ids_and_unknown_sessions_refused(profile: Path) -> None:
    async with SessionStore(profile) as s:
        for bad in ("../tenant-b/sessions/x", "a/b", "", ".hidden", "x" * 300):
            with pytest.raises(ValueError):
                await s.append(StoredMessage(bad, "user", "x"))
        with pytest.raises(UnknownSessionError):
            await s.append(StoredMessage("20260101_000000_deadbeef", "user", "x"))
        with pytest.raises(ValueError):
            await s.append(StoredMessage("20260101_000000_deadbeef", "user", "x", meta={"o": object()}))
    assert not (profile.parent / "tenant-b").exists()
    assert db_uids(profile) == []


async def test_second_store_on_same_profile_is_refused(profile: Path) -> None:
    async with SessionStore(profile):
        with pytest.raises(SessionStoreError):
            await SessionStore(profile).open()
    s = SessionStore(profile)  # released on close; an instance can be reopened
    await s.open()
    await s.close()
    await s.open()
    await s.close()
    await s.close()


# ---------------------------------------------------------------- reconciliation


async def test_journal_only_lines_are_reconciled(profile: Path) -> None:
    async with SessionStore(profile) as s:
        sid = await s.start_session("lane")
        await s.append_many(msgs(sid, 2))
    # crash after the journal write, before SQLite commit: lines only in the journal
    extra = msgs(sid, 2, prefix="late")
    with jpath(profile, sid).open("a", encoding="utf-8") as f:
        for m in extra:
            f.write(json.dumps({"type": "message", **m.to_json()}, ensure_ascii=False) + "\n")
        f.write(
            json.dumps(
                {
                    "type": "event",
                    "event": "flags",
                    "uids": [extra[0].uid],
                    "active": False,
                    "compacted": None,
                    "reason": "undo",
                    "ts": 1.0,
                }
            )
            + "\n"
        )
    child = "20260101_000000_0000abcd"
    child_msg = StoredMessage(child, "user", "in child")
    jpath(profile, child).write_text(
        json.dumps(
            {
                "type": "event",
                "event": "session_start",
                "session_id": child,
                "session_key": "lane2",
                "parent_session_id": None,
                "source": "discord",
                "ts": 2.0,
            }
        )
        + "\n"
        + json.dumps({"type": "message", **child_msg.to_json()})
        + "\n",
        "utf-8",
    )
    async with SessionStore(profile) as s:
        assert [m.content for m in await s.history(sid)] == ["m0", "m1", "late1"]
        assert len(await s.history(sid, include_inactive=True)) == 4
        assert (await s.session_info(sid))["message_count"] == 4
        info = await s.session_info(child)
        assert info is not None and info["source"] == "discord" and info["message_count"] == 1
        assert await s.route("lane2") == child
        assert await s.route("lane") == sid
    assert_consistent(profile)
    assert offsets(profile)[sid] == jpath(profile, sid).stat().st_size


async def test_torn_last_line_is_truncated(profile: Path) -> None:
    async with SessionStore(profile) as s:
        sid = await s.start_session("k")
        await s.append_many(msgs(sid, 2))
    path = jpath(profile, sid)
    good = path.read_bytes()
    whole = StoredMessage(sid, "user", "complete")
    with path.open("ab") as f:
        f.write((json.dumps({"type": "message", **whole.to_json()}) + "\n").encode())
        f.write(b'{"type":"message","uid":"torn-uid","session_id":"' + sid.encode() + b'","content":"hal')
    async with SessionStore(profile) as s:
        assert [m.content for m in await s.history(sid)] == ["m0", "m1", "complete"]
        assert path.read_bytes().endswith(b"\n")
        assert b"torn-uid" not in path.read_bytes()
        assert path.read_bytes().startswith(good)
        await s.append(StoredMessage(sid, "user", "after"))
    assert_consistent(profile)
    async with SessionStore(profile) as s:
        assert [m.content for m in await s.history(sid)] == ["m0", "m1", "complete", "after"]


async def test_garbled_middle_line_is_skipped_not_fatal(profile: Path) -> None:
    async with SessionStore(profile) as s:
        sid = await s.start_session("k")
        await s.append(StoredMessage(sid, "user", "a"))
    later = StoredMessage(sid, "user", "b")
    with jpath(profile, sid).open("ab") as f:
        f.write(b"\xff\xfe not json at all\n")
        f.write((json.dumps({"type": "message", **later.to_json()}) + "\n").encode())
    async with SessionStore(profile) as s:
        assert [m.content for m in await s.history(sid)] == ["a", "b"]
    assert set(db_uids(profile)) == set(journal_uids(profile, tolerant=True))


async def test_rows_deleted_from_sqlite_are_restored(profile: Path) -> None:
    async with SessionStore(profile) as s:
        sid = await s.start_session("k", source="telegram")
        sent = await s.append_many(msgs(sid, 5))
        await s.set_flags([sent[0].uid], compacted=True, reason="compression")
    with db(profile) as c:
        c.execute("DELETE FROM messages WHERE uid IN (?, ?)", (sent[0].uid, sent[3].uid))
    async with SessionStore(profile) as s:
        hist = await s.history(sid, include_inactive=True)
        assert [m.uid for m in hist if m.uid in (sent[0].uid, sent[3].uid)] == [sent[0].uid, sent[3].uid]
        assert next(m for m in hist if m.uid == sent[0].uid).compacted
        assert (await s.search("m3"))[0]["uid"] == sent[3].uid  # FTS re-indexed
    assert_consistent(profile)


async def test_whole_state_db_rebuilt_from_journals(profile: Path) -> None:
    async with SessionStore(profile) as s:
        sid = await s.start_session("lane", source="telegram", user_id="7")
        sent = await s.append_many(msgs(sid, 4))
        await s.set_flags([sent[1].uid], compacted=True, reason="compression")
        await s.undo_last_turn(sid)
        child = await s.rotate("lane", sid, "compression")
        await s.append(StoredMessage(child, "user", "in child"))
        before = await s.export()
    for name in ("state.db", "state.db-wal", "state.db-shm"):
        (profile / name).unlink(missing_ok=True)
    async with SessionStore(profile) as s:
        after = await s.export()
        assert await s.route("lane") == child
    strip = lambda e: [  # noqa: E731
        {k: v for k, v in sess.items() if k not in ("input_tokens", "output_tokens", "compressions", "summary")}
        for sess in e["sessions"]
    ]
    assert strip(after) == strip(before)


async def test_sqlite_only_message_is_journaled_on_open(profile: Path) -> None:
    async with SessionStore(profile) as s:
        sid = await s.start_session("k")
        await s.append_many(msgs(sid, 2))
    orphan = StoredMessage(sid, "assistant", "only in sqlite", tool_calls=[{"id": "c"}])
    with db(profile) as c:
        c.execute(
            f"INSERT INTO messages({session_db.MSG_COLS}) VALUES ({','.join('?' * 13)})",
            msg_row(orphan),
        )
    async with SessionStore(profile) as s:
        pass
    assert orphan.uid in journal_uids(profile)
    assert_consistent(profile)
    line = next(d for d in jlines(profile, sid) if d.get("uid") == orphan.uid)
    assert StoredMessage.from_json(line).to_json() == orphan.to_json()


async def test_journal_that_lost_its_tail_is_refilled(profile: Path) -> None:
    async with SessionStore(profile, fsync="never") as s:
        sid = await s.start_session("k")
        await s.append_many(msgs(sid, 3))
        other = await s.start_session("k2")
        await s.append(StoredMessage(other, "user", "x"))
    # OS crash with fsync=never: the journal lost its last line, the second journal entirely
    path = jpath(profile, sid)
    lines = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(b"".join(lines[:-1]))
    jpath(profile, other).unlink()
    async with SessionStore(profile) as s:
        assert len(await s.history(sid)) == 3
    assert_consistent(profile)
    assert any(d.get("event") == "session_start" for d in jlines(profile, other))
    async with SessionStore(profile) as s:  # stable: nothing re-journaled twice
        pass
    assert_consistent(profile)


async def test_reopen_reads_only_the_journal_tail(profile: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async with SessionStore(profile) as s:
        a = await s.start_session("a")
        b = await s.start_session("b")
        await s.append_many(msgs(a, 20) + msgs(b, 20))
    offs = offsets(profile)
    assert offs == {a: jpath(profile, a).stat().st_size, b: jpath(profile, b).stat().st_size}
    late = StoredMessage(a, "user", "late")
    with jpath(profile, a).open("a", encoding="utf-8") as f:
        f.write(json.dumps({"type": "message", **late.to_json()}) + "\n")

    reads: list[tuple[str, int]] = []
    real = Journal.read

    def spy(path: Path, start: int, *key: Any) -> Any:
        reads.append((Path(path).stem, start))
        return real(path, start, *key)

    monkeypatch.setattr(Journal, "read", staticmethod(spy))
    async with SessionStore(profile) as s:
        assert (await s.history(a))[-1].uid == late.uid
    assert reads == [(a, offs[a])]
    assert offsets(profile)[a] == jpath(profile, a).stat().st_size
    reads.clear()
    async with SessionStore(profile):
        pass
    assert reads == []


# ---------------------------------------------------------------- routes and rotation


async def test_rotate_moves_route_and_parent_keeps_messages(profile: Path) -> None:
    async with SessionStore(profile) as s:
        old = await s.start_session("lane", source="discord", user_id="u", model="gpt")
        sent = await s.append_many(msgs(old, 3))
        new = await s.rotate("lane", old, "compression")
        assert new != old and await s.route("lane") == new
        o, n = await s.session_info(old), await s.session_info(new)
        assert o["ended_at"] is not None and o["end_reason"] == "compression"
        assert n["parent_session_id"] == old and n["ended_at"] is None
        assert (n["source"], n["user_id"], n["model"]) == ("discord", "u", "gpt")
        assert [m.uid for m in await s.history(old)] == [m.uid for m in sent]
        assert await s.history(new) == []
        with pytest.raises(StaleRouteError):
            await s.rotate("lane", old, "again")
    ev = [d["event"] for d in jlines(profile, old) if d["type"] == "event"]
    assert ev == ["session_start", "session_end"]
    assert jlines(profile, new)[0]["parent_session_id"] == old


async def test_rotate_is_atomic_for_readers(profile: Path) -> None:
    bad: list[Any] = []
    stop = threading.Event()
    async with SessionStore(profile) as s:
        sid = await s.start_session("lane")

        def reader() -> int:
            c = open_state_db(profile / "state.db")
            n = 0
            while not stop.is_set():
                row = c.execute(
                    "SELECT r.session_id, s.id, s.ended_at FROM routes r LEFT JOIN sessions s "
                    "ON s.id = r.session_id WHERE r.session_key='lane'"
                ).fetchone()
                if row is None or row[1] is None or row[2] is not None:
                    bad.append(row)
                n += 1
            c.close()
            return n

        t = asyncio.create_task(asyncio.to_thread(reader))
        for i in range(60):
            await s.append(StoredMessage(sid, "user", f"turn {i}"))
            sid = await s.rotate("lane", sid, "reset")
            assert await s.route("lane") == sid
        stop.set()
        assert await t > 0
    assert bad == []


async def test_concurrent_rotations_of_one_lane_cannot_fork_it(profile: Path) -> None:
    async with SessionStore(profile) as s:
        sid = await s.start_session("lane")
        results = await asyncio.gather(
            *(s.rotate("lane", sid, "compression") for _ in range(5)), return_exceptions=True
        )
        ok = [r for r in results if isinstance(r, str)]
        assert len(ok) == 1 and all(isinstance(r, StaleRouteError) for r in results if not isinstance(r, str))
        assert await s.route("lane") == ok[0]


async def test_crash_mid_rotate_is_replayed_with_route(profile: Path) -> None:
    async with SessionStore(profile) as s:
        old = await s.start_session("lane")
    child = "20270101_000000_00c0ffee"
    with jpath(profile, old).open("a") as f:
        f.write(
            json.dumps({"type": "event", "event": "session_end", "session_id": old, "reason": "compression", "ts": 5.0})
            + "\n"
        )
    jpath(profile, child).write_text(
        json.dumps(
            {
                "type": "event",
                "event": "session_start",
                "session_id": child,
                "session_key": "lane",
                "parent_session_id": old,
                "source": "",
                "route": True,
                "ts": 5.0,
            }
        )
        + "\n"
    )
    async with SessionStore(profile) as s:
        assert await s.route("lane") == child
        assert (await s.session_info(old))["ended_at"] == 5.0


async def test_get_or_start_and_end_session(profile: Path) -> None:
    async with SessionStore(profile) as s:
        assert await s.route("k") is None
        sid, created = await s.get_or_start("k", source="console")
        assert created
        assert await s.get_or_start("k") == (sid, False)
        got = await asyncio.gather(*(s.get_or_start("k2") for _ in range(10)))
        assert len({g[0] for g in got}) == 1 and sum(g[1] for g in got) == 1
        await s.end_session(sid, "user_reset")
        await s.end_session(sid, "twice is a no-op")
        assert (await s.session_info(sid))["end_reason"] == "user_reset"
        assert await s.route("k") is None
        sid2, created = await s.get_or_start("k")
        assert created and sid2 != sid
        unrouted = await s.start_session("k", route=False)
        assert await s.route("k") == sid2 != unrouted


# ---------------------------------------------------------------- flags, search, export


async def test_compacted_hidden_from_history_but_searchable_and_exported(profile: Path) -> None:
    async with SessionStore(profile) as s:
        sid = await s.start_session("k")
        old = await s.append_many(
            [
                StoredMessage(sid, "user", "the platypus lives in rivers"),
                StoredMessage(sid, "assistant", "indeed, platypus facts"),
            ]
        )
        summary = await s.append(StoredMessage(sid, "user", "[summary] animals discussed"))
        assert await s.set_flags([m.uid for m in old], compacted=True, reason="compression") == 2
        assert [m.uid for m in await s.history(sid)] == [summary.uid]
        assert len(await s.history(sid, include_inactive=True)) == 3
        hits = await s.search("platypus")
        assert {h["uid"] for h in hits} == {m.uid for m in old}
        assert all(h["compacted"] and ">>>platypus<<<" in h["snippet"] for h in hits)
        exported = await s.export()
        json.dumps(exported)
        (sess,) = exported["sessions"]
        assert [m["uid"] for m in sess["messages"]] == [old[0].uid, old[1].uid, summary.uid]
        assert sess["messages"][0]["compacted"] is True
    flags = [d for d in jlines(profile, sid) if d.get("event") == "flags"]
    assert flags[0]["compacted"] is True and flags[0]["active"] is None and flags[0]["reason"] == "compression"


async def test_undo_last_turn(profile: Path) -> None:
    async with SessionStore(profile) as s:
        sid = await s.start_session("k")
        await s.append_many(
            [
                StoredMessage(sid, "user", "q1"),
                StoredMessage(sid, "assistant", "a1"),
                StoredMessage(sid, "user", "q2"),
                StoredMessage(sid, "assistant", None, tool_calls=[{"id": "c"}]),
                StoredMessage(sid, "tool", "r", tool_call_id="c"),
                StoredMessage(sid, "assistant", "a2"),
            ]
        )
        assert await s.undo_last_turn(sid) == 4
        assert [m.content for m in await s.history(sid)] == ["q1", "a1"]
        assert await s.undo_last_turn(sid) == 2
        assert await s.undo_last_turn(sid) == 0
        assert len(await s.search("q2")) == 1  # originals stay searchable
    async with SessionStore(profile) as s:
        assert await s.history(sid) == []


@pytest.mark.parametrize(
    "query",
    [
        '"',
        "*",
        "NEAR(",
        "AND OR",
        "AND",
        "OR",
        "NOT",
        "(",
        ")",
        "-x",
        "^",
        "col:val",
        'a"b',
        "''",
        "{a b}",
        "NEAR(a b, 2)",
        "\x00",
        "💥",
        "   ",
        "",
        "a" * 5000,
        " ".join(["x"] * 500),
        "foo*",
        "content: x",
    ],
)
async def test_search_survives_hostile_fts_syntax(profile: Path, query: str) -> None:
    async with SessionStore(profile) as s:
        sid = await s.start_session("k")
        await s.append(StoredMessage(sid, "user", "meet me NEAR the station AND bring foo"))
        hits = await s.search(query)
        assert isinstance(hits, list)
        if query.strip() in ("NEAR(", "AND", "foo*"):
            assert [h["session_id"] for h in hits] == [sid]


async def test_search_ranking_limit_and_or_fallback(profile: Path) -> None:
    async with SessionStore(profile) as s:
        sid = await s.start_session("k")
        await s.append_many([StoredMessage(sid, "user", f"zebra number {i}") for i in range(30)])
        await s.append(StoredMessage(sid, "user", "giraffe only"))
        assert len(await s.search("zebra", limit=5)) == 5
        assert len(await s.search("zebra", limit=10_000)) == 30
        assert [h["role"] for h in await s.search("giraffe unicorn")] == ["user"]  # OR fallback
        assert await s.search("unicorn") == []


async def test_two_stores_never_see_each_other(tmp_path: Path) -> None:
    a_dir, b_dir = tmp_path / "a", tmp_path / "b"
    async with SessionStore(a_dir) as a, SessionStore(b_dir) as b:
        sa = await a.start_session("same-key")
        sb = await b.start_session("same-key")
        await a.append(StoredMessage(sa, "user", "secret alpha shared-word"))
        await b.append(StoredMessage(sb, "user", "secret beta shared-word"))
        assert [h["uid"] for h in await a.search("shared-word")] == [(await a.history(sa))[0].uid]
        assert [h["session_id"] for h in await b.search("shared-word")] == [sb]
        assert await a.search("beta") == [] and await b.search("alpha") == []
        assert await a.history(sb) == [] and await b.history(sa) == []
        assert await a.route("same-key") == sa and await b.route("same-key") == sb
        with pytest.raises(UnknownSessionError):
            await a.append(StoredMessage(sb, "user", "cross-tenant write"))
        assert [x["id"] for x in await a.list_sessions()] == [sa]
        assert "beta" not in json.dumps(await a.export())
    assert os.listdir(a_dir / "sessions") != os.listdir(b_dir / "sessions")


# ---------------------------------------------------------------- concurrency and durability


async def test_concurrent_appends_keep_order_and_count(profile: Path) -> None:
    async with SessionStore(profile) as s:
        sid = await s.start_session("lane-1")
        other = await s.start_session("lane-2")

        async def writer(w: int, target: str) -> None:
            for i in range(25):
                await s.append(StoredMessage(target, "user", f"w{w} #{i}", meta={"w": w, "i": i}))
                if i % 7 == 0:
                    await asyncio.sleep(0)

        async def rotator() -> None:
            cur = other
            for _ in range(5):
                cur = await s.rotate("lane-2", cur, "compression")
                await s.append(StoredMessage(cur, "assistant", "rotated"))

        await asyncio.gather(*(writer(w, sid) for w in range(20)), rotator())
        hist = await s.history(sid)
        assert len(hist) == 500 and (await s.session_info(sid))["message_count"] == 500
        for w in range(20):
            assert [m.meta["i"] for m in hist if m.meta["w"] == w] == list(range(25))
    journal_order = [d["uid"] for d in jlines(profile, sid) if d["type"] == "message"]
    assert journal_order == [m.uid for m in hist]
    assert_consistent(profile)


async def test_cancelled_writers_leave_both_sides_consistent(profile: Path) -> None:
    async with SessionStore(profile) as s:
        sid = await s.start_session("k")
        tasks = [asyncio.create_task(s.append(StoredMessage(sid, "user", f"c{i}"))) for i in range(40)]
        await asyncio.sleep(0)
        for t in tasks[::2]:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.sleep(0.05)
        live = {m.uid for m in await s.history(sid)}
    assert set(journal_uids(profile)) == set(db_uids(profile)) == live


async def test_disk_full_on_journal_write(profile: Path) -> None:
    async with SessionStore(profile) as s:
        sid = await s.start_session("k")
        await s.append(StoredMessage(sid, "user", "before"))
        size = jpath(profile, sid).stat().st_size
        real = s._journal._write_fd

        def full_disk(fd: int, data: memoryview) -> int:
            os.write(fd, data[: len(data) // 2])  # a torn half line reaches the file
            raise OSError(errno.ENOSPC, "No space left on device")

        s._journal._write_fd = full_disk  # type: ignore[method-assign]
        with pytest.raises(JournalWriteError, match="No space left"):
            await s.append(StoredMessage(sid, "user", "lost"))
        with pytest.raises(JournalWriteError):
            await s.rotate("k", sid, "compression")
        assert jpath(profile, sid).stat().st_size == size
        assert [m.content for m in await s.history(sid)] == ["before"]
        assert await s.route("k") == sid
        s._journal._write_fd = real  # type: ignore[method-assign]
        await s.append(StoredMessage(sid, "user", "after"))
    assert_consistent(profile)
    async with SessionStore(profile) as s:
        assert [m.content for m in await s.history(sid)] == ["before", "after"]


async def test_disk_full_when_truncate_also_fails(profile: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async with SessionStore(profile) as s:
        sid = await s.start_session("k")

        def full_disk(fd: int, data: memoryview) -> int:
            os.write(fd, data[:10])
            raise OSError(errno.ENOSPC, "No space left on device")

        def no_truncate(*a: Any) -> None:
            raise OSError(errno.EIO, "io error")

        s._journal._write_fd = full_disk  # type: ignore[method-assign]
        monkeypatch.setattr(journal_mod.os, "ftruncate", no_truncate)
        with pytest.raises(JournalWriteError):
            await s.append(StoredMessage(sid, "user", "lost"))
        monkeypatch.undo()
        del s._journal._write_fd
        await s.append(StoredMessage(sid, "user", "after"))  # must start on a fresh line
    async with SessionStore(profile) as s:
        assert [m.content for m in await s.history(sid)] == ["after"]
    assert set(journal_uids(profile, tolerant=True)) == set(db_uids(profile))
    raw = jpath(profile, sid).read_bytes().split(b"\n")
    assert any(line.startswith(b'{"type":"m') and not line.endswith(b"}") for line in raw)  # garbage kept apart


async def test_sqlite_failure_withdraws_journal_line(profile: Path) -> None:
    async with SessionStore(profile) as s:
        sid = await s.start_session("k")
        size = jpath(profile, sid).stat().st_size
        await on_connection(
            s, "CREATE TEMP TRIGGER boom BEFORE INSERT ON messages BEGIN SELECT RAISE(ABORT, 'disk full'); END"
        )
        with pytest.raises(DatabaseWriteError, match="disk full"):
            await s.append(StoredMessage(sid, "user", "nope"))
        assert jpath(profile, sid).stat().st_size == size
        await on_connection(s, "DROP TRIGGER boom")
        await s.append(StoredMessage(sid, "user", "yes"))
    assert_consistent(profile)
    assert len(db_uids(profile)) == 1


@pytest.mark.parametrize("policy", ["always", "batch", "never"])
async def test_fsync_policies(profile: Path, monkeypatch: pytest.MonkeyPatch, policy: str) -> None:
    calls: list[int] = []
    real = os.fsync
    monkeypatch.setattr(journal_mod.os, "fsync", lambda fd: (calls.append(fd), real(fd))[1])
    async with SessionStore(profile, fsync=policy) as s:  # type: ignore[arg-type]
        sid = await s.start_session("k")
        calls.clear()
        for i in range(40):
            await s.append(StoredMessage(sid, "user", f"x{i}"))
        during = len(calls)
        await asyncio.sleep(0.15)
        after_wait = len(calls)
        await s.sync()
        synced = len(calls)
    if policy == "always":
        assert during >= 40
    elif policy == "batch":
        assert during < 20 and after_wait >= 1
    else:
        assert after_wait == 0 and synced >= 1
    with db(profile) as c:
        sync_level = c.execute("PRAGMA synchronous").fetchone()[0]  # per-connection; just readable
    assert sync_level in (0, 1, 2, 3)


async def test_many_journals_with_small_handle_cache(profile: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(journal_mod, "MAX_OPEN_JOURNALS", 4)
    synced: set[int] = set()
    real = os.fsync
    monkeypatch.setattr(journal_mod.os, "fsync", lambda fd: (synced.add(fd), real(fd))[1])
    async with SessionStore(profile, fsync="never") as s:
        sids = [await s.start_session(f"k{i}") for i in range(12)]
        await s.append_many([StoredMessage(sid, "user", f"to {sid}") for sid in sids])
        assert s._journal.open_fds <= 4
        assert synced  # evicted dirty journals were fsynced before their descriptor closed
    assert_consistent(profile)
    assert len(db_uids(profile)) == 12


# ---------------------------------------------------------------- counters, stats, backup


async def test_counters_info_and_stats(profile: Path) -> None:
    async with SessionStore(profile) as s:
        assert await s.stats() == {"sessions": 0, "messages": 0, "last_activity": None}
        sid = await s.start_session("k")
        await s.add_usage(sid, 100, 20)
        await s.add_usage(sid, 1, 2)
        await s.increment_compressions(sid)
        await s.set_summary(sid, "short summary ✓")
        m = await s.append(StoredMessage(sid, "user", "hi"))
        info = await s.session_info(sid)
        assert (info["input_tokens"], info["output_tokens"], info["compressions"], info["summary"]) == (
            101,
            22,
            1,
            "short summary ✓",
        )
        st = await s.stats()
        assert st["sessions"] == 1 and st["messages"] == 1 and st["last_activity"] >= m.timestamp
        assert await s.session_info("nope") is None
        with pytest.raises(UnknownSessionError):
            await s.add_usage("20200101_000000_00000000", 1, 1)
        assert [x["id"] for x in await s.list_sessions()] == [sid]


async def test_backup_passes_integrity_check(profile: Path, tmp_path: Path) -> None:
    dest = tmp_path / "backups" / "state.db"
    async with SessionStore(profile) as s:
        sid = await s.start_session("k")
        sent = await s.append_many(msgs(sid, 50))
        await s.set_flags([sent[0].uid], active=False, reason="reset")
        await s.backup_to(dest)
    c = sqlite3.connect(dest)
    try:
        assert c.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        c.execute("INSERT INTO messages_fts(messages_fts) VALUES ('integrity-check')")
        assert c.execute("SELECT count(*) FROM messages").fetchone()[0] == 50
        assert c.execute("SELECT rowid FROM messages_fts WHERE messages_fts MATCH 'm7'").fetchall()
    finally:
        c.close()
    with db(profile) as c:
        c.execute("INSERT INTO messages_fts(messages_fts) VALUES ('integrity-check')")
        cols = {r[1] for r in c.execute("PRAGMA table_info(messages)")}
        assert {
            "id",
            "session_id",
            "role",
            "content",
            "tool_call_id",
            "tool_calls",
            "tool_name",
            "timestamp",
            "token_count",
            "finish_reason",
        } <= cols
        scols = {r[1] for r in c.execute("PRAGMA table_info(sessions)")}
        assert {"parent_session_id", "started_at", "ended_at", "end_reason"} <= scols
        assert c.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


# ---------------------------------------------------------------- cheap open


async def test_reopen_after_a_clean_close_skips_schema_script_and_journal_scan(
    profile: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with SessionStore(profile) as s:
        sid = await s.start_session("k")
        await s.append_many(msgs(sid, 3))
    scans: list[str] = []
    real_scan = Journal.scan
    monkeypatch.setattr(Journal, "scan", lambda self, *a: (scans.append("scan"), real_scan(self, *a))[1])
    monkeypatch.setattr(session_db, "SCHEMA", "this is not SQL")  # would fail if the script ran
    async with SessionStore(profile) as s:
        assert [m.content for m in await s.history(sid)] == ["m0", "m1", "m2"]
        await s.append(StoredMessage(sid, "user", "m3"))
    assert scans == []
    with db(profile) as c:
        assert c.execute("PRAGMA user_version").fetchone()[0] == session_db.USER_VERSION


async def test_a_journal_changed_after_a_clean_close_is_still_reconciled(profile: Path) -> None:
    async with SessionStore(profile) as s:
        sid = await s.start_session("k")
        await s.append_many(msgs(sid, 2))
    late = StoredMessage(sid, "user", "written by a crashed run")
    with jpath(profile, sid).open("a", encoding="utf-8") as f:
        f.write(json.dumps({"type": "message", **late.to_json()}) + "\n")
    async with SessionStore(profile) as s:
        assert (await s.history(sid))[-1].content == "written by a crashed run"
    with db(profile) as c:
        c.execute("DELETE FROM messages WHERE uid=?", (late.uid,))  # a row lost behind the store's back
    async with SessionStore(profile) as s:
        assert (await s.history(sid))[-1].uid == late.uid
    assert_consistent(profile)


async def test_profiles_sharing_one_pool_thread_never_see_each_others_messages(tmp_path: Path) -> None:
    pool = sessions_mod.StoragePool(1)  # every call of both tenants runs on the same thread
    try:
        a = await SessionStore(tmp_path / "a", pool=pool).open()
        b = await SessionStore(tmp_path / "b", pool=pool).open()
        sa, _ = await a.get_or_start("lane")
        sb, _ = await b.get_or_start("lane")
        await asyncio.gather(
            *(
                s.append(StoredMessage(sid, "user", f"{who} secret {i}"))
                for i in range(20)
                for s, sid, who in ((a, sa, "alice"), (b, sb, "bob"))
            )
        )
        hits_a, hits_b = await asyncio.gather(a.search("secret", limit=100), b.search("secret", limit=100))
        assert len(hits_a) == len(hits_b) == 20
        assert all("alice" in h["snippet"] for h in hits_a) and all("bob" in h["snippet"] for h in hits_b)
        assert {m.content.split()[0] for m in await a.history(sa)} == {"alice"}
        await asyncio.gather(a.close(), b.close())
    finally:
        pool.shutdown()
    for who, other in (("a", "bob"), ("b", "alice")):
        assert other not in (tmp_path / who / "state.db").read_bytes().decode("latin-1")
        assert not any(other in p.read_text("utf-8") for p in (tmp_path / who / "sessions").glob("*.jsonl"))
