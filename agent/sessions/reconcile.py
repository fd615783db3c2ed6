"""Reconciliation: bring state.db and the journals of one profile to the same set of
messages, by uid, when the profile opens.

The checkpoint is the `journal_offsets` table, which every write transaction keeps up to
date: where each journal ends and how many message lines it holds. When every journal
ends exactly at its recorded offset and the message rows add up to the recorded lines,
journal and database agree and the open skips the scan (and writes nothing). Journals only
grow and every row is journaled first, so anything a crash left half done shows up as a
journal longer than its offset, and the next open reads that tail.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import apsw

from agent.messages import StoredMessage
from agent.sessions import db as q
from agent.sessions.codec import check_session_id, end_line, message_line, msg_row, now, row_msg, start_line
from agent.sessions.db import Row
from agent.sessions.journal import Journal, Record
from agent.sessions.write import journaled

log = logging.getLogger("agent.sessions")


def _agree(db: apsw.Connection, journal: Journal, offsets: dict[str, int]) -> bool:
    """True when the journals and state.db are known to hold the same messages."""
    if offsets != journal.sizes():
        return False
    counts = q.aggregate(
        db, "SELECT (SELECT COALESCE(sum(messages), 0) FROM journal_offsets), (SELECT count(*) FROM messages)"
    )
    if counts[0] != counts[1]:
        return False
    # every session is journaled (a session row without a journal is rebuilt below)
    sessions = q.aggregate(db, "SELECT count(*) FROM sessions")
    return int(sessions[0]) <= len(offsets)


def reconcile(db: apsw.Connection, journal: Journal) -> None:
    """Bring state.db and the journals to the same set of messages (runs in open())."""
    # the open's one-shot statements stay out of the statement cache (agent/sessions/db.py)
    offsets = {r[0]: r[1] for r in db.execute('SELECT session_id, "offset" FROM journal_offsets', can_cache=False)}
    if _agree(db, journal, offsets):
        return
    # Sessions whose SQLite message count differs from what their journal holds (rows
    # added or lost behind the store's back) get a full scan; the rest only a tail read.
    suspects = {
        r[0]
        for r in db.execute(
            "SELECT c.session_id FROM (SELECT session_id, count(*) AS n FROM messages GROUP BY session_id) c "
            "LEFT JOIN journal_offsets j ON j.session_id = c.session_id "
            "WHERE COALESCE(j.messages, -1) != c.n "
            "UNION SELECT j.session_id FROM journal_offsets j WHERE j.messages > 0 AND NOT EXISTS "
            "(SELECT 1 FROM messages m WHERE m.session_id = j.session_id)"
        )
    }
    files, todo = journal.scan(offsets, suspects)
    for sid, path, start, full in todo:
        _reconcile_file(db, journal, sid, path, start, full=full)
    ids: list[Row] = db.execute("SELECT id FROM sessions ORDER BY started_at, id").fetchall()
    for (sid,) in ids:
        if sid in files:
            continue
        try:
            check_session_id(sid)
        except ValueError:
            log.warning("session %r has a name unusable as a journal file; not journaled", sid)
            continue
        _rebuild_journal(db, journal, sid)


def _reconcile_file(db: apsw.Connection, journal: Journal, sid: str, path: Path, offset: int, *, full: bool) -> None:
    """Replay the journal from `offset` (from 0 when `full`, then re-journal SQLite-only messages)."""
    records, end = Journal.read(path, offset, journal.key)
    with q.Transaction(db):
        journal_uids = _replay(db, sid, records)
        db.execute(
            'INSERT INTO journal_offsets(session_id, "offset", messages) VALUES (?, ?, ?) '
            'ON CONFLICT(session_id) DO UPDATE SET "offset"=excluded."offset", messages='
            + ("excluded.messages" if full else "COALESCE(journal_offsets.messages, 0) + excluded.messages"),
            (sid, end, len(journal_uids)),
        )
    if not full:
        return
    missing = [m for m in map(row_msg, q.session_messages(db, sid)) if m.uid not in journal_uids]
    if not missing:
        return
    log.warning("re-journaling %d message(s) of %s found only in state.db", len(missing), sid)
    lines: list[dict[str, Any]] = []
    if not any(r.data.get("event") == "session_start" for r in records):
        lines.append(_start_line_from_db(db, sid))
    lines.extend(message_line(m) for m in missing)
    journaled(db, journal, {sid: lines})


def _replay(db: apsw.Connection, sid: str, records: list[Record]) -> set[str]:
    """Apply journal records to SQLite idempotently (inside the caller's transaction).

    Returns the uids of this session's message lines that SQLite now holds; records that
    cannot be applied are logged and skipped rather than failing open().
    """
    held: set[str] = set()
    for rec in records:
        d = rec.data
        try:
            if d.get("type") == "message":
                if d.get("session_id") != sid or not isinstance(d.get("uid"), str) or not d["uid"]:
                    raise ValueError(f"message line for session {d.get('session_id')!r}")
                m = StoredMessage.from_json(d)
                row = msg_row(m)
                db.execute("INSERT OR IGNORE INTO sessions(id, started_at) VALUES (?, ?)", (sid, float(m.timestamp)))
                db.execute(q.INSERT_MSG, row)
                if db.changes() > 0:
                    db.execute("UPDATE sessions SET message_count = COALESCE(message_count, 0) + 1 WHERE id=?", (sid,))
                held.add(m.uid)
            elif d.get("type") == "event":
                _replay_event(db, sid, d)
        except (TypeError, ValueError, OverflowError, apsw.BindingsError) as e:
            log.warning("skipping unusable journal line of %s at byte %d: %s", sid, rec.start, e)
    return held


def _replay_event(db: apsw.Connection, sid: str, d: dict[str, Any]) -> None:
    ev = d.get("event")
    ts = float(d.get("ts") or now())
    if ev == "session_start":
        existed = db.execute("SELECT 1 FROM sessions WHERE id=?", (sid,)).fetchone()
        key = d.get("session_key")
        q.insert_session(
            db,
            sid,
            key,
            parent=d.get("parent_session_id"),
            ts=ts,
            source=d.get("source") or "",
            user_id=d.get("user_id") or "",
            model=d.get("model") or "",
        )
        if d.get("route", True) and isinstance(key, str) and existed is None:
            _restore_route(db, key, sid, ts)
    elif ev == "session_end":
        db.execute("INSERT OR IGNORE INTO sessions(id, started_at) VALUES (?, ?)", (sid, ts))
        q.apply_end(db, sid, d.get("reason"), ts)
    elif ev == "flags":
        uids = [u for u in d.get("uids") or [] if isinstance(u, str)]
        q.apply_flags(db, uids, d.get("active"), d.get("compacted"))


def _restore_route(db: apsw.Connection, key: str, sid: str, ts: float) -> None:
    """A replayed session_start takes its lane unless the lane routes to a newer live session."""
    cur = db.execute(
        "SELECT s.ended_at, s.started_at FROM routes r JOIN sessions s ON s.id = r.session_id WHERE r.session_key=?",
        (key,),
    ).fetchone()
    if cur is None or cur[0] is not None or (cur[1] or 0) <= ts:
        q.set_route(db, key, sid, ts)


def _start_line_from_db(db: apsw.Connection, sid: str) -> dict[str, Any]:
    row = q.session_row(db, sid)
    return start_line(
        sid,
        row["session_key"],
        parent=row["parent_session_id"],
        route=False,
        ts=row["started_at"] or now(),
        source=row["source"] or "",
        user_id=row["user_id"] or "",
        model=row["model"] or "",
    )


def _rebuild_journal(db: apsw.Connection, journal: Journal, sid: str) -> None:
    """Write a whole journal for a session that exists only in state.db."""
    info = q.session_row(db, sid)
    rows = q.session_messages(db, sid)
    lines = [_start_line_from_db(db, sid)]
    lines.extend(message_line(row_msg(r)) for r in rows)
    if info["ended_at"] is not None:
        lines.append(end_line(sid, info["end_reason"], info["ended_at"]))
    log.warning("journal of %s missing; rebuilt from state.db (%d messages)", sid, len(rows))
    db.execute("DELETE FROM journal_offsets WHERE session_id=?", (sid,))
    journaled(db, journal, {sid: lines})
