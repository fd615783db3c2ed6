"""`profiles delete` in cluster mode: a person's rows in PostgreSQL go with their profile.

The profile directory and gateway.db are scrubbed by gateway/tenants.py; this removes what
the nodes share: inbox and outbox rows of the tenant and of its private chats (and pending
messages from its accounts elsewhere), its lanes and lease, open confirmations, its reminders' due rows (and those it set in a shared chat), pairing and
link codes, the `shared_kv` rows that name its accounts, and its identity links. Run with
every node stopped, like `profiles delete` itself.
"""

from __future__ import annotations

import asyncio
from functools import partial

from core.settings import Config
from gateway.cluster.db import Pool, dsn_from_env, open_pool
from gateway.tenants import DeleteReport, TenantInfo, delete_tenant, kv_principals
from tenancy.keys import link_tenant_id


async def erase_tenant(pool: Pool, tenant_id: str, principals: set[str], chats: set[tuple[str, str]]) -> int:
    """Remove the tenant's rows from every shared table, in one transaction; how many."""
    removed = 0
    async with pool.connection() as conn, conn.transaction():
        links = await (await conn.execute("SELECT principal, link_name FROM identity_links")).fetchall()
        names = {r["link_name"] for r in links if link_tenant_id(r["link_name"]) == tenant_id}
        everyone = set(principals) | {r["principal"] for r in links if r["link_name"] in names}
        for platform, user in (p.split(":", 1) for p in everyone if ":" in p):
            chats = chats | {(platform, user)}  # Telegram: a DM chat id is the user id
        cur = await conn.execute(
            "DELETE FROM inbox WHERE tenant = %s OR (payload->>'platform') || ':' || (payload->>'user_id') = ANY(%s)",
            (tenant_id, sorted(everyone)),
        )
        removed += cur.rowcount
        for platform, chat in sorted(chats):  # its private chats (the outbox rows go with their inbox rows)
            cur = await conn.execute("DELETE FROM inbox WHERE platform = %s AND chat_id = %s", (platform, chat))
            removed += cur.rowcount
            cur = await conn.execute("DELETE FROM outbox WHERE platform = %s AND chat_id = %s", (platform, chat))
            removed += cur.rowcount
        for table in (
            "outbox",
            "lanes",
            "tenant_leases",
            "budget_usage",
            "budget_pending",
            "budget_said",
            "confirmations",
        ):
            cur = await conn.execute(f"DELETE FROM {table} WHERE tenant = %s", (tenant_id,))
            removed += cur.rowcount
        # its reminders' occurrences, and those it set in a shared chat's profile
        cur = await conn.execute(
            "DELETE FROM reminder_due WHERE tenant = %s OR principal = ANY(%s)", (tenant_id, sorted(everyone))
        )
        removed += cur.rowcount
        cur = await conn.execute(
            "DELETE FROM pairing_codes WHERE platform || ':' || user_id = ANY(%s)", (sorted(everyone),)
        )
        removed += cur.rowcount
        cur = await conn.execute("DELETE FROM link_codes WHERE principal = ANY(%s)", (sorted(everyone),))
        removed += cur.rowcount
        for row in await (await conn.execute("SELECT key, value FROM shared_kv")).fetchall():
            if kv_principals(row["key"], row["value"]) & everyone:  # the keys are gateway.db's kv keys
                await conn.execute("DELETE FROM shared_kv WHERE key = %s", (row["key"],))
                removed += 1
        cur = await conn.execute("DELETE FROM identity_links WHERE principal = ANY(%s)", (sorted(everyone),))
        if cur.rowcount:
            removed += cur.rowcount
            await conn.execute("UPDATE identity_links_generation SET generation = generation + 1")
    return removed


def erase_tenant_now(cfg: Config, tenant_id: str, principals: set[str], chats: set[tuple[str, str]]) -> int:
    """`erase_tenant` from `profiles delete` (no event loop running)."""

    async def run() -> int:
        pool = await open_pool(dsn_from_env(cfg.cluster.postgres_dsn_env or ""), max_size=1)
        try:
            return await erase_tenant(pool, tenant_id, principals, chats)
        finally:
            await pool.close()

    return asyncio.run(run())


def delete_tenant_everywhere(cfg: Config, info: TenantInfo) -> DeleteReport:
    """`profiles delete` in cluster mode: the profile and gateway.db (`delete_tenant`), then
    the tenant's rows in PostgreSQL, under the same run lock."""
    from gateway.cluster.links import load_shared_links

    return delete_tenant(cfg, info, erase_shared=partial(erase_tenant_now, cfg), links=load_shared_links(cfg))


__all__ = ["delete_tenant_everywhere", "erase_tenant", "erase_tenant_now"]
