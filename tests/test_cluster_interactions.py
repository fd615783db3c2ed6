"""Discord slash commands answered from any node of a cluster, on the real PostgreSQL: the
node holding the shard defers the interaction and records it in the shared inbox with its
follow-up webhook; the node that runs the turn answers through that webhook, and the token
leaves PostgreSQL once the message is done (docs/cluster.md#slash-commands-answered-from-any-node).

Two in-process nodes, each with the real DiscordAdapter (discord.py) against the fake
Discord, the fake model, one data_dir and one schema."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import pytest
from pydantic import SecretStr

from adapters.discord_bot import DiscordAdapter
from core.messages import ReplyHandle
from core.settings import DiscordConfig
from gateway.cluster.build import build_cluster_gateway
from gateway.cluster.inbox import Inbound, record_inbound, spend_expired_handles
from gateway.cluster.ingress import discord_shard
from gateway.runtime import GatewayApp
from tests.fakes.discord_api import FakeDiscord
from tests.pg import require_postgres
from tests.test_cluster_node import DSN_ENV, TTL, schema_dsn
from tests.test_telegram_adapter import Recorder

require_postgres()

TOKEN_ENV = "HERMES_CLUSTER_DISCORD_TOKEN"


@pytest.fixture
async def fake(monkeypatch):
    async with FakeDiscord() as f:
        monkeypatch.setenv(TOKEN_ENV, f.token)
        f.guild = f.add_guild("Hermes Lab")
        f.general = f.channel_named(f.guild, "general")
        f.alice = f.add_user("alice")
        yield f


@pytest.fixture
def discord_node_config(config_for, fake, schema, monkeypatch):
    monkeypatch.setenv(DSN_ENV, schema_dsn(schema))

    def build(node_id: str):
        discord = {
            "enabled": True,
            "token_env": TOKEN_ENV,
            "api_base": fake.api_base,
            "gateway_url": fake.gateway_url,
        }
        cluster = {"postgres_dsn_env": DSN_ENV, "node_id": node_id, "lease_ttl_s": TTL, "poll_interval_s": 0.3}
        return config_for(platforms={"discord": discord}, cluster=cluster, limits={"rate_limit_per_minute": 1000})

    return build


@asynccontextmanager
async def discord_node(cfg: Any) -> AsyncIterator[GatewayApp]:
    """A node as `run` builds it in cluster mode (the adapter elected, built by the factory)."""

    def adapters(_pacer: object) -> list[DiscordAdapter]:
        return [
            DiscordAdapter.from_config(cfg.platforms.discord, ready_timeout=10, guild_ready_timeout=0.05, elected=True)
        ]

    app = build_cluster_gateway(cfg, adapters_for=adapters)
    await app.start()
    try:
        yield app
    finally:
        await app.stop(drain_timeout=5)


@asynccontextmanager
async def two_nodes(discord_node_config: Any) -> AsyncIterator[tuple[GatewayApp, GatewayApp]]:
    async with AsyncExitStack() as stack:
        a = await stack.enter_async_context(discord_node(discord_node_config("a")))
        b = await stack.enter_async_context(discord_node(discord_node_config("b")))
        yield a, b


async def until(cond: Any, timeout: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"{what} not reached within {timeout} s"
        await asyncio.sleep(0.02)


async def inbox_row(app: GatewayApp, message_id: str) -> dict[str, Any] | None:
    assert app.node is not None
    async with app.node.pool.connection() as conn:
        return await (
            await conn.execute(
                "SELECT payload::text AS payload, reply_handle, done_at FROM inbox WHERE message_id = %s",
                (message_id,),
            )
        ).fetchone()


async def sent_under(app: GatewayApp, message_id: str) -> set[tuple[str, int]]:
    """(holder of the lease the chunks were sent under, epoch) of the message's reply chunks."""
    assert app.node is not None
    async with app.node.pool.connection() as conn:
        rows = await (
            await conn.execute(
                """SELECT l.holder, o.sent_epoch FROM outbox o JOIN inbox i ON i.id = o.inbox_id
                   JOIN tenant_leases l ON l.tenant = o.tenant WHERE i.message_id = %s""",
                (message_id,),
            )
        ).fetchall()
    return {(r["holder"], r["sent_epoch"]) for r in rows}


