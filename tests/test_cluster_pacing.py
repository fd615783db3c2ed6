"""Telegram flood pacing shared by the nodes of a cluster, on the real PostgreSQL: real
TelegramAdapters, each with its own pool (as separate nodes have), send through the fake
Bot API, which records when each message arrived; the per-chat and per-bot limits must
hold for all of them together (docs/cluster.md#flood-pacing-across-nodes)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from adapters.telegram import TelegramAdapter
from adapters.telegram.flood import FloodLimits
from core.messages import DeliveryDeferred, OutboundMessage
from core.protocols import SendPacer
from gateway.cluster.db import Pool
from gateway.cluster.pacing import PgFloodGate
from tests.fakes.telegram_api import FakeTelegram
from tests.pg import require_postgres, second_pool
from tests.test_telegram_adapter import BOT, TOKEN, Recorder, make_cfg

require_postgres()

# Two messages a second in a chat (Telegram's is one; two shows a window, not a spacing).
PER_CHAT = FloodLimits(per_chat=(2, 1.0), per_group=(50, 1.0), overall=(100, 1.0))
# Four messages a second for the bot, whatever the chat.
PER_BOT = FloodLimits(per_chat=(50, 1.0), per_group=(50, 1.0), overall=(4, 1.0))
# Arrivals are counted in windows this much shorter than the limit's period: a send's
# trip to the fake may be late by up to this much without a false alarm, while three
# nodes pacing on their own put three times the limit into one window (the control test).
MARGIN_S = 0.3


def most_in_window(times: list[float], width: float) -> int:
    """The largest number of `times` inside any half-open window [t, t + width)."""
    times = sorted(times)
    return max((sum(1 for u in times[i:] if u < t + width) for i, t in enumerate(times)), default=0)


@asynccontextmanager
async def telegram_nodes(
    tg: FakeTelegram, pacers: list[SendPacer], limits: FloodLimits
) -> AsyncIterator[list[TelegramAdapter]]:
    """One started TelegramAdapter per pacer (cluster mode: it sends, the election receives)."""
    adapters = []
    for i, pacer in enumerate(pacers):
        cfg = make_cfg(tg, base_url=tg.base_url_for(f"node-{i}"))
        adapter = TelegramAdapter(cfg, TOKEN, elected=True, flood_limits=limits, flood_gate=pacer)
        await adapter.start(Recorder())
        adapters.append(adapter)
    try:
        yield adapters
    finally:
        for adapter in adapters:
            await adapter.aclose()


@asynccontextmanager
async def node_pools(schema: str, n: int) -> AsyncIterator[list[Pool]]:
    pools = [await second_pool(schema) for _ in range(n)]
    try:
        yield pools
    finally:
        for p in pools:
            await p.close()


async def send_all(adapters: list[TelegramAdapter], chats: list[int], per_node: int) -> None:
    """Every adapter sends `per_node` messages to its chat (`chats[i]`, or the only one), all at once."""

    async def node(i: int, adapter: TelegramAdapter) -> None:
        chat = chats[i % len(chats)]
        for k in range(per_node):
            await adapter.send(OutboundMessage(chat_id=str(chat), text=f"node {i} message {k}"))

    await asyncio.gather(*(node(i, a) for i, a in enumerate(adapters)))


def arrivals(tg: FakeTelegram) -> list[float]:
    return [m["_at"] for m in tg.sent_messages()]


async def test_three_nodes_sending_to_one_chat_keep_its_rate_together(pool, schema):
    async with FakeTelegram(token=TOKEN, bot_username=BOT) as tg, node_pools(schema, 3) as pools:
        tg.push_private(111, "hello")  # the chat exists
        pacers: list[SendPacer] = [PgFloodGate(p, PER_CHAT) for p in pools]
        async with telegram_nodes(tg, pacers, PER_CHAT) as adapters:
            await send_all(adapters, [111], per_node=3)
        times = arrivals(tg)
        assert len(times) == 9 and {m["_via"] for m in tg.sent_messages()} == {"node-0", "node-1", "node-2"}
        assert most_in_window(times, 1.0 - MARGIN_S) <= 2
        # nine at two a second: the last can start no sooner than 4 s after the first
        assert max(times) - min(times) >= 4.0 - MARGIN_S


async def test_three_nodes_sending_to_their_own_chats_keep_the_bots_rate_together(pool, schema):
    async with FakeTelegram(token=TOKEN, bot_username=BOT) as tg, node_pools(schema, 3) as pools:
        chats = [-1001, -1002, 333]  # two groups and a person: every chat counts for the bot
        for chat in chats:
            if chat < 0:
                tg.add_chat(chat, "supergroup")
            else:
                tg.push_private(chat, "hello")
        pacers: list[SendPacer] = [PgFloodGate(p, PER_BOT) for p in pools]
        async with telegram_nodes(tg, pacers, PER_BOT) as adapters:
            await send_all(adapters, chats, per_node=4)
        times = arrivals(tg)
        assert len(times) == 12
        assert most_in_window(times, 1.0 - MARGIN_S) <= 4
        assert max(times) - min(times) >= 2.0 - MARGIN_S


async def test_without_the_shared_pacer_three_nodes_break_the_chats_rate():
    """The control: each node pacing only its own sends puts three times the limit into one
    window, so the measurement above would see a pacer that does not share."""
    async with FakeTelegram(token=TOKEN, bot_username=BOT) as tg:
        tg.push_private(111, "hello")
        adapters = []
        for i in range(3):
            cfg = make_cfg(tg, base_url=tg.base_url_for(f"node-{i}"))
            adapter = TelegramAdapter(cfg, TOKEN, elected=True, flood_limits=PER_CHAT)  # its own FloodGate
            await adapter.start(Recorder())
            adapters.append(adapter)
        try:
            await send_all(adapters, [111], per_node=2)
        finally:
            for adapter in adapters:
                await adapter.aclose()
        assert most_in_window(arrivals(tg), 1.0 - MARGIN_S) > 2


async def test_a_node_alone_asks_the_database_once_per_send(pool):
    """Its own recent sends are waited out in process: the database is asked only when this
    node's own windows have room, and then it grants at once."""
    async with FakeTelegram(token=TOKEN, bot_username=BOT) as tg:
        tg.push_private(111, "hello")
        pacer = PgFloodGate(pool, PER_CHAT)
        async with telegram_nodes(tg, [pacer], PER_CHAT) as adapters:
            await send_all(adapters, [111], per_node=5)
        assert len(tg.sent_messages(111)) == 5
        assert (pacer.takes, pacer.refused) == (5, 0)
        assert most_in_window(arrivals(tg), 1.0 - MARGIN_S) <= 2


