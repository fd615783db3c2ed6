"""The budget ledger of one tenant in its own state.db (docs/concepts.md#budgets).

Tenant data, so it lives in the profile: removed with the person, carried by
`profiles export` (state.db and its text dump), locked and fenced like every other write
of the profile. Two counters per period (`d:YYYY-MM-DD`, `m:YYYY-MM`, in the tenant's time
zone) hold tokens and cost; cost is kept in integer nano-units of the price's currency so
sums are exact. A call is reserved (its estimate added, a pending row written) before it
is made (in one transaction with the check against the caps) and settled (the estimate
replaced by the response's usage) with the profile's next write, normally the turn's
answer: a crash in between leaves the estimate counted, an over-count, never an
under-count. The operator's per-tenant caps (`budget set`) are `budget.json` beside it.

The functions take a connection inside a transaction (APSW, through
`SessionStore.transact` in the gateway and directly in `hermes-gateway budget`), so both run
the same SQL.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import apsw

from agent.sessions import SessionStore
from agent.sessions.db import BUDGET_DDL
from agent.vault import ProfileFiles, VaultError, as_files

if TYPE_CHECKING:
    from agent.metering import Reservation

NANOS = 1_000_000_000  # nano-units per unit of cost


OVERRIDE_FILE = "budget.json"
#: a state.db connection: APSW, one SQLite library per file (docs/concepts.md#one-sqlite-library-per-file)
Conn = apsw.Connection
LIMIT_KEYS = ("tokens_per_day", "tokens_per_month", "cost_per_day", "cost_per_month")
log = logging.getLogger("hermes.agent")


@dataclass(frozen=True)
class Totals:
    """A tenant's use in the current day and month (cost in nano-units)."""

    day_tokens: int = 0
    day_cost_nanos: int = 0
    month_tokens: int = 0
    month_cost_nanos: int = 0


def ensure_tables(db: Conn) -> None:
    """Create the ledger's tables in a state.db no store has opened since they were added
    (a store's open does it: the turn's steps below assume them)."""
    db.execute(BUDGET_DDL, can_cache=False)


def _add(db: Conn, period: str, tokens: int, cost_nanos: int) -> None:
    """Add to one period's counters (a settle's negative delta never takes them below 0)."""
    t, c = int(tokens), int(cost_nanos)
    db.execute(
        "INSERT INTO budget_usage(period, tokens, cost_nanos) VALUES (?, MAX(?, 0), MAX(?, 0)) "
        "ON CONFLICT(period) DO UPDATE SET tokens = MAX(budget_usage.tokens + ?, 0), "
        "cost_nanos = MAX(budget_usage.cost_nanos + ?, 0)",
        (period, t, c, t, c),
    )


def over_cap(t: Totals, limits: dict[str, float | None]) -> str | None:
    """The first cap `t` has reached (the month's before the day's: it resets later), or None."""
    used = {
        "tokens_per_month": t.month_tokens,
        "cost_per_month": t.month_cost_nanos,
        "tokens_per_day": t.day_tokens,
        "cost_per_day": t.day_cost_nanos,
    }
    for key, value in used.items():
        cap = limits.get(key)
        if cap is not None and value >= (int(cap) if key.startswith("tokens") else round(cap * NANOS)):
            return key
    return None


def reserve(
    db: Conn,
    call_id: str,
    day: str,
    month: str,
    tokens: int,
    cost_nanos: int,
    limits: dict[str, float | None],
) -> tuple[Totals, bool]:
    """Check the caps and, under them, count a call's estimate before it is made: the use
    before this call, and whether it was reserved (False: a cap is reached, nothing written)."""
    before = totals(db, day, month)
    if over_cap(before, limits) is not None:
        return before, False
    now = time.time()
    # estimates of calls never settled (stopped, or cut by a crash) stay counted; their rows go
    db.execute("DELETE FROM budget_pending WHERE at < ?", (now - 86400,))
    db.execute(
        "INSERT INTO budget_pending(call_id, day, month, tokens, cost_nanos, at) VALUES (?, ?, ?, ?, ?, ?)",
        (call_id, day, month, int(tokens), int(cost_nanos), now),
    )
    _add(db, f"d:{day}", tokens, cost_nanos)
    _add(db, f"m:{month}", tokens, cost_nanos)
    return before, True


