"""Ingress election on the real PostgreSQL: one node polls Telegram (the fake answers two
concurrent getUpdates with 409, so a second poller would show), another takes over when the
holder stops renewing; in webhook mode every node accepts and only the elected one calls
setWebhook. Discord shards are split across nodes by lease (DMs on shard 0), replies go out
through REST from any node, and a shard moves when its node leaves."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable

from adapters.discord_bot import DiscordAdapter
from adapters.telegram import TelegramAdapter
from core.messages import InboundMessage, OutboundMessage
from core.settings import DiscordConfig
from gateway.cluster.db import Pool
from gateway.cluster.ingress import TELEGRAM_POLLING, TELEGRAM_WEBHOOK, IngressElection, Role, discord_shard
from gateway.cluster.leases import leave, register_node
from tests.fakes.discord_api import FakeDiscord
from tests.fakes.telegram_api import FakeTelegram
from tests.pg import require_postgres, second_pool
from tests.test_telegram_adapter import BOT, LOOSE_FLOOD, TOKEN, Recorder, free_port, make_cfg

require_postgres()
TTL = 2.0  # short, so a takeover happens within the test


async def wait_until(predicate: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached"
        await asyncio.sleep(0.02)


class TgNode:
    """One node's Telegram adapter (elected receiving) and its ingress election."""

    def __init__(self, name: str, pool: Pool, adapter: TelegramAdapter, events: list[str]) -> None:
        self.name, self.pool, self.adapter, self.sink = name, pool, adapter, Recorder()

        async def start() -> None:
            events.append(f"{name} starts")
            await adapter.start_receiving()

        async def stop() -> None:
            await adapter.stop_receiving()
            events.append(f"{name} stopped")

        role = TELEGRAM_POLLING if adapter.cfg.mode == "polling" else TELEGRAM_WEBHOOK
        self.election = IngressElection(pool, f"node-{name}", TTL, [Role(role, start, stop)], interval_s=0.1)


async def tg_node(tg: FakeTelegram, schema: str, name: str, events: list[str], **cfg) -> TgNode:
    adapter = TelegramAdapter(
        make_cfg(tg, **cfg), TOKEN, elected=True, backoff_initial_s=0.05, backoff_max_s=0.2, flood_limits=LOOSE_FLOOD
    )
    node = TgNode(name, await second_pool(schema), adapter, events)
    await adapter.start(node.sink)
    return node


async def close(*nodes: TgNode) -> None:
    for n in nodes:
        await n.election.stop()
        await n.adapter.aclose()
        await n.pool.close()


async def test_only_the_lease_holder_polls_and_another_node_takes_over_when_it_stops_renewing(pool, schema, caplog):
    events: list[str] = []
    async with FakeTelegram(token=TOKEN, bot_username=BOT) as tg:
        a = await tg_node(tg, schema, "a", events)
        b = await tg_node(tg, schema, "b", events)
        try:
            await a.election.start()
            await b.election.start()
            assert a.election.held == [TELEGRAM_POLLING] and b.election.held == []
            for i in range(5):
                tg.push_private(1000 + i, f"hello {i}")
            await a.sink.wait(5)
            for _ in range(10):  # several rounds of both elections and long polls
                await b.election.step()
            assert b.sink.messages == [] and not b.adapter.receiving
            assert ("getUpdates", 409) not in tg.responses  # never two pollers at once

            # node A loses the database: it cannot renew, so it stops polling by itself
            await a.pool.close()
            await wait_until(lambda: "a stopped" in events)
            await wait_until(lambda: b.election.held == [TELEGRAM_POLLING])
            assert events == ["a starts", "a stopped", "b starts"]  # never both at once
            tg.push_private(2000, "after the takeover")
            assert [m.text for m in await b.sink.wait(1)] == ["after the takeover"]
            assert len(a.sink.messages) == 5
            # A's abandoned long poll may be ended with a 409 that nobody reads; no node was refused
            assert "getUpdates conflict" not in caplog.text
            async with pool.connection() as conn:
                row = await (
                    await conn.execute("SELECT holder, epoch FROM tenant_leases WHERE tenant = %s", (TELEGRAM_POLLING,))
                ).fetchone()
            assert row == {"holder": "node-b", "epoch": 2}
        finally:
            await close(b)
            await a.election.stop()
            await a.adapter.aclose()


