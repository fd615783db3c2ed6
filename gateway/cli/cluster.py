"""`hermes-gateway cluster migrate|status`: the PostgreSQL schema and the cluster's state (docs/cluster.md)."""

from __future__ import annotations

import argparse
import asyncio
import sys

from core.settings import Config

# psycopg and the rest of gateway/cluster are imported only when a cluster command runs:
# every other command (and a single node) neither pays for nor needs them.


def register(sub: argparse._SubParsersAction) -> None:
    cluster = sub.add_parser("cluster", help="cluster mode: migrate the PostgreSQL schema, show status")
    csub = cluster.add_subparsers(dest="cluster_command", required=True)
    csub.add_parser("migrate", help="create or upgrade the cluster schema in PostgreSQL (safe to run twice)")
    csub.add_parser("status", help="nodes, tenant leases, claimed lanes, queue depth, oldest pending message")
    cluster.set_defaults(handler=run_cluster_command)


def run_cluster_command(cfg: Config, args: argparse.Namespace) -> int:
    import psycopg

    from gateway.cluster.db import ClusterError

    if not cfg.cluster.postgres_dsn_env:
        print(
            "error: cluster.postgres_dsn_env is not set in the config; cluster commands need "
            "the name of the environment variable that holds the PostgreSQL DSN",
            file=sys.stderr,
        )
        return 2
    try:
        return asyncio.run(_run(cfg, args.cluster_command))
    except ClusterError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except psycopg.Error as err:
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        print(f"error: PostgreSQL: {first}", file=sys.stderr)
        return 1


async def _run(cfg: Config, command: str) -> int:
    from gateway.cluster.db import ClusterError, dsn_from_env, open_pool, probe
    from gateway.cluster.migrations import LATEST, migrate, schema_version
    from gateway.cluster.status import format_status, read_status

    dsn = dsn_from_env(cfg.cluster.postgres_dsn_env or "")
    await probe(dsn)  # libpq's reason in one line, before the pool would retry in the background
    pool = await open_pool(dsn, max_size=1)
    try:
        if command == "migrate":
            applied = await migrate(pool)
            if applied:
                print(f"migrated to schema version {LATEST} (applied {', '.join(map(str, applied))})")
            else:
                print(f"schema is up to date (version {LATEST})")
            return 0
        version = await schema_version(pool)
        if version == 0:
            raise ClusterError("the cluster schema does not exist yet; run `hermes-gateway cluster migrate`")
        print(format_status(await read_status(pool, version)))
        return 0
    finally:
        await pool.close()
