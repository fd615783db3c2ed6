"""The budget ledger in PostgreSQL (docs/cluster.md#budgets): the `Ledger` of
agent/metering.py for cluster mode, one row set per tenant in `budget_usage`,
`budget_pending` and `budget_said`.

The same rules as a profile's own ledger (agent/ledger.py): the caps are checked and the
estimate counted in one transaction before the call, the count settled from the usage
after it, a crash in between over-counts, never under-counts. Each reservation holds a
transaction-scoped advisory lock on its tenant, so two nodes (a lease handed over mid-turn,
a budget CLI beside a node) never both pass a cap the tenant has one call left under.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

from agent.ledger import Totals, over_cap
from core.settings import Config
from gateway.cluster.db import Conn, Pool, dsn_from_env, open_pool

T = TypeVar("T")

_LOCK = "SELECT pg_advisory_xact_lock(hashtext('hermes-gateway budget ' || %s))"
_ADD = """
INSERT INTO budget_usage (tenant, period, tokens, cost_nanos)
VALUES (%(tenant)s, %(period)s, GREATEST(%(tokens)s, 0), GREATEST(%(cost)s, 0))
ON CONFLICT (tenant, period) DO UPDATE SET
    tokens = GREATEST(budget_usage.tokens + %(tokens)s, 0),
    cost_nanos = GREATEST(budget_usage.cost_nanos + %(cost)s, 0)
"""


async def _add(conn: Conn, tenant: str, period: str, tokens: int, cost_nanos: int) -> None:
    """Add to one period's counters; a settle's negative delta never takes them below 0."""
    await conn.execute(_ADD, {"tenant": tenant, "period": period, "tokens": int(tokens), "cost": int(cost_nanos)})


async def _totals(conn: Conn, tenant: str, day: str, month: str) -> Totals:
    rows = await (
        await conn.execute(
            "SELECT period, tokens, cost_nanos FROM budget_usage WHERE tenant = %s AND period = ANY(%s)",
            (tenant, [f"d:{day}", f"m:{month}"]),
        )
    ).fetchall()
    got = {r["period"]: (int(r["tokens"]), int(r["cost_nanos"])) for r in rows}
    d, m = got.get(f"d:{day}", (0, 0)), got.get(f"m:{month}", (0, 0))
    return Totals(d[0], d[1], m[0], m[1])


class PgLedger:
    """One tenant's counts in PostgreSQL, atomic across nodes."""

    def __init__(self, pool: Pool, tenant: str) -> None:
        self.pool, self.tenant = pool, tenant

    async def reserve(
        self, call_id: str, day: str, month: str, tokens: int, cost_nanos: int, limits: dict[str, float | None]
    ) -> tuple[Totals, bool]:
        async with self.pool.connection() as conn, conn.transaction():
            await conn.execute(_LOCK, (self.tenant,))
            before = await _totals(conn, self.tenant, day, month)
            if over_cap(before, limits) is not None:
                return before, False
            # estimates of calls never settled (stopped, or cut by a crash) stay counted; their rows go
            await conn.execute(
                "DELETE FROM budget_pending WHERE tenant = %s AND at < now() - interval '1 day'", (self.tenant,)
            )
            await conn.execute(
                "INSERT INTO budget_pending (tenant, call_id, day, month, tokens, cost_nanos) "
                "VALUES (%s, %s, %s, %s, %s, %s)",
                (self.tenant, call_id, day, month, int(tokens), int(cost_nanos)),
            )
            await _add(conn, self.tenant, f"d:{day}", tokens, cost_nanos)
            await _add(conn, self.tenant, f"m:{month}", tokens, cost_nanos)
            return before, True

    async def settle(self, call_id: str, day: str, month: str, tokens: int, cost_nanos: int) -> None:
        async with self.pool.connection() as conn, conn.transaction():
            row = await (
                await conn.execute(
                    "DELETE FROM budget_pending WHERE tenant = %s AND call_id = %s RETURNING day, month, tokens, cost_nanos",
                    (self.tenant, call_id),
                )
            ).fetchone()
            if row is not None:  # else a reset dropped the estimate: all of the usage counts
                day, month = row["day"], row["month"]
                tokens, cost_nanos = int(tokens) - int(row["tokens"]), int(cost_nanos) - int(row["cost_nanos"])
            await _add(conn, self.tenant, f"d:{day}", tokens, cost_nanos)
            await _add(conn, self.tenant, f"m:{month}", tokens, cost_nanos)

    async def totals(self, day: str, month: str) -> Totals:
        async with self.pool.connection() as conn:
            return await _totals(conn, self.tenant, day, month)

    async def mark_once(self, key: str) -> bool:
        async with self.pool.connection() as conn:
            cur = await conn.execute(
                "INSERT INTO budget_said (tenant, key) VALUES (%s, %s) ON CONFLICT DO NOTHING", (self.tenant, key)
            )
            return cur.rowcount == 1

    async def reset(self) -> None:
        """Start the tenant's count afresh: every period's use, open estimates, notices said."""
        async with self.pool.connection() as conn, conn.transaction():
            await conn.execute(_LOCK, (self.tenant,))
            for table in ("budget_usage", "budget_pending", "budget_said"):
                await conn.execute(f"DELETE FROM {table} WHERE tenant = %s", (self.tenant,))


def with_cluster_ledger(cfg: Config, tenant: str, fn: Callable[[PgLedger], Awaitable[T]]) -> T:
    """Run `fn` on the tenant's ledger from a command (`hermes-gateway budget`; no loop running)."""

    async def run() -> T:
        pool = await open_pool(dsn_from_env(cfg.cluster.postgres_dsn_env or ""), max_size=1)
        try:
            return await fn(PgLedger(pool, tenant))
        finally:
            await pool.close()

    return asyncio.run(run())


__all__ = ["PgLedger", "with_cluster_ledger"]
