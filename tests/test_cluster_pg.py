"""Cluster mode's PostgreSQL layer on the real PostgreSQL (127.0.0.1:5432, database `test`).

Every test gets a fresh schema (a random name on the search_path), dropped at the end.
Without a reachable server these tests skip locally, saying why; under CI they fail.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from urllib.parse import quote

import psycopg
import pytest

from core.settings import parse_config
from gateway.cli import main as cli_main
from gateway.cluster.db import ClusterError, Pool, open_pool
from gateway.cluster.inbox import (
    CLAIM_SQL,
    Inbound,
    NotClaimed,
    claim_lane,
    lock_claimed_lane,
    pending_messages,
    record_inbound,
    refresh_lane_head,
    release_lane,
)
from gateway.cluster.leases import (
    FencedOut,
    Lease,
    acquire_lease,
    fenced,
    heartbeat,
    register_node,
    release_lease,
    renew_lease,
)
from gateway.cluster.migrations import LATEST, migrate, schema_version
from gateway.cluster.wakeups import InboxWakeups
from tests.pg import DSN, ensure_server_running, pg_cluster, require_postgres, second_pool

TTL = 15.0

require_postgres()
_second_pool = second_pool
_pg_cluster = pg_cluster
_ensure_server_running = ensure_server_running


def _msg(lane: str, message_id: str, *, tenant: str | None = None, text: str = "hi") -> Inbound:
    return Inbound(
        platform="telegram",
        chat_id=f"chat-{lane}",
        message_id=message_id,
        lane=lane,
        tenant=tenant or f"tenant-{lane}",
        payload={"text": text},
    )


async def _time_passes_for_node(pool: Pool, node_id: str) -> None:
    """The node stopped heartbeating longer than its ttl ago (moves its expiry into the past)."""
    async with pool.connection() as conn:
        await conn.execute(
            "UPDATE nodes SET lease_expires_at = now() - interval '1 second' WHERE node_id = %s", (node_id,)
        )


async def _time_passes_for_lease(pool: Pool, tenant: str) -> None:
    async with pool.connection() as conn:
        await conn.execute(
            "UPDATE tenant_leases SET expires_at = now() - interval '1 second' WHERE tenant = %s", (tenant,)
        )


async def _done(pool: Pool, lease: Lease, node_id: str, inbox_id: int) -> None:
    """Finish a claimed message without a reply the way the node's outbox does
    (gateway/cluster/ledger.py): fenced by the tenant lease, on a lane this node holds, and
    the lane's head moves on."""
    async with fenced(pool, lease) as conn:
        lane = (await (await conn.execute("SELECT lane FROM inbox WHERE id = %s", (inbox_id,))).fetchone())["lane"]
        await lock_claimed_lane(conn, lane, node_id)
        await conn.execute(
            "UPDATE inbox SET answered_at = now(), done_epoch = %s, done_at = now() WHERE id = %s",
            (lease.epoch, inbox_id),
        )
        await refresh_lane_head(conn, lane)


# --- migrations -----------------------------------------------------------------------------


async def test_migrate_twice_applies_each_version_once(schema):
    p = await open_pool(DSN, schema=schema)
    try:
        assert await schema_version(p) == 0
        assert await migrate(p) == list(range(1, LATEST + 1))
        assert await migrate(p) == []
        assert await schema_version(p) == LATEST
        async with p.connection() as conn:
            rows = await (await conn.execute("SELECT version FROM schema_migrations ORDER BY version")).fetchall()
        assert [r["version"] for r in rows] == list(range(1, LATEST + 1))
    finally:
        await p.close()


async def test_concurrent_migrate_from_several_nodes_applies_each_version_once(schema):
    pools = [await open_pool(DSN, schema=schema) for _ in range(4)]
    try:
        results = await asyncio.gather(*(migrate(p) for p in pools))
        assert sorted(results) == [[], [], [], list(range(1, LATEST + 1))]
        assert await schema_version(pools[0]) == LATEST
    finally:
        for p in pools:
            await p.close()


