"""A test's own look into a profile's state.db, through APSW as the store opens it.

One SQLite library per file in a process (docs/concepts.md#one-sqlite-library-per-file):
the suite runs gateways, admin commands and its own reads in one process, so a stdlib
`sqlite3` open of a state.db an APSW connection holds is refused (`refuse_stdlib_beside_apsw`);
what the stdlib reads is checked once the store has closed (tests/test_state_db_stdlib.py).
"""

from __future__ import annotations

import os
import sqlite3
import sys
import weakref
from contextlib import closing
from typing import Any
from urllib.parse import urlsplit

import apsw


def open_state_db(path: str | os.PathLike[str]) -> apsw.Connection:
    """A read-write APSW connection (close it; `with` on it is a transaction, not a close)."""
    conn = apsw.Connection(str(path))
    conn.set_busy_timeout(10000)
    return conn


def integrity_of(db: str | os.PathLike[str]) -> str:
    """PRAGMA integrity_check of any SQLite file of a data dir, with the library that owns it
    (APSW for a state.db, the stdlib for gateway.db and the rest)."""
    if os.fspath(db).endswith("state.db"):
        conn = open_state_db(db)
        try:
            return str(conn.execute("PRAGMA integrity_check").fetchall()[0][0])
        finally:
            conn.close()
    with closing(sqlite3.connect(db)) as std:
        return str(std.execute("PRAGMA integrity_check").fetchone()[0])


def _file_of(database: Any) -> str | None:
    text = os.fsdecode(database) if isinstance(database, (str, bytes, os.PathLike)) else None
    if not text or text == ":memory:":
        return None
    if text.startswith("file:"):
        text = urlsplit(text).path
    return os.path.realpath(text)


# every APSW connection the process made, with its file (read at creation: an attribute of
# a connection busy on another thread cannot be read)
_opened: weakref.WeakKeyDictionary[apsw.Connection, str] = weakref.WeakKeyDictionary()


def _record(conn: apsw.Connection) -> None:
    if conn.filename:
        _opened[conn] = os.path.realpath(conn.filename)


def _held() -> set[str]:
    held = set()
    for conn, path in list(_opened.items()):
        try:
            conn.filename  # noqa: B018 (raises once closed)
        except apsw.ConnectionClosedError:
            continue
        except apsw.ThreadingViolationError:  # in use on a pool thread: open
            pass
        held.add(path)
    return held


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if event != "sqlite3.connect" or not args:
        return
    target = _file_of(args[0])
    if target is not None and target in _held():
        raise RuntimeError(
            f"the stdlib opened {target}, which APSW has open in this process: one SQLite library "
            "per file (docs/concepts.md#one-sqlite-library-per-file); use tests.statedb.open_state_db"
        )


def refuse_stdlib_beside_apsw() -> None:
    """Make a stdlib open of a file APSW holds fail loudly instead of a later bus error."""
    apsw.connection_hooks.append(_record)
    sys.addaudithook(_audit)


__all__ = ["integrity_of", "open_state_db", "refuse_stdlib_beside_apsw"]