@pytest.mark.parametrize(("command", "private"), [("help", False), ("whoami", True)])
async def test_a_slash_command_node_a_deferred_is_answered_by_node_b_through_its_webhook(
    fake, fake_llm, discord_node_config, caplog, command, private
):
    caplog.set_level(logging.DEBUG)
    async with two_nodes(discord_node_config) as (a, b):
        assert a._election is not None and a._election.held == [discord_shard(0)]  # a receives
        assert b.node is not None
        # b serves alice's profile, so whichever node claims her lane, b runs it
        held = await b.node.hold(f"discord-{fake.alice}")
        try:
            inter = fake.push_interaction(command, user_id=fake.alice, channel_id=fake.general)
            callback = await fake.wait_answered(inter)
            assert callback["type"] == 5  # deferred ("thinking..."), by node a within Discord's 3 s
            message_id = f"interaction-{inter['id']}"
            await until(lambda: fake.sent_messages(fake.general), what="the answer")
            row = await inbox_row(a, message_id)
            assert row is not None
            await until_done(a, message_id)
        finally:
            await b.node.unhold(held)
        (answer,) = fake.sent_messages(fake.general)
        # the first follow-up replaced the deferred response: the interaction was completed
        assert answer["via"] == "interaction" and answer["interaction_id"] == inter["id"]
        assert bool(answer["body"].get("flags", 0) & 64) is private
        webhook_posts = fake.rest_calls("POST", rf"/webhooks/{fake.app_id}/")
        assert len(webhook_posts) == 1
        # sent under b's lease of alice's profile, so by b; a never held it
        assert {holder for holder, _ in await sent_under(a, message_id)} == {"b"}
        assert message_id not in a.adapters["discord"]._interactions  # type: ignore[attr-defined]
        # the token: never in the payload, gone from its column once answered, never logged
        row = await inbox_row(a, message_id)
        assert row is not None and row["done_at"] is not None and row["reply_handle"] is None
        assert inter["token"] not in row["payload"]
        assert inter["token"] not in caplog.text


async def until_done(app: GatewayApp, message_id: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        row = await inbox_row(app, message_id)
        if row is not None and row["done_at"] is not None:
            return
        assert time.monotonic() < deadline, f"{message_id} not done within {timeout} s"
        await asyncio.sleep(0.05)


async def test_an_interaction_token_past_its_life_leaves_the_inbox_but_privacy_stays(pool):
    handle = ReplyHandle(application_id="42", token=SecretStr("itok-secret"), ephemeral=True, created_at=time.time())
    payload = {
        "platform": "discord",
        "chat_id": "1",
        "chat_type": "group",
        "user_id": "7",
        "message_id": "interaction-9",
    }
    assert await record_inbound(
        pool, Inbound("discord", "1", "interaction-9", "lane", "discord-7", payload, handle.stored())
    )
    assert await spend_expired_handles(pool) == 0  # still usable: kept
    async with pool.connection() as conn:
        await conn.execute("UPDATE inbox SET received_at = now() - interval '16 minutes'")
    assert await spend_expired_handles(pool) == 1
    async with pool.connection() as conn:
        row = await (await conn.execute("SELECT reply_handle FROM inbox")).fetchone()
    assert row is not None and row["reply_handle"] == {"ephemeral": True}


async def test_the_node_that_ran_a_lane_removes_the_placeholder_of_a_command_nothing_answered(fake):
    """`release` at the end of a claim: given back unfinished, the next holder answers (the
    placeholder stays); done without an answer, nothing will, so "thinking..." goes now."""
    cfg = DiscordConfig(enabled=True, api_base=fake.api_base, gateway_url=fake.gateway_url)
    adapter = DiscordAdapter(cfg, fake.token, ready_timeout=10, guild_ready_timeout=0.05, elected=True)
    sink = Recorder()
    await adapter.start(sink)
    try:
        await adapter.start_shard(0)
        await fake.wait_until(lambda: 0 in fake.connected_shards)
        inter = fake.push_interaction("help", user_id=fake.alice, channel_id=fake.general)
        (msg,) = await sink.wait(1)
        assert (await fake.wait_answered(inter))["type"] == 5
        assert msg.reply_handle is not None and msg.reply_handle.application_id == fake.app_id
        assert inter["token"] not in repr(msg) and inter["token"] not in msg.model_dump_json()
        deletes = lambda: fake.rest_calls("DELETE", r"/messages/@original$")  # noqa: E731
        adapter.adopt(msg)
        await adapter.release([msg.message_id], done=False)
        assert deletes() == []
        adapter.adopt(msg)  # the lane's next holder
        await adapter.release([msg.message_id], done=True)
        assert len(deletes()) == 1
        assert next(s for s in fake.interactions.values() if s["id"] == inter["id"]).get("original_deleted")
    finally:
        await adapter.stop()
