"""Budgets: every model call counted to the tenant of its lane, caps checked before the
call, said once per period, durable across restarts and crashes, lifted by `budget set`;
/usage and /metrics totals (docs/concepts.md#budgets)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import sys
from pathlib import Path

from adapters.telegram import TelegramAdapter
from gateway.build import build_gateway
from gateway.cli import main as cli_main
from tenancy.keys import tenant_dir
from tests.conftest import RecordingAdapter, dm, group, say
from tests.fakes.llm import FakeLLM
from tests.fakes.telegram_api import FakeTelegram
from tests.fakes.transcription import FakeTranscription
from tests.statedb import open_state_db

ROOT = Path(__file__).resolve().parents[1]
TG_TOKEN = "123456:AAE2eBUDGETtokenSECRET_-xyz"
TG_TOKEN_ENV = "HERMES_BUDGET_TG_TOKEN"

PERSON_CAP = {"per_person": {"tokens_per_day": 100}}


def used_tokens(llm: FakeLLM) -> int:
    return sum(u["prompt_tokens"] + u["completion_tokens"] for u in llm.usage_sent)


def write_config(path: Path, cfg) -> Path:
    path.write_text(
        json.dumps(
            {
                "data_dir": str(cfg.data_dir),
                "llm": {"base_url": cfg.llm.base_url, "model": "fake-model"},
                "storage": {"fsync": "never"},
                "budgets": cfg.budgets.model_dump(exclude_none=True),
            }
        ),
        encoding="utf-8",
    )
    return path


async def started(cfg) -> tuple:
    adapter = RecordingAdapter()
    app = build_gateway(cfg, [adapter])
    await app.start()
    return app, adapter


async def test_a_capped_person_is_refused_without_a_model_call_while_another_is_served(config_for, fake_llm):
    cfg = config_for(budgets=PERSON_CAP, limits={"rate_limit_per_minute": 1000})
    app, adapter = await started(cfg)
    try:
        assert await say(app, adapter, dm("alice", "hello")) != []
        assert used_tokens(fake_llm) >= 100, "the fake's usage must exceed the cap for this test"
        calls = len(fake_llm.requests)
        refused = await say(app, adapter, dm("alice", "and again"))
        assert len(fake_llm.requests) == calls
        assert len(refused) == 1
        assert "today's model budget" in refused[0] and "of 100 tokens" in refused[0] and "resets on" in refused[0]
        # said once per period: later messages are finished quietly, not kept
        assert await say(app, adapter, dm("alice", "hello?")) == []
        assert len(fake_llm.requests) == calls
        assert await app.inbox.pending() == []
        # another person is served
        assert await say(app, adapter, dm("bob", "hi")) != []
        assert len(fake_llm.requests) == calls + 1
        metrics = app.metrics.render()
        assert "hermes_budget_refusals_total 2" in metrics
        assert f'hermes_llm_tokens_total{{kind="prompt"}} {sum(u["prompt_tokens"] for u in fake_llm.usage_sent)}' in (
            metrics
        )
        assert "alice" not in metrics
    finally:
        await app.stop()


async def test_a_message_over_the_cap_is_not_stored_anywhere(config_for, fake_llm):
    """The check rides in the write of the person's message: at the cap that write is
    rolled back, journal line included, and no estimate is left pending."""
    cfg = config_for(budgets=PERSON_CAP, limits={"rate_limit_per_minute": 1000})
    app, adapter = await started(cfg)
    try:
        assert await say(app, adapter, dm("alice", "hello")) != []
        assert len(await say(app, adapter, dm("alice", "over the cap now"))) == 1
    finally:
        await app.stop()
    profile = tenant_dir(cfg.data_dir, "testchat-alice")
    journals = b"".join(p.read_bytes() for p in (profile / "sessions").glob("*.jsonl"))
    assert b"hello" in journals and b"over the cap now" not in journals
    con = open_state_db(profile / "state.db")
    try:
        contents = [r[0] for r in con.execute("SELECT content FROM messages WHERE role='user'")]
        pending = con.execute("SELECT count(*) FROM budget_pending").fetchone()[0]
    finally:
        con.close()
    assert contents == ["hello"]
    assert pending == 0, "the answered call was settled, the refused one never reserved"


async def test_usage_shows_the_sum_of_the_usage_the_model_reported(config_for, fake_llm):
    cfg = config_for(
        budgets={"per_person": {"tokens_per_month": 1_000_000}},
        llm={"price_in_per_mtok": 2.0, "price_out_per_mtok": 10.0},
        limits={"rate_limit_per_minute": 1000},
    )
    app, adapter = await started(cfg)
    try:
        for text in ("one", "two", "three"):
            await say(app, adapter, dm("carol", text))
        [usage] = await say(app, adapter, dm("carol", "/usage"))
        total = used_tokens(fake_llm)
        cost = sum(u["prompt_tokens"] * 2.0 + u["completion_tokens"] * 10.0 for u in fake_llm.usage_sent) / 1e6
        assert f"Today: {total:,} tokens, ${cost:,.4f}" in usage or f"Today: {total:,} tokens, ${cost:,.2f}" in usage
        assert f"This month: {total:,} tokens" in usage
        assert f"left: {1_000_000 - total:,} of 1,000,000 tokens" in usage
        assert app.metrics.llm_cost.value() == __import__("pytest").approx(cost)
    finally:
        await app.stop()


async def test_a_shared_lane_counts_to_the_chat_under_per_chat(config_for, fake_llm):
    cfg = config_for(
        budgets={"per_chat": {"tokens_per_day": 100}, "per_person": {"tokens_per_day": 10**9}},
        tenancy={"group_sessions_per_user": False},
        limits={"rate_limit_per_minute": 1000},
    )
    app, adapter = await started(cfg)
    try:
        assert await say(app, adapter, group("g1", "dave", "hello all")) != []
        calls = len(fake_llm.requests)
        [refused] = await say(app, adapter, group("g1", "erin", "me too"))
        assert refused.startswith("This chat has used today's model budget")
        assert len(fake_llm.requests) == calls
        assert await say(app, adapter, dm("erin", "in private then")) != []  # her own budget is untouched
    finally:
        await app.stop()


async def test_the_cap_holds_across_a_restart_and_budget_set_lifts_it(config_for, fake_llm, tmp_path):
    cfg = config_for(budgets=PERSON_CAP, limits={"rate_limit_per_minute": 1000})
    app, adapter = await started(cfg)
    try:
        await say(app, adapter, dm("alice", "hello"))
        assert len(await say(app, adapter, dm("alice", "more"))) == 1
    finally:
        await app.stop()
    calls = len(fake_llm.requests)
    app, adapter = await started(cfg)
    try:
        assert await say(app, adapter, dm("alice", "after the restart")) == []  # already said this period
        assert len(fake_llm.requests) == calls
        conf = write_config(tmp_path / "cfg.json", cfg)
        assert cli_main(["-c", str(conf), "budget", "set", "testchat:alice", "--tokens-per-day", "1000000"]) == 0
        assert await say(app, adapter, dm("alice", "lifted?")) != []
        assert len(fake_llm.requests) == calls + 1
        assert cli_main(["-c", str(conf), "budget", "set", "testchat:alice", "--tokens-per-day", "none"]) == 0
        assert await say(app, adapter, dm("alice", "no cap at all")) != []
        assert cli_main(["-c", str(conf), "budget", "set", "testchat:alice", "--default"]) == 0
        assert await say(app, adapter, dm("alice", "capped again")) == []  # refusal said already today
        assert cli_main(["-c", str(conf), "budget", "reset", "testchat:alice"]) == 0
        assert await say(app, adapter, dm("alice", "after reset")) != []
    finally:
        await app.stop()


async def test_budget_show_prints_use_and_caps(config_for, fake_llm, tmp_path, capsys):
    cfg = config_for(budgets=PERSON_CAP)
    app, adapter = await started(cfg)
    try:
        await say(app, adapter, dm("alice", "hello"))
    finally:
        await app.stop()
    conf = write_config(tmp_path / "cfg.json", cfg)
    capsys.readouterr()
    assert cli_main(["-c", str(conf), "budget", "show", "testchat:alice", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["used"]["tokens_today"] == used_tokens(fake_llm)
    assert data["limits"]["tokens_per_day"] == 100
    assert cli_main(["-c", str(conf), "budget", "show", "nobody-here"]) == 1


async def test_crossing_warn_at_is_said_once(config_for, fake_llm):
    cfg = config_for(
        budgets={"per_person": {"tokens_per_day": 10_000}, "warn_at": 0.01}, limits={"rate_limit_per_minute": 1000}
    )
    app, adapter = await started(cfg)
    try:
        first = await say(app, adapter, dm("frank", "hello"))
        warnings = [t for t in first if "% of today's model budget" in t]
        assert len(warnings) == 1 and "of 10,000 tokens" in warnings[0]
        second = await say(app, adapter, dm("frank", "again"))
        assert not [t for t in second if "model budget" in t]
    finally:
        await app.stop()


async def test_admins_are_counted_but_never_capped(config_for, fake_llm):
    cfg = config_for(budgets=PERSON_CAP, access={"admins": ["testchat:root"]}, limits={"rate_limit_per_minute": 1000})
    app, adapter = await started(cfg)
    try:
        for text in ("one", "two", "three"):
            replies = await say(app, adapter, dm("root", text))
            assert replies and "budget" not in replies[0]
        [usage] = await say(app, adapter, dm("root", "/usage"))
        assert f"Today: {used_tokens(fake_llm):,} tokens" in usage and "never capped" in usage
    finally:
        await app.stop()


async def test_compression_summaries_and_reviews_count_to_the_tenant(config_for, fake_llm):
    cfg = config_for(memory={"nudge_interval": 1}, limits={"rate_limit_per_minute": 1000})
    app, adapter = await started(cfg)
    try:
        await say(app, adapter, dm("gina", "remember that I like tea"))
        await say(app, adapter, dm("gina", "/compress"))
        assert await app.drain(10)
        [usage] = await say(app, adapter, dm("gina", "/usage"))
        match = re.search(r"Today: ([\d,]+) tokens", usage)
        assert match is not None
        assert int(match.group(1).replace(",", "")) == used_tokens(fake_llm)
        assert len(fake_llm.requests) >= 2  # the turn and at least the review or the summary
    finally:
        await app.stop()


async def test_a_crash_between_the_call_and_the_count_over_counts_never_under_counts(tmp_path, fake_llm):
    """SIGKILL while the model is answering (after the reservation, before the count), then
    a restart that answers everything: every tenant's count is at least the usage the model
    reported, the killed call's estimate included, and the cap still holds afterwards."""
    proc: asyncio.subprocess.Process | None = None
    seen = 0

    async def kill_on_the_fifth(request):
        nonlocal seen
        seen += 1
        if seen == 5 and proc is not None:
            proc.send_signal(signal.SIGKILL)  # the request is in flight: reserved, never settled
            await asyncio.sleep(1)
        return None  # the default answer

    fake_llm.responder = kill_on_the_fifth
    config = tmp_path / "gw.json"
    config.write_text(
        json.dumps(
            {
                "data_dir": str(tmp_path / "data"),
                "llm": {"base_url": fake_llm.base_url, "model": "fake", "max_retries": 0},
                "storage": {"fsync": "batch"},
                "limits": {"rate_limit_per_minute": 1000, "max_queued_turns": 100, "busy_mode": "queue"},
                "budgets": {"per_person": {"tokens_per_month": 10**9}},
            }
        )
    )
    for run in range(2):
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "tests.fakes.burst_gateway",
            str(config),
            "20",
            cwd=ROOT,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        code = await asyncio.wait_for(proc.wait(), 90)
        assert (code == -signal.SIGKILL) == (run == 0)
    counted = 0
    for profile in sorted((tmp_path / "data" / "profiles").iterdir()):
        con = open_state_db(profile / "state.db")
        try:
            counted += sum(t for (t,) in con.execute("SELECT tokens FROM budget_usage WHERE period LIKE 'm:%'"))
        finally:
            con.close()
    delivered = sum(u["prompt_tokens"] + u["completion_tokens"] for u in fake_llm.usage_sent)
    assert counted >= delivered
    assert counted > delivered, "the killed call's estimate stays counted"


