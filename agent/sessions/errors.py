"""Errors the session store raises on purpose."""

from __future__ import annotations


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
