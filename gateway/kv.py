"""Small shared state (pairing codes and approvals, link codes, link requests, rate-limit
stamps) as string keys and values.

`Access` and `Linking` keep it through this interface, so a single node uses gateway.db's
kv table (`SqliteKV`) and a cluster node the same keys in PostgreSQL
(`gateway.cluster.shared_kv.PgKV`), where a code issued on one node is redeemed on another.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, cast

if TYPE_CHECKING:  # pragma: no cover
    from gateway.inbox import Inbox


class KeyValue(Protocol):
    async def get(self, key: str) -> str | None: ...

    async def put(self, key: str, value: str | None) -> None:
        """Set `key`; None deletes it."""

    async def take(self, key: str) -> str | None:
        """Read and delete `key` in one step: of two callers racing for it, one gets it."""

    async def get_many(self, keys: Sequence[str]) -> dict[str, str]:
        """The keys of `keys` that exist, in one lookup."""

    async def scan(self, prefix: str) -> list[tuple[str, str]]:
        """Every (key, value) whose key starts with `prefix`."""


class SqliteKV:
    """The single-node store: the kv table of gateway.db, through the open `Inbox`."""

    def __init__(self, inbox: Inbox) -> None:
        self.inbox = inbox

    async def get(self, key: str) -> str | None:
        return await self.inbox.get(key)

    async def put(self, key: str, value: str | None) -> None:
        await self.inbox.put(key, value)

    async def take(self, key: str) -> str | None:
        def run(con: sqlite3.Connection) -> str | None:
            row = con.execute("SELECT value FROM kv WHERE key=?", (key,)).fetchone()
            if row is not None:
                con.execute("DELETE FROM kv WHERE key=?", (key,))
            return cast("str | None", row[0] if row else None)

        return await self.inbox.atomically(run)

    async def get_many(self, keys: Sequence[str]) -> dict[str, str]:
        if not keys:
            return {}
        marks = ", ".join("?" for _ in keys)
        rows = await self.inbox.db.execute_fetchall(f"SELECT key, value FROM kv WHERE key IN ({marks})", list(keys))
        return {str(k): str(v) for k, v in rows}

    async def scan(self, prefix: str) -> list[tuple[str, str]]:
        # a range on the primary key: every key that starts with `prefix` (keys are ASCII)
        rows = await self.inbox.db.execute_fetchall(
            "SELECT key, value FROM kv WHERE key >= ? AND key < ?", (prefix, prefix + "\U0010ffff")
        )
        return [(k, v) for k, v in rows]