async def test_transcription_minutes_count_to_the_sender_and_the_cap_stops_the_next_one(
    fake_llm, config_for, monkeypatch
):
    """A priced transcription asks for `verbose_json` and counts its duration's minutes; over
    the cost cap the next voice note is not sent to the service at all."""
    monkeypatch.setenv(TG_TOKEN_ENV, TG_TOKEN)
    async with FakeTelegram(token=TG_TOKEN, bot_username="hermes_test_bot") as tg, FakeTranscription() as stt:
        stt.duration_s = 90.0
        cfg = config_for(
            platforms={
                "telegram": {"enabled": True, "token_env": TG_TOKEN_ENV, "base_url": tg.base_url, "poll_timeout_s": 2}
            },
            transcription={"base_url": stt.base_url, "price_per_minute": 0.006},
            budgets={"per_person": {"cost_per_day": 0.005}},
        )
        adapter = TelegramAdapter.from_config(cfg.platforms.telegram, backoff_initial_s=0.05, backoff_max_s=0.5)
        app = build_gateway(cfg, [adapter])
        await app.start()
        try:
            tg.push_media(111, "voice", b"OggS first voice note")
            await tg.wait_sent(1, 111, timeout=20)
            assert await app.drain(20)
            assert [r["fields"]["response_format"] for r in stt.requests] == ["verbose_json"]
            con = open_state_db(tenant_dir(cfg.data_dir, "telegram-111") / "state.db")
            try:
                [(cost,)] = con.execute("SELECT cost_nanos FROM budget_usage WHERE period LIKE 'd:%'").fetchall()
            finally:
                con.close()
            assert cost == round(90 / 60 * 0.006 * 1e9)  # the model has no price: only the minutes cost
            # 0.009 counted against a 0.005 cap: refused, no further transcription
            tg.push_media(111, "voice", b"OggS second voice note")
            await asyncio.sleep(0.5)
            assert await app.drain(20)
            assert len(stt.requests) == 1
            assert any("model budget" in m["text"] for m in tg.sent_messages(111))
        finally:
            await app.stop()
            await adapter.aclose()