async def test_a_429_one_node_got_holds_the_chat_for_every_node(pool, schema):
    async with node_pools(schema, 1) as (other_pool,):
        a, b = PgFloodGate(pool, PER_CHAT), PgFloodGate(other_pool, PER_CHAT)
        await a.wait_turn("111")
        a.hold("111", 1.5)  # Telegram said retry_after to node a
        retry = asyncio.create_task(a.wait_turn("111"))  # the retry writes the hold for everyone

        async def held() -> bool:
            async with pool.connection() as conn:
                row = await (
                    await conn.execute(
                        "SELECT held_until > extract(epoch FROM now()) AS h FROM send_pacing WHERE key = 'telegram:chat:111'"
                    )
                ).fetchone()
            return bool(row and row["h"])

        deadline = time.monotonic() + 10
        while not await held():
            assert time.monotonic() < deadline, "the hold never reached the database"
            await asyncio.sleep(0.02)
        written = time.monotonic()
        await b.wait_turn("111")  # node b never saw the 429
        waited = time.monotonic() - written
        await retry
        assert waited >= 1.5 - 0.5  # the hold, less what passed before it was seen written
        assert b.refused >= 1


async def test_a_send_when_the_database_is_away_is_deferred_not_sent_unpaced(schema):
    async with FakeTelegram(token=TOKEN, bot_username=BOT) as tg:
        tg.push_private(111, "hello")
        gone = await second_pool(schema)
        await gone.close()  # the node's database went away
        async with telegram_nodes(tg, [PgFloodGate(gone, PER_CHAT)], PER_CHAT) as (adapter,):
            try:
                await adapter.send(OutboundMessage(chat_id="111", text="paced?"))
            except DeliveryDeferred as exc:
                assert "flood pacing unavailable" in str(exc)
            else:
                raise AssertionError("a send the cluster could not pace went out")
        assert tg.sent_messages(111) == []