async def test_migrate_refuses_a_schema_newer_than_this_gateway(pool):
    async with pool.connection() as conn:
        await conn.execute(
            "INSERT INTO schema_migrations (version, name) VALUES (%s, 'from the future')", (LATEST + 1,)
        )
    with pytest.raises(ClusterError, match="newer than this gateway"):
        await migrate(pool)


# --- leases and fencing ---------------------------------------------------------------------


async def test_lease_takeover_after_ttl_bumps_epoch_and_the_old_holders_fenced_commit_is_refused(pool, schema):
    a = await acquire_lease(pool, "alice", "node-a", ttl_s=1.0)
    assert a is not None and a.epoch == 1
    assert await acquire_lease(pool, "alice", "node-b", ttl_s=1.0) is None  # held and current
    await asyncio.sleep(1.3)  # node-a stops renewing for longer than the ttl
    b = await acquire_lease(pool, "alice", "node-b", ttl_s=TTL)
    assert b is not None and b.holder == "node-b" and b.epoch == 2

    with pytest.raises(FencedOut):
        async with fenced(pool, a) as conn:
            await conn.execute("CREATE TABLE must_not_exist (x int)")
    assert await renew_lease(pool, a, TTL) is None
    async with fenced(pool, b) as conn:
        await conn.execute("CREATE TABLE written_by_b (x int)")
    async with pool.connection() as conn:
        names = {
            r["t"]
            for r in await (
                await conn.execute("SELECT tablename AS t FROM pg_tables WHERE schemaname = %s", (schema,))
            ).fetchall()
        }
    assert "written_by_b" in names and "must_not_exist" not in names


async def test_a_lease_released_and_retaken_keeps_counting_epochs(pool):
    a = await acquire_lease(pool, "bob", "node-a", TTL)
    assert a is not None
    assert (await acquire_lease(pool, "bob", "node-a", TTL)).epoch == a.epoch  # re-acquire by the holder
    await release_lease(pool, a)
    b = await acquire_lease(pool, "bob", "node-b", TTL)
    assert b is not None and b.epoch == a.epoch + 1
    await release_lease(pool, b)
    a2 = await acquire_lease(pool, "bob", "node-a", TTL)
    assert a2 is not None and a2.epoch == a.epoch + 2
    with pytest.raises(FencedOut):  # the epoch-1 lease of node-a is not the epoch-3 one
        async with fenced(pool, a):
            pass


async def test_an_expired_lease_nobody_took_is_refused_until_renewed(pool):
    a = await acquire_lease(pool, "carol", "node-a", TTL)
    await _time_passes_for_lease(pool, "carol")
    with pytest.raises(FencedOut):
        async with fenced(pool, a):
            pass
    renewed = await renew_lease(pool, a, TTL)
    assert renewed is not None and renewed.epoch == a.epoch
    async with fenced(pool, renewed):
        pass


async def test_a_takeover_waits_for_a_fenced_transaction_in_flight(pool, schema):
    a = await acquire_lease(pool, "dave", "node-a", ttl_s=1.0)
    other = await _second_pool(schema)
    try:
        async with fenced(pool, a) as conn:  # checked while current, then the lease runs out
            await asyncio.sleep(1.3)
            takeover = asyncio.create_task(acquire_lease(other, "dave", "node-b", TTL))
            await asyncio.sleep(0.3)
            assert not takeover.done()  # blocked on the lease row this transaction holds
            await conn.execute("CREATE TABLE committed_under_epoch_1 (x int)")
        b = await takeover
        assert b is not None and b.epoch == a.epoch + 1
    finally:
        await other.close()


# --- inbox, lanes and claims ----------------------------------------------------------------


async def test_a_duplicate_delivery_is_recorded_once(pool):
    first = await record_inbound(pool, _msg("L1", "100", text="hello"))
    again = await record_inbound(pool, _msg("L1", "100", text="hello (redelivered)"))
    other_chat = await record_inbound(pool, Inbound("telegram", "another-chat", "100", "L2", "t2", {}))
    assert first is not None and again is None and other_chat is not None
    msgs = await pending_messages(pool, "L1")
    assert [(m.message_id, m.payload["text"]) for m in msgs] == [("100", "hello")]


