"""How a failed turn is classified, so the gateway says what is true about the message.

- A storage fault (disk full, a database locked by someone else) and a resource fault
  (descriptors, memory) pass by themselves: the turn keeps its messages pending and is
  retried in its lane (order holds) until it works again.
- A damaged profile (`ProfileDamaged`) holds its lanes until it is repaired.
- The model that cannot answer now (unreachable, over its rate limit, our credentials
  refused: `ModelDown`) is retried the same way; so is anything else that is not the
  message's own fault. Only a message that can never be answered (its conversation
  refused by the provider, too long for the model's window, an answer that ran past its
  deadline) is finished, and the person is told why.
"""

from __future__ import annotations

import errno

from agent.sessions.errors import damaged_sqlite, sqlite_cannot_open, sqlite_transient
from core.errors import cause_chain
from tenancy.profiles import ProfileDamaged

_DISK_FULL = {errno.ENOSPC, errno.EDQUOT}
_NO_DESCRIPTORS = {errno.EMFILE, errno.ENFILE}

__all__ = [
    "MODEL_DOWN_KINDS",
    "ModelDown",
    "ProfileDamaged",
    "damaged_database",
    "damaged_profile",
    "resource_fault",
    "storage_fault",
]

#: LLMError kinds that say nothing about the message: asking again later can succeed
MODEL_DOWN_KINDS = frozenset({"unavailable", "rate_limited", "auth"})


_MODEL_DOWN_WHY = {
    "unavailable": "the model server is unreachable or failing",
    "rate_limited": "the model provider's rate limit",
    "auth": "the model provider refused our credentials; an operator needs to fix the API key",
}


class ModelDown(Exception):
    """The model cannot answer now for a reason that is not the message's own: the turn
    keeps its messages pending and is retried with backoff, like a storage fault. It names
    only the kind: no text of the turn (a replay's stored answers) reaches the log."""

    def __init__(self, kind: str) -> None:
        super().__init__(f"the model cannot answer ({_MODEL_DOWN_WHY.get(kind, kind)})")
        self.kind = kind


def storage_fault(exc: BaseException) -> str | None:
    """ "disk full" or "database locked" when `exc` (or what caused it) is one, else None."""
    for cur in cause_chain(exc):
        if isinstance(cur, OSError) and cur.errno in _DISK_FULL:
            return "disk full"
        fault = sqlite_transient(cur)
        if fault is not None:
            return fault
    return None


def resource_fault(exc: BaseException) -> str | None:
    """ "too many open files" or "out of memory" when `exc` (or its cause) is one, else None.

    SQLite reports a descriptor limit only as "unable to open database file"; that counts
    too (closing idle profiles is what frees descriptors, and it is harmless otherwise)."""
    for cur in cause_chain(exc):
        if isinstance(cur, MemoryError) or (isinstance(cur, OSError) and cur.errno == errno.ENOMEM):
            return "out of memory"
        if isinstance(cur, OSError) and cur.errno in _NO_DESCRIPTORS:
            return "too many open files"
        if sqlite_cannot_open(cur):
            return "too many open files"
    return None


def damaged_database(exc: BaseException) -> str | None:
    """What SQLite said when `exc` (or its cause) shows a damaged database file ("database
    disk image is malformed", "file is not a database"), else None."""
    for cur in cause_chain(exc):
        if damaged_sqlite(cur):
            return f"state.db cannot be read ({cur})"
    return None


def damaged_profile(exc: BaseException) -> ProfileDamaged | None:
    """The `ProfileDamaged` in `exc`'s cause chain, if any."""
    for cur in cause_chain(exc):
        if isinstance(cur, ProfileDamaged):
            return cur
    return None


class StartupError(Exception):
    """The gateway cannot serve (no platform came up, gateway.db unreadable, the listen
    address taken); the message is one sentence for the operator, never a traceback."""
