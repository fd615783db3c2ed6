"""TelegramAdapter against the fake Bot API over real HTTP, with a recording sink (no gateway)."""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import socket
import subprocess
import sys
import time
import warnings
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from telegram.warnings import PTBUserWarning

from adapters.telegram import TelegramAdapter, doctor, telegram_commands
from adapters.telegram.flood import FloodGate, FloodLimits
from adapters.telegram.format import markdown_to_telegram_html
from core.messages import DeliveryDeferred, InboundMessage, OutboundMessage, SentMessage
from core.settings import ConfigError, TelegramConfig
from core.text import utf16_len
from tests.fakes.telegram_api import FakeTelegram, _parse_html

TOKEN = "123456:AAEfakeTOKENfakeTOKENfake_-xyz"
# Pacing loose enough not to slow the tests that are not about it (those set their own).
LOOSE_FLOOD = FloodLimits(per_chat=(50, 1.0), per_group=(50, 1.0), overall=(100, 1.0))
BOT = "hermes_test_bot"


class Recorder:
    """A sink: records every message; `fail` makes the next calls raise."""

    def __init__(self) -> None:
        self.messages: list[InboundMessage] = []
        self.fail = 0
        self.calls = 0
        self.gate: asyncio.Event | None = None
        self._changed = asyncio.Condition()

    async def __call__(self, msg: InboundMessage) -> None:
        self.calls += 1
        if self.gate is not None:
            await self.gate.wait()
        if self.fail:
            self.fail -= 1
            raise RuntimeError("database is locked")
        self.messages.append(msg)
        async with self._changed:
            self._changed.notify_all()

    async def wait(self, n: int, timeout: float = 10.0) -> list[InboundMessage]:
        async def waiter() -> None:
            async with self._changed:
                await self._changed.wait_for(lambda: len(self.messages) >= n)

        await asyncio.wait_for(waiter(), timeout)
        return self.messages

    def texts(self) -> list[str]:
        return [m.text for m in self.messages]


def make_cfg(tg: FakeTelegram, **over: Any) -> TelegramConfig:
    data: dict[str, Any] = {"enabled": True, "base_url": tg.base_url, "poll_timeout_s": 2}
    data.update(over)
    return TelegramConfig.model_validate(data)


@pytest.fixture
async def tg():
    async with FakeTelegram(token=TOKEN, bot_username=BOT) as fake:
        yield fake


@asynccontextmanager
async def running(tg: FakeTelegram, sink: Any = None, *, kwargs: dict[str, Any] | None = None, **cfg: Any):
    adapter = TelegramAdapter(
        make_cfg(tg, **cfg),
        TOKEN,
        **({"backoff_initial_s": 0.05, "backoff_max_s": 0.2, "flood_limits": LOOSE_FLOOD} | (kwargs or {})),
    )
    await adapter.start(sink or Recorder())
    try:
        yield adapter
    finally:
        await adapter.aclose()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def settle(tg: FakeTelegram) -> None:
    """Wait until every pushed update has been acknowledged (so filtering is done)."""
    await tg.wait_acked(timeout=10)


# ----------------------------------------------------------------------------- start


async def test_start_registers_commands_without_admin_ones(tg):
    async with running(tg) as adapter:
        assert adapter.bot_username == BOT and adapter.bot_id == tg.bot_id
        names = [c["command"] for c in tg.commands]
        assert "help" in names and "new" in names and "start" in names
        assert "pair" not in names
        assert all(n.islower() for n in names)
        assert [c.command for c in telegram_commands()] == names


async def test_bad_token_fails_start_with_a_clear_error(tg):
    adapter = TelegramAdapter(make_cfg(tg), "999:WRONG")
    with pytest.raises(ConfigError, match="rejected the bot token"):
        await adapter.start(Recorder())


async def test_unreachable_at_start_keeps_trying_in_the_background(tg):
    tg.fail_next("getMe", status=502, times=2)
    rec = Recorder()
    async with running(tg, rec) as adapter:
        tg.push_private(111, "hello")
        await rec.wait(1)
        assert adapter.bot_username == BOT
    assert [s for m, s in tg.responses if m == "getMe"] == [502, 502, 200]


def test_from_config_names_the_missing_env_var(monkeypatch):
    monkeypatch.delenv("HERMES_TEST_TG_TOKEN", raising=False)
    cfg = TelegramConfig(enabled=True, token_env="HERMES_TEST_TG_TOKEN")
    with pytest.raises(ConfigError, match="HERMES_TEST_TG_TOKEN"):
        TelegramAdapter.from_config(cfg)
    monkeypatch.setenv("HERMES_TEST_TG_TOKEN", TOKEN)
    adapter = TelegramAdapter.from_config(cfg)
    assert adapter.platform == "telegram" and adapter.max_message_length == 4096 and adapter.can_edit
    assert adapter.measure("a😀") == 3


