"""Per-profile session store: an append-only JSONL journal plus a SQLite index.

Every write goes to `sessions/<session_id>.jsonl` first (flushed, fsynced per policy), then
to `state.db` in one transaction. `open()` reconciles the two by message uid, so after a
crash at any point both hold the same messages. Nothing is rewritten in place: undo,
compression and resets append events and flip the `active`/`compacted` flags.
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import fcntl
import json
import logging
import os
import re
import secrets
import sqlite3
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable
from datetime import datetime, timezone
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, TypeVar

import aiosqlite

from agent.fileio import private_file, private_mkdir

from agent.messages import StoredMessage

log = logging.getLogger(__name__)

FsyncPolicy = Literal["always", "batch", "never"]
SCHEMA_VERSION = 1
BATCH_FSYNC_INTERVAL = 0.05  # seconds: the most a `batch` journal line stays un-fsynced
MAX_OPEN_JOURNALS = 32  # per-instance cache of journal file descriptors
SEARCH_MAX_LIMIT = 100
SEARCH_MAX_TERMS = 32
_SQL_CHUNK = 500  # uids per `IN (...)` clause, well below SQLite's variable limit
_SESSION_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
_START_KW = frozenset({"source", "user_id", "model"})

T = TypeVar("T")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta(key TEXT PRIMARY KEY, value TEXT);
CREATE TABLE IF NOT EXISTS sessions(
    id TEXT PRIMARY KEY,
    session_key TEXT,
    source TEXT,
    user_id TEXT,
    model TEXT,
    started_at REAL,
    ended_at REAL,
    end_reason TEXT,
    parent_session_id TEXT,
    message_count INTEGER DEFAULT 0,
    title TEXT,
    input_tokens INTEGER DEFAULT 0,
    output_tokens INTEGER DEFAULT 0,
    compressions INTEGER DEFAULT 0,
    summary TEXT
);
CREATE INDEX IF NOT EXISTS idx_sessions_key ON sessions(session_key);
CREATE INDEX IF NOT EXISTS idx_sessions_parent ON sessions(parent_session_id);
CREATE TABLE IF NOT EXISTS messages(
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    uid TEXT UNIQUE NOT NULL,
    session_id TEXT NOT NULL,
    role TEXT,
    content TEXT,
    tool_call_id TEXT,
    tool_calls TEXT,
    tool_name TEXT,
    timestamp REAL,
    token_count INTEGER,
    finish_reason TEXT,
    active INTEGER DEFAULT 1,
    compacted INTEGER DEFAULT 0,
    meta TEXT
);
CREATE INDEX IF NOT EXISTS idx_messages_session ON messages(session_id, id);
CREATE VIRTUAL TABLE IF NOT EXISTS messages_fts USING fts5(
    content, content='messages', content_rowid='id'
);
CREATE TRIGGER IF NOT EXISTS messages_fts_ai AFTER INSERT ON messages BEGIN
    INSERT INTO messages_fts(rowid, content) VALUES (new.id, new.content);
END;
CREATE TRIGGER IF NOT EXISTS messages_fts_ad AFTER DELETE ON messages BEGIN
    INSERT INTO messages_fts(messages_fts, rowid, content) VALUES ('delete', old.id, old.content);
END;
CREATE TRIGGER IF NOT EXISTS messages_fts_au AFTER UPDATE OF content ON messages BEGIN
    INSERT INTO messages_fts(messages_fts, rowid, content) VALUES ('delete', old.id, old.content);
    INSERT INTO messages_fts(rowid, content) VALUES (new.id, new.content);
END;
CREATE TABLE IF NOT EXISTS routes(
    session_key TEXT PRIMARY KEY,
    session_id TEXT NOT NULL,
    updated_at REAL
);
CREATE INDEX IF NOT EXISTS idx_routes_session ON routes(session_id);
CREATE TABLE IF NOT EXISTS journal_offsets(
    session_id TEXT PRIMARY KEY,
    "offset" INTEGER,
    messages INTEGER DEFAULT 0
);
CREATE TABLE IF NOT EXISTS compression_state(
    session_id TEXT PRIMARY KEY,
    state TEXT NOT NULL,
    updated_at REAL
);
"""

_MSG_COLS = (
    "uid, session_id, role, content, tool_call_id, tool_calls, tool_name, timestamp, "
    "token_count, finish_reason, active, compacted, meta"
)
_INSERT_MSG = f"INSERT OR IGNORE INTO messages({_MSG_COLS}) VALUES ({', '.join('?' * 13)})"
_SESSION_COLS = (
    "id, session_key, source, user_id, model, started_at, ended_at, end_reason, "
    "parent_session_id, message_count, title, input_tokens, output_tokens, compressions, summary"
)


class SessionStoreError(Exception):
    """Base class of every error this store raises on purpose."""


class JournalWriteError(SessionStoreError):
    """The journal could not be written (e.g. disk full); nothing was stored."""


class DatabaseWriteError(SessionStoreError):
    """SQLite refused a write after the journal line was written; the line was withdrawn."""


class UnknownSessionError(SessionStoreError, KeyError):
    """The session id is not in this store."""


class StaleRouteError(SessionStoreError):
    """rotate() was asked to rotate a session that is no longer the lane's live session."""


def _now() -> float:
    return time.time()


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


_LINE_BREAKERS = str.maketrans({"\u2028": "\\u2028", "\u2029": "\\u2029", "\x85": "\\u0085"})


def _journal_line(obj: dict[str, Any]) -> str:
    """One JSONL line. Unicode line separators are escaped so no reader can split a record."""
    return _dumps(obj).translate(_LINE_BREAKERS) + "\n"


def _clean_str(s: str) -> str:
    """Replace lone surrogates (unencodable in UTF-8) with U+FFFD; pairs are joined."""
    try:
        s.encode("utf-8")
        return s
    except UnicodeEncodeError:
        return s.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


