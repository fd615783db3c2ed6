"""Cluster mode, in process: two GatewayApp nodes on one data_dir and one PostgreSQL schema,
the real TelegramAdapter in webhook mode against the fake Bot API (a webhook can be posted
to either node), and the fake LLM."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import socket
import sys
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest

from adapters.telegram import TelegramAdapter
from adapters.telegram.flood import FloodLimits
from agent.sessions import SessionStore
from core.errors import LeaseLost
from core.redact import Redactor
from core.settings import ConfigError
from gateway.build import build_gateway
from gateway.cluster.build import build_cluster_gateway
from gateway.cluster.leases import FencedOut
from gateway.logs import JsonFormatter
from gateway.runtime import GatewayApp
from tests.fakes.llm import hang, memory_saving_responder
from tests.fakes.telegram_api import FakeTelegram
from tests.pg import DSN, require_postgres

require_postgres()

TOKEN = "123456:AAE2eFAKEtokenFAKEtoken_-cluster"
TOKEN_ENV = "HERMES_CLUSTER_TG_TOKEN"
SECRET_ENV = "HERMES_CLUSTER_TG_SECRET"
DSN_ENV = "HERMES_CLUSTER_TEST_DSN"
SECRET = "cluster-secret_1"
LOOSE_FLOOD = FloodLimits(per_chat=(50, 1.0), per_group=(50, 1.0), overall=(100, 1.0))
TTL = 3.0


def schema_dsn(schema: str) -> str:
    """The DSN with `schema` on the search_path (what a node's cluster.postgres_dsn_env holds)."""
    return f"{DSN}?options={quote(f'-csearch_path={schema}')}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
async def tg(monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    monkeypatch.setenv(SECRET_ENV, SECRET)
    async with FakeTelegram(token=TOKEN) as fake:
        yield fake


@pytest.fixture
def node_config(config_for, tg, schema, monkeypatch):
    """The config of node `node_id` (webhook on its own port) over the shared data_dir."""
    monkeypatch.setenv(DSN_ENV, schema_dsn(schema))

    def build(node_id: str, *, polling: bool = False, **sections: Any):
        port = free_port()
        telegram = {
            "enabled": True,
            "token_env": TOKEN_ENV,
            "base_url": tg.base_url,
            "mode": "polling" if polling else "webhook",
            "webhook": {
                "listen": "127.0.0.1",
                "port": port,
                "path": "/telegram",
                "public_url": f"http://127.0.0.1:{port}",
                "secret_token_env": SECRET_ENV,
            },
        }
        sections.setdefault("limits", {"rate_limit_per_minute": 1000})
        cluster = {"postgres_dsn_env": DSN_ENV, "node_id": node_id, "lease_ttl_s": TTL, "poll_interval_s": 0.3}
        cluster.update(sections.pop("cluster", {}))
        return config_for(platforms={"telegram": telegram}, cluster=cluster, **sections)

    return build


class Node:
    def __init__(self, app: GatewayApp) -> None:
        self.app = app
        self.url = f"http://127.0.0.1:{app.cfg.platforms.telegram.webhook.port}/telegram"


@asynccontextmanager
async def started(cfg):
    # elected, as `hermes-gateway run` builds it in cluster mode: the ingress election decides
    # which node polls or registers the webhook (every node serves the webhook)
    adapter = TelegramAdapter.from_config(
        cfg.platforms.telegram, backoff_initial_s=0.05, backoff_max_s=0.5, flood_limits=LOOSE_FLOOD, elected=True
    )
    app = build_cluster_gateway(cfg, [adapter])
    await app.start()
    try:
        yield Node(app)
    finally:
        await app.stop(drain_timeout=5)
        await adapter.aclose()


@asynccontextmanager
async def cluster(node_config, *names: str, **sections: Any):
    async with AsyncExitStack() as stack:
        yield [await stack.enter_async_context(started(node_config(n, **sections))) for n in names]


async def post(tg: FakeTelegram, update: Any, node: Node) -> int:
    """Telegram delivering `update` to `node`'s webhook."""
    return await tg.post_to_webhook(update, url=node.url, secret_token=SECRET)


def texts(tg: FakeTelegram, chat_id: int) -> list[str]:
    return [m["text"] for m in tg.sent_messages(chat_id)]


async def settled(nodes: list[Node], timeout: float = 20) -> None:
    """Until the shared inbox holds nothing pending."""
    app = nodes[0].app
    assert app.node is not None

    async def empty() -> bool:
        async with app.node.pool.connection() as conn:
            row = await (await conn.execute("SELECT count(*) AS n FROM inbox WHERE done_at IS NULL")).fetchone()
            return row is not None and row["n"] == 0

    async def wait() -> None:
        while not await empty():
            await asyncio.sleep(0.05)

    await asyncio.wait_for(wait(), timeout)


# --- config and CLI -------------------------------------------------------------------------


def test_a_cluster_config_keeps_reminders_streaming_and_notices_on(node_config):
    cfg = node_config("n1")
    assert cfg.cluster.max_lanes == 4 and cfg.reminders_on and cfg.streaming_mode == "dm"
    assert node_config("n1", reminders={"enabled": True}).reminders_on  # docs/cluster.md#reminders
    assert not node_config("n1", reminders={"enabled": False}).reminders_on
    with pytest.raises(ConfigError, match="node_id"):
        node_config("n1", cluster={"node_id": "has space"})
    # drafts and notices go through the PostgreSQL outbox (docs/cluster.md#streaming-and-progress-notices)
    assert node_config("n1", delivery={"streaming": "all"}).streaming_mode == "all"
    assert node_config("n1", delivery={"streaming": "off"}).streaming_mode == "off"
    assert node_config("n1", compression={"progress_notices": True}).compression.progress_notices


# --- answering --------------------------------------------------------------------------------


async def test_every_message_is_answered_once_whichever_node_receives_it(tg, fake_llm, node_config):
    async with cluster(node_config, "n1", "n2") as nodes:
        for i in range(12):
            update = tg.push_private(100 + i % 4, f"hello {i}")
            assert await post(tg, update, nodes[i % 2]) == 200
        await settled(nodes)
        for user in range(100, 104):  # messages of one lane may be answered together (busy_mode collect)
            named = [int(n) for t in texts(tg, user) for n in re.findall(r"hello (\d+)", t)]
            assert sorted(named) == [i for i in range(12) if 100 + i % 4 == user]


async def test_a_duplicate_delivery_to_both_nodes_is_answered_once(tg, fake_llm, node_config):
    async with cluster(node_config, "n1", "n2") as nodes:
        update = tg.push_private(111, "only once")
        statuses = await asyncio.gather(*(post(tg, update, n) for n in nodes * 2))
        assert statuses == [200] * 4
        await settled(nodes)
        await asyncio.sleep(0.3)
        assert texts(tg, 111) == ["ok: only once"]
        assert len(fake_llm.requests) == 1


async def test_a_lanes_messages_are_answered_in_arrival_order_across_nodes(tg, fake_llm, node_config):
    async def slow(request: dict) -> str:
        await asyncio.sleep(0.05)
        return "ok: " + json.dumps(request["messages"][-1]["content"])[1:-1]

    fake_llm.responder = slow
    async with cluster(node_config, "n1", "n2", limits={"busy_mode": "queue", "rate_limit_per_minute": 1000}) as nodes:
        for i in range(8):
            assert await post(tg, tg.push_private(222, f"step {i}"), nodes[i % 2]) == 200
        await settled(nodes)
        assert texts(tg, 222) == [f"ok: step {i}" for i in range(8)]


async def ingress_held(node: Node) -> list[str]:
    """The ingress roles `node` holds, as its /healthz cluster check reports them."""
    assert node.app.cluster_health is not None
    _, detail = await node.app.cluster_health()
    return detail["leases"]["ingress"]


async def test_in_polling_mode_one_node_polls_and_another_takes_over_when_it_stops(tg, fake_llm, node_config):
    async with AsyncExitStack() as first:
        one = await first.enter_async_context(started(node_config("n1", polling=True)))
        async with started(node_config("n2", polling=True)) as two:
            assert await ingress_held(one) == ["ingress:telegram-polling"]
            assert await ingress_held(two) == []
            for i in range(6):
                tg.push_private(500 + i % 2, f"polled {i}")
            await tg.wait_sent(6)
            await first.aclose()  # the poller leaves: its lease is released, n2 takes over
            for i in range(6, 10):
                tg.push_private(500 + i % 2, f"polled {i}")
            await tg.wait_sent(10, timeout=15)
            assert await ingress_held(two) == ["ingress:telegram-polling"]
            await settled([two])
    for user in (500, 501):
        assert sorted(texts(tg, user)) == sorted(f"ok: polled {i}" for i in range(10) if 500 + i % 2 == user)
    assert len(fake_llm.requests) == 10


# --- failover and fencing -------------------------------------------------------------------


async def test_a_node_that_stops_heartbeating_is_taken_over_and_its_unsent_chunks_go_out_in_order(
    tg, fake_llm, node_config
):
    long_answer = "\n\n".join(f"part {i} " + "x" * 3000 for i in range(3))  # three chunks
    fake_llm.script(long_answer)
    async with started(node_config("n1")) as one:
        app = one.app
        assert app.node is not None
        tg.fail_next("sendMessage", status=500, times=100)  # n1 records the answer but cannot send it
        assert await post(tg, tg.push_private(333, "long please"), one) == 200

        async def recorded() -> None:
            while True:
                async with app.node.pool.connection() as conn:
                    row = await (await conn.execute("SELECT count(*) AS n FROM outbox")).fetchone()
                if row and row["n"] == 3:
                    return
                await asyncio.sleep(0.05)

        await asyncio.wait_for(recorded(), 20)
        # n1 freezes: no heartbeats, no sends (its tasks are cancelled without leaving)
        assert app.claims is not None
        await app.claims.stop(0)
        app.claims = None
        await app.deliverer.close(0)
        assert app.node._beat is not None
        app.node._beat.cancel()
        tg._failures.clear()  # the platform works again
        async with started(node_config("n2")) as two:
            await tg.wait_sent(3, 333, timeout=20)
            await settled([two])
        assert [t.split(" x")[0] for t in texts(tg, 333)] == ["part 0", "part 1", "part 2"]
        assert len(fake_llm.requests) == 1  # the turn was not run again


async def test_a_profile_write_under_a_lost_lease_is_refused_and_the_profile_closed(tg, fake_llm, node_config):
    async with started(node_config("n1")) as one:
        app = one.app
        node = app.node
        assert node is not None
        assert await post(tg, tg.push_private(444, "hello"), one) == 200
        await settled([one])
        [tenant] = list(node.held_tenants())
        profile = app.profiles._open[tenant]
        held = node.held(tenant)
        assert held is not None
        # another node takes the tenant over: its lease expired and the epoch moved on
        async with node.pool.connection() as conn:
            await conn.execute(
                "UPDATE tenant_leases SET holder = 'n2', epoch = epoch + 1, expires_at = now() + interval '1 minute'"
                " WHERE tenant = %s",
                (tenant,),
            )
        await node.beat()  # the renewal fails: the lease is lost
        assert held.lost and node.metrics.leases_lost.value() == 1
        with pytest.raises(LeaseLost):
            await profile.memory.add("memory", "written after the takeover")
        with pytest.raises(LeaseLost):
            held.check()
        memory_file = profile.path / "memories" / "MEMORY.md"
        assert not memory_file.exists() or "written after the takeover" not in memory_file.read_text()

        async def closed() -> None:
            while tenant in app.profiles._open:
                await asyncio.sleep(0.05)

        await asyncio.wait_for(closed(), 10)
        # once the other holder's lease lapses, this node takes the tenant back (a new epoch)
        async with node.pool.connection() as conn:
            await conn.execute("UPDATE tenant_leases SET expires_at = now() WHERE tenant = %s", (tenant,))
        assert await post(tg, tg.push_private(444, "again"), one) == 200
        await settled([one])
        assert texts(tg, 444) == ["ok: hello", "ok: again"]
        again = node.held(tenant)
        assert again is not None and again.epoch == held.epoch + 2


async def test_a_lease_the_database_stops_renewing_is_lost_at_its_local_deadline_and_its_profile_closed_before_it_expires(
    tg, fake_llm, node_config, caplog
):
    caplog.set_level(logging.INFO, logger="hermes.cluster")
    fake_llm.script(hang(60, "too late"))
    async with started(node_config("n1")) as one:
        app, node = one.app, one.app.node
        assert node is not None and node._beat is not None
        assert await post(tg, tg.push_private(1919, "slow please"), one) == 200
        for _ in range(400):  # until the turn is in the model's hands: the profile is in use
            if fake_llm.requests:
                break
            await asyncio.sleep(0.05)
        held = node.held("telegram-1919")
        assert held is not None
        node._beat.cancel()  # no renewal answers any more (as while PostgreSQL restarts)

        async def closed() -> None:
            while "telegram-1919" in app.profiles._open:
                await asyncio.sleep(0.05)

        await asyncio.wait_for(closed(), 3 * TTL)
        assert held.lost and held.reason == "not renewed in time"
        async with node.pool.connection() as conn:
            cur = await conn.execute(
                "SELECT extract(epoch FROM expires_at)::float8 AS e FROM tenant_leases WHERE tenant = 'telegram-1919'"
            )
            row = await cur.fetchone()
        assert row is not None
        [close] = [r for r in caplog.records if getattr(r, "event", "") == "profile_close"]
        assert close.tenant == "telegram-1919" and close.ts < row["e"]  # closed before another node could open it
    assert texts(tg, 1919) == []  # the stopped turn sent nothing; the message stays pending


async def test_a_chunk_sent_while_its_lane_was_taken_away_is_sent_again_when_the_node_claims_the_lane_back(
    tg, fake_llm, node_config
):
    async with started(node_config("n1")) as one:
        node = one.app.node
        assert node is not None
        tg.delay_next("sendMessage", 2.0)  # Telegram takes the answer but confirms it late
        assert await post(tg, tg.push_private(2020, "hello"), one) == 200
        await tg.wait_sent(1, 2020, timeout=20)
        async with node.pool.connection() as conn:  # meanwhile the lane went to a node that then died
            await conn.execute("INSERT INTO nodes (node_id, lease_expires_at) VALUES ('n2', now() + interval '3 s')")
            await conn.execute("UPDATE lanes SET claimed_by = 'n2' WHERE claimed_by = 'n1'")
        # n1 could not mark the chunk sent; once n2's claim is reaped, n1 claims the lane
        # back, sends the chunk again (the documented window) and the message is done
        await settled([one], timeout=20)
    assert texts(tg, 2020) in (["ok: hello"], ["ok: hello", "ok: hello"])


async def test_an_outbox_commit_under_a_stale_epoch_is_refused(tg, fake_llm, node_config):
    gate = asyncio.Event()

    async def held_up(request: dict) -> str:
        await gate.wait()
        return "late answer"

    fake_llm.responder = held_up
    async with started(node_config("n1")) as one:
        app = one.app
        node = app.node
        assert node is not None
        assert await post(tg, tg.push_private(555, "hello"), one) == 200

        async def claimed() -> str:
            while not node.claims:
                await asyncio.sleep(0.02)
            return next(iter(node.claims))

        lane = await asyncio.wait_for(claimed(), 10)
        tenant = node.claims[lane].tenant

        async def asked() -> None:  # the turn is at the model: its tenant lease is held
            while not fake_llm.requests:
                await asyncio.sleep(0.02)

        await asyncio.wait_for(asked(), 10)
        async with node.pool.connection() as conn:  # taken over behind the node's back
            bumped = await conn.execute("UPDATE tenant_leases SET epoch = epoch + 1 WHERE tenant = %s", (tenant,))
            assert bumped.rowcount == 1
        gate.set()
        await settled([one])
        assert node.metrics.fenced.value(kind="turn") == 1  # the turn under epoch 1 committed nothing
        # the message stayed pending and was run again under the current epoch: answered once
        assert texts(tg, 555) == ["late answer"]
        async with node.pool.connection() as conn:
            rows = await (await conn.execute("SELECT epoch FROM outbox")).fetchall()
        assert [r["epoch"] for r in rows] == [2]


# --- audit and storage --------------------------------------------------------------------------


async def test_profile_open_and_close_are_audited_as_json_with_tenant_epoch_node_and_ts(
    tg, fake_llm, node_config, caplog
):
    caplog.set_level(logging.INFO, logger="hermes.cluster")
    async with started(node_config("n1")) as one:
        assert await post(tg, tg.push_private(666, "hi"), one) == 200
        await settled([one])
    fmt = JsonFormatter(Redactor([]))
    events = [json.loads(fmt.format(r)) for r in caplog.records if getattr(r, "event", "").startswith("profile_")]
    assert [e["event"] for e in events] == ["profile_open", "profile_close"]
    for e in events:
        assert e["node"] == "n1" and e["epoch"] >= 1 and e["tenant"] and isinstance(e["ts"], float)
    assert events[0]["tenant"] == events[1]["tenant"]


async def test_profiles_of_a_cluster_node_use_a_rollback_journal_not_wal(tg, fake_llm, node_config):
    async with started(node_config("n1")) as one:
        assert await post(tg, tg.push_private(777, "hi"), one) == 200
        await settled([one])
        data_dir = one.app.cfg.data_dir
    [db] = list((data_dir / "profiles").glob("*/state.db"))
    import sqlite3

    with sqlite3.connect(db) as con:
        assert con.execute("PRAGMA journal_mode").fetchone()[0] == "delete"
    assert not (data_dir / "gateway.db").exists()


def test_a_session_store_guard_refuses_the_write_and_the_close_writes_nothing(tmp_path):
    allowed = [True]

    def guard() -> None:
        if not allowed[0]:
            raise LeaseLost("gone")

    async def scenario() -> None:
        store = SessionStore(tmp_path / "p", guard=guard, journal_mode="delete", profile_lock=False)
        await store.open()
        sid = await store.start_session("k")
        allowed[0] = False
        with pytest.raises(LeaseLost):
            await store.start_session("k2")
        await store.close()
        allowed[0] = True
        again = SessionStore(tmp_path / "p")
        await again.open()
        assert await again.route("k") == sid and await again.route("k2") is None
        await again.close()

    asyncio.run(scenario())


async def test_an_answer_stored_in_the_profile_but_never_recorded_is_sent_by_the_next_claim(tg, fake_llm, node_config):
    """A node died between writing the answer into the profile and recording it in the
    outbox (here: the record is refused once) while a later message waited: the next claim
    sends the stored answer for the first message and answers the later one on its own."""
    async with started(node_config("n1")) as one:
        app = one.app
        outbox = app.shared_outbox
        assert outbox is not None
        real_record = outbox.record
        refused: list[str] = []

        async def record_once_refused(drafts, *, finish=(), source=None):
            if finish and not refused:
                first = finish[0][0]
                refused.append(first.text)
                later = first.model_copy(update={"message_id": first.message_id + "0", "text": "second"})
                await app.handle_inbound(later)  # arrives while the first is in flight
                raise FencedOut("the node died here")
            return await real_record(drafts, finish=finish, source=source)

        outbox.record = record_once_refused  # type: ignore[method-assign]
        assert await post(tg, tg.push_private(888, "first"), one) == 200
        await tg.wait_sent(2, 888, timeout=20)
        await settled([one])
        assert refused == ["first"]
        assert texts(tg, 888) == ["ok: first", "ok: second"]
        assert len(fake_llm.requests) == 2  # the first answer was not asked for again


async def test_nodes_share_the_data_dir_but_a_single_node_gateway_is_kept_out(tg, fake_llm, node_config, config_for):
    from gateway.runlock import AdminError

    async with cluster(node_config, "n1", "n2"):
        single = build_gateway(config_for(), [])
        with pytest.raises(AdminError, match="is in use"):
            await single.start()
        await single.stop()


async def test_a_graceful_stop_leaves_the_cluster_and_frees_its_tenant_leases_at_once(tg, fake_llm, node_config):
    async with started(node_config("n1")) as one:
        assert await post(tg, tg.push_private(999, "hi"), one) == 200
        await settled([one])
        node = one.app.node
        assert node is not None and node.held_tenants()
        pool_dsn = node.dsn
    import psycopg

    async with await psycopg.AsyncConnection.connect(pool_dsn) as conn:
        nodes = await (await conn.execute("SELECT count(*) FROM nodes")).fetchone()
        live = await (await conn.execute("SELECT count(*) FROM tenant_leases WHERE expires_at > now()")).fetchone()
    assert nodes == (0,) and live == (0,)


async def test_a_message_with_nul_characters_is_recorded_without_them_and_answered(tg, fake_llm, node_config):
    async with started(node_config("n1")) as one:
        assert await post(tg, tg.push_private(1212, "a\x00b typed \\u0000"), one) == 200
        await settled([one])
        assert texts(tg, 1212) == ["ok: ab typed \\u0000"]


async def test_an_answered_message_keeps_no_text_in_the_shared_inbox(tg, fake_llm, node_config):
    """As gateway.db on one node: once answered, what a person said leaves PostgreSQL; the
    row keeps who sent it where, which a delete needs (docs/cluster.md#the-postgresql-layer)."""
    async with started(node_config("n1")) as one:
        assert await post(tg, tg.push_private(1313, "my canary 4242 text"), one) == 200
        await settled([one])
        assert texts(tg, 1313) == ["ok: my canary 4242 text"]
        assert one.app.node is not None
        async with one.app.node.pool.connection() as conn:
            rows = await (await conn.execute("SELECT payload, done_at FROM inbox")).fetchall()
            chunks = await (await conn.execute("SELECT body FROM outbox")).fetchall()
    assert rows and all(r["done_at"] is not None for r in rows)
    assert not [r for r in rows if "4242" in json.dumps(r["payload"])]
    assert not [c for c in chunks if "4242" in json.dumps(c["body"])]
    assert {(r["payload"]["platform"], r["payload"]["user_id"]) for r in rows} == {("telegram", "1313")}


def refuse_the_first_collected_record(app: GatewayApp, before: Any = None) -> list[int]:
    """Make the node's outbox refuse, as if the node had died there, the first record that
    finishes several collected messages (`before(finish)` runs first). Returns the list the
    refused record's message count is put in."""
    outbox = app.shared_outbox
    assert outbox is not None
    real_record = outbox.record
    refused: list[int] = []

    async def record_once_refused(drafts, *, finish=(), source=None):
        if len(finish) > 1 and not refused:
            refused.append(len(finish))
            if before is not None:
                await before(finish)
            raise FencedOut("the node died here")
        return await real_record(drafts, finish=finish, source=source)

    outbox.record = record_once_refused  # type: ignore[method-assign]
    return refused


async def test_a_collected_answer_stored_but_never_recorded_is_sent_by_the_next_claim(tg, fake_llm, node_config):
    """As above, for one turn that answered several collected messages."""
    async with started(node_config("n1", limits={"coalesce_burst_ms": 300, "rate_limit_per_minute": 1000})) as one:
        refused = refuse_the_first_collected_record(one.app)
        fake_llm.responder = memory_saving_responder  # the collected turn saves a memory first
        for text in ("zero", "remember one", "two", "three"):
            assert await post(tg, tg.push_private(1313, text), one) == 200
        await settled([one])
        assert refused == [3]
        sent = texts(tg, 1313)
        assert sent[0] == "ok: zero" and len(sent) == 2 and sent[1].startswith("done:"), sent
        assert len(fake_llm.requests) == 3  # zero, the tool call, the answer: none asked again


async def test_a_stored_collected_answer_is_sent_when_the_next_claim_collects_it_with_a_new_message(
    tg, fake_llm, node_config
):
    """The storm's lost replies: a node answered several collected messages in the profile
    and died before recording it, while a new message arrived. The next claim collects the
    answered messages with the new one: the stored answer is sent with the new answer, not
    dropped by finishing the answered messages with the new message's reply."""
    async with started(node_config("n1", limits={"coalesce_burst_ms": 300, "rate_limit_per_minute": 1000})) as one:
        app = one.app

        async def a_later_message_arrives(finish) -> None:  # while the collected turn is in flight
            last = finish[-1][0]
            await app.handle_inbound(last.model_copy(update={"message_id": last.message_id + "0", "text": "four"}))

        refused = refuse_the_first_collected_record(app, before=a_later_message_arrives)
        fake_llm.responder = memory_saving_responder
        for text in ("zero", "remember one", "two", "three"):
            assert await post(tg, tg.push_private(1616, text), one) == 200
        await settled([one])
        assert refused == [3]
        sent = "\n".join(texts(tg, 1616))
        assert "ok: zero" in sent and "done:" in sent and "four" in sent, sent
        assert len(fake_llm.requests) == 4  # zero, the tool call, its answer, four: none asked again


async def test_a_node_restarted_under_the_same_id_writes_under_a_new_epoch(tg, fake_llm, node_config):
    epochs = []
    for text in ("first life", "second life"):
        async with started(node_config("n1")) as one:
            assert await post(tg, tg.push_private(1414, text), one) == 200
            await settled([one])
            assert one.app.node is not None
            epochs += list(one.app.node.held_tenants().values())
    assert texts(tg, 1414) == ["ok: first life", "ok: second life"]
    assert epochs[1] > epochs[0]


async def test_a_collected_answer_stored_by_a_node_that_then_froze_is_sent_by_another_node(tg, fake_llm, node_config):
    limits = {"coalesce_burst_ms": 300, "rate_limit_per_minute": 1000}
    fake_llm.responder = memory_saving_responder
    async with started(node_config("n1", limits=limits)) as one:
        app = one.app
        assert app.shared_outbox is not None and app.claims is not None and app.node is not None
        real_record = app.shared_outbox.record
        refused: list[int] = []

        async def record_then_freeze(drafts, *, finish=(), source=None):
            if len(finish) > 1 and not refused:
                refused.append(len(finish))
                assert app.claims is not None and app.node is not None and app.node._beat is not None
                app.claims._stopping = True  # n1 takes no more lanes and stops heartbeating
                app.node._beat.cancel()
                raise FencedOut("n1 froze here")
            return await real_record(drafts, finish=finish, source=source)

        app.shared_outbox.record = record_then_freeze  # type: ignore[method-assign]
        for text in ("zero", "remember one", "two", "three"):
            assert await post(tg, tg.push_private(1515, text), one) == 200
        await tg.wait_sent(1, 1515, timeout=20)
        while not refused:
            await asyncio.sleep(0.05)
        async with started(node_config("n2", limits=limits)) as two:
            await tg.wait_sent(2, 1515, timeout=30)
            await settled([two])
    sent = texts(tg, 1515)
    assert sent[0] == "ok: zero" and len(sent) == 2 and sent[1].startswith("done:"), sent


# --- one process per node id -----------------------------------------------------------------


def node_config_file(tmp_path, fake_llm, tg: FakeTelegram, node_id: str) -> Path:
    """A YAML config of node `node_id` over the same data_dir, for `hermes-gateway run`."""
    port = free_port()
    data = {
        "data_dir": str(tmp_path / "data"),
        "llm": {"base_url": fake_llm.base_url, "model": "fake-model", "max_retries": 1, "timeout_s": 10},
        "storage": {"fsync": "never"},
        "platforms": {
            "telegram": {
                "enabled": True,
                "token_env": TOKEN_ENV,
                "base_url": tg.base_url,
                "mode": "webhook",
                "webhook": {
                    "listen": "127.0.0.1",
                    "port": port,
                    "path": "/telegram",
                    "public_url": f"http://127.0.0.1:{port}",
                    "secret_token_env": SECRET_ENV,
                },
            }
        },
        "cluster": {"postgres_dsn_env": DSN_ENV, "node_id": node_id, "lease_ttl_s": TTL, "poll_interval_s": 0.3},
    }
    path = tmp_path / f"{node_id}-again.yaml"
    path.write_text(json.dumps(data))  # JSON is YAML
    return path


async def test_a_second_process_under_a_live_node_id_refuses_to_start_naming_it_and_the_first_runs_on(
    tg, fake_llm, node_config, tmp_path
):
    async with started(node_config("n1")) as one:
        assert one.app.node is not None
        assert await post(tg, tg.push_private(1717, "before"), one) == 200
        await settled([one])
        epochs = one.app.node.held_tenants()
        proc = await asyncio.create_subprocess_exec(
            str(Path(sys.executable).parent / "hermes-gateway"),
            "-c",
            str(node_config_file(tmp_path, fake_llm, tg, "n1")),
            "run",
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        try:
            _, err = await asyncio.wait_for(proc.communicate(), 60)
        finally:
            if proc.returncode is None:  # it started (the bug): do not leave it running
                proc.kill()
                await proc.wait()
        lines = err.decode().strip().splitlines()
        assert proc.returncode == 1, lines
        assert lines[-1].startswith("error: node id n1 is in use by another running process"), lines
        assert f"pid {os.getpid()}" in lines[-1] and "cluster.node_id" in lines[-1]
        assert not any("Traceback" in line for line in lines), lines
        # the first process kept its id, its leases and their epochs, and answers on
        assert one.app.node.displaced is None
        assert await post(tg, tg.push_private(1717, "after"), one) == 200
        await settled([one])
        assert one.app.node.held_tenants() == epochs
    assert texts(tg, 1717) == ["ok: before", "ok: after"]


async def test_a_node_id_whose_process_stopped_heartbeating_is_taken_once_it_lapses_and_the_old_one_holds_nothing(
    tg, fake_llm, node_config
):
    async with started(node_config("n1")) as old:
        node = old.app.node
        assert node is not None and node._beat is not None
        assert await post(tg, tg.push_private(1818, "first life"), old) == 200
        await settled([old])
        first_epoch = node.held_tenants()["telegram-1818"]
        node._beat.cancel()  # the old process stops heartbeating (frozen, or dead without leaving)
        await old.app.profiles.close_all()
        async with started(node_config("n1")) as new:  # waits out the old registration, then joins
            assert new.app.node is not None
            assert await post(tg, tg.push_private(1818, "second life"), new) == 200
            await settled([new])
            assert new.app.node.held_tenants()["telegram-1818"] > first_epoch
            await node.beat()  # the old process wakes up: its id is another live process's now
            assert node.displaced is not None and "node id n1 is in use" in node.displaced
            with pytest.raises(LeaseLost):
                await node.hold("telegram-1818")
            election = old.app._election
            assert election is not None
            await election.step()  # its ingress roles are keyed by the id: it gives them up
            assert election.held == []
            assert new.app._election is not None and new.app._election.held
            assert old.app.cluster_health is not None and new.app.cluster_health is not None
            ok, body = await old.app.cluster_health()  # its /healthz says so
            assert not ok and body["node"]["ok"] is False and "another running process" in body["node"]["detail"]
            assert (await new.app.cluster_health())[0]
            # and `run` ends it with that sentence: it has nothing left to serve
            gone = old.app.nothing_to_serve()
            assert gone is not None and "node id n1 is in use" in gone
            assert new.app.nothing_to_serve() is None
            assert await post(tg, tg.push_private(1818, "still here"), new) == 200
            await settled([new])
    assert texts(tg, 1818) == ["ok: first life", "ok: second life", "ok: still here"]