def test_webhook_mode_requires_a_secret(monkeypatch):
    monkeypatch.setenv("HERMES_TEST_TG_TOKEN", TOKEN)
    monkeypatch.delenv("HERMES_TEST_TG_SECRET", raising=False)
    cfg = TelegramConfig(enabled=True, token_env="HERMES_TEST_TG_TOKEN", mode="webhook")
    with pytest.raises(ConfigError, match="secret_token_env"):
        TelegramAdapter.from_config(cfg)
    cfg = TelegramConfig.model_validate(
        {
            "enabled": True,
            "token_env": "HERMES_TEST_TG_TOKEN",
            "mode": "webhook",
            "webhook": {"secret_token_env": "HERMES_TEST_TG_SECRET"},
        }
    )
    with pytest.raises(ConfigError, match="HERMES_TEST_TG_SECRET"):
        TelegramAdapter.from_config(cfg)
    monkeypatch.setenv("HERMES_TEST_TG_SECRET", "has spaces!")
    with pytest.raises(ConfigError, match="A-Z a-z 0-9"):
        TelegramAdapter.from_config(cfg)


# ----------------------------------------------------------------------------- normalisation


async def test_dm_is_normalised(tg):
    rec = Recorder()
    async with running(tg, rec):
        pushed = tg.push_private(111, "hello there", username="alice")
        [msg] = await rec.wait(1)
    assert msg.platform == "telegram"
    assert msg.chat_type == "dm"
    assert msg.chat_id == "111" and msg.user_id == "111" and msg.user_name == "alice"
    assert msg.message_id == str(pushed.message_id)
    assert msg.text == "hello there"
    assert msg.thread_id is None and msg.reply_to_message_id is None
    assert msg.mentions_bot is True
    assert msg.raw["update_id"] == pushed.update_id
    assert "raw" not in repr(msg)


async def test_group_and_supergroup_need_a_mention(tg):
    rec = Recorder()
    async with running(tg, rec):
        tg.push_group(-100200, 1, "just chatting")  # not addressed: dropped
        tg.push_group(-100200, 2, f"@{BOT} what is 2+2?")
        tg.push_group(-300, 3, f"hey @{BOT.upper()}, help me", chat_type="group")
        tg.push_group(-100200, 4, "@someone_else look")  # other mention: dropped
        await settle(tg)
    assert [(m.chat_id, m.chat_type, m.user_id, m.text, m.mentions_bot) for m in rec.messages] == [
        ("-100200", "group", "2", "what is 2+2?", True),
        ("-300", "group", "3", "hey, help me", True),
    ]


async def test_mention_offsets_are_utf16(tg):
    rec = Recorder()
    async with running(tg, rec):
        tg.push_group(-100200, 2, f"😀👍 @{BOT} ünïcode 𝄞 ok")
        [msg] = await rec.wait(1)
    assert msg.text == "😀👍 ünïcode 𝄞 ok"


async def test_reply_to_the_bot_counts_as_addressed(tg):
    rec = Recorder()
    async with running(tg, rec) as adapter:
        tg.push_group(-100200, 2, f"@{BOT} hi")
        [first] = await rec.wait(1)
        sent = await adapter.send(
            OutboundMessage(chat_id="-100200", text="hello!", reply_to_message_id=first.message_id)
        )
        assert sent is not None
        tg.push_group(-100200, 2, "and another thing", reply_to_bot_message_id=int(sent.message_id))
        # a reply to another person is not addressed
        tg.push_group(-100200, 5, "I agree", reply_to_message_id=int(first.message_id))
        await settle(tg)
    assert rec.texts() == ["hi", "and another thing"]
    second = rec.messages[1]
    assert second.mentions_bot and second.reply_to_message_id == sent.message_id


async def test_commands_in_groups(tg):
    rec = Recorder()
    async with running(tg, rec):
        tg.push_group(-100200, 2, "/help")
        tg.push_group(-100200, 2, f"/status@{BOT}")
        tg.push_group(-100200, 2, f"/compress@{BOT} focus the plan")
        tg.push_group(-100200, 2, "/help@other_bot")  # for another bot: dropped
        await settle(tg)
    assert rec.texts() == ["/help", "/status", "/compress focus the plan"]
    assert [m.mentions_bot for m in rec.messages] == [False, True, True]


async def test_no_mention_required_when_configured(tg):
    rec = Recorder()
    async with running(tg, rec, require_mention_in_groups=False):
        tg.push_group(-100200, 2, "just chatting")
        tg.push_group(-100200, 2, "/help@other_bot")
        tg.push_group(-100200, 2, f"@{BOT} you there?")
        await settle(tg)
    assert [(m.text, m.mentions_bot) for m in rec.messages] == [("just chatting", False), ("you there?", True)]