def _clean(obj: Any) -> Any:
    if isinstance(obj, str):
        return _clean_str(obj)
    if isinstance(obj, dict):
        return {_clean(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj


def _check_session_id(session_id: str) -> str:
    """Session ids become file names: refuse anything that could leave sessions/."""
    if not isinstance(session_id, str) or not _SESSION_ID_RE.match(session_id) or ".." in session_id:
        raise ValueError(f"invalid session id: {session_id!r}")
    return session_id


def _chunks(items: list[T], n: int = _SQL_CHUNK) -> Iterable[list[T]]:
    for i in range(0, len(items), n):
        yield items[i : i + n]


def fts_query(query: str, *, join: str = " ") -> str:
    """Turn free text into a safe FTS5 query: every term becomes a quoted phrase."""
    terms = [t for t in query.split() if t][:SEARCH_MAX_TERMS]
    return join.join('"' + t.replace('"', '""') + '"' for t in terms)


def _msg_row(m: StoredMessage) -> tuple[Any, ...]:
    return (
        m.uid,
        m.session_id,
        m.role,
        m.content,
        m.tool_call_id,
        None if m.tool_calls is None else _dumps(m.tool_calls),
        m.tool_name,
        m.timestamp,
        m.token_count,
        m.finish_reason,
        1 if m.active else 0,
        1 if m.compacted else 0,
        _dumps(m.meta or {}),
    )


def _row_msg(r: sqlite3.Row) -> StoredMessage:
    return StoredMessage(
        session_id=r["session_id"],
        role=r["role"],
        content=r["content"],
        uid=r["uid"],
        tool_call_id=r["tool_call_id"],
        tool_calls=None if r["tool_calls"] is None else json.loads(r["tool_calls"]),
        tool_name=r["tool_name"],
        timestamp=r["timestamp"],
        token_count=r["token_count"],
        finish_reason=r["finish_reason"],
        active=bool(r["active"]),
        compacted=bool(r["compacted"]),
        meta=json.loads(r["meta"]) if r["meta"] else {},
    )


async def _noop() -> None:
    return None


def _message_line(m: StoredMessage) -> dict[str, Any]:
    return {"type": "message", **m.to_json()}


# SQL: true for a compression summary row (meta {"compressed_summary": true}); undo skips them.
_IS_SUMMARY_SQL = "(json_valid(meta) AND COALESCE(json_extract(meta, '$.compressed_summary'), 0) != 0)"


def _conversation_order(msgs: list[StoredMessage]) -> list[StoredMessage]:
    """Insertion order, except that a message whose meta names `after_uid` (a compression
    summary) follows that message when it is present. Originals are never re-inserted, so a
    summary written after the tail it precedes still reads [head..., summary, tail...].

    System prompts lead: a rebuilt one (meta `replaces`, appended later) stands first, and
    an anchor naming the prompt it replaced names the new one."""
    if any(m.role == "system" for m in msgs[1:]):
        msgs = [m for m in msgs if m.role == "system"] + [m for m in msgs if m.role != "system"]
    alias = {m.meta["replaces"]: m.uid for m in msgs
             if m.role == "system" and isinstance(m.meta, dict) and isinstance(m.meta.get("replaces"), str)}
    present = {m.uid for m in msgs}
    moved: dict[str, list[StoredMessage]] = {}
    for m in msgs:
        anchor = m.meta.get("after_uid") if isinstance(m.meta, dict) else None
        for _ in range(len(alias)):
            if anchor not in alias or anchor in present:
                break
            anchor = alias[anchor]
        if isinstance(anchor, str) and anchor != m.uid and anchor in present:
            moved.setdefault(anchor, []).append(m)
    if not moved:
        return msgs
    moved_ids = {id(m) for ms in moved.values() for m in ms}
    out: list[StoredMessage] = []
    emitted: set[int] = set()
    for root in msgs:
        if id(root) in moved_ids:
            continue
        stack = [root]
        while stack:
            m = stack.pop()
            if id(m) in emitted:
                continue
            emitted.add(id(m))
            out.append(m)
            stack.extend(reversed(moved.pop(m.uid, [])))
    out.extend(m for m in msgs if id(m) not in emitted)  # anchor cycles: keep insertion order
    return out


@dataclasses.dataclass
class _Record:
    """One parsed journal line and where it starts in the file."""

    start: int
    data: dict[str, Any]


class SessionStore:
    """Sessions and messages of one tenant profile (`profile_dir`)."""

    def __init__(self, profile_dir: Path, fsync: FsyncPolicy = "batch") -> None:
        if fsync not in ("always", "batch", "never"):
            raise ValueError(f"fsync must be always|batch|never, not {fsync!r}")
        self.profile_dir = Path(profile_dir)
        self.fsync: FsyncPolicy = fsync
        self.db_path = self.profile_dir / "state.db"
        self.sessions_dir = self.profile_dir / "sessions"
        self._db: aiosqlite.Connection | None = None  # writes (and write-side reads)
        self._rdb: aiosqlite.Connection | None = None  # committed-only reads
        self._lock = asyncio.Lock()
        self._fds: OrderedDict[str, int] = OrderedDict()
        self._dirty: set[str] = set()  # journals written since their last fsync
        self._dir_dirty = False
        self._suspect: set[str] = set()  # journals a failed write may have left unterminated
        self._sync_task: asyncio.Task[None] | None = None
        self._lock_fd: int | None = None

    # ------------------------------------------------------------------ lifecycle

    async def open(self) -> "SessionStore":
        """Open state.db (creating the schema) and reconcile it with the journals."""
        if self._db is not None:
            return self
        private_mkdir(self.sessions_dir)
        self._take_profile_lock()
        private_file(self.db_path)  # SQLite gives -wal/-shm the database file's mode
        sync = "FULL" if self.fsync == "always" else "NORMAL"
        db: aiosqlite.Connection | None = None
        try:
            db = await aiosqlite.connect(self.db_path, isolation_level=None)
            db.row_factory = sqlite3.Row
            await db.execute("PRAGMA busy_timeout=10000")
            await db.execute("PRAGMA journal_mode=WAL")
            await db.execute(f"PRAGMA synchronous={sync}")
            await db.executescript(_SCHEMA)
            row = await (await db.execute("SELECT value FROM meta WHERE key='schema_version'")).fetchone()
            if row is None:
                await db.execute("INSERT INTO meta(key, value) VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
            elif int(row[0]) > SCHEMA_VERSION:
                raise SessionStoreError(f"{self.db_path} has schema {row[0]}, newer than {SCHEMA_VERSION}")
            self._db = db
            async with self._lock:
                await self._reconcile()
            rdb = await aiosqlite.connect(self.db_path, isolation_level=None)
            rdb.row_factory = sqlite3.Row
            await rdb.execute("PRAGMA busy_timeout=10000")
            await rdb.execute("PRAGMA query_only=1")
            self._rdb = rdb
        except BaseException:
            self._db = None
            if self._sync_task is not None:
                self._sync_task.cancel()
                self._sync_task = None
            if db is not None:
                await db.close()
            self._close_fds()
            self._release_profile_lock()
            raise
        return self

    def _take_profile_lock(self) -> None:
        """One writer per profile: a second SessionStore on the same directory would corrupt offsets."""
        fd = os.open(self.sessions_dir / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            raise SessionStoreError(f"{self.profile_dir} is already open by another SessionStore") from e
        self._lock_fd = fd

    def _release_profile_lock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    async def close(self) -> None:
        """Fsync every journal written to, close file handles and both connections."""
        if self._db is None:
            return
        async with self._lock:
            if self._sync_task is not None:
                self._sync_task.cancel()
                self._sync_task = None
            try:
                await asyncio.to_thread(self._fsync_dirty, True)
            finally:
                self._close_fds()
                db, rdb = self._db, self._rdb
                self._db = self._rdb = None
                try:
                    if rdb is not None:
                        await rdb.close()
                    await db.close()
                finally:
                    self._release_profile_lock()

    async def sync(self) -> None:
        """Fsync every journal written since the last fsync, whatever the policy."""
        await self._write(lambda: asyncio.to_thread(self._fsync_dirty, True))

    async def __aenter__(self) -> "SessionStore":
        return await self.open()

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    # ------------------------------------------------------------------ sessions

    async def start_session(
        self,
        session_key: str,
        *,
        source: str = "",
        user_id: str = "",
        model: str = "",
        parent_session_id: str | None = None,
        route: bool = True,
    ) -> str:
        """Create a session (journaled first); with `route`, point the lane at it atomically."""

        async def op() -> str:
            return await self._start_locked(
                session_key, source=source, user_id=user_id, model=model,
                parent_session_id=parent_session_id, route=route,
            )

        return await self._write(op)

    async def end_session(self, session_id: str, reason: str) -> None:
        """Mark a session ended and drop any route to it. Ending twice is a no-op."""
        _check_session_id(session_id)

        async def op() -> None:
            info = await self._session_row(session_id)
            if info["ended_at"] is not None:
                return
            ts = _now()
            line = {"type": "event", "event": "session_end", "session_id": session_id, "reason": reason, "ts": ts}

            async def tx() -> None:
                await self._apply_end(session_id, reason, ts)

            await self._journaled({session_id: [line]}, tx)

        await self._write(op)

    async def rotate(self, session_key: str, old_session_id: str, reason: str, *,
                     carry: list[StoredMessage] | None = None, compact_uids: list[str] | None = None,
                     **start_kwargs: Any) -> str:
        """End `old_session_id` and start its child, moving the lane's route, in one transaction.

        The child inherits source/user_id/model unless given. `carry` messages (any session_id;
        they are re-homed) become the child's first messages and `compact_uids` of the old
        session are flagged compacted, in the same journal write and transaction.
        Raises StaleRouteError when the old session already ended or the lane routes elsewhere
        (a concurrent rotate).
        """
        _check_session_id(old_session_id)
        unknown = set(start_kwargs) - _START_KW
        if unknown:
            raise TypeError(f"rotate() got unexpected arguments: {sorted(unknown)}")
        carried = self._prepare_messages(list(carry or []), check_session=False)

        async def op() -> str:
            db = self._require_db()
            old = await self._session_row(old_session_id)
            if old["ended_at"] is not None:
                raise StaleRouteError(f"session {old_session_id} already ended ({old['end_reason']})")
            cur = await (
                await db.execute("SELECT session_id FROM routes WHERE session_key=?", (session_key,))
            ).fetchone()
            if cur is not None and cur[0] != old_session_id:
                raise StaleRouteError(f"lane {session_key!r} routes to {cur[0]}, not {old_session_id}")
            kw = {k: start_kwargs.get(k, old[k] or "") for k in _START_KW}
            new_id = self._new_session_id()
            ts = _now()
            end_line = {
                "type": "event", "event": "session_end", "session_id": old_session_id, "reason": reason, "ts": ts,
            }
            start_line = self._start_line(new_id, session_key, parent=old_session_id, route=True, ts=ts, **kw)
            msgs = [dataclasses.replace(m, session_id=new_id) for m in carried]
            if await self._existing_uids([m.uid for m in msgs]):
                raise ValueError("rotate(carry=...) messages need fresh uids")
            flagged = await self._uids_of(old_session_id, list(compact_uids or []))
            old_lines: list[dict[str, Any]] = [end_line]
            if flagged:
                old_lines.insert(0, {"type": "event", "event": "flags", "uids": flagged, "active": None,
                                     "compacted": True, "reason": reason, "ts": ts})

            async def tx() -> None:
                await self._apply_end(old_session_id, reason, ts, move_routes_to=new_id)
                await self._insert_session(new_id, session_key, parent=old_session_id, ts=ts, **kw)
                await self._set_route(session_key, new_id, ts)
                await self._insert_messages(msgs)
                if flagged:
                    await self._apply_flags(flagged, None, True)

            await self._journaled(
                {old_session_id: old_lines, new_id: [start_line, *(_message_line(m) for m in msgs)]}, tx)
            return new_id

        return await self._write(op)

    async def route(self, session_key: str) -> str | None:
        """The live (not ended) session id of a lane, or None."""
        row = await self._fetchone(
            "SELECT r.session_id FROM routes r JOIN sessions s ON s.id = r.session_id "
            "WHERE r.session_key=? AND s.ended_at IS NULL",
            (session_key,),
        )
        return None if row is None else row[0]

    async def get_or_start(self, session_key: str, **kw: Any) -> tuple[str, bool]:
        """The lane's live session, starting (and routing) one if there is none."""
        unknown = set(kw) - _START_KW - {"parent_session_id"}
        if unknown:
            raise TypeError(f"get_or_start() got unexpected arguments: {sorted(unknown)}")

        async def op() -> tuple[str, bool]:
            db = self._require_db()
            rows = await db.execute_fetchall(
                "SELECT r.session_id FROM routes r JOIN sessions s ON s.id = r.session_id "
                "WHERE r.session_key=? AND s.ended_at IS NULL",
                (session_key,),
            )
            if rows:
                return rows[0][0], False
            return await self._start_locked(session_key, route=True, **kw), True

        return await self._write(op)

    # ------------------------------------------------------------------ messages

    async def append(self, msg: StoredMessage) -> StoredMessage:
        """Store one message (journal first). Re-appending a known uid is a no-op."""
        return (await self.append_many([msg]))[0]

    async def append_many(self, msgs: list[StoredMessage]) -> list[StoredMessage]:
        """Store messages in one transaction, in list order. Returns them as stored.

        Lone surrogates in strings are replaced with U+FFFD (UTF-8 cannot carry them).
        """
        if not msgs:
            return []
        cleaned = self._prepare_messages(msgs)

        async def op() -> list[StoredMessage]:
            sids = sorted({m.session_id for m in cleaned})
            for sid in sids:
                await self._session_row(sid)
            known = await self._existing_uids([m.uid for m in cleaned])
            fresh: list[StoredMessage] = []
            lines: dict[str, list[dict[str, Any]]] = {}
            for m in cleaned:
                if m.uid not in known:
                    known.add(m.uid)
                    fresh.append(m)
                    lines.setdefault(m.session_id, []).append(_message_line(m))
            if not fresh:
                return cleaned

            async def tx() -> None:
                await self._insert_messages(fresh)

            await self._journaled(lines, tx)
            return cleaned

        return await self._write(op)

    @staticmethod
    def _prepare_messages(msgs: list[StoredMessage], check_session: bool = True) -> list[StoredMessage]:
        """Validate messages for storage; lone surrogates are replaced with U+FFFD."""
        cleaned: list[StoredMessage] = []
        for m in msgs:
            if check_session:
                _check_session_id(m.session_id)
            if not isinstance(m.uid, str) or not m.uid:
                raise ValueError("message uid must be a non-empty string")
            if not isinstance(m.role, str) or not (m.content is None or isinstance(m.content, str)):
                raise TypeError(f"message {m.uid}: role must be str and content str or None")
            if not (m.tool_calls is None or isinstance(m.tool_calls, list)) or not isinstance(m.meta, dict):
                raise TypeError(f"message {m.uid}: tool_calls must be a list or None and meta a dict")
            data = _message_line(m)
            try:
                _dumps(data).encode("utf-8")
            except UnicodeEncodeError:
                data = _clean(data)
                m = StoredMessage.from_json(data)
            except (TypeError, ValueError) as e:
                raise ValueError(f"message {m.uid} is not JSON-serialisable: {e}") from e
            cleaned.append(m)
        return cleaned

    async def _insert_messages(self, fresh: list[StoredMessage]) -> None:
        """Insert rows and bump message counts (inside the caller's transaction)."""
        if not fresh:
            return
        db = self._require_db()
        await db.executemany(_INSERT_MSG, [_msg_row(m) for m in fresh])
        counts: dict[str, int] = {}
        for m in fresh:
            counts[m.session_id] = counts.get(m.session_id, 0) + 1
        await db.executemany(
            "UPDATE sessions SET message_count = COALESCE(message_count, 0) + ? WHERE id=?",
            [(n, sid) for sid, n in counts.items()],
        )

    async def _uids_of(self, session_id: str, uids: list[str]) -> list[str]:
        """The given uids that belong to `session_id`, in insertion order."""
        db = self._require_db()
        found: list[str] = []
        for part in _chunks(list(dict.fromkeys(uids))):
            rows = await (
                await db.execute(
                    f"SELECT uid FROM messages WHERE session_id=? AND uid IN ({','.join('?' * len(part))}) ORDER BY id",
                    (session_id, *part),
                )
            ).fetchall()
            found.extend(r[0] for r in rows)
        return found

    async def compact(self, session_id: str, uids: list[str], messages: list[StoredMessage], *,
                      reason: str = "compression") -> int:
        """Append `messages` to `session_id` and flag its `uids` compacted, atomically: one
        journal write (message lines, then a flags event) and one SQLite transaction.
        Returns how many messages were flagged."""
        _check_session_id(session_id)
        cleaned = self._prepare_messages(messages)
        if any(m.session_id != session_id for m in cleaned):
            raise ValueError("compact() messages must belong to the compacted session")

        async def op() -> int:
            await self._session_row(session_id)
            known = await self._existing_uids([m.uid for m in cleaned])
            fresh = [m for m in cleaned if m.uid not in known]
            flagged = await self._uids_of(session_id, list(uids))
            lines = [_message_line(m) for m in fresh]
            if flagged:
                lines.append({"type": "event", "event": "flags", "uids": flagged, "active": None,
                              "compacted": True, "reason": reason, "ts": _now()})
            if not lines:
                return 0

            async def tx() -> None:
                await self._insert_messages(fresh)
                if flagged:
                    await self._apply_flags(flagged, None, True)

            await self._journaled({session_id: lines}, tx)
            return len(flagged)

        return await self._write(op)

    async def history(self, session_id: str, *, include_inactive: bool = False) -> list[StoredMessage]:
        """Messages of a session in conversation order; only active, uncompacted ones by default.

        Conversation order is insertion order, except that a compression summary (meta
        `after_uid`) follows the message it names, so history reads [head, summary, tail]."""
        where = "" if include_inactive else " AND active=1 AND compacted=0"
        rows = await self._fetchall(
            f"SELECT {_MSG_COLS} FROM messages WHERE session_id=?{where} ORDER BY id", (session_id,)
        )
        return _conversation_order([_row_msg(r) for r in rows])

    async def set_flags(
        self, uids: list[str], *, active: bool | None = None, compacted: bool | None = None, reason: str
    ) -> int:
        """Flip `active`/`compacted` on messages (journaled as a flags event). Returns how many matched."""
        if active is None and compacted is None:
            raise ValueError("set_flags needs active and/or compacted")

        async def op() -> int:
            return await self._set_flags_locked(list(uids), active, compacted, reason)

        return await self._write(op)

    async def undo_last_turn(self, session_id: str) -> int:
        """Deactivate the last visible user message and everything active after it; returns the count.

        Repeated calls walk back one turn each.
        """
        _check_session_id(session_id)

        async def op() -> int:
            db = self._require_db()
            last = await (
                await db.execute(
                    "SELECT id FROM messages WHERE session_id=? AND role='user' AND active=1 AND compacted=0 "
                    f"AND NOT {_IS_SUMMARY_SQL} ORDER BY id DESC LIMIT 1",
                    (session_id,),
                )
            ).fetchone()
            if last is None:
                return 0
            rows = await (
                await db.execute(
                    f"SELECT uid FROM messages WHERE session_id=? AND id>=? AND active=1 AND NOT {_IS_SUMMARY_SQL} "
                    "ORDER BY id",
                    (session_id, last[0]),
                )
            ).fetchall()
            return await self._set_flags_locked([r[0] for r in rows], False, None, "undo")

        return await self._write(op)

    async def search(self, query: str, limit: int = 10, *, session_key: str | None = None) -> list[dict[str, Any]]:
        """FTS5 search over this profile's messages, inactive and compacted ones included;
        with `session_key`, only over the sessions of that one lane. System prompts (they
        hold memory snapshots) are never returned, even where an older database indexed them.

        Every term is quoted, so model-written queries cannot be FTS syntax errors. All
        terms must match; if that finds nothing, any term may match. `limit` is capped.
        """
        if not isinstance(query, str) or not query.strip():
            return []
        try:
            limit = max(1, min(int(limit), SEARCH_MAX_LIMIT))
        except (TypeError, ValueError):
            limit = 10
        lane_filter = " AND m.session_id IN (SELECT id FROM sessions WHERE session_key = ?)" if session_key else ""
        sql = (
            "SELECT m.uid, m.session_id, m.role, m.timestamp, m.active, m.compacted, "
            "snippet(messages_fts, 0, '>>>', '<<<', '...', 16) AS snippet "
            "FROM messages_fts JOIN messages m ON m.id = messages_fts.rowid "
            f"WHERE messages_fts MATCH ? AND m.role IS NOT 'system'{lane_filter} ORDER BY rank LIMIT ?"
        )
        rows: list[sqlite3.Row] = []
        for q in dict.fromkeys((fts_query(query), fts_query(query, join=" OR "))):
            params = (q, session_key, limit) if session_key else (q, limit)
            try:
                rows = await self._fetchall(sql, params)
            except sqlite3.OperationalError as e:  # defensive: quoting should prevent this
                log.warning("session search failed for %r: %s", query, e)
                return []
            if rows:
                break
        return [
            {
                "session_id": r["session_id"],
                "role": r["role"],
                "snippet": (r["snippet"] or "").replace("\x00", ""),
                "timestamp": r["timestamp"],
                "uid": r["uid"],
                "active": bool(r["active"]),
                "compacted": bool(r["compacted"]),
            }
            for r in rows
        ]

    # ------------------------------------------------------------------ counters and info

    async def add_usage(self, session_id: str, input_tokens: int, output_tokens: int) -> None:
        """Add token usage to a session's counters (SQLite only)."""
        await self._update_session(
            session_id,
            "input_tokens = COALESCE(input_tokens,0) + ?, output_tokens = COALESCE(output_tokens,0) + ?",
            (int(input_tokens), int(output_tokens)),
        )

    async def increment_compressions(self, session_id: str, by: int = 1) -> None:
        """Count `by` more compressions of this session (SQLite only)."""
        await self._update_session(session_id, "compressions = COALESCE(compressions,0) + ?", (int(by),))

    async def compression_state(self, session_id: str) -> dict[str, Any]:
        """The session's persisted compression state (streaks, cooldowns...; {} if none)."""
        row = await self._fetchone("SELECT state FROM compression_state WHERE session_id=?", (session_id,))
        if row is None:
            return {}
        try:
            data = json.loads(row[0])
        except (TypeError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    async def set_compression_state(self, session_id: str, state: dict[str, Any]) -> None:
        """Replace the session's compression state (SQLite only; soft state)."""
        text = _dumps(_clean(state))

        async def op() -> None:
            await self._require_db().execute(
                "INSERT INTO compression_state(session_id, state, updated_at) VALUES (?, ?, ?) "
                "ON CONFLICT(session_id) DO UPDATE SET state=excluded.state, updated_at=excluded.updated_at",
                (session_id, text, _now()),
            )

        await self._write(op)

    async def set_summary(self, session_id: str, text: str) -> None:
        """Store the session's latest summary text (SQLite only)."""
        await self._update_session(session_id, "summary = ?", (_clean_str(text),))

    async def session_info(self, session_id: str) -> dict[str, Any] | None:
        """The sessions row as a dict, or None."""
        row = await self._fetchone(f"SELECT {_SESSION_COLS} FROM sessions WHERE id=?", (session_id,))
        return None if row is None else dict(row)

    async def list_sessions(self) -> list[dict[str, Any]]:
        """Every sessions row, oldest first."""
        rows = await self._fetchall(f"SELECT {_SESSION_COLS} FROM sessions ORDER BY started_at, id", ())
        return [dict(r) for r in rows]

    async def stats(self) -> dict[str, Any]:
        """Counts of sessions and messages, and the latest message/session timestamp."""
        row = await self._fetchone(
            "SELECT (SELECT count(*) FROM sessions) AS sessions, (SELECT count(*) FROM messages) AS messages, "
            "max(COALESCE((SELECT max(timestamp) FROM messages), 0), "
            "    COALESCE((SELECT max(max(COALESCE(started_at,0), COALESCE(ended_at,0))) FROM sessions), 0)) AS last",
            (),
        )
        assert row is not None
        return {"sessions": row["sessions"], "messages": row["messages"], "last_activity": row["last"] or None}

    async def export(self) -> dict[str, Any]:
        """Every session with all its messages (inactive and compacted too), JSON-serialisable."""

        async def op() -> dict[str, Any]:
            db = self._require_db()
            sessions = [
                dict(r)
                for r in await (
                    await db.execute(f"SELECT {_SESSION_COLS} FROM sessions ORDER BY started_at, id")
                ).fetchall()
            ]
            by_id: dict[str, list[dict[str, Any]]] = {s["id"]: [] for s in sessions}
            for r in await (await db.execute(f"SELECT {_MSG_COLS} FROM messages ORDER BY id")).fetchall():
                by_id.setdefault(r["session_id"], []).append(_row_msg(r).to_json())
            for s in sessions:
                s["messages"] = by_id.get(s["id"], [])
            return {"schema_version": SCHEMA_VERSION, "exported_at": _now(), "sessions": sessions}

        return await self._write(op)

    async def backup_to(self, dest_path: Path) -> None:
        """Copy state.db to `dest_path` with SQLite's online backup API."""
        dest_path = Path(dest_path)
        private_mkdir(dest_path.parent)
        private_file(dest_path)

        if self._rdb is None:
            raise SessionStoreError("session store is not open")
        # From the read connection: a committed snapshot, without blocking writers.
        target = await asyncio.to_thread(sqlite3.connect, str(dest_path), check_same_thread=False)
        try:
            await self._rdb.backup(target)
        finally:
            await asyncio.to_thread(target.close)

    # ------------------------------------------------------------------ write plumbing

    def _require_db(self) -> aiosqlite.Connection:
        if self._db is None:
            raise SessionStoreError("session store is not open")
        return self._db

    async def _write(self, fn: Callable[[], Awaitable[T]]) -> T:
        """Run `fn` under the write lock, shielded so a cancelled caller can't split journal and db."""
        self._require_db()

        async def locked() -> T:
            async with self._lock:
                self._require_db()
                return await fn()

        task = asyncio.ensure_future(locked())
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
        return await asyncio.shield(task)

    async def _journaled(
        self, lines: dict[str, list[dict[str, Any]]], tx: Callable[[], Awaitable[None]]
    ) -> None:
        """Journal `lines` (per session), then run `tx` and record new offsets in one transaction.

        If SQLite fails, the just-written journal bytes are truncated away again, so the
        caller's exception means "not stored" on both sides.
        """
        db = self._require_db()
        payload = {sid: "".join(_journal_line(d) for d in ds).encode("utf-8") for sid, ds in lines.items() if ds}
        try:
            spans = await asyncio.to_thread(self._journal_write, payload)
        except OSError as e:
            raise JournalWriteError(f"journal write failed in {self.sessions_dir}: {e}") from e
        try:
            await db.execute("BEGIN IMMEDIATE")
            try:
                await tx()
                await db.executemany(
                    'INSERT INTO journal_offsets(session_id, "offset", messages) VALUES (?, ?, ?) '
                    'ON CONFLICT(session_id) DO UPDATE SET "offset"=excluded."offset", '
                    "messages=COALESCE(journal_offsets.messages, 0) + excluded.messages",
                    [
                        (sid, end, sum(1 for d in lines[sid] if d.get("type") == "message"))
                        for sid, (_, end) in spans.items()
                    ],
                )
                await db.execute("COMMIT")
            except BaseException:
                if db.in_transaction:
                    await db.execute("ROLLBACK")
                raise
        except Exception as e:
            await asyncio.to_thread(self._journal_withdraw, spans)
            if isinstance(e, sqlite3.Error):
                raise DatabaseWriteError(f"state.db write failed ({e}); journal entry withdrawn") from e
            raise
        self._after_write()

    def _after_write(self) -> None:
        if self.fsync == "batch" and self._dirty and self._sync_task is None:
            self._sync_task = asyncio.get_running_loop().create_task(self._batch_sync())

    async def _batch_sync(self) -> None:
        await asyncio.sleep(BATCH_FSYNC_INTERVAL)
        async with self._lock:
            self._sync_task = None
            if self._db is not None:
                await asyncio.to_thread(self._fsync_dirty, False)

    def _fd(self, session_id: str) -> int:
        """A cached O_APPEND descriptor of a session journal (blocking; call in a thread)."""
        fd = self._fds.get(session_id)
        if fd is not None:
            self._fds.move_to_end(session_id)
            return fd
        path = self.sessions_dir / f"{session_id}.jsonl"
        created = not path.exists()
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        if created:
            if self.fsync == "always":
                self._fsync_dir()
            else:
                self._dir_dirty = True
        self._fds[session_id] = fd
        while len(self._fds) > MAX_OPEN_JOURNALS:
            old_sid, old_fd = self._fds.popitem(last=False)
            try:
                if old_sid in self._dirty:  # close()/sync() could not reach it once closed
                    os.fsync(old_fd)
                    self._dirty.discard(old_sid)
            finally:
                os.close(old_fd)
        return fd

    def _fsync_dir(self) -> None:
        dfd = os.open(self.sessions_dir, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
        self._dir_dirty = False

    def _journal_write(self, payload: dict[str, bytes]) -> dict[str, tuple[int, int]]:
        """Append each session's bytes; on failure undo what was written. Returns (start, end) spans."""
        spans: dict[str, tuple[int, int]] = {}
        try:
            for sid, data in payload.items():
                fd = self._fd(sid)
                start = os.fstat(fd).st_size
                if sid in self._suspect:
                    start, data = self._repair_tail(sid, fd, start, data)
                spans[sid] = (start, start)
                view = memoryview(data)
                while view:
                    n = self._write_fd(fd, view)
                    if n <= 0:
                        raise OSError(errno.EIO, "short write")
                    view = view[n:]
                spans[sid] = (start, start + len(data))
                self._dirty.add(sid)
                if self.fsync == "always":
                    os.fsync(fd)
                    self._dirty.discard(sid)
        except OSError:
            self._journal_withdraw(spans)
            raise
        return spans

    def _write_fd(self, fd: int, data: memoryview) -> int:
        """One write(2); a seam for tests that simulate a full disk."""
        return os.write(fd, data)

    def _repair_tail(self, sid: str, fd: int, size: int, data: bytes) -> tuple[int, bytes]:
        """After an unrepaired failed write, make sure new lines start on a fresh line."""
        if size > 0:
            with open(self.sessions_dir / f"{sid}.jsonl", "rb") as f:
                f.seek(size - 1)
                if f.read(1) != b"\n":
                    data = b"\n" + data
        self._suspect.discard(sid)
        return size, data

    def _journal_withdraw(self, spans: dict[str, tuple[int, int]]) -> None:
        """Truncate journals back to where this write started (best effort)."""
        for sid, (start, _) in spans.items():
            fd = self._fds.get(sid)
            try:
                if fd is None:
                    os.truncate(self.sessions_dir / f"{sid}.jsonl", start)
                else:
                    os.ftruncate(fd, start)
            except OSError as e:
                self._suspect.add(sid)
                log.error("could not withdraw journal bytes of %s: %s (reconciled on next open)", sid, e)

    def _fsync_dirty(self, everything: bool) -> None:
        """Fsync dirty journals (and the directory). `everything` also covers fsync=never."""
        if self.fsync == "never" and not everything:
            return
        for sid in list(self._dirty):
            fd = self._fds.get(sid)
            if fd is not None:
                os.fsync(fd)
            self._dirty.discard(sid)
        if self._dir_dirty:
            self._fsync_dir()

    def _close_fds(self) -> None:
        while self._fds:
            _, fd = self._fds.popitem()
            try:
                os.close(fd)
            except OSError:
                pass
        self._dirty.clear()

    # ------------------------------------------------------------------ SQL helpers (write side)

    def _new_session_id(self) -> str:
        while True:
            sid = f"{datetime.now(timezone.utc).strftime('%Y%m%d_%H%M%S')}_{secrets.token_hex(4)}"
            if not (self.sessions_dir / f"{sid}.jsonl").exists():
                return sid

    @staticmethod
    def _start_line(
        sid: str, session_key: str, *, parent: str | None, route: bool, ts: float,
        source: str = "", user_id: str = "", model: str = "",
    ) -> dict[str, Any]:
        return {
            "type": "event", "event": "session_start", "session_id": sid, "session_key": session_key,
            "parent_session_id": parent, "source": source, "user_id": user_id, "model": model,
            "route": route, "ts": ts,
        }

    async def _start_locked(
        self, session_key: str, *, source: str = "", user_id: str = "", model: str = "",
        parent_session_id: str | None = None, route: bool = True,
    ) -> str:
        if parent_session_id is not None:
            _check_session_id(parent_session_id)
        sid = self._new_session_id()
        ts = _now()
        kw = {"source": source, "user_id": user_id, "model": model}
        line = self._start_line(sid, session_key, parent=parent_session_id, route=route, ts=ts, **kw)

        async def tx() -> None:
            await self._insert_session(sid, session_key, parent=parent_session_id, ts=ts, **kw)
            if route:
                await self._set_route(session_key, sid, ts)

        await self._journaled({sid: [line]}, tx)
        return sid

    async def _insert_session(
        self, sid: str, session_key: str | None, *, parent: str | None, ts: float,
        source: str = "", user_id: str = "", model: str = "",
    ) -> None:
        """Insert a sessions row, or fill in the blanks of a placeholder row."""
        await self._require_db().execute(
            "INSERT INTO sessions(id, session_key, source, user_id, model, started_at, parent_session_id) "
            "VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT(id) DO UPDATE SET "
            "session_key=COALESCE(sessions.session_key, excluded.session_key), "
            "source=COALESCE(NULLIF(sessions.source, ''), excluded.source), "
            "user_id=COALESCE(NULLIF(sessions.user_id, ''), excluded.user_id), "
            "model=COALESCE(NULLIF(sessions.model, ''), excluded.model), "
            "started_at=min(COALESCE(sessions.started_at, excluded.started_at), excluded.started_at), "
            "parent_session_id=COALESCE(sessions.parent_session_id, excluded.parent_session_id)",
            (sid, session_key, source, user_id, model, ts, parent),
        )

    async def _set_route(self, session_key: str, sid: str, ts: float) -> None:
        await self._require_db().execute(
            "INSERT OR REPLACE INTO routes(session_key, session_id, updated_at) VALUES (?, ?, ?)",
            (session_key, sid, ts),
        )

    async def _apply_end(self, sid: str, reason: str | None, ts: float, move_routes_to: str | None = None) -> None:
        db = self._require_db()
        await db.execute(
            "UPDATE sessions SET ended_at=?, end_reason=? WHERE id=? AND ended_at IS NULL", (ts, reason, sid)
        )
        if move_routes_to is None:
            await db.execute("DELETE FROM routes WHERE session_id=?", (sid,))
        else:
            await db.execute(
                "UPDATE routes SET session_id=?, updated_at=? WHERE session_id=?", (move_routes_to, ts, sid)
            )

    async def _apply_flags(self, uids: list[str], active: bool | None, compacted: bool | None) -> int:
        db = self._require_db()
        a = None if active is None else int(bool(active))
        c = None if compacted is None else int(bool(compacted))
        n = 0
        for part in _chunks(uids):
            cur = await db.execute(
                f"UPDATE messages SET active=COALESCE(?, active), compacted=COALESCE(?, compacted) "
                f"WHERE uid IN ({','.join('?' * len(part))})",
                (a, c, *part),
            )
            n += max(cur.rowcount, 0)
        return n

    async def _set_flags_locked(
        self, uids: list[str], active: bool | None, compacted: bool | None, reason: str
    ) -> int:
        db = self._require_db()
        by_session: dict[str, list[str]] = {}
        for part in _chunks(list(dict.fromkeys(uids))):
            rows = await (
                await db.execute(
                    f"SELECT uid, session_id FROM messages WHERE uid IN ({','.join('?' * len(part))}) ORDER BY id",
                    part,
                )
            ).fetchall()
            for r in rows:
                by_session.setdefault(r["session_id"], []).append(r["uid"])
        if not by_session:
            return 0
        ts = _now()
        lines = {
            sid: [{"type": "event", "event": "flags", "uids": us, "active": active, "compacted": compacted,
                   "reason": reason, "ts": ts}]
            for sid, us in by_session.items()
        }
        count = 0

        async def tx() -> None:
            nonlocal count
            count = await self._apply_flags([u for us in by_session.values() for u in us], active, compacted)

        await self._journaled(lines, tx)
        return count

    async def _session_row(self, sid: str) -> sqlite3.Row:
        row = await (
            await self._require_db().execute(f"SELECT {_SESSION_COLS} FROM sessions WHERE id=?", (sid,))
        ).fetchone()
        if row is None:
            raise UnknownSessionError(sid)
        return row

    async def _existing_uids(self, uids: list[str]) -> set[str]:
        db = self._require_db()
        found: set[str] = set()
        for part in _chunks(uids):
            rows = await (
                await db.execute(f"SELECT uid FROM messages WHERE uid IN ({','.join('?' * len(part))})", part)
            ).fetchall()
            found.update(r[0] for r in rows)
        return found

    async def _update_session(self, session_id: str, assignments: str, params: tuple[Any, ...]) -> None:
        async def op() -> None:
            cur = await self._require_db().execute(
                f"UPDATE sessions SET {assignments} WHERE id=?", (*params, session_id)
            )
            if cur.rowcount == 0:
                raise UnknownSessionError(session_id)

        await self._write(op)

    # ------------------------------------------------------------------ read helpers

    async def _fetchall(self, sql: str, params: tuple[Any, ...]) -> list[sqlite3.Row]:
        if self._rdb is None:
            raise SessionStoreError("session store is not open")
        return list(await self._rdb.execute_fetchall(sql, params))  # one thread hop, not two

    async def _fetchone(self, sql: str, params: tuple[Any, ...]) -> sqlite3.Row | None:
        rows = await self._fetchall(sql, params)
        return rows[0] if rows else None

    # ------------------------------------------------------------------ reconciliation

    @staticmethod
    def _read_journal(path: Path, start: int) -> tuple[list[_Record], int]:
        """Parse journal lines from `start`; cut a torn or garbled tail. Returns (records, end).

        Garbled lines followed by good ones are skipped (logged), never cut.
        """
        with open(path, "r+b") as f:
            f.seek(start)
            data = f.read()
            raws = data.split(b"\n")
            tail = raws.pop()  # bytes after the last newline: a torn write when non-empty
            records: list[_Record] = []
            pos = start
            bad_from: int | None = None  # start of trailing garbled lines
            for raw in raws:
                line_start, pos = pos, pos + len(raw) + 1
                if not raw.strip():
                    continue
                try:
                    obj = json.loads(raw.decode("utf-8"))
                    if not isinstance(obj, dict):
                        raise ValueError("not a JSON object")
                except ValueError:  # includes UnicodeDecodeError and JSONDecodeError
                    log.warning("garbled journal line in %s at byte %d", path, line_start)
                    if bad_from is None:
                        bad_from = line_start
                    continue
                bad_from = None
                records.append(_Record(line_start, obj))
            end = pos if bad_from is None else bad_from
            if tail or bad_from is not None:
                log.warning("truncating torn journal tail of %s at byte %d", path, end)
                f.truncate(end)
                f.flush()
                os.fsync(f.fileno())
        return records, end

    def _scan_journals(
        self, offsets: dict[str, int], suspects: set[str]
    ) -> tuple[set[str], list[tuple[str, Path, int, bool]]]:
        """All journal session ids, and (id, path, start, full) for each journal needing work.

        An offset is trusted when the file is at least that long and a line ends right
        before it; otherwise the journal lost data state.db has, and gets a full scan.
        """
        seen: set[str] = set()
        out: list[tuple[str, Path, int, bool]] = []
        for path in sorted(self.sessions_dir.glob("*.jsonl")):
            try:
                sid = _check_session_id(path.stem)
            except ValueError:
                log.warning("ignoring journal with an invalid session id: %s", path)
                continue
            seen.add(sid)
            offset = offsets.get(sid, 0)
            size = path.stat().st_size
            ok = offset == 0
            if 0 < offset <= size:
                with open(path, "rb") as f:
                    f.seek(offset - 1)
                    ok = f.read(1) == b"\n"
            if not ok:
                log.warning("journal %s lost data state.db has; full reconcile", path)
            full = sid in suspects or not ok
            if full or size > offset:
                out.append((sid, path, 0 if full else offset, full))
        return seen, out

    async def _reconcile(self) -> None:
        """Bring state.db and the journals to the same set of messages (runs in open())."""
        db = self._require_db()
        offsets = {
            r[0]: r[1]
            for r in await (await db.execute('SELECT session_id, "offset" FROM journal_offsets')).fetchall()
        }
        # Sessions whose SQLite message count differs from what their journal holds (rows
        # added or lost behind the store's back) get a full scan; the rest only a tail read.
        suspects = {
            r[0]
            for r in await (
                await db.execute(
                    "SELECT c.session_id FROM (SELECT session_id, count(*) AS n FROM messages GROUP BY session_id) c "
                    "LEFT JOIN journal_offsets j ON j.session_id = c.session_id "
                    "WHERE COALESCE(j.messages, -1) != c.n "
                    "UNION SELECT j.session_id FROM journal_offsets j WHERE j.messages > 0 AND NOT EXISTS "
                    "(SELECT 1 FROM messages m WHERE m.session_id = j.session_id)"
                )
            ).fetchall()
        }
        files, todo = await asyncio.to_thread(self._scan_journals, offsets, suspects)
        for sid, path, start, full in todo:
            await self._reconcile_file(sid, path, start, full=full)
        for (sid,) in await (await db.execute("SELECT id FROM sessions ORDER BY started_at, id")).fetchall():
            if sid in files:
                continue
            try:
                _check_session_id(sid)
            except ValueError:
                log.warning("session %r has a name unusable as a journal file; not journaled", sid)
                continue
            await self._rebuild_journal(sid)

    async def _reconcile_file(self, sid: str, path: Path, offset: int, *, full: bool) -> None:
        """Replay the journal from `offset` (from 0 when `full`, then re-journal SQLite-only messages)."""
        db = self._require_db()
        records, end = await asyncio.to_thread(self._read_journal, path, offset)
        await db.execute("BEGIN IMMEDIATE")
        try:
            journal_uids = await self._replay(sid, records)
            await db.execute(
                'INSERT INTO journal_offsets(session_id, "offset", messages) VALUES (?, ?, ?) '
                'ON CONFLICT(session_id) DO UPDATE SET "offset"=excluded."offset", messages='
                + ("excluded.messages" if full else "COALESCE(journal_offsets.messages, 0) + excluded.messages"),
                (sid, end, len(journal_uids)),
            )
            await db.execute("COMMIT")
        except BaseException:
            await db.execute("ROLLBACK")
            raise
        if not full:
            return
        rows = await (
            await db.execute(f"SELECT {_MSG_COLS} FROM messages WHERE session_id=? ORDER BY id", (sid,))
        ).fetchall()
        missing = [_row_msg(r) for r in rows if r["uid"] not in journal_uids]
        if not missing:
            return
        log.warning("re-journaling %d message(s) of %s found only in state.db", len(missing), sid)
        lines: list[dict[str, Any]] = []
        if not any(r.data.get("event") == "session_start" for r in records):
            lines.append(await self._start_line_from_db(sid))
        lines.extend(_message_line(m) for m in missing)
        await self._journaled({sid: lines}, _noop)

    async def _replay(self, sid: str, records: list[_Record]) -> set[str]:
        """Apply journal records to SQLite idempotently (inside the caller's transaction).

        Returns the uids of this session's message lines that SQLite now holds; records
        that cannot be applied are logged and skipped rather than failing open().
        """
        db = self._require_db()
        held: set[str] = set()
        for rec in records:
            d = rec.data
            try:
                if d.get("type") == "message":
                    if d.get("session_id") != sid or not isinstance(d.get("uid"), str) or not d["uid"]:
                        raise ValueError(f"message line for session {d.get('session_id')!r}")
                    m = StoredMessage.from_json(d)
                    row = _msg_row(m)
                    await db.execute(
                        "INSERT OR IGNORE INTO sessions(id, started_at) VALUES (?, ?)", (sid, float(m.timestamp))
                    )
                    cur = await db.execute(_INSERT_MSG, row)
                    if cur.rowcount > 0:
                        await db.execute(
                            "UPDATE sessions SET message_count = COALESCE(message_count, 0) + 1 WHERE id=?", (sid,)
                        )
                    held.add(m.uid)
                elif d.get("type") == "event":
                    await self._replay_event(sid, d)
            except (TypeError, ValueError, sqlite3.InterfaceError, sqlite3.ProgrammingError) as e:
                log.warning("skipping unusable journal line of %s at byte %d: %s", sid, rec.start, e)
        return held

    async def _replay_event(self, sid: str, d: dict[str, Any]) -> None:
        db = self._require_db()
        ev = d.get("event")
        ts = float(d.get("ts") or _now())
        if ev == "session_start":
            existed = await (await db.execute("SELECT 1 FROM sessions WHERE id=?", (sid,))).fetchone()
            key = d.get("session_key")
            await self._insert_session(
                sid, key, parent=d.get("parent_session_id"), ts=ts,
                source=d.get("source") or "", user_id=d.get("user_id") or "", model=d.get("model") or "",
            )
            if d.get("route", True) and isinstance(key, str) and existed is None:
                await self._restore_route(key, sid, ts)
        elif ev == "session_end":
            await db.execute("INSERT OR IGNORE INTO sessions(id, started_at) VALUES (?, ?)", (sid, ts))
            await self._apply_end(sid, d.get("reason"), ts)
        elif ev == "flags":
            uids = [u for u in d.get("uids") or [] if isinstance(u, str)]
            await self._apply_flags(uids, d.get("active"), d.get("compacted"))

    async def _restore_route(self, key: str, sid: str, ts: float) -> None:
        """A replayed session_start takes its lane unless the lane routes to a newer live session."""
        db = self._require_db()
        cur = await (
            await db.execute(
                "SELECT s.ended_at, s.started_at FROM routes r JOIN sessions s ON s.id = r.session_id "
                "WHERE r.session_key=?",
                (key,),
            )
        ).fetchone()
        if cur is None or cur["ended_at"] is not None or (cur["started_at"] or 0) <= ts:
            await self._set_route(key, sid, ts)

    async def _start_line_from_db(self, sid: str) -> dict[str, Any]:
        row = await self._session_row(sid)
        return self._start_line(
            sid, row["session_key"], parent=row["parent_session_id"], route=False,
            ts=row["started_at"] or _now(), source=row["source"] or "", user_id=row["user_id"] or "",
            model=row["model"] or "",
        )

    async def _rebuild_journal(self, sid: str) -> None:
        """Write a whole journal for a session that exists only in state.db."""
        db = self._require_db()
        info = await self._session_row(sid)
        rows = await (
            await db.execute(f"SELECT {_MSG_COLS} FROM messages WHERE session_id=? ORDER BY id", (sid,))
        ).fetchall()
        lines = [await self._start_line_from_db(sid)]
        lines.extend(_message_line(_row_msg(r)) for r in rows)
        if info["ended_at"] is not None:
            lines.append(
                {"type": "event", "event": "session_end", "session_id": sid, "reason": info["end_reason"],
                 "ts": info["ended_at"]}
            )
        log.warning("journal of %s missing; rebuilt from state.db (%d messages)", sid, len(rows))
        await db.execute("DELETE FROM journal_offsets WHERE session_id=?", (sid,))
        await self._journaled({sid: lines}, _noop)
