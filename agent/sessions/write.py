"""The dual write: journal lines first (flushed, fsynced per policy), then one SQLite
transaction that applies them and records the journals' new end offsets.

If SQLite fails, the just-written journal bytes are truncated away again, so the caller's
exception means "not stored" on both sides.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import apsw

from agent.sessions.db import Transaction, record_offsets
from agent.sessions.errors import DatabaseWriteError, JournalWriteError
from agent.sessions.journal import Journal

Lines = dict[str, list[dict[str, Any]]]
Tx = Callable[[apsw.Connection], None]


def journaled(
    db: apsw.Connection, journal: Journal, lines: Lines, tx: Tx | None = None, extra: Tx | None = None
) -> None:
    """Journal `lines` (per session), then run `tx` (and `extra`, e.g. counters that ride
    along) and record the new offsets, all in one transaction."""
    payload = {sid: journal.encode(sid, ds) for sid, ds in lines.items() if ds}
    try:
        spans = journal.write(payload)
    except OSError as e:
        raise JournalWriteError(f"journal write failed in {journal.sessions_dir}: {e}") from e
    try:
        with Transaction(db):
            if tx is not None:
                tx(db)
            if extra is not None:
                extra(db)
            record_offsets(
                db,
                [
                    (sid, end, sum(1 for d in lines[sid] if d.get("type") == "message"))
                    for sid, (_, end) in spans.items()
                ],
            )
    except Exception as e:
        journal.withdraw(spans)
        if isinstance(e, apsw.Error):
            raise DatabaseWriteError(f"state.db write failed ({e}); journal entry withdrawn") from e
        raise
