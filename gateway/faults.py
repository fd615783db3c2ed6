"""Storage faults that pass by themselves: disk full and a database locked by someone else.

A turn that hits one keeps its messages pending and is retried in its lane (order holds)
until storage works again, instead of failing the person's message for good.
"""

from __future__ import annotations

import errno
import sqlite3

_DISK_FULL = {errno.ENOSPC, errno.EDQUOT}
_SQLITE_TRANSIENT = ("database is locked", "database or disk is full", "disk is full", "database table is locked")


def storage_fault(exc: BaseException) -> str | None:
    """ "disk full" or "database locked" when `exc` (or what caused it) is one, else None."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, OSError) and cur.errno in _DISK_FULL:
            return "disk full"
        if isinstance(cur, sqlite3.OperationalError):
            text = str(cur).lower()
            if any(t in text for t in _SQLITE_TRANSIENT):
                return "disk full" if "full" in text else "database locked"
        cur = cur.__cause__ or cur.__context__
    return None


class StartupError(Exception):
    """The gateway cannot serve (no platform came up, gateway.db unreadable, the listen
    address taken); the message is one sentence for the operator, never a traceback."""
