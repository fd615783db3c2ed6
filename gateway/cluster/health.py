"""The cluster part of `/healthz`: is the database reachable and migrated, is this node's
membership alive, and which leases does it hold (a count of tenants, the ingress roles by
name; no tenant id, since tenant ids carry user ids)."""

from __future__ import annotations

import asyncio
from typing import Any

import psycopg
from psycopg_pool import PoolTimeout

from gateway.cluster.db import Pool, fetch_one, one_line
from gateway.cluster.migrations import LATEST


class ClusterHealth:
    """`await check()` -> (healthy, body): the cluster part of `/healthz` (gateway/cluster/build.py)."""

    def __init__(self, pool: Pool, node_id: str, *, timeout_s: float = 3.0, instance: str | None = None) -> None:
        """`instance`: this process as the nodes table names it; a row of another process
        under the same id is not this node's membership."""
        self.pool = pool
        self.node_id = node_id
        self.timeout_s = timeout_s
        self.instance = instance

    async def check(self) -> tuple[bool, dict[str, Any]]:
        body: dict[str, Any] = {"node_id": self.node_id}
        try:
            async with asyncio.timeout(self.timeout_s):
                facts = await self._facts()
        except (TimeoutError, PoolTimeout):
            body["database"] = {"ok": False, "reachable": False, "detail": f"no answer within {self.timeout_s:g} s"}
            return False, {"ok": False, **body}
        except psycopg.Error as err:
            body["database"] = {"ok": False, "reachable": False, "detail": one_line(err)}
            return False, {"ok": False, **body}
        version, node, tenants, ingress = facts
        db_ok = version == LATEST
        body["database"] = {
            "ok": db_ok,
            "reachable": True,
            "schema_version": version,
            "detail": "migrated" if db_ok else f"schema at {version}, this gateway needs {LATEST}",
        }
        taken = node is not None and self.instance is not None and node["instance"] not in (None, self.instance)
        alive = node is not None and node["expires_in_s"] > 0 and not taken
        body["node"] = {
            "ok": alive,
            "registered": node is not None and not taken,
            "lease_expires_in_s": round(node["expires_in_s"], 1) if node is not None and not taken else None,
        }
        if taken:
            body["node"]["detail"] = "the node id is in use by another running process"
        body["leases"] = {"tenants": tenants, "ingress": ingress}
        ok = db_ok and alive
        return ok, {"ok": ok, **body}

    async def _facts(self) -> tuple[int, dict[str, Any] | None, int, list[str]]:
        async with self.pool.connection() as conn:
            version = int((await fetch_one(conn, "SELECT coalesce(max(version), 0) AS v FROM schema_migrations"))["v"])
            row = await (
                await conn.execute(
                    """SELECT extract(epoch FROM lease_expires_at - now())::float8 AS s, instance
                       FROM nodes WHERE node_id = %s""",
                    (self.node_id,),
                )
            ).fetchone()
            node = {"expires_in_s": float(row["s"]), "instance": row["instance"]} if row else None
            rows = await (
                await conn.execute(
                    "SELECT tenant FROM tenant_leases WHERE holder = %s AND expires_at > now() ORDER BY tenant",
                    (self.node_id,),
                )
            ).fetchall()
        names = [r["tenant"] for r in rows]
        ingress = [n for n in names if n.startswith("ingress:")]
        return version, node, len(names) - len(ingress), ingress