async def test_forum_topic_is_a_thread(tg):
    rec = Recorder()
    async with running(tg, rec):
        tg.push_topic(-100300, 42, 7, "not addressed")
        pushed = tg.push_topic(-100300, 42, 7, f"@{BOT} in the topic")
        await settle(tg)
    [msg] = rec.messages
    assert msg.chat_type == "thread" and msg.thread_id == "42" and msg.chat_id == "-100300"
    assert msg.message_id == str(pushed.message_id)
    # every topic message "replies" to the topic's creation message: that is not a reply
    assert msg.reply_to_message_id is None


async def test_supergroup_reply_thread_is_not_a_topic(tg):
    """In a non-forum supergroup, replies carry message_thread_id but are not topics."""
    rec = Recorder()
    async with running(tg, rec):
        first = tg.push_group(-100200, 2, f"@{BOT} one")
        tg.push_group(
            -100200,
            2,
            f"@{BOT} two",
            reply_to_message_id=first.message_id,
            extra={"message_thread_id": first.message_id},
        )
        await rec.wait(2)
    assert [(m.chat_type, m.thread_id) for m in rec.messages] == [("group", None), ("group", None)]


async def test_bots_and_service_messages_are_ignored(tg):
    rec = Recorder()
    async with running(tg, rec):
        tg.push_private(555, "I am a bot", is_bot=True)
        tg.push_group(-100200, 556, f"@{BOT} bot talk", is_bot=True)
        tg.push_group(-100200, tg.bot_id, f"@{BOT} myself", is_bot=True)
        tg.push_group(-100200, 777000, f"@{BOT} channel relay", extra={"is_automatic_forward": True})
        tg.push_update(
            {
                "message": {
                    "message_id": 900,
                    "date": 1,
                    "chat": {"id": -100200, "type": "supergroup"},
                    "from": {"id": 9, "is_bot": False, "first_name": "x"},
                    "new_chat_members": [{"id": 9, "is_bot": False, "first_name": "x"}],
                }
            }
        )
        tg.push_private(111, "real person")
        await settle(tg)
    assert rec.texts() == ["real person"]


async def test_edits_and_channel_posts_ignored_by_default(tg):
    rec = Recorder()
    async with running(tg, rec):
        p = tg.push_private(111, "first")
        await rec.wait(1)
        tg.push_edit(111, p.message_id, "first (edited)")
        tg.push_channel_post(-100900, "channel news")
        tg.push_private(111, "second")
        await settle(tg)
    assert rec.texts() == ["first", "second"]


async def test_edits_and_channel_posts_when_configured(tg):
    rec = Recorder()
    async with running(
        tg, rec, handle_edited_messages=True, handle_channel_posts=True, require_mention_in_groups=False
    ):
        p = tg.push_private(111, "first")
        await rec.wait(1)
        tg.push_edit(111, p.message_id, "first (edited)")
        tg.push_channel_post(-100900, "channel news")
        await rec.wait(3)
    first, edit, post = rec.messages
    assert edit.text == "first (edited)" and edit.message_id != first.message_id
    assert edit.message_id.startswith(f"{p.message_id}:")
    assert post.chat_type == "channel" and post.chat_id == "-100900" and post.text == "channel news"


async def test_caption_with_attachment(tg):
    rec = Recorder()
    async with running(tg, rec):
        tg.push_group(-100200, 2, f"@{BOT} summarise this", caption=True)
        [msg] = await rec.wait(1)
    assert msg.text == "summarise this"
    assert [(a.type, a.name, a.size) for a in msg.attachments] == [("document", "notes.txt", 12)]
    assert msg.attachments[0].url == ""  # file URLs contain the token: never exposed


# ----------------------------------------------------------------------------- restart safety


async def test_offset_is_acknowledged_only_after_the_sink_returns(tg):
    rec = Recorder()
    rec.gate = asyncio.Event()
    async with running(tg, rec):
        pushed = tg.push_private(111, "hold on")
        await tg.wait_for(lambda: rec.calls == 1)
        await asyncio.sleep(0.3)
        assert tg.acked_offset is None or tg.acked_offset <= pushed.update_id
        assert tg.pending_updates  # still unconfirmed at Telegram
        rec.gate.set()
        await rec.wait(1)
        await settle(tg)
    assert tg.acked_offset == pushed.update_id + 1


async def test_sink_failure_redelivers_instead_of_losing(tg):
    rec = Recorder()
    rec.fail = 1
    async with running(tg, rec):
        tg.push_private(111, "one")
        tg.push_private(111, "two")
        await rec.wait(2)
        await settle(tg)
    assert rec.texts() == ["one", "two"]
    assert rec.calls == 3  # "one" failed once, then both went through, in order


