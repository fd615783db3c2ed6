"""The budget ledger of one tenant in its own state.db (docs/concepts.md#budgets).

Tenant data, so it lives in the profile: removed with the person, carried by
`profiles export` (state.db and its text dump), locked and fenced like every other write
of the profile. Two counters per period (`d:YYYY-MM-DD`, `m:YYYY-MM`, in the tenant's time
zone) hold tokens and cost; cost is kept in integer nano-units of the price's currency so
sums are exact. A call is reserved (its estimate added, a pending row written) before it
is made and settled (the estimate replaced by the response's usage) after: a crash in
between leaves the estimate counted, an over-count, never an under-count.

The functions take a `sqlite3.Connection` inside a transaction, so the gateway (through
`SessionStore.transact`) and the operator's CLI (`hermes-gateway budget`) run the same SQL.
"""

from __future__ import annotations

import json
import sqlite3
import time
from dataclasses import dataclass
from typing import Any

from agent.sessions import SessionStore

NANOS = 1_000_000_000  # nano-units per unit of cost

_DDL = """
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
CREATE TABLE IF NOT EXISTS budget_state(key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""

_OVERRIDE_KEY = "override"
_LIMIT_KEYS = ("tokens_per_day", "tokens_per_month", "cost_per_day", "cost_per_month")


@dataclass(frozen=True)
class Totals:
    """A tenant's use in the current day and month (cost in nano-units)."""

    day_tokens: int = 0
    day_cost_nanos: int = 0
    month_tokens: int = 0
    month_cost_nanos: int = 0


def ensure_tables(db: sqlite3.Connection) -> None:
    for stmt in _DDL.split(";"):
        if stmt.strip():
            db.execute(stmt)


def _add(db: sqlite3.Connection, period: str, tokens: int, cost_nanos: int) -> None:
    """Add to one period's counters (a settle's negative delta never takes them below 0)."""
    t, c = int(tokens), int(cost_nanos)
    db.execute(
        "INSERT INTO budget_usage(period, tokens, cost_nanos) VALUES (?, MAX(?, 0), MAX(?, 0)) "
        "ON CONFLICT(period) DO UPDATE SET tokens = MAX(budget_usage.tokens + ?, 0), "
        "cost_nanos = MAX(budget_usage.cost_nanos + ?, 0)",
        (period, t, c, t, c),
    )


def reserve(db: sqlite3.Connection, call_id: str, day: str, month: str, tokens: int, cost_nanos: int) -> None:
    """Count a call's estimate before it is made."""
    ensure_tables(db)
    now = time.time()
    # estimates of calls never settled (stopped, or cut by a crash) stay counted; their rows go
    db.execute("DELETE FROM budget_pending WHERE at < ?", (now - 86400,))
    db.execute(
        "INSERT INTO budget_pending(call_id, day, month, tokens, cost_nanos, at) VALUES (?, ?, ?, ?, ?, ?)",
        (call_id, day, month, int(tokens), int(cost_nanos), now),
    )
    _add(db, f"d:{day}", tokens, cost_nanos)
    _add(db, f"m:{month}", tokens, cost_nanos)


def settle(db: sqlite3.Connection, call_id: str, day: str, month: str, tokens: int, cost_nanos: int) -> None:
    """Replace a call's estimate by what it used (all of it when a reset dropped the estimate)."""
    ensure_tables(db)
    row = db.execute("SELECT day, month, tokens, cost_nanos FROM budget_pending WHERE call_id=?", (call_id,)).fetchone()
    if row is not None:
        day, month = row[0], row[1]
        tokens, cost_nanos = int(tokens) - int(row[2]), int(cost_nanos) - int(row[3])
        db.execute("DELETE FROM budget_pending WHERE call_id=?", (call_id,))
    _add(db, f"d:{day}", tokens, cost_nanos)
    _add(db, f"m:{month}", tokens, cost_nanos)


def totals(db: sqlite3.Connection, day: str, month: str) -> Totals:
    ensure_tables(db)
    got = {
        r[0]: (int(r[1]), int(r[2]))
        for r in db.execute(
            "SELECT period, tokens, cost_nanos FROM budget_usage WHERE period IN (?, ?)", (f"d:{day}", f"m:{month}")
        )
    }
    d, m = got.get(f"d:{day}", (0, 0)), got.get(f"m:{month}", (0, 0))
    return Totals(d[0], d[1], m[0], m[1])


def mark_once(db: sqlite3.Connection, key: str) -> bool:
    """Record that `key` (a notice of one period) was said; False when it was already."""
    ensure_tables(db)
    cur = db.execute("INSERT OR IGNORE INTO budget_state(key, value) VALUES (?, ?)", (f"said:{key}", str(time.time())))
    return cur.rowcount == 1


def get_override(db: sqlite3.Connection) -> dict[str, Any]:
    """The operator's per-tenant limits (`budget set`): key -> value, None = no cap."""
    ensure_tables(db)
    row = db.execute("SELECT value FROM budget_state WHERE key=?", (_OVERRIDE_KEY,)).fetchone()
    if row is None:
        return {}
    data = json.loads(row[0])
    return {k: data[k] for k in _LIMIT_KEYS if k in data} if isinstance(data, dict) else {}


def set_override(db: sqlite3.Connection, limits: dict[str, Any] | None) -> None:
    """Replace the per-tenant limits (None or {}: the config's limits apply again)."""
    ensure_tables(db)
    if not limits:
        db.execute("DELETE FROM budget_state WHERE key=?", (_OVERRIDE_KEY,))
        return
    db.execute(
        "INSERT INTO budget_state(key, value) VALUES (?, ?) ON CONFLICT(key) DO UPDATE SET value=excluded.value",
        (_OVERRIDE_KEY, json.dumps({k: limits[k] for k in _LIMIT_KEYS if k in limits})),
    )


def reset(db: sqlite3.Connection) -> None:
    """Start the tenant's count afresh: every period's use, open estimates and the notices said."""
    ensure_tables(db)
    db.execute("DELETE FROM budget_usage")
    db.execute("DELETE FROM budget_pending")
    db.execute("DELETE FROM budget_state WHERE key LIKE 'said:%'")


class ProfileLedger:
    """The ledger of one open profile, through its session store (the `Ledger` of
    agent/metering.py for a single node)."""

    def __init__(self, store: SessionStore) -> None:
        self._store = store

    async def reserve(self, call_id: str, day: str, month: str, tokens: int, cost_nanos: int) -> None:
        await self._store.transact(lambda db: reserve(db, call_id, day, month, tokens, cost_nanos))

    async def settle(self, call_id: str, day: str, month: str, tokens: int, cost_nanos: int) -> None:
        await self._store.transact(lambda db: settle(db, call_id, day, month, tokens, cost_nanos))

    async def totals(self, day: str, month: str) -> Totals:
        return await self._store.transact(lambda db: totals(db, day, month))

    async def mark_once(self, key: str) -> bool:
        return await self._store.transact(lambda db: mark_once(db, key))

    async def override(self) -> dict[str, Any]:
        return await self._store.transact(get_override)


__all__ = [
    "NANOS",
    "ProfileLedger",
    "Totals",
    "ensure_tables",
    "get_override",
    "mark_once",
    "reserve",
    "reset",
    "set_override",
    "settle",
    "totals",
]