async def test_two_concurrent_claimers_never_share_a_lane_and_take_lanes_in_arrival_order(pool, schema):
    lanes = [f"lane-{i:02d}" for i in range(30)]
    for i, lane in enumerate(lanes):  # arrival order = lane order; a later message per lane too
        await record_inbound(pool, _msg(lane, f"m{i}"))
    for i, lane in enumerate(reversed(lanes)):
        await record_inbound(pool, _msg(lane, f"late{i}"))
    other = await _second_pool(schema)
    got: dict[str, list[str]] = {"node-a": [], "node-b": []}
    try:
        for node, p in (("node-a", pool), ("node-b", other)):
            await register_node(p, node, TTL)

        async def claimer(node: str, p: Pool) -> None:
            while (c := await claim_lane(p, node)) is not None:
                got[node].append(c.lane)
                assert c.messages[0].message_id.startswith("m")  # oldest first
                await asyncio.sleep(0)

        await asyncio.gather(claimer("node-a", pool), claimer("node-b", other))
    finally:
        await other.close()
    both = got["node-a"] + got["node-b"]
    assert sorted(both) == lanes  # every lane once, none twice
    assert got["node-a"] and got["node-b"]
    for node_lanes in got.values():  # each claimer took the oldest free lane every time
        assert node_lanes == sorted(node_lanes)


async def test_a_claimed_lane_is_not_handed_out_again_until_released(pool):
    await register_node(pool, "node-a", TTL)
    await register_node(pool, "node-b", TTL)
    await record_inbound(pool, _msg("L", "1"))
    claim = await claim_lane(pool, "node-a")
    assert claim is not None and claim.lane == "L"
    await record_inbound(pool, _msg("L", "2"))  # more work for the claimed lane arrives
    assert await claim_lane(pool, "node-b") is None
    assert await release_lane(pool, "node-a", "L")
    again = await claim_lane(pool, "node-b")
    assert again is not None and [m.message_id for m in again.messages] == ["1", "2"]


async def test_messages_of_a_lane_run_in_arrival_order_and_completion_moves_the_head(pool):
    await register_node(pool, "node-a", TTL)
    for mid in ("1", "2", "3"):
        await record_inbound(pool, _msg("L", mid, tenant="t"))
    lease = await acquire_lease(pool, "t", "node-a", TTL)
    claim = await claim_lane(pool, "node-a")
    assert [m.message_id for m in claim.messages] == ["1", "2", "3"]
    await _done(pool, lease, "node-a", claim.messages[0].id)
    await release_lane(pool, "node-a", "L")
    claim = await claim_lane(pool, "node-a")
    assert [m.message_id for m in claim.messages] == ["2", "3"]


async def test_the_lane_of_an_expired_node_is_claimed_by_another_and_the_old_node_is_refused(pool):
    await register_node(pool, "node-a", TTL)
    await register_node(pool, "node-b", TTL)
    await record_inbound(pool, _msg("L", "1", tenant="t"))
    lease_a = await acquire_lease(pool, "t", "node-a", TTL)
    claim_a = await claim_lane(pool, "node-a")
    assert claim_a is not None
    assert await claim_lane(pool, "node-b") is None

    await _time_passes_for_node(pool, "node-a")  # node-a stopped heartbeating
    claim_b = await claim_lane(pool, "node-b")
    assert claim_b is not None and claim_b.lane == "L" and claim_b.messages[0].message_id == "1"

    assert not await heartbeat(pool, "node-a", TTL)  # node-a learns it was expired
    with pytest.raises(NotClaimed):  # its tenant lease is still current, but the lane is gone
        await _done(pool, lease_a, "node-a", claim_a.messages[0].id)
    assert not await release_lane(pool, "node-a", "L")
    with pytest.raises(NotClaimed):
        await claim_lane(pool, "node-a")
    assert [m.message_id for m in await pending_messages(pool, "L")] == ["1"]  # the late write left nothing


