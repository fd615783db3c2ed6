"""Tool-call confirmations on Telegram and Discord: the real adapters post a question with
"Allow" / "Deny" buttons, hand a press to the gateway's answerer, tell the presser what
the answerer said, and settle the question, all against the fake Bot API and the fake
Discord that python-telegram-bot and discord.py talk to over real sockets."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest

from adapters.discord_bot import DiscordAdapter
from adapters.telegram import TelegramAdapter
from adapters.telegram.flood import FloodLimits
from core.messages import ConfirmRequest, ConfirmVerdict, DeliveryDeferred, InboundMessage, SentMessage
from core.protocols import Confirms
from core.settings import DiscordConfig, TelegramConfig
from core.text import utf16_len
from tests.fakes.discord_api import FakeDiscord
from tests.fakes.telegram_api import FakeTelegram

TG_TOKEN = "123456:AAEfakeTOKENfakeTOKENfake_-xyz"
LOOSE_FLOOD = FloodLimits(per_chat=(50, 1.0), per_group=(50, 1.0), overall=(100, 1.0))
QUESTION = "Allow the tool shell to run: ls -la /srv?"


class Answerer:
    """The gateway's side, reduced to its rule: a question (token) is answered once, by
    the person it was asked of. Records every press it is handed."""

    def __init__(self, owners: dict[str, str] | None = None, *, fail: bool = False) -> None:
        self.owners = dict(owners or {})  # open questions: token -> the asker's user id
        self.fail = fail
        self.calls: list[tuple[str, str, bool]] = []
        self.decided: dict[str, bool] = {}

    async def __call__(self, token: str, user_id: str, allow: bool) -> ConfirmVerdict:
        self.calls.append((token, user_id, allow))
        if self.fail:
            raise RuntimeError("the registry fell over")
        owner = self.owners.get(token)
        if owner is None:
            return "expired"
        if owner != user_id:
            return "not_yours"
        del self.owners[token]
        self.decided[token] = allow
        return "ok"


class Sink:
    """Records what the adapter hands the gateway as chat messages."""

    def __init__(self) -> None:
        self.messages: list[InboundMessage] = []

    async def __call__(self, msg: InboundMessage) -> None:
        self.messages.append(msg)


def request(token: str, platform: str, chat_id: str, user_id: str, *, thread_id: str | None = None) -> ConfirmRequest:
    return ConfirmRequest(
        token=token, platform=platform, chat_id=chat_id, thread_id=thread_id, user_id=user_id, text=QUESTION
    )


# =========================================================================== Telegram


@pytest.fixture
async def tg() -> AsyncIterator[FakeTelegram]:
    async with FakeTelegram(token=TG_TOKEN) as fake:
        yield fake


@asynccontextmanager
async def telegram(
    tg: FakeTelegram, answerer: Any = None, sink: Sink | None = None, **cfg: Any
) -> AsyncIterator[TelegramAdapter]:
    config = TelegramConfig.model_validate({"enabled": True, "base_url": tg.base_url, "poll_timeout_s": 2, **cfg})
    adapter = TelegramAdapter(config, TG_TOKEN, backoff_initial_s=0.05, backoff_max_s=0.2, flood_limits=LOOSE_FLOOD)
    adapter.answerer = answerer
    await adapter.start(sink or Sink())
    try:
        yield adapter
    finally:
        await adapter.aclose()


def keyboard(message: dict[str, Any]) -> list[list[tuple[str, str]]]:
    rows = (message.get("reply_markup") or {}).get("inline_keyboard") or []
    return [[(b["text"], b.get("callback_data")) for b in row] for row in rows]


async def test_telegram_asks_with_allow_and_deny_buttons_in_the_topic(tg):
    tg.ensure_topic(-100500, 7, "ops")
    async with telegram(tg) as adapter:
        sent = await adapter.ask(request("tok1", "telegram", "-100500", "111", thread_id="7"))
        assert sent is not None and (sent.chat_id, sent.thread_id) == ("-100500", "7")
        [message] = tg.sent_messages(-100500)
        assert str(message["message_id"]) == sent.message_id
        assert message["text"] == QUESTION
        assert message["message_thread_id"] == 7 and message["is_topic_message"]
        assert keyboard(message) == [[("Allow", "hgc:tok1:a"), ("Deny", "hgc:tok1:d")]]


async def test_telegram_ask_in_a_chat_that_blocked_the_bot_is_none_and_a_network_failure_raises(tg):
    tg.add_chat(222, "private")
    async with telegram(tg) as adapter:
        tg.fail_next("sendMessage", status=403)
        assert await adapter.ask(request("tok1", "telegram", "222", "222")) is None
        tg.add_chat(333, "private")
        tg.fail_next("sendMessage", status=502)
        with pytest.raises(DeliveryDeferred):
            await adapter.ask(request("tok2", "telegram", "333", "333"))
        assert not tg.sent_messages()


async def test_telegram_a_press_by_the_asker_reaches_the_answerer_and_gets_a_toast(tg):
    tg.add_chat(111, "private")
    answerer = Answerer({"tok1": "111", "tok2": "111"})
    sink = Sink()
    async with telegram(tg, answerer, sink) as adapter:
        assert "callback_query" in adapter.allowed_updates
        first = await adapter.ask(request("tok1", "telegram", "111", "111"))
        second = await adapter.ask(request("tok2", "telegram", "111", "111"))
        assert first is not None and second is not None
        allow = tg.press_button(111, int(first.message_id), 111, text="Allow")
        deny = tg.press_button(111, int(second.message_id), 111, text="Deny")
        assert await tg.wait_answered(allow) == {
            "callback_query_id": allow.callback_query_id,
            "text": "Allowed.",
            "show_alert": False,
        }
        assert (await tg.wait_answered(deny))["text"] == "Denied."
        assert answerer.calls == [("tok1", "111", True), ("tok2", "111", False)]
        assert answerer.decided == {"tok1": True, "tok2": False}
        await tg.wait_acked()
    assert sink.messages == []  # a press is never a chat message


async def test_telegram_a_press_by_someone_else_gets_an_alert_and_changes_nothing(tg):
    tg.ensure_topic(-100500, 7)
    answerer = Answerer({"tok1": "111"})
    async with telegram(tg, answerer) as adapter:
        sent = await adapter.ask(request("tok1", "telegram", "-100500", "111", thread_id="7"))
        assert sent is not None
        intruder = tg.press_button(-100500, int(sent.message_id), 999, text="Allow")
        answer = await tg.wait_answered(intruder)
        assert (answer["text"], answer["show_alert"]) == ("Only the person who asked can answer this.", True)
        assert answerer.calls == [("tok1", "999", True)] and answerer.decided == {}
        assert keyboard(tg.sent_messages(-100500)[0])  # the buttons are still there
        owner = tg.press_button(-100500, int(sent.message_id), 111, text="Deny")
        assert (await tg.wait_answered(owner))["text"] == "Denied."
        assert answerer.decided == {"tok1": False}


async def test_telegram_an_expired_question_says_so(tg):
    tg.add_chat(111, "private")
    answerer = Answerer({"tok1": "111"})
    async with telegram(tg, answerer) as adapter:
        sent = await adapter.ask(request("tok1", "telegram", "111", "111"))
        assert sent is not None
        del answerer.owners["tok1"]  # timed out on the gateway's side
        late = tg.press_button(111, int(sent.message_id), 111, text="Allow")
        answer = await tg.wait_answered(late)
        assert (answer["text"], answer["show_alert"]) == ("This question has expired.", True)
        assert answerer.calls == [("tok1", "111", True)]
    # an adapter the gateway gave no answerer: every question it finds has expired
    async with telegram(tg, None) as adapter:
        orphan = tg.press_button(111, int(sent.message_id), 111, text="Deny")
        assert (await tg.wait_answered(orphan))["text"] == "This question has expired."


async def test_telegram_settle_removes_the_buttons(tg):
    tg.ensure_topic(-100500, 7)
    async with telegram(tg) as adapter:
        req = request("tok1", "telegram", "-100500", "111", thread_id="7")
        sent = await adapter.ask(req)
        assert sent is not None
        await adapter.settle(req, sent, "Allowed.")
        [message] = tg.sent_messages(-100500)
        assert message["text"] == f"{QUESTION}\n\nAllowed."
        assert "reply_markup" not in message
        assert tg.edits[-1]["reply_markup"] is None
        with pytest.raises(LookupError):
            tg.press_button(-100500, int(sent.message_id), 111, text="Allow")
        # a question that is gone (deleted meanwhile) is not an error
        del tg.messages[(-100500, int(sent.message_id))]
        await adapter.settle(req, sent, "Denied.")


async def test_telegram_settle_shortens_a_question_that_would_not_fit(tg):
    tg.add_chat(111, "private")
    async with telegram(tg) as adapter:
        req = ConfirmRequest(token="tok1", platform="telegram", chat_id="111", user_id="111", text="🙂" * 2048)
        sent = await adapter.ask(req)  # 4096 UTF-16 units: exactly Telegram's limit
        assert sent is not None
        await adapter.settle(req, sent, "No answer: denied.")
        [message] = tg.sent_messages(111)
        assert message["text"].endswith("…\n\nNo answer: denied.") and message["text"].startswith("🙂")
        assert utf16_len(message["text"]) <= 4096 and "reply_markup" not in message


async def test_telegram_a_foreign_callback_is_answered_and_ignored(tg):
    tg.add_chat(111, "private")
    answerer = Answerer({"tok1": "111"})
    async with telegram(tg, answerer) as adapter:
        sent = await adapter.ask(request("tok1", "telegram", "111", "111"))
        assert sent is not None
        foreign = tg.press_button(111, int(sent.message_id), 111, data="vote:42:up")
        broken = tg.press_button(111, int(sent.message_id), 111, data="hgc:tok1:maybe")
        for press in (foreign, broken):
            answer = await tg.wait_answered(press)
            assert (answer["text"], answer["show_alert"]) == (None, False)
        assert answerer.calls == []


async def test_telegram_a_failing_answerer_does_not_stop_the_receive_loop(tg, caplog):
    tg.add_chat(111, "private")
    answerer = Answerer({"tok1": "111"}, fail=True)
    sink = Sink()
    async with telegram(tg, answerer, sink) as adapter:
        sent = await adapter.ask(request("tok1", "telegram", "111", "111"))
        assert sent is not None
        with caplog.at_level(logging.ERROR, logger="adapters.telegram"):
            press = tg.press_button(111, int(sent.message_id), 111, text="Allow")
            answer = await tg.wait_answered(press)
        assert answer["text"] is None  # the spinner stops; nothing untrue is said
        assert answerer.calls == [("tok1", "111", True)]
        assert "could not take a button press" in caplog.text
        # a press whose answer Telegram refuses (a query answered elsewhere) is survived too
        tg.fail_next(
            "answerCallbackQuery",
            status=400,
            description="Bad Request: query is too old and response timeout expired or query ID is invalid",
        )
        answerer.fail = False
        stale = tg.press_button(111, int(sent.message_id), 111, text="Allow")
        tg.push_private(111, "still listening?")
        await tg.wait_for(lambda: len(sink.messages) == 1)
        assert tg.answer_to(stale) is None and answerer.decided == {"tok1": True}
        assert [m.text for m in sink.messages] == ["still listening?"]
        assert adapter.status == "connected (polling)"


@pytest.fixture
def webhook_env(monkeypatch):
    monkeypatch.setenv("HERMES_TEST_TG_TOKEN", TG_TOKEN)
    monkeypatch.setenv("HERMES_TEST_TG_SECRET", "s3cr3t-Token_ok")


async def test_telegram_a_press_arrives_through_the_webhook_too(tg, webhook_env):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = TelegramConfig.model_validate(
        {
            "enabled": True,
            "base_url": tg.base_url,
            "token_env": "HERMES_TEST_TG_TOKEN",
            "mode": "webhook",
            "webhook": {
                "listen": "127.0.0.1",
                "port": port,
                "path": "/tg/hook",
                "public_url": "https://bot.example.org",
                "secret_token_env": "HERMES_TEST_TG_SECRET",
            },
        }
    )
    tg.add_chat(111, "private")
    answerer = Answerer({"tok1": "111"})
    sink = Sink()
    adapter = TelegramAdapter.from_config(cfg, flood_limits=LOOSE_FLOOD)
    adapter.answerer = answerer
    await adapter.start(sink)
    try:
        await tg.wait_for(lambda: tg.webhook["url"] != "")
        assert "callback_query" in tg.webhook["allowed_updates"]
        sent = await adapter.ask(request("tok1", "telegram", "111", "111"))
        assert sent is not None
        press = tg.press_button(111, int(sent.message_id), 111, text="Allow")
        assert await tg.post_to_webhook(press, url=f"http://127.0.0.1:{adapter.webhook_port}/tg/hook") == 200
        assert tg.answer_to(press) is not None and tg.answer_to(press)["text"] == "Allowed."  # type: ignore[index]
        assert answerer.decided == {"tok1": True} and sink.messages == []
    finally:
        await adapter.aclose()


# =========================================================================== Discord


class World:
    """A fake Discord with one guild (#general and a thread under it) and two people."""

    def __init__(self, fake: FakeDiscord) -> None:
        self.fake = fake
        self.guild = fake.add_guild("Hermes Lab")
        self.general = fake.channel_named(self.guild, "general")
        self.thread = fake.add_thread(self.general, "a topic")
        self.alice = fake.add_user("alice")
        self.bob = fake.add_user("bob")


@pytest.fixture
async def dc() -> AsyncIterator[tuple[FakeDiscord, World]]:
    async with FakeDiscord() as fake:
        yield fake, World(fake)


@asynccontextmanager
async def discord_bot(
    fake: FakeDiscord, answerer: Any = None, sink: Sink | None = None
) -> AsyncIterator[DiscordAdapter]:
    cfg = DiscordConfig(enabled=True, api_base=fake.api_base, gateway_url=fake.gateway_url)
    adapter = DiscordAdapter(cfg, fake.token, ready_timeout=10, guild_ready_timeout=0.05)
    adapter.answerer = answerer
    await adapter.start(sink or Sink())
    try:
        assert adapter.status == "connected"
        yield adapter
    finally:
        await adapter.stop()


def buttons(message: dict[str, Any]) -> list[tuple[str, str | None, int]]:
    return [
        (b.get("label"), b.get("custom_id"), b.get("style"))
        for row in message.get("components") or []
        for b in row.get("components") or []
    ]


async def test_discord_asks_with_allow_and_deny_buttons_in_the_thread(dc):
    fake, world = dc
    async with discord_bot(fake) as adapter:
        sent = await adapter.ask(request("tok1", "discord", world.general, world.alice, thread_id=world.thread))
        assert sent == SentMessage(chat_id=world.general, thread_id=world.thread, message_id=sent.message_id)
        [record] = fake.sent_messages(world.thread)
        assert record["id"] == sent.message_id and record["content"] == QUESTION
        assert record["allowed_mentions"] == {"parse": []}
        # green Allow, red Deny; the custom_id carries the question and the choice
        assert buttons(fake.messages[sent.message_id]) == [("Allow", "hgc:tok1:a", 3), ("Deny", "hgc:tok1:d", 4)]
        # discord.py keeps no view for it: presses are dispatched on the custom_id
        assert adapter.client is not None and not adapter.client.persistent_views
        assert not adapter.client._connection._view_store._views
        fake.forbid_channel(world.general)
        assert await adapter.ask(request("tok2", "discord", world.general, world.alice)) is None


async def test_discord_a_press_by_the_asker_reaches_the_answerer_and_is_acknowledged(dc):
    fake, world = dc
    answerer = Answerer({"tok1": world.alice, "tok2": world.alice})
    sink = Sink()
    async with discord_bot(fake, answerer, sink) as adapter:
        first = await adapter.ask(request("tok1", "discord", world.general, world.alice))
        second = await adapter.ask(request("tok2", "discord", world.general, world.alice))
        assert first is not None and second is not None
        allow = fake.press_button(first.message_id, world.alice, label="Allow")
        deny = fake.press_button(second.message_id, world.alice, label="Deny")
        assert (await fake.wait_answered(allow))["type"] == 6  # deferred update: settle edits it
        assert (await fake.wait_answered(deny))["type"] == 6
        await fake.wait_until(lambda: len(answerer.calls) == 2)
        assert sorted(answerer.calls) == [("tok1", world.alice, True), ("tok2", world.alice, False)]
        assert answerer.decided == {"tok1": True, "tok2": False}
        assert fake.followups(allow) == [] and fake.followups(deny) == []
        fake.push_dm(world.bob, "sentinel")  # handed over after anything dispatched before it
        await fake.wait_until(lambda: len(sink.messages) == 1)
    assert [m.text for m in sink.messages] == ["sentinel"]  # a press is never a chat message


async def test_discord_a_press_by_someone_else_gets_an_ephemeral_refusal(dc):
    fake, world = dc
    answerer = Answerer({"tok1": world.alice})
    async with discord_bot(fake, answerer) as adapter:
        sent = await adapter.ask(request("tok1", "discord", world.general, world.alice, thread_id=world.thread))
        assert sent is not None
        intruder = fake.press_button(sent.message_id, world.bob, label="Allow")
        await fake.wait_until(lambda: len(fake.followups(intruder)) == 1)
        [refusal] = fake.followups(intruder)
        assert refusal["content"] == "Only the person who asked can answer this."
        assert refusal["body"]["flags"] & 64  # only bob sees it
        assert answerer.calls == [("tok1", world.bob, True)] and answerer.decided == {}
        assert buttons(fake.messages[sent.message_id])  # still waiting for alice
        owner = fake.press_button(sent.message_id, world.alice, label="Deny")
        await fake.wait_answered(owner)
        await fake.wait_until(lambda: answerer.decided == {"tok1": False})
        assert fake.followups(owner) == []


async def test_discord_an_expired_question_gets_an_ephemeral_refusal(dc):
    fake, world = dc
    async with discord_bot(fake, Answerer()) as adapter:
        sent = await adapter.ask(request("tok1", "discord", world.general, world.alice))
        assert sent is not None
        late = fake.press_button(sent.message_id, world.alice, label="Allow")
        await fake.wait_until(lambda: len(fake.followups(late)) == 1)
        [refusal] = fake.followups(late)
        assert refusal["content"] == "This question has expired." and refusal["body"]["flags"] & 64


async def test_discord_settle_removes_the_buttons(dc):
    fake, world = dc
    async with discord_bot(fake) as adapter:
        req = request("tok1", "discord", world.general, world.alice, thread_id=world.thread)
        sent = await adapter.ask(req)
        assert sent is not None
        await adapter.settle(req, sent, "Denied.")
        message = fake.messages[sent.message_id]
        assert message["content"] == f"{QUESTION}\n\nDenied." and message["components"] == []
        with pytest.raises(LookupError):
            fake.press_button(sent.message_id, world.alice, label="Allow")
        long = ConfirmRequest(
            token="tok2", platform="discord", chat_id=world.general, user_id=world.alice, text="x" * 2000
        )
        sent_long = await adapter.ask(long)
        assert sent_long is not None
        await adapter.settle(long, sent_long, "Allowed.")
        content = fake.messages[sent_long.message_id]["content"]
        assert len(content) == 2000 and content.endswith("…\n\nAllowed.")
        # a question that is gone (deleted meanwhile) is not an error
        del fake.messages[sent.message_id]
        await adapter.settle(req, sent, "Allowed.")


async def test_discord_a_press_after_a_restart_of_the_adapter_still_reaches_the_answerer(dc):
    fake, world = dc
    async with discord_bot(fake, Answerer()) as first:
        sent = await first.ask(request("tok1", "discord", world.general, world.alice))
        assert sent is not None
    answerer = Answerer({"tok1": world.alice})
    async with discord_bot(fake, answerer):
        press = fake.press_button(sent.message_id, world.alice, label="Allow")
        assert (await fake.wait_answered(press))["type"] == 6
        await fake.wait_until(lambda: answerer.decided == {"tok1": True})
        assert answerer.calls == [("tok1", world.alice, True)]


async def test_discord_a_foreign_component_is_ignored(dc):
    fake, world = dc
    answerer = Answerer({"tok1": world.alice})
    sink = Sink()
    async with discord_bot(fake, answerer, sink) as adapter:
        sent = await adapter.ask(request("tok1", "discord", world.general, world.alice))
        assert sent is not None
        foreign = fake.press_button(sent.message_id, world.alice, custom_id="poll:42:up")
        fake.push_dm(world.bob, "sentinel")
        await fake.wait_until(lambda: len(sink.messages) == 1)
        await asyncio.sleep(0.2)
        assert fake.interaction_callback(foreign) is None and fake.followups(foreign) == []
        assert answerer.calls == []


async def test_discord_a_failing_answerer_does_not_stop_the_receive_loop(dc, caplog):
    fake, world = dc
    answerer = Answerer({"tok1": world.alice}, fail=True)
    sink = Sink()
    async with discord_bot(fake, answerer, sink) as adapter:
        sent = await adapter.ask(request("tok1", "discord", world.general, world.alice))
        assert sent is not None
        with caplog.at_level(logging.ERROR, logger="adapters.discord_bot"):
            press = fake.press_button(sent.message_id, world.alice, label="Allow")
            await fake.wait_answered(press)
            await fake.wait_until(lambda: "could not take a button press" in caplog.text)
        assert fake.followups(press) == []
        answerer.fail = False
        again = fake.press_button(sent.message_id, world.alice, label="Allow")
        await fake.wait_answered(again)
        await fake.wait_until(lambda: answerer.decided == {"tok1": True})
        fake.push_dm(world.bob, "still listening?")
        await fake.wait_until(lambda: len(sink.messages) == 1)
        assert sink.messages[0].text == "still listening?" and adapter.status == "connected"


# =========================================================================== both


def test_both_adapters_are_confirms():
    tg_adapter = TelegramAdapter(TelegramConfig(enabled=True), TG_TOKEN)
    dc_adapter = DiscordAdapter(DiscordConfig(enabled=True), "token")
    for adapter in (tg_adapter, dc_adapter):
        assert isinstance(adapter, Confirms)
        assert adapter.answerer is None
