"""The delivery outbox: every answer is recorded with the turn's completion, sent in order,
retried through platform outages and restarts, given up only after delivery.max_age_s,
and never retried into a chat the bot was removed from. Real adapters against the fake
Telegram Bot API and the fake Discord."""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import asynccontextmanager
from typing import Any

import pytest

from adapters.discord_bot import DiscordAdapter
from adapters.telegram import TelegramAdapter
from gateway.build import build_gateway
from gateway.runtime import GatewayApp
from tests.conftest import RecordingAdapter, dm
from tests.fakes.discord_api import FakeDiscord
from tests.fakes.telegram_api import FakeTelegram

TOKEN = "123456:AAEoutboxFAKEtoken_-outbox"
TOKEN_ENV = "HERMES_OUTBOX_TG_TOKEN"
FAST = {"retry_initial_s": 0.05, "retry_max_s": 0.2}


@pytest.fixture
async def tg(monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    async with FakeTelegram(token=TOKEN) as fake:
        fake.add_chat(111, "private")
        yield fake


def tg_config(config_for, tg: FakeTelegram, **delivery: Any):
    return config_for(
        platforms={"telegram": {"enabled": True, "token_env": TOKEN_ENV, "base_url": tg.base_url, "poll_timeout_s": 1}},
        delivery={**FAST, **delivery},
    )


@asynccontextmanager
async def telegram_gateway(cfg):
    adapter = TelegramAdapter.from_config(cfg.platforms.telegram, backoff_initial_s=0.02, backoff_max_s=0.1)
    app = build_gateway(cfg, [adapter])
    await app.start()
    try:
        yield app
    finally:
        await app.stop(drain_timeout=5)
        await adapter.aclose()


async def statuses(app: GatewayApp) -> list[str]:
    rows = await app.inbox.db.execute_fetchall("SELECT status FROM outbox ORDER BY id")
    return [r[0] for r in rows]


async def test_telegram_answering_502_for_a_while_still_delivers_every_answer_once_in_order(tg, fake_llm, config_for):
    async with telegram_gateway(tg_config(config_for, tg)) as app:
        tg.fail_next("sendMessage", status=502, times=6)
        tg.fail_next("sendMessage", status=500, times=2)
        first = tg.push_private(111, "one")
        second = tg.push_private(111, "two")
        await tg.wait_sent(2, 111, timeout=30)
        assert await app.drain(20)
        assert app.metrics.deliveries.value(platform="telegram", outcome="retried") >= 8
    sent = tg.sent_messages(111)
    assert [m["text"] for m in sent] == ["ok: one", "ok: two"]
    assert [m["reply_to_message"]["message_id"] for m in sent] == [first.message_id, second.message_id]
    assert len(fake_llm.requests) == 2  # the turns ran once; only the delivery was retried


async def test_unsent_answer_is_delivered_after_a_restart_without_a_second_turn(tg, fake_llm, config_for):
    cfg = tg_config(config_for, tg)
    async with telegram_gateway(cfg) as app:
        tg.fail_next("sendMessage", status=502, times=10_000)  # Telegram is down
        tg.push_private(111, "are you there?")
        await tg.wait_for(lambda: len(tg.calls_of("sendMessage")) >= 2, timeout=20)
        assert await statuses(app) == ["pending"]
    assert tg.sent_messages(111) == []
    tg._failures.clear()  # Telegram is back
    async with telegram_gateway(cfg) as app:
        await tg.wait_sent(1, 111, timeout=20)
        assert await app.drain(10)
        assert await statuses(app) == ["sent"]
    assert [m["text"] for m in tg.sent_messages(111)] == ["ok: are you there?"]
    assert len(fake_llm.requests) == 1


async def test_chat_the_bot_was_removed_from_is_not_retried(tg, fake_llm, config_for):
    async with telegram_gateway(tg_config(config_for, tg)) as app:
        tg.fail_next("sendMessage", status=403)
        tg.push_private(111, "hello?")
        await tg.wait_for(lambda: len(tg.calls_of("sendMessage")) >= 1, timeout=20)
        assert await app.drain(10)
        assert await statuses(app) == ["refused"]
        assert app.metrics.deliveries.value(platform="telegram", outcome="refused") == 1
    assert len(tg.calls_of("sendMessage")) == 1


async def test_answer_is_given_up_after_max_age_with_a_log_line_and_a_metric(tg, fake_llm, config_for, caplog):
    caplog.set_level(logging.ERROR, logger="hermes.outbox")
    async with telegram_gateway(tg_config(config_for, tg, max_age_s=0.5)) as app:
        tg.fail_next("sendMessage", status=502, times=10_000)
        tg.push_private(111, "lost in space")
        await tg.wait_for(lambda: app.metrics.deliveries.value(platform="telegram", outcome="expired") == 1, timeout=30)
        assert await statuses(app) == ["expired"]
        rows = await app.inbox.db.execute_fetchall("SELECT text FROM outbox")
        assert rows == [(None,)]  # nothing of the conversation stays in gateway.db
    assert any("delivery.max_age_s" in r.getMessage() for r in caplog.records)
    assert "hermes_deliveries_total" in app.metrics.render()


async def test_a_clock_jump_neither_expires_nor_stalls_an_unsent_answer(tg, fake_llm, config_for, monkeypatch):
    async with telegram_gateway(tg_config(config_for, tg, max_age_s=3600)) as app:
        tg.fail_next("sendMessage", status=502, times=10_000)
        tg.push_private(111, "tick tock")
        await tg.wait_for(lambda: len(tg.calls_of("sendMessage")) >= 2, timeout=20)
        real = time.time
        monkeypatch.setattr(time, "time", lambda: real() + 2 * 24 * 3600)  # NTP jumps two days ahead
        await tg.wait_for(lambda: len(tg.calls_of("sendMessage")) >= 4, timeout=20)
        tg._failures.clear()
        await tg.wait_sent(1, 111, timeout=20)
        assert await app.drain(10)
        assert await statuses(app) == ["sent"]
        assert app.metrics.deliveries.value(platform="telegram", outcome="expired") == 0


# ----------------------------------------------------------------------------- Discord


@pytest.fixture
async def discord_fake():
    async with FakeDiscord() as f:
        f.guild = f.add_guild("Hermes Lab")
        f.general = f.channel_named(f.guild, "general")
        f.alice = f.add_user("alice")
        yield f


@asynccontextmanager
async def discord_gateway(fake: FakeDiscord, cfg):
    adapter = DiscordAdapter(cfg.platforms.discord, fake.token, ready_timeout=10, guild_ready_timeout=0.05)
    app = build_gateway(cfg, [adapter])
    await app.start()
    try:
        yield app
    finally:
        await app.stop(drain_timeout=5)


def discord_config(config_for, fake: FakeDiscord):
    return config_for(
        platforms={"discord": {"enabled": True, "api_base": fake.api_base, "gateway_url": fake.gateway_url}},
        delivery=FAST,
    )


async def test_discord_resend_after_a_lost_response_posts_one_message(discord_fake, fake_llm, config_for):
    fake = discord_fake
    async with discord_gateway(fake, discord_config(config_for, fake)) as app:
        fake.fail_after_create_next(503)  # Discord posted it, the answer got lost; discord.py does not retry 503
        fake.push_dm(fake.alice, "only once please")
        channel = fake.dm_channels[fake.alice]
        await fake.wait_until(lambda: app.metrics.deliveries.value(platform="discord", outcome="sent") == 1, 20)
        assert await app.drain(10)
        assert app.metrics.deliveries.value(platform="discord", outcome="retried") == 1
    assert [m["content"] for m in fake.sent_messages(channel)] == ["ok: only once please"]


async def test_discord_outage_is_ridden_out_in_order(discord_fake, fake_llm, config_for):
    fake = discord_fake
    async with discord_gateway(fake, discord_config(config_for, fake)) as app:
        fake.fail_creates(503, count=5)
        fake.push_dm(fake.alice, "first")
        fake.push_dm(fake.alice, "second")
        channel = fake.dm_channels[fake.alice]
        await fake.wait_until(lambda: len(fake.sent_messages(channel)) >= 2, 30)
        assert await app.drain(10)
    assert [m["content"] for m in fake.sent_messages(channel)] == ["ok: first", "ok: second"]


# ----------------------------------------------------------------------------- coalescing


async def test_coalesced_batch_is_answered_once_after_a_crash(config_for, fake_llm, monkeypatch):
    cfg = config_for(limits={"coalesce_burst_ms": 300})
    adapter = RecordingAdapter()
    app = build_gateway(cfg, [adapter])
    await app.start()

    async def killed(*args: Any, **kwargs: Any) -> list[int]:
        raise asyncio.CancelledError  # killed before the answer was recorded: nothing more runs

    monkeypatch.setattr(app.outbox, "record", killed)  # the crash point: answer stored, outbox not
    for text in ("first part", "second part", "third part"):
        await adapter.sink(dm("lou", text))
    assert await app.drain(20)
    assert len(fake_llm.requests) == 1 and adapter.texts() == []
    await app.stop()
    monkeypatch.undo()

    for coalesce in (0, 300):  # replayed one by one (coalescing now off) or as a batch again
        adapter = RecordingAdapter()
        app = build_gateway(config_for(limits={"coalesce_burst_ms": coalesce}), [adapter])
        await app.start()
        try:
            assert await app.drain(20)
            if coalesce == 0:
                # the stored answer of the batch (the model saw its three parts as one message)
                assert adapter.texts() == ["ok: first part\n\nsecond part\n\nthird part"]
            else:
                assert adapter.texts() == []  # nothing left to answer
            rows = await app.inbox.db.execute_fetchall("SELECT status FROM inbound")
            assert [r[0] for r in rows] == ["done", "done", "done"]
        finally:
            await app.stop()
    assert len(fake_llm.requests) == 1