async def test_a_node_that_stops_gracefully_hands_polling_over_at_once(pool, schema):
    events: list[str] = []
    async with FakeTelegram(token=TOKEN, bot_username=BOT) as tg:
        a = await tg_node(tg, schema, "a", events)
        b = await tg_node(tg, schema, "b", events)
        try:
            await a.election.start()
            await b.election.start()
            tg.push_private(1, "first")
            await a.sink.wait(1)
            await a.election.stop()  # releases the lease
            await b.election.step()
            assert b.election.held == [TELEGRAM_POLLING] and events == ["a starts", "a stopped", "b starts"]
            tg.push_private(2, "second")
            assert [m.text for m in await b.sink.wait(1)] == ["second"]  # "first" was acknowledged by A
        finally:
            await close(a, b)


async def test_webhook_mode_every_node_accepts_and_only_the_elected_one_sets_the_webhook(pool, schema, monkeypatch):
    monkeypatch.setenv("HG_TG_SECRET", "s3cret")
    events: list[str] = []
    async with FakeTelegram(token=TOKEN, bot_username=BOT) as tg:
        nodes = []
        for name in ("a", "b"):
            webhook = {
                "listen": "127.0.0.1",
                "port": free_port(),
                "path": "/tg",
                "public_url": "https://bot.example/tg",
                "secret_token_env": "HG_TG_SECRET",
            }
            nodes.append(await tg_node(tg, schema, name, events, mode="webhook", webhook=webhook))
        a, b = nodes
        try:
            await a.election.start()
            await b.election.start()
            await wait_until(lambda: len(tg.calls_of("setWebhook")) == 1)
            for _ in range(3):
                await b.election.step()
            assert len(tg.calls_of("setWebhook")) == 1 and b.election.held == []
            for node, uid in ((a, 1), (b, 2)):  # a load balancer may pick either node
                pushed = tg.push_private(uid, f"via {node.name}")
                status = await tg.post_to_webhook(pushed, url=f"http://127.0.0.1:{node.adapter.webhook_port}/tg")
                assert status == 200
                assert [m.text for m in await node.sink.wait(1)] == [f"via {node.name}"]
        finally:
            await close(a, b)


# ----- Discord shards -----------------------------------------------------------------------


def guilds_on_both_shards(fake: FakeDiscord) -> dict[int, str]:
    """A guild on shard 0 and one on shard 1 (of 2), each with a #general channel."""
    by_shard: dict[int, str] = {}
    while len(by_shard) < 2:
        gid = fake.add_guild(f"guild {len(fake.guilds)}")
        by_shard.setdefault((int(gid) >> 22) % 2, gid)
        time.sleep(0.002)  # snowflakes of the next millisecond: the other shard, sooner or later
    return by_shard


class DcNode:
    def __init__(self, name: str, fake: FakeDiscord, pool: Pool) -> None:
        self.name, self.pool, self.got = name, pool, []
        cfg = DiscordConfig(enabled=True, api_base=fake.api_base, gateway_url=fake.gateway_url, shard_count=2)
        self.adapter = DiscordAdapter(cfg, fake.token, ready_timeout=10, guild_ready_timeout=0.05, elected=True)
        roles = [
            Role(
                discord_shard(i),
                functools.partial(self.adapter.start_shard, i),
                functools.partial(self.adapter.stop_shard, i),
                spread=True,
            )
            for i in range(2)
        ]
        self.election = IngressElection(pool, f"node-{name}", TTL, roles, interval_s=0.1)

    async def sink(self, msg: InboundMessage) -> None:
        self.got.append(msg)


