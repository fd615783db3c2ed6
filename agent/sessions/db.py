"""state.db: the schema, opening a connection, and the statements the store runs.

APSW (its bundled SQLite), not the stdlib `sqlite3`: a close does not checkpoint, statements
stay prepared per connection, and each call costs less (docs/concepts.md#session-storage).
The files stay plain SQLite, which the stdlib (the Hermes CLI) reads. Every function here
runs on a storage pool thread inside one store call, with the connection handed in
explicitly (no connection is shared between profiles, and one call at a time uses it).
Rows are tuples in the order of the column lists below (SESSION_COLS, MSG_COLS).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal, TypeVar, cast

import apsw

from agent.messages import StoredMessage
from agent.sessions.codec import msg_row
from agent.sessions.errors import SessionStoreError, UnknownSessionError
from agent.vault import DataKey

SCHEMA_VERSION = 1
# PRAGMA user_version of a state.db whose schema script already ran (so open() can skip it)
USER_VERSION = 2
_SQL_CHUNK = 500  # uids per `IN (...)` clause, well below SQLite's variable limit
# the most page cache one profile's connection keeps between calls (SQLite's default is
# 2 MiB): open profiles are counted against storage.memory_budget_mib (docs/concepts.md#open-profiles)
PAGE_CACHE_KIB = 256
# prepared statements kept per connection (APSW's cache, keyed by SQL text; ~2.3 KiB each):
# a turn uses about 10; the open's one-shot statements bypass it (can_cache=False)
STATEMENT_CACHE = 24
# WAL pages after which a commit checkpoints (SQLite's default is 1,000 = 4 MiB), and the
# size a WAL is cut back to after a checkpoint: a close does not checkpoint, so this is
# what bounds the -wal file a profile keeps between opens
WAL_AUTOCHECKPOINT_PAGES = 256
WAL_SIZE_LIMIT = 1 << 20
# lookaside per connection (SQLite's default 1,200 B x 40 = 47 KiB): 8 KiB saves ~36 KiB
# per open profile at no measured CPU cost
LOOKASIDE = (256, 32)

Connection = apsw.Connection
Row = tuple[Any, ...]
Error = apsw.Error
T = TypeVar("T")
log = logging.getLogger("agent.sessions")


def _configure_library() -> None:
    """Process-wide SQLite settings of APSW's library (before its first connection)."""
    try:
        apsw.shutdown()
        apsw.config(apsw.SQLITE_CONFIG_LOOKASIDE, *LOOKASIDE)
        apsw.initialize()
    except apsw.Error as e:  # a connection exists already: SQLite's default lookaside stays
        log.debug("SQLite lookaside left at its default: %s", e)


_configure_library()

# the budget ledger's tables (agent/ledger.py): in the schema, so a turn's ledger steps
# find them without a CREATE of their own (USER_VERSION 2 adds them to older files)
BUDGET_DDL = """
CREATE TABLE IF NOT EXISTS budget_usage(
    period TEXT PRIMARY KEY,
    tokens INTEGER NOT NULL DEFAULT 0,
    cost_nanos INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS budget_pending(
    call_id TEXT PRIMARY KEY,
    day TEXT NOT NULL,
    month TEXT NOT NULL,
    tokens INTEGER NOT NULL,
    cost_nanos INTEGER NOT NULL,
    at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS budget_said(key TEXT PRIMARY KEY, at REAL NOT NULL);
"""

