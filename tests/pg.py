"""The real PostgreSQL for cluster tests (127.0.0.1:5432, database `test`): one fresh schema
per test, dropped at the end. A test module calls `require_postgres()` at import: without a
reachable server its tests skip locally, saying why; under CI they fail.

Fixtures (import them into the test module): `schema`, `pool` (migrated, on `schema`).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from pathlib import Path

import psycopg
import pytest

from gateway.cluster.db import Pool, open_pool
from gateway.cluster.migrations import migrate

DSN = os.environ.get("HERMES_TEST_PG_DSN", "postgresql://postgres@127.0.0.1:5432/test")


def reachable() -> str | None:
    """None when the server answers, else libpq's reason."""
    try:
        psycopg.connect(DSN, connect_timeout=3).close()
    except psycopg.Error as err:
        return str(err).strip().splitlines()[0]
    return None


def require_postgres() -> None:
    why_not = reachable()
    if why_not is None:
        return
    if os.environ.get("CI"):
        raise RuntimeError(f"CI is set but PostgreSQL at {DSN} is unreachable: {why_not}")
    pytest.skip(
        f"PostgreSQL at {DSN} is unreachable ({why_not}); start it with "
        "`pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start` "
        "(these tests are required under CI)",
        allow_module_level=True,
    )


def pg_cluster() -> list[str] | None:
    if shutil.which("pg_ctlcluster") is None or not Path("/etc/postgresql").is_dir():
        return None
    versions = sorted(os.listdir("/etc/postgresql"))
    return [versions[-1], "main"] if versions else None


def ensure_server_running() -> None:
    cluster = pg_cluster()
    if cluster is None or reachable() is None:
        return
    subprocess.run(["pg_ctlcluster", "--skip-systemctl-redirect", *cluster, "start"], check=False, capture_output=True)


@pytest.fixture
def schema():
    name = f"hermes_test_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(DSN, autocommit=True) as conn:
        conn.execute(f'CREATE SCHEMA "{name}"')
    yield name
    ensure_server_running()
    with psycopg.connect(DSN, autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA "{name}" CASCADE')


@pytest.fixture
async def pool(schema):
    p = await open_pool(DSN, schema=schema, max_size=6)
    await migrate(p)
    yield p
    await p.close()


async def second_pool(schema: str) -> Pool:
    """Another node's own connections to the same database."""
    return await open_pool(DSN, schema=schema, max_size=4)
