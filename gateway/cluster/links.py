"""Identity links in PostgreSQL (table `identity_links`): the `LinkStore` of
tenancy/identity.py for cluster mode.

`IdentityLinks.save()` sends its changes here (from a thread, so on a connection of its
own); `refresh(links)` reads the links back only when `identity_links_generation` moved,
so a node can call it before routing every message for the price of one primary-key read.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager

import psycopg
from psycopg.rows import DictRow

from core.settings import Config
from gateway.cluster.db import ClusterError, Conn, Pool, dsn_from_env, fetch_one, one_line, open_pool
from gateway.cluster.leases import Lease, acquire_lease, release_lease, renew_lease
from tenancy.identity import IdentityLinks


class PgLinkStore:
    def __init__(self, pool: Pool, connect: Callable[[], psycopg.Connection[DictRow]] | None = None) -> None:
        """`connect` opens a blocking connection for `apply` (default: the pool's DSN and options)."""
        self.pool = pool
        self._connect = connect or (lambda: psycopg.connect(pool.conninfo, **pool.kwargs))  # type: ignore[arg-type]
        self._seen: int | None = None  # the generation `refresh` last loaded

    def apply(self, linked: list[tuple[str, str]], unlinked: list[tuple[str, str]]) -> None:
        """Record the changes in one transaction; ValueError if a principal is linked to
        another name already (another node linked it meanwhile): nothing is recorded then."""
        if not linked and not unlinked:
            return
        try:
            with self._connect() as conn, conn.transaction():
                for name, principal in unlinked:
                    conn.execute(
                        "DELETE FROM identity_links WHERE principal = %s AND link_name = %s", (principal, name)
                    )
                for name, principal in linked:
                    conn.execute(
                        "INSERT INTO identity_links (principal, link_name) VALUES (%s, %s) ON CONFLICT DO NOTHING",
                        (principal, name),
                    )
                    row = conn.execute(
                        "SELECT link_name FROM identity_links WHERE principal = %s", (principal,)
                    ).fetchone()
                    other = row["link_name"] if row else None  # the pool's kwargs give dict rows
                    if other != name:
                        raise ValueError(f"{principal!r} is already linked to {other!r}; unlink it first")
                conn.execute("UPDATE identity_links_generation SET generation = generation + 1")
        except psycopg.Error as err:
            raise ClusterError(f"could not record identity links: {one_line(err)}") from None

    async def refresh(self, links: IdentityLinks, *, force: bool = False) -> bool:
        """Bring `links` up to date with the database; True when they were re-read."""
        async with self.pool.connection() as conn:
            gen = int((await fetch_one(conn, "SELECT generation FROM identity_links_generation"))["generation"])
            if gen == self._seen and not force:
                return False
            links.replace_runtime(await _read(conn))
        self._seen = gen
        return True


def load_shared_links(cfg: Config) -> IdentityLinks:
    """The identity links as the cluster has them (the config's pinned, the runtime ones from
    PostgreSQL, not links.json), for the admin commands (no loop running); a change saved
    through them is recorded in PostgreSQL (docs/cluster.md#shared-identity-state)."""

    async def run() -> IdentityLinks:
        pool = await open_pool(dsn_from_env(cfg.cluster.postgres_dsn_env or ""), max_size=1)
        try:
            store = PgLinkStore(pool)
            links = IdentityLinks.shared(store, cfg.tenancy)
            await store.refresh(links, force=True)
            return links
        finally:
            await pool.close()

    return asyncio.run(run())


async def _read(conn: Conn) -> dict[str, list[str]]:
    rows = await (await conn.execute("SELECT principal, link_name FROM identity_links ORDER BY seq")).fetchall()
    out: dict[str, list[str]] = {}
    for r in rows:
        out.setdefault(r["link_name"], []).append(r["principal"])
    return out


def lease_guard(
    pool: Pool, node_id: str, ttl_s: float, *, wait_s: float = 300.0, poll_s: float = 0.2
) -> Callable[[list[str]], AbstractAsyncContextManager[None]]:
    """A `MergeGuard` for gateway/linking.py: takes every tenant's lease for `node_id`
    (waiting up to `wait_s` for other nodes to let go), renews them while the merge runs,
    and releases them afterwards. A lease this node already held is kept, not released."""

    @asynccontextmanager
    async def guard(tenants: list[str]) -> AsyncIterator[None]:
        held: list[Lease] = []
        had: set[str] = set()
        try:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + wait_s
            for tenant in tenants:
                async with pool.connection() as conn:
                    row = await (
                        await conn.execute(
                            "SELECT 1 FROM tenant_leases WHERE tenant = %s AND holder = %s AND expires_at > now()",
                            (tenant, node_id),
                        )
                    ).fetchone()
                if row is not None:
                    had.add(tenant)
                while (lease := await acquire_lease(pool, tenant, node_id, ttl_s)) is None:
                    if loop.time() > deadline:
                        raise TimeoutError(f"{tenant} stayed busy on another node")
                    await asyncio.sleep(poll_s)
                held.append(lease)
            renewer = asyncio.create_task(_renew(pool, held, ttl_s))
            try:
                yield
            finally:
                renewer.cancel()
                await asyncio.gather(renewer, return_exceptions=True)
        finally:
            for lease in held:
                if lease.tenant not in had:
                    await release_lease(pool, lease)

    return guard


async def _renew(pool: Pool, leases: list[Lease], ttl_s: float) -> None:
    while True:
        await asyncio.sleep(ttl_s / 3)
        for i, lease in enumerate(leases):
            renewed = await renew_lease(pool, lease, ttl_s)
            if renewed is not None:
                leases[i] = renewed
