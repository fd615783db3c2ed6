"""Cluster mode's shared identity state: pairing codes and approvals, link codes and
requests in `shared_kv`, identity links in `identity_links`, so a code one node gave is
redeemed through any node and a link made on one node routes the next message on every node.

`SharedIdentity` is built with the gateway's other parts (gateway/cluster/build.py) and
started once the node's pool is open, before anything is replayed. The first node of a new
cluster brings in what the single-node gateway kept (links.json's links and gateway.db's
pairing approvals), once.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
from pathlib import Path

from core.settings import Config
from gateway.cluster.db import Pool, fetch_one
from gateway.cluster.links import PgLinkStore, lease_guard
from gateway.cluster.shared_kv import PgKV
from tenancy.identity import IdentityLinks

_IMPORTED = "cluster:imported-single-node-state"


class SharedIdentity:
    """The access store, links and merge guard of a node, kept in PostgreSQL."""

    def __init__(self, cfg: Config, pool: Pool, node_id: str, ttl_s: float) -> None:
        self.data_dir = cfg.data_dir
        self.pool = pool
        self.kv = PgKV(pool)  # pairing and link codes, approvals
        self.store = PgLinkStore(pool)
        self.links = IdentityLinks.shared(self.store, cfg.tenancy)
        self.merge_guard = lease_guard(pool, node_id, ttl_s)

    async def start(self) -> None:
        """Bring in the single-node state (once per cluster), then read the links."""
        await import_single_node_state(self.data_dir, self.pool, self.kv, self.store)
        await self.store.refresh(self.links, force=True)

    async def refresh(self) -> bool:
        """Bring `links` up to date with links other nodes made (before routing a message)."""
        return await self.store.refresh(self.links)


async def import_single_node_state(data_dir: Path, pool: Pool, kv: PgKV, store: PgLinkStore) -> bool:
    """Once per cluster: the runtime links of links.json and the pairing approvals of
    gateway.db, so switching a gateway to cluster mode keeps who is linked and paired.
    Entries already in the database win. True when this call did the import."""
    async with pool.connection() as conn, conn.transaction():
        await conn.execute("SELECT pg_advisory_xact_lock(hashtext('hermes-gateway import ' || current_schema()))")
        if (await fetch_one(conn, "SELECT count(*) AS n FROM shared_kv WHERE key = %s", (_IMPORTED,)))["n"]:
            return False
        links, paired = await asyncio.to_thread(_read_single_node, data_dir)
        for key, value in paired:
            await conn.execute(
                "INSERT INTO shared_kv (key, value) VALUES (%s, %s) ON CONFLICT DO NOTHING", (key, value)
            )
        for name, principals in links.items():
            for p in principals:
                await conn.execute(
                    "INSERT INTO identity_links (principal, link_name) VALUES (%s, %s) ON CONFLICT DO NOTHING",
                    (p, name),
                )
        await conn.execute("UPDATE identity_links_generation SET generation = generation + 1")
        await conn.execute("INSERT INTO shared_kv (key, value) VALUES (%s, %s)", (_IMPORTED, json.dumps(str(data_dir))))
    return True


def _read_single_node(data_dir: Path) -> tuple[dict[str, list[str]], list[tuple[str, str]]]:
    links: dict[str, list[str]] = {}
    path = data_dir / "links.json"
    if path.exists():
        links = IdentityLinks.load(path).as_dict()
    paired: list[tuple[str, str]] = []
    db = data_dir / "gateway.db"
    if db.exists():
        conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
        try:
            paired = list(conn.execute("SELECT key, value FROM kv WHERE key LIKE 'paired:%'"))
        except sqlite3.OperationalError:  # no kv table yet
            paired = []
        finally:
            conn.close()
    return links, paired