async def test_discord_shards_are_split_across_nodes_dms_on_shard_0_and_replies_go_through_rest(pool, schema):
    async with FakeDiscord() as fake:
        guild = guilds_on_both_shards(fake)
        channel = {s: fake.channel_named(g, "general") for s, g in guild.items()}
        alice = fake.add_user("alice")
        await register_node(pool, "node-a", TTL)
        await register_node(pool, "node-b", TTL)
        a, b = DcNode("a", fake, await second_pool(schema)), DcNode("b", fake, await second_pool(schema))
        try:
            for node in (a, b):
                await node.adapter.start(node.sink)
            assert fake.connected_shards == []  # logged in for REST only, no shard yet
            await a.election.start()
            await b.election.start()
            assert a.election.held == [discord_shard(0)] and b.election.held == [discord_shard(1)]
            await fake.wait_until(lambda: fake.connected_shards == [0, 1])
            assert sorted(op["d"]["shard"][0] for op in fake.gateway_ops("recv") if op["op"] == 2) == [0, 1]

            dm = fake.push_dm(alice, "a private hello")
            in_0 = fake.push_guild_message(channel[0], alice, "hello shard 0", mention_bot=True)
            in_1 = fake.push_guild_message(channel[1], alice, "hello shard 1", mention_bot=True)
            await fake.wait_until(lambda: len(a.got) == 2 and len(b.got) == 1)
            assert [m.message_id for m in a.got] == [dm["id"], in_0["id"]]  # DMs arrive on shard 0
            assert [m.message_id for m in b.got] == [in_1["id"]]

            # node B ran the turn of the DM that node A received: it answers through REST
            sent = await b.adapter.send(OutboundMessage(chat_id=a.got[0].chat_id, text="answered by B"))
            assert sent is not None
            assert [m["content"] for m in fake.sent_messages(a.got[0].chat_id)] == ["answered by B"]

            # node B leaves: node A takes shard 1 over and receives its guild's messages
            await b.election.stop()
            await leave(pool, "node-b")
            await a.election.step()
            assert a.election.held == [discord_shard(0), discord_shard(1)]
            assert a.adapter.shards == [0, 1] and b.adapter.shards == []
            await fake.wait_until(lambda: fake.connected_shards == [0, 1])
            later = fake.push_guild_message(channel[1], alice, "after the takeover", mention_bot=True)
            await fake.wait_until(lambda: any(m.message_id == later["id"] for m in a.got))
            assert len(b.got) == 1
        finally:
            for node in (a, b):
                await node.election.stop()
            for node in (a, b):
                await node.adapter.stop()
                await node.pool.close()


async def test_a_node_that_joins_gets_its_share_of_the_shards(pool, schema):
    async with FakeDiscord() as fake:
        await register_node(pool, "node-a", TTL)
        a, b = DcNode("a", fake, await second_pool(schema)), DcNode("b", fake, await second_pool(schema))
        try:
            for node in (a, b):
                await node.adapter.start(node.sink)
            await a.election.start()  # alone: it holds both
            assert a.election.held == [discord_shard(0), discord_shard(1)]
            await register_node(pool, "node-b", TTL)
            await b.election.step()
            assert b.election.held == []  # nothing free yet
            await a.election.step()  # its share is now one: it gives the surplus back
            await b.election.step()
            assert a.election.held == [discord_shard(0)] and b.election.held == [discord_shard(1)]
            await fake.wait_until(lambda: fake.connected_shards == [0, 1])
        finally:
            for node in (a, b):
                await node.election.stop()
            for node in (a, b):
                await node.adapter.stop()
                await node.pool.close()


async def test_a_single_node_with_shard_count_runs_every_shard_itself():
    async with FakeDiscord() as fake:
        guild = guilds_on_both_shards(fake)
        alice = fake.add_user("alice")
        got: list[InboundMessage] = []

        async def sink(msg: InboundMessage) -> None:
            got.append(msg)

        cfg = DiscordConfig(enabled=True, api_base=fake.api_base, gateway_url=fake.gateway_url, shard_count=2)
        adapter = DiscordAdapter(cfg, fake.token, ready_timeout=10, guild_ready_timeout=0.05)
        await adapter.start(sink)
        try:
            await fake.wait_until(lambda: fake.connected_shards == [0, 1])
            for shard, gid in guild.items():
                fake.push_guild_message(fake.channel_named(gid, "general"), alice, f"on {shard}", mention_bot=True)
            fake.push_dm(alice, "dm")
            await fake.wait_until(lambda: len(got) == 3)
            assert sorted(m.text for m in got) == ["dm", "on 0", "on 1"]
        finally:
            await adapter.stop()