async def test_claim_with_100k_pending_rows_uses_the_claimable_index(pool):
    async with pool.connection() as conn, conn.transaction():
        await conn.execute("""
            INSERT INTO inbox (platform, chat_id, message_id, lane, tenant, payload)
            SELECT 'telegram', 'chat-' || (g % 10000), g::text, 'lane-' || (g % 10000), 'tenant-' || (g % 10000),
                   '{"text": "x"}'::jsonb
            FROM generate_series(1, 100000) AS g""")
        await conn.execute("""
            INSERT INTO lanes (lane, tenant, head_id)
            SELECT lane, min(tenant), min(id) FROM inbox WHERE done_at IS NULL GROUP BY lane""")
        # half of the lanes are busy on other nodes
        await conn.execute("INSERT INTO nodes (node_id, lease_expires_at) VALUES ('busy', now() + interval '1 hour')")
        await conn.execute("UPDATE lanes SET claimed_by = 'busy', claimed_at = now() WHERE head_id % 2 = 0")
    async with pool.connection() as conn:
        await conn.execute("ANALYZE inbox")
        await conn.execute("ANALYZE lanes")
        async with conn.transaction():
            plan = await (await conn.execute(f"EXPLAIN (ANALYZE, FORMAT JSON) {CLAIM_SQL}")).fetchone()
    text = str(plan)
    assert "lanes_claimable" in text, text
    assert "Seq Scan" not in text, text

    await register_node(pool, "node-a", TTL)
    claim = await claim_lane(pool, "node-a", limit=5)
    assert claim is not None and claim.lane == "lane-1"  # the oldest free head: inbox id 1
    assert [m.message_id for m in claim.messages] == ["1", "10001", "20001", "30001", "40001"]
    async with pool.connection() as conn:
        plan = await (
            await conn.execute(
                "EXPLAIN (FORMAT JSON) SELECT id FROM inbox WHERE lane = 'lane-1' AND done_at IS NULL ORDER BY id LIMIT 100"
            )
        ).fetchone()
    assert "inbox_pending_by_lane" in str(plan)


async def test_a_recorded_message_wakes_a_listening_node_of_the_same_schema_only(pool, schema):
    other_schema = f"{schema}_other"
    async with await psycopg.AsyncConnection.connect(DSN, autocommit=True) as admin:
        await admin.execute(f'CREATE SCHEMA "{other_schema}"')
    other = await open_pool(DSN, schema=other_schema)
    try:
        await migrate(other)
        async with InboxWakeups(DSN, schema=schema) as wakeups:
            await record_inbound(other, _msg("L", "elsewhere"))  # another installation's inbox
            assert not await wakeups.wait(timeout_s=0.5)
            await record_inbound(pool, _msg("L", "1"))
            assert await wakeups.wait(timeout_s=30)
    finally:
        await other.close()
        async with await psycopg.AsyncConnection.connect(DSN, autocommit=True) as admin:
            await admin.execute(f'DROP SCHEMA "{other_schema}" CASCADE')


# --- the CLI --------------------------------------------------------------------------------


def _config_file(tmp_path: Path, extra: str = "") -> Path:
    path = tmp_path / "hermes-gateway.yaml"
    path.write_text(f"data_dir: {tmp_path / 'data'}\ncluster:\n  postgres_dsn_env: HERMES_TEST_CLUSTER_DSN\n{extra}")
    return path