def settle(db: Conn, call_id: str, day: str, month: str, tokens: int, cost_nanos: int) -> None:
    """Replace a call's estimate by what it used (all of it when a reset dropped the estimate)."""
    row = db.execute("SELECT day, month, tokens, cost_nanos FROM budget_pending WHERE call_id=?", (call_id,)).fetchone()
    if row is not None:
        day, month = row[0], row[1]
        tokens, cost_nanos = int(tokens) - int(row[2]), int(cost_nanos) - int(row[3])
        db.execute("DELETE FROM budget_pending WHERE call_id=?", (call_id,))
    _add(db, f"d:{day}", tokens, cost_nanos)
    _add(db, f"m:{month}", tokens, cost_nanos)


def totals(db: Conn, day: str, month: str) -> Totals:
    got = {
        r[0]: (int(r[1]), int(r[2]))
        for r in db.execute(
            "SELECT period, tokens, cost_nanos FROM budget_usage WHERE period IN (?, ?)", (f"d:{day}", f"m:{month}")
        )
    }
    d, m = got.get(f"d:{day}", (0, 0)), got.get(f"m:{month}", (0, 0))
    return Totals(d[0], d[1], m[0], m[1])


def mark_once(db: Conn, key: str) -> bool:
    """Record that `key` (a notice of one period) was said; False when it was already."""
    if db.execute("SELECT 1 FROM budget_said WHERE key=?", (key,)).fetchone() is not None:
        return False
    db.execute("INSERT INTO budget_said(key, at) VALUES (?, ?)", (key, time.time()))
    return True


def read_override(profile: ProfileFiles | Path) -> dict[str, float | None]:
    """The operator's per-tenant caps (`budget set`, budget.json): key -> value, None = no cap."""
    files = as_files(profile)
    try:
        data = json.loads(files.read_text(OVERRIDE_FILE))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, VaultError):
        log.warning("%s is unreadable; the config's budget applies", files.path(OVERRIDE_FILE))
        return {}
    if not isinstance(data, dict):
        return {}
    return {k: data[k] for k in LIMIT_KEYS if k in data and (data[k] is None or isinstance(data[k], (int, float)))}


def write_override(profile: ProfileFiles | Path, limits: dict[str, float | None]) -> None:
    """Replace the per-tenant caps, sealed in an encrypted profile ({}: the config's caps apply again)."""
    files = as_files(profile)
    if not limits:
        files.path(OVERRIDE_FILE).unlink(missing_ok=True)
        return
    files.write_text(OVERRIDE_FILE, json.dumps({k: limits[k] for k in LIMIT_KEYS if k in limits}, indent=1))


def reset(db: Conn) -> None:
    """Start the tenant's count afresh: every period's use, open estimates and the notices said."""
    ensure_tables(db)
    db.execute("DELETE FROM budget_usage")
    db.execute("DELETE FROM budget_pending")
    db.execute("DELETE FROM budget_said")


class ProfileLedger:
    """The ledger of one open profile, through its session store (the `Ledger` of
    agent/metering.py for a single node)."""

    def __init__(self, store: SessionStore) -> None:
        self._store = store

    async def reserve(
        self, call_id: str, day: str, month: str, tokens: int, cost_nanos: int, limits: dict[str, float | None]
    ) -> tuple[Totals, bool]:
        return await self._store.transact(lambda db: reserve(db, call_id, day, month, tokens, cost_nanos, limits))

    def reserving(self, r: Reservation) -> Callable[[Conn], bool]:
        """`reserve` as a step of another transaction of this store (the turn's write of the
        person's message): True when made; False, with `r.before` set, at a cap."""

        def step(db: Conn) -> bool:
            r.before, made = reserve(db, r.call_id, r.period.day, r.period.month, r.tokens, r.cost_nanos, r.limits)
            return made

        return step

    async def settle(self, call_id: str, day: str, month: str, tokens: int, cost_nanos: int) -> None:
        # with the profile's next write (normally the turn's answer), not a transaction of its own
        self._store.transact_later(lambda db: settle(db, call_id, day, month, tokens, cost_nanos))

    async def totals(self, day: str, month: str) -> Totals:
        return await self._store.transact(lambda db: totals(db, day, month))

    async def mark_once(self, key: str) -> bool:
        return await self._store.transact(lambda db: mark_once(db, key))


__all__ = [
    "LIMIT_KEYS",
    "NANOS",
    "OVERRIDE_FILE",
    "ProfileLedger",
    "Totals",
    "ensure_tables",
    "mark_once",
    "over_cap",
    "read_override",
    "reserve",
    "reset",
    "settle",
    "totals",
    "write_override",
]