SCHEMA = (
    """
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
    + BUDGET_DDL
)

MSG_COLS = (
    "uid, session_id, role, content, tool_call_id, tool_calls, tool_name, timestamp, "
    "token_count, finish_reason, active, compacted, meta"
)
INSERT_MSG = f"INSERT OR IGNORE INTO messages({MSG_COLS}) VALUES ({', '.join('?' * 13)})"
SESSION_COLS = (
    "id, session_key, source, user_id, model, started_at, ended_at, end_reason, "
    "parent_session_id, message_count, title, input_tokens, output_tokens, compressions, summary"
)
LIVE_ROUTE_SQL = (
    "SELECT r.session_id FROM routes r JOIN sessions s ON s.id = r.session_id "
    "WHERE r.session_key=? AND s.ended_at IS NULL"
)
# SQL: true for a compression summary row (meta {"compressed_summary": true}); undo skips them.
IS_SUMMARY_SQL = "(json_valid(meta) AND COALESCE(json_extract(meta, '$.compressed_summary'), 0) != 0)"


def chunks(items: list[T], n: int = _SQL_CHUNK) -> Iterable[list[T]]:
    for i in range(0, len(items), n):
        yield items[i : i + n]


JournalMode = Literal["wal", "delete"]


def connect(
    path: Path, fsync: str, journal_mode: JournalMode = "wal", *, key: DataKey | None = None
) -> apsw.Connection:
    """Open state.db for one profile (usable from any pool thread, one call at a time).

    `journal_mode` "delete" (a rollback journal) is for a data_dir on a network filesystem
    (cluster mode): WAL's shared-memory index only works among processes of one host.
    A close leaves the WAL for the next open or SQLite's auto-checkpoint (no checkpoint and
    fsyncs per close); the journal, written first, covers what an un-fsynced WAL loses.
    The schema script runs only when PRAGMA user_version says it has not run yet. With
    `key` the file is encrypted by SQLite3 Multiple Ciphers (docs/privacy.md#encryption-at-rest)."""
    db = apsw.Connection(str(path), statementcachesize=STATEMENT_CACHE)
    try:
        _key(db, key)
        db.config(apsw.SQLITE_DBCONFIG_NO_CKPT_ON_CLOSE, 1)
        db.set_busy_timeout(10000)
        mode = "WAL" if journal_mode == "wal" else "DELETE"
        # one call: the mode is read from the file (a no-op when it is already set)
        version = db.execute(
            # secure_delete: an erased message's bytes are zeroed in the file, not left in free pages
            f"PRAGMA cache_size=-{PAGE_CACHE_KIB}; PRAGMA synchronous={'FULL' if fsync == 'always' else 'NORMAL'}; "
            "PRAGMA secure_delete=ON; "
            f"PRAGMA wal_autocheckpoint={WAL_AUTOCHECKPOINT_PAGES}; PRAGMA journal_size_limit={WAL_SIZE_LIMIT}; "
            f"PRAGMA journal_mode={mode}; PRAGMA user_version",
            can_cache=False,  # one-shot statements would crowd the turn's out of the cache
        ).fetchall()[-1][0]
        if version != USER_VERSION:
            db.execute(SCHEMA, can_cache=False)
            row = db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
            if row is None:
                db.execute("INSERT INTO meta(key, value) VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
            elif int(row[0]) > SCHEMA_VERSION:
                raise SessionStoreError(f"{path} has schema {row[0]}, newer than {SCHEMA_VERSION}")
            db.execute(f"PRAGMA user_version={USER_VERSION}")
    except BaseException:
        db.close()
        raise
    return db


def open_reader(path: Path, key: DataKey | None = None) -> apsw.Connection:
    """A connection to a state.db outside its store (the CLI, doctor, backups, exports),
    keyed with `key` when the profile is encrypted (docs/privacy.md#encryption-at-rest).

    APSW as well: two SQLite libraries with one file open in one process do not see each
    other's locks, and the stdlib's close can cut the shared-memory index under APSW's
    mapping, a bus error (docs/concepts.md#one-sqlite-library-per-file). Read-only when the
    file allows it (a WAL's -shm must exist or be creatable); read-write otherwise."""
    try:
        db = apsw.Connection(str(path), flags=apsw.SQLITE_OPEN_READONLY)
        try:
            _key(db, key)
            db.set_busy_timeout(10000)
            db.execute("SELECT 1 FROM sqlite_master LIMIT 1").fetchall()
            return db
        except BaseException:
            db.close()
            raise
    except apsw.Error:  # e.g. no -shm yet and a directory it cannot create one in
        pass
    db = apsw.Connection(str(path), flags=apsw.SQLITE_OPEN_READWRITE)
    _key(db, key)
    db.set_busy_timeout(10000)
    return db


def _key(db: apsw.Connection, key: DataKey | None) -> None:
    """Key a fresh connection (the first statement it runs); no-op for a plain file."""
    if key is not None:
        db.execute(key.db_pragma(), can_cache=False).fetchall()


def backup_file(source: apsw.Connection, dest: Path, key: DataKey | None = None) -> None:
    """Copy an open state.db to `dest` with SQLite's online backup (writers go on): a
    self-contained file with a rollback journal, which the stdlib reads. An encrypted
    source (`key`) gives a copy encrypted with the same key: the backup API copies pages
    only between connections keyed alike."""
    target = apsw.Connection(str(dest))
    try:
        _key(target, key)
        with target.backup("main", source, "main") as b:
            b.step()
        target.execute("PRAGMA journal_mode=DELETE").fetchall()
    finally:
        target.close()


def plain_copy(source: apsw.Connection, dest: Path, key: DataKey) -> None:
    """A plain copy of an open encrypted state.db, for the owner and the Hermes CLI
    (docs/privacy.md#exports-and-the-hermes-cli): VACUUM INTO (a consistent snapshot, keyed
    like its source), then the copy's key removed; the stdlib reads the result."""
    source.execute("VACUUM INTO ?", (str(dest),)).fetchall()
    copy = apsw.Connection(str(dest))
    try:
        _key(copy, key)
        copy.execute("PRAGMA journal_mode=DELETE").fetchall()
        copy.execute("PRAGMA rekey=''").fetchall()
    finally:
        copy.close()


SESSION_NAMES = tuple(c.strip() for c in SESSION_COLS.split(","))
MSG_NAMES = tuple(c.strip() for c in MSG_COLS.split(","))


def aggregate(db: apsw.Connection, sql: str) -> Row:
    """The one row of an aggregate query (always there), not kept in the statement cache."""
    return cast(Row, db.execute(sql, can_cache=False).fetchone())


def session_dict(row: Row) -> dict[str, Any]:
    """A `SELECT {SESSION_COLS}` row by column name."""
    return dict(zip(SESSION_NAMES, row, strict=True))


def session_row(db: apsw.Connection, sid: str) -> dict[str, Any]:
    row = db.execute(f"SELECT {SESSION_COLS} FROM sessions WHERE id=?", (sid,)).fetchone()
    if row is None:
        raise UnknownSessionError(sid)
    return session_dict(row)


def live_route(db: apsw.Connection, session_key: str) -> str | None:
    row = db.execute(LIVE_ROUTE_SQL, (session_key,)).fetchone()
    return None if row is None else row[0]


def existing_uids(db: apsw.Connection, uids: list[str]) -> set[str]:
    found: set[str] = set()
    for part in chunks(uids):
        rows: list[Row] = db.execute(
            f"SELECT uid FROM messages WHERE uid IN ({','.join('?' * len(part))})", part
        ).fetchall()
        found.update(r[0] for r in rows)
    return found


def uids_of(db: apsw.Connection, session_id: str, uids: list[str]) -> list[str]:
    """The given uids that belong to `session_id`, in insertion order."""
    found: list[str] = []
    for part in chunks(list(dict.fromkeys(uids))):
        rows: list[Row] = db.execute(
            f"SELECT uid FROM messages WHERE session_id=? AND uid IN ({','.join('?' * len(part))}) ORDER BY id",
            (session_id, *part),
        ).fetchall()
        found.extend(r[0] for r in rows)
    return found


def uids_by_session(db: apsw.Connection, uids: list[str]) -> dict[str, list[str]]:
    by_session: dict[str, list[str]] = {}
    for part in chunks(list(dict.fromkeys(uids))):
        rows: list[Row] = db.execute(
            f"SELECT uid, session_id FROM messages WHERE uid IN ({','.join('?' * len(part))}) ORDER BY id", part
        ).fetchall()
        for uid, sid in rows:
            by_session.setdefault(sid, []).append(uid)
    return by_session


def session_messages(db: apsw.Connection, sid: str, *, include_inactive: bool = True) -> list[Row]:
    where = "" if include_inactive else " AND active=1 AND compacted=0"
    return db.execute(f"SELECT {MSG_COLS} FROM messages WHERE session_id=?{where} ORDER BY id", (sid,)).fetchall()


def insert_messages(db: apsw.Connection, fresh: list[StoredMessage]) -> None:
    """Insert rows and bump message counts (inside the caller's transaction)."""
    if not fresh:
        return
    db.executemany(INSERT_MSG, [msg_row(m) for m in fresh])
    counts: dict[str, int] = {}
    for m in fresh:
        counts[m.session_id] = counts.get(m.session_id, 0) + 1
    db.executemany(
        "UPDATE sessions SET message_count = COALESCE(message_count, 0) + ? WHERE id=?",
        [(n, sid) for sid, n in counts.items()],
    )


def insert_session(
    db: apsw.Connection,
    sid: str,
    session_key: str | None,
    *,
    parent: str | None,
    ts: float,
    source: str = "",
    user_id: str = "",
    model: str = "",
) -> None:
    """Insert a sessions row, or fill in the blanks of a placeholder row."""
    db.execute(
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


def set_route(db: apsw.Connection, session_key: str, sid: str, ts: float) -> None:
    db.execute(
        "INSERT OR REPLACE INTO routes(session_key, session_id, updated_at) VALUES (?, ?, ?)", (session_key, sid, ts)
    )


def apply_end(db: apsw.Connection, sid: str, reason: str | None, ts: float, move_routes_to: str | None = None) -> None:
    db.execute("UPDATE sessions SET ended_at=?, end_reason=? WHERE id=? AND ended_at IS NULL", (ts, reason, sid))
    if move_routes_to is None:
        db.execute("DELETE FROM routes WHERE session_id=?", (sid,))
    else:
        db.execute("UPDATE routes SET session_id=?, updated_at=? WHERE session_id=?", (move_routes_to, ts, sid))


def apply_flags(db: apsw.Connection, uids: list[str], active: bool | None, compacted: bool | None) -> int:
    a = None if active is None else int(bool(active))
    c = None if compacted is None else int(bool(compacted))
    n = 0
    for part in chunks(uids):
        db.execute(
            f"UPDATE messages SET active=COALESCE(?, active), compacted=COALESCE(?, compacted) "
            f"WHERE uid IN ({','.join('?' * len(part))})",
            (a, c, *part),
        )
        n += db.changes()
    return n


def record_offsets(db: apsw.Connection, rows: list[tuple[str, int, int]]) -> None:
    """New journal end offsets and message-line counts per session (inside the transaction)."""
    db.executemany(
        'INSERT INTO journal_offsets(session_id, "offset", messages) VALUES (?, ?, ?) '
        'ON CONFLICT(session_id) DO UPDATE SET "offset"=excluded."offset", '
        "messages=COALESCE(journal_offsets.messages, 0) + excluded.messages",
        rows,
    )


def add_usage(db: apsw.Connection, sid: str, input_tokens: int, output_tokens: int) -> int:
    db.execute(
        "UPDATE sessions SET input_tokens = COALESCE(input_tokens,0) + ?, "
        "output_tokens = COALESCE(output_tokens,0) + ? WHERE id=?",
        (int(input_tokens), int(output_tokens), sid),
    )
    return db.changes()


def put_compression_state(db: apsw.Connection, sid: str, text: str, ts: float) -> None:
    db.execute(
        "INSERT INTO compression_state(session_id, state, updated_at) VALUES (?, ?, ?) "
        "ON CONFLICT(session_id) DO UPDATE SET state=excluded.state, updated_at=excluded.updated_at",
        (sid, text, ts),
    )


def get_compression_state(db: apsw.Connection, sid: str) -> str | None:
    row = db.execute("SELECT state FROM compression_state WHERE session_id=?", (sid,)).fetchone()
    return None if row is None else row[0]


class Transaction:
    """`with Transaction(db):` BEGIN IMMEDIATE ... COMMIT, ROLLBACK on any exception."""

    def __init__(self, db: apsw.Connection) -> None:
        self.db = db

    def __enter__(self) -> apsw.Connection:
        self.db.execute("BEGIN IMMEDIATE")
        return self.db

    def __exit__(self, exc_type: Any, exc: Any, _tb: Any) -> None:
        if exc_type is None:
            self.db.execute("COMMIT")
        elif self.db.in_transaction:
            self.db.execute("ROLLBACK")