async def test_updates_queued_before_start_are_all_delivered(tg):
    for i in range(5):
        tg.push_private(111, f"queued {i}")
    rec = Recorder()
    async with running(tg, rec):
        await rec.wait(5)
    assert rec.texts() == [f"queued {i}" for i in range(5)]
    # the first poll had no offset: nothing was skipped or dropped
    assert "offset" not in tg.calls_of("getUpdates")[0]


async def test_stop_acknowledges_what_was_recorded(tg):
    rec = Recorder()
    async with running(tg, rec):
        last = tg.push_private(111, "one")
        await rec.wait(1)
    assert tg.acked_offset == last.update_id + 1 and not tg.pending_updates


async def test_malformed_update_is_skipped_and_acknowledged(tg, caplog):
    rec = Recorder()
    caplog.set_level(logging.WARNING, logger="adapters.telegram")
    async with running(tg, rec):
        bad = tg.push_update({"message": {"message_id": 5, "date": 1, "chat": "not-a-chat", "text": "SECRET-TEXT"}})
        tg.push_update(
            {
                "message": {
                    "message_id": 6,
                    "date": 1,
                    "chat": {"id": 111, "type": "private"},
                    "from": "nobody",
                    "text": "SECRET-TEXT",
                }
            }
        )
        tg.push_private(111, "after")
        await rec.wait(1)
        await settle(tg)
    assert rec.texts() == ["after"]
    assert str(bad.update_id) in caplog.text
    assert "SECRET-TEXT" not in caplog.text


async def test_polling_survives_errors_and_conflicts(tg, caplog):
    rec = Recorder()
    tg.fail_next("getUpdates", status=502)
    tg.fail_next("getUpdates", status=409)
    tg.fail_next("getUpdates", status=429, retry_after=1)
    async with running(tg, rec):
        tg.push_private(111, "still here")
        await rec.wait(1, timeout=15)
    assert "409" in caplog.text


async def test_polling_removes_an_existing_webhook_keeping_updates(tg):
    tg.webhook["url"] = "https://example.org/hook"
    tg.push_private(111, "sent while the webhook was set")
    rec = Recorder()
    async with running(tg, rec):
        await rec.wait(1)
    assert tg.calls_of("deleteWebhook")[0].get("drop_pending_updates") in (None, False)


async def test_stop_is_prompt_during_a_long_poll(tg):
    async with running(tg, poll_timeout_s=30) as adapter:
        await tg.wait_for(lambda: len(tg.calls_of("getUpdates")) >= 1)
        await asyncio.sleep(0.2)
        started = time.monotonic()
        await adapter.stop()
        assert time.monotonic() - started < 3


# ----------------------------------------------------------------------------- delivery


async def test_send_reply_in_topic_with_html(tg):
    async with running(tg) as adapter:
        tg.ensure_topic(-100300, 42)
        user = tg.push_topic(-100300, 42, 7, f"@{BOT} hi")
        sent = await adapter.send(
            OutboundMessage(
                chat_id="-100300",
                thread_id="42",
                reply_to_message_id=str(user.message_id),
                text="**Bold** and `a<b>` & _it_\n```python\nif a < b:\n    pass\n```",
            )
        )
    assert isinstance(sent, SentMessage) and sent.thread_id == "42" and sent.chat_id == "-100300"
    [msg] = tg.sent_messages(-100300)
    assert msg["message_thread_id"] == 42 and msg["reply_to_message"]["message_id"] == user.message_id
    assert msg["_params"]["parse_mode"] == "HTML"
    assert msg["text"] == "Bold and a<b> & it\nif a < b:\n    pass"
    assert str(msg["message_id"]) == sent.message_id


async def test_reply_to_a_deleted_message_still_sends(tg):
    async with running(tg) as adapter:
        tg.add_chat(111, "private")
        sent = await adapter.send(OutboundMessage(chat_id="111", text="hi", reply_to_message_id="99999"))
    assert sent is not None and tg.sent_messages(111)[0]["text"] == "hi"


async def test_flood_control_waits_and_sends_once(tg):
    async with running(tg) as adapter:
        tg.add_chat(111, "private")
        tg.fail_next("sendMessage", status=429, retry_after=1)
        started = time.monotonic()
        sent = await adapter.send(OutboundMessage(chat_id="111", text="chunk one"))
        elapsed = time.monotonic() - started
    assert sent is not None
    assert elapsed >= 0.95
    assert [s for m, s in tg.responses if m == "sendMessage"] == [429, 200]
    assert [m["text"] for m in tg.sent_messages(111)] == ["chunk one"]


