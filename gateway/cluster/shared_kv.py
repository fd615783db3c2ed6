"""The `KeyValue` store of gateway/kv.py in PostgreSQL (table `shared_kv`): pairing codes
and approvals, link codes and requests are seen by every node, so a code one node gave out
is redeemed or approved through any other."""

from __future__ import annotations

from collections.abc import Sequence

from gateway.cluster.db import Pool


class PgKV:
    def __init__(self, pool: Pool) -> None:
        self.pool = pool

    async def get(self, key: str) -> str | None:
        async with self.pool.connection() as conn:
            row = await (await conn.execute("SELECT value FROM shared_kv WHERE key = %s", (key,))).fetchone()
            return row["value"] if row else None

    async def put(self, key: str, value: str | None) -> None:
        async with self.pool.connection() as conn:
            if value is None:
                await conn.execute("DELETE FROM shared_kv WHERE key = %s", (key,))
            else:
                await conn.execute(
                    """INSERT INTO shared_kv (key, value) VALUES (%s, %s)
                       ON CONFLICT (key) DO UPDATE SET value = EXCLUDED.value, updated_at = now()""",
                    (key, value),
                )

    async def take(self, key: str) -> str | None:
        async with self.pool.connection() as conn:
            row = await (await conn.execute("DELETE FROM shared_kv WHERE key = %s RETURNING value", (key,))).fetchone()
            return row["value"] if row else None

    async def get_many(self, keys: Sequence[str]) -> dict[str, str]:
        if not keys:
            return {}
        async with self.pool.connection() as conn:
            rows = await (
                await conn.execute("SELECT key, value FROM shared_kv WHERE key = ANY(%s)", (list(keys),))
            ).fetchall()
            return {r["key"]: r["value"] for r in rows}

    async def scan(self, prefix: str) -> list[tuple[str, str]]:
        async with self.pool.connection() as conn:
            rows = await (
                await conn.execute(
                    "SELECT key, value FROM shared_kv WHERE key >= %s AND key < %s ORDER BY key",
                    (prefix, prefix + "\U0010ffff"),
                )
            ).fetchall()
            return [(r["key"], r["value"]) for r in rows]
