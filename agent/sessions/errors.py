"""Errors the session store raises on purpose."""

from __future__ import annotations

import sqlite3

import apsw


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


class WriteRefused(SessionStoreError):
    """A write's gate (a budget reservation riding on it) said no: nothing was stored."""


# What SQLite says about a profile's state.db, by class: APSW's (the store) and the stdlib's
# (admin tools, gateway.db) alike, so one classification serves both engines.
def damaged_sqlite(exc: BaseException) -> bool:
    """True for "file is not a database" / "database disk image is malformed"."""
    if isinstance(exc, (apsw.CorruptError, apsw.NotADBError)):
        return True
    return type(exc) is sqlite3.DatabaseError  # its subclasses are other failures


def sqlite_transient(exc: BaseException) -> str | None:
    """ "disk full" or "database locked" when SQLite said so, else None."""
    if isinstance(exc, apsw.FullError):
        return "disk full"
    if isinstance(exc, (apsw.BusyError, apsw.LockedError)):
        return "database locked"
    if isinstance(exc, sqlite3.OperationalError):
        text = str(exc).lower()
        if any(t in text for t in _SQLITE_TRANSIENT):
            return "disk full" if "full" in text else "database locked"
    return None


def sqlite_cannot_open(exc: BaseException) -> bool:
    """ "unable to open database file" (SQLite's only word for a descriptor limit too)."""
    if isinstance(exc, apsw.CantOpenError):
        return True
    return isinstance(exc, sqlite3.OperationalError) and "unable to open database file" in str(exc).lower()


_SQLITE_TRANSIENT = ("database is locked", "database or disk is full", "disk is full", "database table is locked")
