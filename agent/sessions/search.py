"""session_search: FTS5 over one profile's own messages (never across tenants)."""

from __future__ import annotations

import logging
from typing import Any

import apsw

log = logging.getLogger("agent.sessions")

SEARCH_MAX_LIMIT = 100
SEARCH_MAX_TERMS = 32


def fts_query(query: str, *, join: str = " ") -> str:
    """Turn free text into a safe FTS5 query: every term becomes a quoted phrase."""
    terms = [t for t in query.split() if t][:SEARCH_MAX_TERMS]
    return join.join('"' + t.replace('"', '""') + '"' for t in terms)


def clamp_limit(limit: Any) -> int:
    try:
        return max(1, min(int(limit), SEARCH_MAX_LIMIT))
    except (TypeError, ValueError):
        return 10


def search(db: apsw.Connection, query: str, limit: int, session_key: str | None) -> list[dict[str, Any]]:
    """FTS5 search over this profile's messages, inactive and compacted ones included;
    with `session_key`, only over the sessions of that one lane. System prompts (they hold
    memory snapshots) are never returned, even where an older database indexed them.

    Every term is quoted, so model-written queries cannot be FTS syntax errors. All terms
    must match; if that finds nothing, any term may match."""
    lane_filter = " AND m.session_id IN (SELECT id FROM sessions WHERE session_key = ?)" if session_key else ""
    sql = (
        "SELECT m.uid, m.session_id, m.role, m.timestamp, m.active, m.compacted, "
        "snippet(messages_fts, 0, '>>>', '<<<', '...', 16) AS snippet "
        "FROM messages_fts JOIN messages m ON m.id = messages_fts.rowid "
        f"WHERE messages_fts MATCH ? AND m.role IS NOT 'system'{lane_filter} ORDER BY rank LIMIT ?"
    )
    rows: list[tuple[Any, ...]] = []
    for q in dict.fromkeys((fts_query(query), fts_query(query, join=" OR "))):
        params = (q, session_key, limit) if session_key else (q, limit)
        try:
            rows = db.execute(sql, params).fetchall()
        except apsw.SQLError as e:  # defensive: quoting should prevent this
            log.warning("session search failed for %r: %s", query, e)
            return []
        if rows:
            break
    return [
        {
            "session_id": sid,
            "role": role,
            "snippet": (snippet or "").replace("\x00", ""),
            "timestamp": ts,
            "uid": uid,
            "active": bool(active),
            "compacted": bool(compacted),
        }
        for uid, sid, role, ts, active, compacted, snippet in rows
    ]