def test_importing_the_adapter_leaves_the_environment_alone():
    env = {k: v for k, v in os.environ.items() if k != "PTB_TIMEDELTA"}
    code = "import os, adapters.telegram; print(os.environ.get('PTB_TIMEDELTA'))"
    res = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parent.parent,
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "None"


async def test_polling_and_flood_control_use_public_ptb_api_without_warnings(tg):
    package = Path(__file__).resolve().parent.parent / "adapters" / "telegram"
    source = "".join(path.read_text() for path in sorted(package.glob("*.py")))
    assert (
        "._post(" not in source
        and "._request" not in source
        and "_retry_after" not in source.replace("_retry_after_seconds", "")
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rec = Recorder()
        async with running(tg, rec) as adapter:
            tg.push_private(111, "hello")
            await rec.wait(1)
            tg.fail_next("sendMessage", status=429, retry_after=1)
            sent = await adapter.send(OutboundMessage(chat_id="111", text="after a 429"))
    assert sent is not None and [m["text"] for m in tg.sent_messages(111)] == ["after a 429"]
    assert [s for m, s in tg.responses if m == "sendMessage"] == [429, 200]
    assert any(m == "getUpdates" for m, _ in tg.calls)
    ptb = [w for w in caught if issubclass(w.category, PTBUserWarning)]
    assert ptb == [], [str(w.message) for w in ptb]


# ----------------------------------------------------------------------------- flood control


class FakeClock:
    """time.monotonic/asyncio.sleep stand-ins: sleeping moves the clock, instantly."""

    def __init__(self) -> None:
        self.t = 1000.0

    def now(self) -> float:
        return self.t

    async def sleep(self, seconds: float) -> None:
        self.t += max(seconds, 0.0)
        await asyncio.sleep(0)


async def test_flood_gate_keeps_telegrams_published_limits():
    clock = FakeClock()
    gate = FloodGate(clock=clock.now, sleep=clock.sleep)  # the defaults: Telegram's limits

    async def times(chat_ids: list[str]) -> list[float]:
        out = []
        for chat_id in chat_ids:
            await gate.wait_turn(chat_id)
            out.append(clock.now())
        return out

    private = await times(["111"] * 3)
    assert [b - a for a, b in itertools.pairwise(private)] == [1.0, 1.0]  # 1 message/s in a chat
    clock.t += 120
    group = await times(["-100200"] * 45)
    assert all(b - a >= 1.0 for a, b in itertools.pairwise(group))
    assert all(group[i + 20] - group[i] >= 60.0 for i in range(len(group) - 20))  # 20/min in a group
    assert group[19] - group[0] == 19.0  # no slower than it has to be
    clock.t += 120
    many = await times([str(1000 + i) for i in range(95)])
    assert all(many[i + 30] - many[i] >= 1.0 for i in range(len(many) - 30))  # 30/s overall
    assert many[29] == many[0]  # a burst of 30 distinct chats goes out at once


async def test_flood_gate_forgets_idle_chats_but_not_busy_ones():
    clock = FakeClock()
    gate = FloodGate(clock=clock.now, sleep=clock.sleep)
    for i in range(600):
        await gate.wait_turn(str(-1000 - i))  # groups: remembered for their 60 s window
    clock.t += 61
    await gate.wait_turn("-5")
    held_at = clock.now()
    gate.hold("-6", 300)  # held by a 429: must be remembered
    for i in range(600):
        await gate.wait_turn(str(10_000 + i))
    tracked = len(gate._chats)
    assert tracked < 700, tracked  # the 600 idle groups were dropped
    await gate.wait_turn("-6")
    assert clock.now() >= held_at + 300  # the hold survived the pruning


async def test_sends_are_paced_per_chat_and_per_group_at_the_bot_api(tg):
    limits = FloodLimits(per_chat=(1, 0.3), per_group=(3, 1.0), overall=(30, 1.0))
    async with running(tg, kwargs={"flood_limits": limits}) as adapter:
        tg.add_chat(111, "private")
        tg.add_chat(-100200, "supergroup")
        sends = [adapter.send(OutboundMessage(chat_id="111", text=f"private {i}")) for i in range(4)]
        sends += [adapter.send(OutboundMessage(chat_id="-100200", text=f"group {i}")) for i in range(5)]
        results = await asyncio.gather(*sends)
    assert all(r is not None for r in results)
    private, group = tg.sent_messages(111), tg.sent_messages(-100200)
    assert [m["text"] for m in private] == [f"private {i}" for i in range(4)]  # in order, once each
    assert [m["text"] for m in group] == [f"group {i}" for i in range(5)]
    at = [m["_at"] for m in private]
    assert all(b - a >= 0.25 for a, b in itertools.pairwise(at)), at  # 0.3 s apart, minus arrival jitter
    gat = [m["_at"] for m in group]
    assert all(gat[i + 3] - gat[i] >= 0.9 for i in range(len(gat) - 3)), gat  # 3 per second
    assert [s for m, s in tg.responses if m == "sendMessage"] == [200] * 9  # ahead of any 429


async def test_a_429_holds_that_chat_and_every_chunk_lands_once(tg):
    limits = FloodLimits(per_chat=(1, 0.05), per_group=(20, 1.0), overall=(30, 1.0))
    async with running(tg, kwargs={"flood_limits": limits}) as adapter:
        tg.add_chat(111, "private")
        tg.add_chat(222, "private")
        tg.fail_next("sendMessage", status=429, retry_after=1)
        first = asyncio.create_task(adapter.send(OutboundMessage(chat_id="111", text="first")))
        await tg.wait_for(lambda: ("sendMessage", 429) in tg.responses)
        refused_at = time.monotonic()
        second = asyncio.create_task(adapter.send(OutboundMessage(chat_id="111", text="second")))
        other = await adapter.send(OutboundMessage(chat_id="222", text="elsewhere"))
        assert other is not None and all(await asyncio.gather(first, second))
    texts = [m["text"] for m in tg.sent_messages(111)]
    assert sorted(texts) == ["first", "second"]  # each exactly once
    held = list(tg.sent_messages(111))
    assert all(m["_at"] - refused_at >= 0.8 for m in held)  # nothing into 111 during the hold
    assert tg.sent_messages(222)[0]["_at"] < min(m["_at"] for m in held)  # other chats go on
    assert [s for m, s in tg.responses if m == "sendMessage"] == [429, 200, 200, 200]


async def test_forbidden_is_logged_once_and_not_retried(tg, caplog):
    caplog.set_level(logging.INFO, logger="adapters.telegram")
    rec = Recorder()
    async with running(tg, rec) as adapter:
        tg.add_chat(-100200, "supergroup")
        tg.fail_next("sendMessage", status=403, description="Forbidden: bot was kicked from the group chat")
        assert await adapter.send(OutboundMessage(chat_id="-100200", text="one")) is None
        assert await adapter.send(OutboundMessage(chat_id="-100200", text="two")) is None
        await adapter.typing("-100200", None)
        assert len(tg.calls_of("sendMessage")) == 1  # no retries, no further attempts
        assert len(tg.calls_of("sendChatAction")) == 0
        # the bot is added back and someone talks to it: sending works again
        tg.push_group(-100200, 2, f"@{BOT} back?")
        await rec.wait(1)
        assert await adapter.send(OutboundMessage(chat_id="-100200", text="yes")) is not None
    warnings_ = [r for r in caplog.records if "-100200" in r.getMessage() and "removed or blocked" in r.getMessage()]
    assert len(warnings_) == 1


async def test_my_chat_member_removal_and_return(tg):
    rec = Recorder()
    async with running(tg, rec) as adapter:
        chat = tg.add_chat(-100200, "supergroup")

        def member_update(status: str) -> dict:
            return {
                "my_chat_member": {
                    "chat": chat,
                    "from": {"id": 1, "is_bot": False, "first_name": "admin"},
                    "date": 1,
                    "old_chat_member": {"status": "member", "user": tg.bot_user},
                    "new_chat_member": {"status": status, "user": tg.bot_user}
                    | ({"until_date": 0} if status == "kicked" else {}),
                }
            }

        tg.push_update(member_update("kicked"))
        await settle(tg)
        assert await adapter.send(OutboundMessage(chat_id="-100200", text="x")) is None
        assert not tg.calls_of("sendMessage")
        tg.push_update(member_update("member"))
        await settle(tg)
        assert await adapter.send(OutboundMessage(chat_id="-100200", text="x")) is not None
    assert rec.messages == []


async def test_rejected_markup_falls_back_to_plain_text(tg):
    async with running(tg) as adapter:
        tg.add_chat(111, "private")
        tg.fail_next(
            "sendMessage",
            status=400,
            description="Bad Request: can't parse entities: Can't find end of the entity starting at byte offset 3",
        )
        text = "**odd** <markup> & stuff"
        sent = await adapter.send(OutboundMessage(chat_id="111", text=text))
    assert sent is not None
    first, second = tg.calls_of("sendMessage")
    assert first["parse_mode"] == "HTML"
    assert "parse_mode" not in second and second["text"] == text
    assert [m["text"] for m in tg.sent_messages(111)] == [text]


async def test_answers_can_still_be_sent_after_stop(tg):
    """The gateway stops adapters first, then lets running turns deliver their answers."""
    async with running(tg) as adapter:
        tg.add_chat(111, "private")
        await adapter.stop()
        tg.push_private(111, "arrives after stop")
        await asyncio.sleep(0.3)
        assert await adapter.send(OutboundMessage(chat_id="111", text="late answer")) is not None
    assert len(tg.pending_updates) == 1  # not consumed by a stopped adapter


async def test_ambiguous_timeout_is_not_resent_by_the_adapter(tg):
    async with running(tg, kwargs={"send_timeout_s": 0.5}) as adapter:
        tg.add_chat(111, "private")
        tg.delay_next("sendMessage", 1.5)
        with pytest.raises(DeliveryDeferred):  # the outbox decides (docs/concepts.md#delivery: the Telegram window)
            await adapter.send(OutboundMessage(chat_id="111", text="maybe delivered"))
        await asyncio.sleep(1.2)
    assert len(tg.calls_of("sendMessage")) == 1
    assert len(tg.sent_messages(111)) == 1  # Telegram did post it: it must not be posted twice


async def test_unknown_chat_returns_none(tg):
    async with running(tg) as adapter:
        assert await adapter.send(OutboundMessage(chat_id="424242", text="hello")) is None


async def test_too_long_chunk_is_split_as_a_safety_net(tg):
    async with running(tg) as adapter:
        tg.add_chat(111, "private")
        sent = await adapter.send(OutboundMessage(chat_id="111", text="word " * 1000))
    assert sent is not None
    assert len(tg.sent_messages(111)) == 2
    assert all(utf16_len(m["text"]) <= 4096 for m in tg.sent_messages(111))


async def test_edit_and_not_modified(tg):
    async with running(tg) as adapter:
        tg.add_chat(111, "private")
        sent = await adapter.send(OutboundMessage(chat_id="111", text="Compressing…", kind="notice"))
        assert tg.calls_of("sendMessage")[0]["disable_notification"] is True
        assert await adapter.edit(sent, "Compressed: 12,000 -> 3,000 tokens") is True
        assert await adapter.edit(sent, "Compressed: 12,000 -> 3,000 tokens") is True  # not modified
        assert await adapter.edit(SentMessage(chat_id="111", message_id="9999"), "x") is False
    assert tg.sent_messages(111)[0]["text"] == "Compressed: 12,000 -> 3,000 tokens"


async def test_typing_in_topic_and_never_raises(tg):
    async with running(tg) as adapter:
        tg.ensure_topic(-100300, 42)
        await adapter.typing("-100300", "42")
        tg.fail_next("sendChatAction", status=429, retry_after=5)
        await adapter.typing("-100300", "42")
        tg.fail_next("sendChatAction", status=500)
        await adapter.typing("-100300", None)
        await adapter.typing("not-a-chat", None)
    first = tg.calls_of("sendChatAction")[0]
    assert first["action"] == "typing" and first["message_thread_id"] == 42


# ----------------------------------------------------------------------------- webhook


@pytest.fixture
def webhook_env(monkeypatch):
    monkeypatch.setenv("HERMES_TEST_TG_TOKEN", TOKEN)
    monkeypatch.setenv("HERMES_TEST_TG_SECRET", "s3cr3t-Token_ok")


async def test_webhook_checks_the_secret(tg, webhook_env):
    cfg = make_cfg(
        tg,
        token_env="HERMES_TEST_TG_TOKEN",
        mode="webhook",
        webhook={
            "listen": "127.0.0.1",
            "port": free_port(),
            "path": "/tg/hook",
            "public_url": "https://bot.example.org",
            "secret_token_env": "HERMES_TEST_TG_SECRET",
        },
    )
    rec = Recorder()
    adapter = TelegramAdapter.from_config(cfg)
    await adapter.start(rec)
    try:
        await tg.wait_for(lambda: tg.webhook["url"] != "")
        assert tg.webhook["url"] == "https://bot.example.org/tg/hook"
        assert tg.webhook["secret_token"] == "s3cr3t-Token_ok"
        local = f"http://127.0.0.1:{adapter.webhook_port}/tg/hook"
        bad = tg.push_private(111, "forged")
        assert await tg.post_to_webhook(bad, url=local, secret_token="wrong") == 403
        assert await tg.post_to_webhook(bad, url=local, secret_token=None) == 403
        async with aiohttp.ClientSession() as s, s.get(local) as resp:
            assert resp.status in (403, 405)
        assert rec.calls == 0
        good = tg.push_private(111, "genuine", username="alice")
        assert await tg.post_to_webhook(good, url=local) == 200
        assert [(m.text, m.chat_type, m.user_id) for m in rec.messages] == [("genuine", "dm", "111")]
        # group gating applies to webhook updates too
        assert await tg.post_to_webhook(tg.push_group(-100200, 2, "unaddressed"), url=local) == 200
        # a sink failure answers 500 so Telegram redelivers
        rec.fail = 1
        again = tg.push_private(111, "retry me")
        assert await tg.post_to_webhook(again, url=local) == 500
        assert await tg.post_to_webhook(again, url=local) == 200
        assert rec.texts() == ["genuine", "retry me"]
        assert not tg.calls_of("getUpdates")  # no polling in webhook mode
    finally:
        await adapter.aclose()


# ----------------------------------------------------------------------------- doctor


async def test_doctor(tg, monkeypatch):
    monkeypatch.setenv("HERMES_TEST_TG_TOKEN", TOKEN)
    ok, text = await doctor(make_cfg(tg, token_env="HERMES_TEST_TG_TOKEN"))
    assert ok and text.startswith(f"ok: @{BOT} (id {tg.bot_id})") and "privacy mode is on" in text

    monkeypatch.setenv("HERMES_TEST_TG_TOKEN", "123:WRONGTOKEN")
    ok, text = await doctor(make_cfg(tg, token_env="HERMES_TEST_TG_TOKEN"))
    assert not ok and "rejected" in text and "HERMES_TEST_TG_TOKEN" in text and "WRONGTOKEN" not in text

    monkeypatch.setenv("HERMES_TEST_TG_TOKEN", "not a token")
    ok, text = await doctor(make_cfg(tg, token_env="HERMES_TEST_TG_TOKEN"))
    assert not ok and "does not look like a bot token" in text

    monkeypatch.delenv("HERMES_TEST_TG_TOKEN")
    ok, text = await doctor(make_cfg(tg, token_env="HERMES_TEST_TG_TOKEN"))
    assert not ok and "HERMES_TEST_TG_TOKEN is not set" in text

    monkeypatch.setenv("HERMES_TEST_TG_TOKEN", TOKEN)
    cfg = TelegramConfig(enabled=True, token_env="HERMES_TEST_TG_TOKEN", base_url="http://127.0.0.1:9/bot")
    ok, text = await doctor(cfg)
    assert not ok and "can't reach" in text and TOKEN not in text


# ----------------------------------------------------------------------------- secrets


async def test_token_never_appears_in_logs(tg, caplog, monkeypatch):
    caplog.set_level(logging.DEBUG)
    rec = Recorder()
    async with running(tg, rec) as adapter:
        tg.push_private(111, "private words")
        await rec.wait(1)
        await adapter.send(OutboundMessage(chat_id="111", text="reply words"))
        await adapter.typing("111", None)
    monkeypatch.setenv("HERMES_TEST_TG_TOKEN", TOKEN)
    await doctor(make_cfg(tg, token_env="HERMES_TEST_TG_TOKEN"))
    await doctor(TelegramConfig(token_env="HERMES_TEST_TG_TOKEN", base_url="http://127.0.0.1:9/bot"))
    everything = "\n".join(r.getMessage() for r in caplog.records) + caplog.text
    assert caplog.records, "expected some debug logging"
    assert TOKEN not in everything
    assert TOKEN.split(":")[1] not in everything
    assert "private words" not in everything and "reply words" not in everything


# ----------------------------------------------------------------------------- formatting


def test_markdown_to_html_examples():
    assert markdown_to_telegram_html("a < b & c > d") == "a &lt; b &amp; c &gt; d"
    assert markdown_to_telegram_html("**x** _y_ ~~z~~ `<t>`") == "<b>x</b> <i>y</i> <s>z</s> <code>&lt;t&gt;</code>"
    assert markdown_to_telegram_html("snake_case_name and 2*3*4") == "snake_case_name and 2*3*4"
    assert (
        markdown_to_telegram_html("```py\nx = '<a>'\n```")
        == "<pre><code class=\"language-py\">x = '&lt;a&gt;'</code></pre>"
    )
    assert markdown_to_telegram_html("# Title\n* item") == "<b>Title</b>\n• item"
    assert (
        markdown_to_telegram_html("[site](https://e.org/?a=1&b=2)") == '<a href="https://e.org/?a=1&amp;b=2">site</a>'
    )
    assert markdown_to_telegram_html("> quoted\n> more\nafter") == "<blockquote>quoted\nmore</blockquote>\nafter"


_md_alphabet = st.sampled_from(
    [
        *list("ab *_~`|#>[]()<&\n-:"),
        "```",
        "```py\n",
        "~~~",
        "~~~yaml\n",
        "   ```\n",
        "**",
        "***",
        "__",
        "~~",
        "||",
        "http://x.y",
        "](http://x.y/a_(b))",
        "|---|---|\n",
        "> > ",
        "😀",
        "&amp;",
    ]
)


@settings(max_examples=300, deadline=None)
@given(st.lists(_md_alphabet, max_size=60).map("".join))
def test_markdown_to_html_is_always_valid_and_never_longer(text):
    converted = markdown_to_telegram_html(text)
    visible = _parse_html(converted)  # raises if Telegram would reject the markup
    assert utf16_len(visible) <= utf16_len(text)
