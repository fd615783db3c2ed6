"""Per-profile session store: an append-only JSONL journal plus a SQLite index.

Every write goes to `sessions/<session_id>.jsonl` first (flushed, fsynced per policy), then
to `state.db` in one transaction. `open()` reconciles the two by message uid, so after a
crash at any point both hold the same messages. Nothing is rewritten in place: undo,
compression and resets append events and flip the `active`/`compacted` flags.

Modules: `store` (SessionStore, the public face), `journal` (JSONL files), `db` (schema and
statements), `write` (the dual write), `reconcile` (open-time repair), `search` (FTS5),
`pool` (the shared storage threads and the group syncer), `codec` (lines and rows).
"""

from agent.sessions.db import SCHEMA, SCHEMA_VERSION
from agent.sessions.errors import (
    DatabaseWriteError,
    JournalWriteError,
    SessionStoreError,
    StaleRouteError,
    UnknownSessionError,
    WriteRefused,
)
from agent.sessions.pool import BATCH_FSYNC_INTERVAL, StoragePool
from agent.sessions.search import SEARCH_MAX_LIMIT, fts_query
from agent.sessions.store import FsyncPolicy, SessionStore

__all__ = [
    "BATCH_FSYNC_INTERVAL",
    "SCHEMA",
    "SCHEMA_VERSION",
    "SEARCH_MAX_LIMIT",
    "DatabaseWriteError",
    "FsyncPolicy",
    "JournalWriteError",
    "SessionStore",
    "SessionStoreError",
    "StaleRouteError",
    "StoragePool",
    "UnknownSessionError",
    "WriteRefused",
    "fts_query",
]