def test_cluster_migrate_and_status_on_the_command_line(schema, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HERMES_TEST_CLUSTER_DSN", f"{DSN}?options={quote(f'-csearch_path={schema}')}")
    cfg = _config_file(tmp_path)
    assert cli_main(["-c", str(cfg), "cluster", "status"]) == 1
    assert "run `hermes-gateway cluster migrate`" in capsys.readouterr().err
    assert cli_main(["-c", str(cfg), "cluster", "migrate"]) == 0
    assert f"migrated to schema version {LATEST}" in capsys.readouterr().out
    assert cli_main(["-c", str(cfg), "cluster", "migrate"]) == 0
    assert "up to date" in capsys.readouterr().out

    async def some_work() -> None:
        p = await open_pool(DSN, schema=schema)
        try:
            await register_node(p, "node-a", TTL)
            await acquire_lease(p, "tenant-x", "node-a", TTL)
            for mid in ("1", "2", "3"):
                await record_inbound(p, _msg("lane-x", mid, tenant="tenant-x"))
            await claim_lane(p, "node-a")
        finally:
            await p.close()

    asyncio.run(some_work())
    assert cli_main(["-c", str(cfg), "cluster", "status"]) == 0
    out = capsys.readouterr().out
    assert "nodes: 1 (1 alive)" in out and "node-a  alive" in out
    assert "tenant-x  node-a  epoch 1" in out
    assert "lane-x  by node-a" in out
    assert "queue depth: 3 pending messages; oldest pending: received" in out


def test_cluster_commands_say_in_one_line_what_is_missing(tmp_path, monkeypatch, capsys):
    cfg = _config_file(tmp_path)
    monkeypatch.delenv("HERMES_TEST_CLUSTER_DSN", raising=False)
    assert cli_main(["-c", str(cfg), "cluster", "status"]) == 1
    err = capsys.readouterr().err
    assert "HERMES_TEST_CLUSTER_DSN" in err and "not set" in err and len(err.strip().splitlines()) == 1

    monkeypatch.setenv("HERMES_TEST_CLUSTER_DSN", "postgresql://postgres:s3cret@127.0.0.1:1/test")
    assert cli_main(["-c", str(cfg), "cluster", "migrate"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: cannot reach PostgreSQL") and len(err.strip().splitlines()) == 1
    assert "s3cret" not in err

    plain = tmp_path / "plain.yaml"
    plain.write_text(f"data_dir: {tmp_path / 'data'}\n")
    assert cli_main(["-c", str(plain), "cluster", "status"]) == 2
    assert "cluster.postgres_dsn_env is not set" in capsys.readouterr().err


def test_chat_refuses_a_cluster_config_in_one_line(tmp_path, capsys):
    cfg = _config_file(tmp_path)
    assert cli_main(["-c", str(cfg), "chat"]) == 2
    err = capsys.readouterr().err
    assert "chat` is single-node only" in err and len(err.strip().splitlines()) == 1


def test_run_as_a_node_says_in_one_line_when_postgresql_is_unreachable(tmp_path, monkeypatch, capsys):
    cfg = _config_file(tmp_path, "platforms:\n  telegram:\n    enabled: true\n")
    monkeypatch.setenv("TELEGRAM_BOT_TOKEN", "123:abc")
    monkeypatch.setenv("HERMES_TEST_CLUSTER_DSN", "postgresql://postgres:s3cret@127.0.0.1:1/test")
    assert cli_main(["-c", str(cfg), "run"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: cannot reach PostgreSQL") and "s3cret" not in "".join(err)


def test_cluster_config_defaults():
    cfg = parse_config({})
    assert cfg.cluster.postgres_dsn_env is None and cfg.cluster.lease_ttl_s == 15
    assert cfg.cluster.node_name().endswith(f"-{os.getpid()}")
    assert parse_config({"cluster": {"node_id": "n1"}}).cluster.node_name() == "n1"


# --- PostgreSQL restart (this test restarts the local server) -------------------------------


@pytest.mark.skipif(_pg_cluster() is None, reason="needs pg_ctlcluster to restart the local PostgreSQL")
async def test_RESTARTS_POSTGRESQL_the_pool_reconnects_and_an_interrupted_transaction_leaves_nothing(pool):
    await register_node(pool, "node-a", TTL)
    await record_inbound(pool, _msg("L", "before"))

    async def interrupted() -> None:
        async with pool.connection() as conn, conn.transaction():
            await conn.execute(
                "INSERT INTO inbox (platform, chat_id, message_id, lane, tenant, payload) "
                "VALUES ('telegram', 'c', 'in-flight', 'L', 't', '{}')"
            )
            await conn.execute("SELECT pg_sleep(60)")

    task = asyncio.create_task(interrupted())
    await asyncio.sleep(0.5)
    try:
        restart = await asyncio.create_subprocess_exec(
            "pg_ctlcluster", "--skip-systemctl-redirect", *_pg_cluster(), "restart", "-m", "fast"
        )
        assert await restart.wait() == 0
        with pytest.raises(psycopg.OperationalError):
            await task
        # the pool replaces its dead connections on its own
        assert await record_inbound(pool, _msg("L", "after")) is not None
        assert await heartbeat(pool, "node-a", TTL)
        claim = await claim_lane(pool, "node-a")
        assert [m.message_id for m in claim.messages] == ["before", "after"]
    finally:
        _ensure_server_running()
