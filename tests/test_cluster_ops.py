"""Cluster mode in /healthz and /metrics (real PostgreSQL): the database, this node's
membership and leases, and the claim and failover counters; nothing of it on a single node."""

from __future__ import annotations

import httpx

from gateway.build import build_gateway
from gateway.cluster.health import ClusterHealth
from gateway.cluster.ingress import TELEGRAM_POLLING, IngressElection, Role, discord_shard
from gateway.cluster.leases import acquire_lease, register_node
from gateway.cluster.migrations import LATEST
from tests.conftest import RecordingAdapter
from tests.pg import require_postgres, second_pool
from tests.test_ops_observability import parse_prometheus, value

require_postgres()
TTL = 15.0


async def _nothing() -> None:
    return None


async def test_healthz_and_metrics_show_the_database_the_nodes_leases_and_failover_counters(config_for, pool, schema):
    await register_node(pool, "node-a", TTL)
    assert await acquire_lease(pool, "telegram-1", "node-a", TTL) is not None
    assert await acquire_lease(pool, discord_shard(0), "node-b", 1.0) is not None
    async with pool.connection() as conn:  # node-b died: its shard lease expired
        await conn.execute("UPDATE tenant_leases SET expires_at = now() - interval '1 second' WHERE holder = 'node-b'")
    app = build_gateway(config_for(observability={"listen": "127.0.0.1:0"}), [RecordingAdapter("telegram")])
    metrics = app.metrics.enable_cluster()
    app.cluster_health = ClusterHealth(pool, "node-a").check
    roles = [Role(TELEGRAM_POLLING, _nothing, _nothing), Role(discord_shard(0), _nothing, _nothing, spread=True)]
    election = IngressElection(pool, "node-a", TTL, roles, metrics=metrics)
    await app.start()
    try:
        await election.start()
        metrics.lane_claimed()
        metrics.lease_taken_over("tenant")
        metrics.fenced_out("outbox")
        async with httpx.AsyncClient(timeout=10) as client:
            health = await client.get(f"{app.observability.url}/healthz")
            types, samples = parse_prometheus((await client.get(f"{app.observability.url}/metrics")).text)
        cluster = health.json()["checks"]["cluster"]
        assert health.status_code == 200 and cluster["ok"]
        assert cluster["database"] == {"ok": True, "reachable": True, "schema_version": LATEST, "detail": "migrated"}
        assert cluster["node"]["registered"] and cluster["node"]["ok"]
        assert cluster["leases"] == {"tenants": 1, "ingress": [discord_shard(0), TELEGRAM_POLLING]}
        assert "telegram-1" not in health.text  # tenant ids carry user ids: only counted
        assert types["hermes_cluster_lanes_claimed_total"] == "counter"
        assert value(samples, "hermes_cluster_lanes_claimed_total") == 1
        assert value(samples, "hermes_cluster_ingress_changes_total", kind="telegram_polling", outcome="gained") == 1
        assert value(samples, "hermes_cluster_ingress_changes_total", kind="discord_shard", outcome="gained") == 1
        assert value(samples, "hermes_cluster_lease_takeovers_total", kind="ingress") == 1  # the shard, not polling
        assert value(samples, "hermes_cluster_lease_takeovers_total", kind="tenant") == 1
        assert value(samples, "hermes_cluster_fenced_writes_total", kind="outbox") == 1
        assert value(samples, "hermes_cluster_ingress_roles") == 2

        await election.stop()
        async with httpx.AsyncClient(timeout=10) as client:
            health = await client.get(f"{app.observability.url}/healthz")
            _, samples = parse_prometheus((await client.get(f"{app.observability.url}/metrics")).text)
        assert health.json()["checks"]["cluster"]["leases"]["ingress"] == []
        assert value(samples, "hermes_cluster_ingress_changes_total", kind="telegram_polling", outcome="released") == 1
        assert value(samples, "hermes_cluster_ingress_roles") == 0
    finally:
        await election.stop()
        await app.stop()


async def test_healthz_fails_when_the_database_is_unreachable_or_the_node_expired(config_for, pool, schema):
    other = await second_pool(schema)
    app = build_gateway(config_for(observability={"listen": "127.0.0.1:0"}), [RecordingAdapter("telegram")])
    app.cluster_health = ClusterHealth(other, "node-a").check
    await app.start()
    try:
        async with httpx.AsyncClient(timeout=10) as client:
            unregistered = await client.get(f"{app.observability.url}/healthz")
            await other.close()
            unreachable = await client.get(f"{app.observability.url}/healthz")
        assert unregistered.status_code == 503
        assert unregistered.json()["checks"]["cluster"]["node"] == {
            "ok": False,
            "registered": False,
            "lease_expires_in_s": None,
        }
        assert unreachable.status_code == 503
        assert unreachable.json()["checks"]["cluster"]["database"]["reachable"] is False
    finally:
        await app.stop()


async def test_a_single_node_shows_no_cluster_fields(config_for):
    app = build_gateway(config_for(observability={"listen": "127.0.0.1:0"}), [RecordingAdapter("telegram")])
    await app.start()
    try:
        async with httpx.AsyncClient(timeout=10) as client:
            health = await client.get(f"{app.observability.url}/healthz")
            metrics = await client.get(f"{app.observability.url}/metrics")
        assert "cluster" not in health.json()["checks"]
        assert "hermes_cluster_" not in metrics.text
    finally:
        await app.stop()
