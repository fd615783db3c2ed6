"""Connecting to PostgreSQL: the DSN from the environment, a psycopg pool that survives a
server restart, and one error type whose message fits on one line."""

from __future__ import annotations

import os

import psycopg
from psycopg.rows import DictRow, dict_row
from psycopg_pool import AsyncConnectionPool, PoolTimeout

Conn = psycopg.AsyncConnection[DictRow]
Pool = AsyncConnectionPool[Conn]


class ClusterError(Exception):
    """A cluster operation that cannot go on; the message is one line, free of secrets."""


def dsn_from_env(env_name: str) -> str:
    """The DSN held by the variable `cluster.postgres_dsn_env` names."""
    dsn = os.environ.get(env_name, "").strip()
    if not dsn:
        raise ClusterError(
            f"cluster.postgres_dsn_env names {env_name}, but that environment variable "
            "is not set (put the PostgreSQL DSN in it, e.g. postgresql://user@host/db)"
        )
    return dsn


def connect_kwargs(schema: str | None) -> dict[str, object]:
    kwargs: dict[str, object] = {"row_factory": dict_row, "autocommit": True, "connect_timeout": 5}
    if schema is not None:  # tests and side-by-side installs: every table lives in this schema
        kwargs["options"] = f"-c search_path={schema}"
    return kwargs


def one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__


async def probe(dsn: str, schema: str | None = None) -> None:
    """Connect once and close, so that an unreachable server is reported with libpq's reason
    (a pool would only say it timed out)."""
    try:
        conn = await psycopg.AsyncConnection.connect(dsn, **connect_kwargs(schema))  # type: ignore[arg-type]
    except psycopg.Error as err:
        raise ClusterError(f"cannot reach PostgreSQL: {one_line(err)}") from None
    await conn.close()


async def open_pool(
    dsn: str, *, schema: str | None = None, min_size: int = 1, max_size: int = 4, timeout_s: float = 10.0
) -> Pool:
    """An open pool whose connections are checked on checkout: after a server restart the
    dead ones are dropped and replaced instead of failing the next query."""
    pool: Pool = AsyncConnectionPool(
        dsn,
        connection_class=Conn,
        kwargs=connect_kwargs(schema),
        min_size=min_size,
        max_size=max_size,
        open=False,
        check=AsyncConnectionPool.check_connection,
        timeout=timeout_s,
        reconnect_timeout=300.0,
    )
    try:
        await pool.open(wait=True, timeout=timeout_s)
    except PoolTimeout:
        await pool.close()
        await probe(dsn, schema)  # raises with the real reason if there is one
        raise ClusterError(f"cannot reach PostgreSQL: no connection within {timeout_s:g} s") from None
    return pool


async def fetch_one(conn: Conn, sql: str, params: tuple[object, ...] = ()) -> DictRow:
    """The first row of a query that always returns one (an aggregate, a RETURNING)."""
    row = await (await conn.execute(sql, params)).fetchone()
    if row is None:
        raise ClusterError(f"query returned no row: {sql.split()[0]}")
    return row
