"""End to end: the real GatewayApp with the real TelegramAdapter (python-telegram-bot over
HTTP) against the fake Bot API and the fake LLM, both real servers on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
import re
import socket
from contextlib import asynccontextmanager
from typing import Any

import pytest

from adapters.telegram import TelegramAdapter
from adapters.telegram.flood import FloodLimits
from core.text import utf16_len
from gateway.build import build_gateway
from gateway.runtime import GatewayApp
from tests.fakes.llm import last_user_text, memory_saving_responder, reply
from tests.fakes.telegram_api import FakeTelegram

TOKEN = "123456:AAE2eFAKEtokenFAKEtoken_-e2e"
TOKEN_ENV = "HERMES_E2E_TG_TOKEN"
SECRET_ENV = "HERMES_E2E_TG_SECRET"
BOT = "hermes_test_bot"
GROUP = -1001234567890
FORUM = -1009876543210
SECRET = "locker code 4711-QX"
# Pacing loose enough not to slow these tests (tests/test_telegram_adapter.py checks the real one).
LOOSE_FLOOD = FloodLimits(per_chat=(50, 1.0), per_group=(50, 1.0), overall=(100, 1.0))


@pytest.fixture
async def tg(monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    async with FakeTelegram(token=TOKEN, bot_username=BOT) as fake:
        yield fake


def tg_config(config_for, tg: FakeTelegram, sections: dict[str, Any] | None = None, **telegram: Any):
    section = {"enabled": True, "token_env": TOKEN_ENV, "base_url": tg.base_url, "poll_timeout_s": 2}
    section.update(telegram)
    return config_for(platforms={"telegram": section}, **(sections or {}))


@asynccontextmanager
async def gateway(cfg):
    adapter = TelegramAdapter.from_config(
        cfg.platforms.telegram, backoff_initial_s=0.05, backoff_max_s=0.5, flood_limits=LOOSE_FLOOD
    )
    app = build_gateway(cfg, [adapter])
    await app.start()
    try:
        yield app, adapter
    finally:
        await app.stop()
        await adapter.aclose()


async def answered(tg: FakeTelegram, app: GatewayApp, n: int, chat_id: int, timeout: float = 20) -> list[dict]:
    """Wait until `n` messages were sent into `chat_id` and the gateway is idle."""
    await tg.wait_sent(n, chat_id, timeout=timeout)
    assert await app.drain(timeout)
    return tg.sent_messages(chat_id)


def replies_to(tg: FakeTelegram, chat_id: int, message_id: int) -> list[dict]:
    return [m for m in tg.sent_messages(chat_id) if m.get("reply_to_message", {}).get("message_id") == message_id]


def requests_from(llm, text: str) -> list[dict]:
    return [r for r in llm.requests if text in last_user_text(r)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ----------------------------------------------------------------------------- DMs


async def test_dm_conversation(tg, fake_llm, config_for):
    async with gateway(tg_config(config_for, tg)) as (app, _adapter):
        assert [c["command"] for c in tg.commands][:2] == ["help", "new"]
        one = tg.push_private(111, "/start", first_name="Alice", username="alice")
        [greeting] = await answered(tg, app, 1, 111)
        assert greeting["text"].startswith("Hi alice") or greeting["text"].startswith("Hi Alice")
        assert greeting["reply_to_message"]["message_id"] == one.message_id
        assert not fake_llm.requests  # /start is the gateway's, not the model's

        two = tg.push_private(111, "my favourite colour is teal", username="alice")
        sent = await answered(tg, app, 2, 111)
        assert sent[-1]["text"] == "ok: my favourite colour is teal"
        assert sent[-1]["reply_to_message"]["message_id"] == two.message_id

        tg.push_private(111, "what colour did I say?", username="alice")
        sent = await answered(tg, app, 3, 111)
        assert sent[-1]["text"] == "ok: what colour did I say?"
        # the same lane: the second turn's request carries the first exchange
        [req] = requests_from(fake_llm, "what colour did I say?")
        assert "my favourite colour is teal" in json.dumps(req)
        # a typing action was shown while the turn ran
        assert any(c["chat_id"] == 111 and c["action"] == "typing" for c in tg.calls_of("sendChatAction"))
        await tg.wait_acked()


async def test_unknown_dm_user_gets_a_pairing_code_that_an_admin_approves(tg, fake_llm, config_for):
    cfg = tg_config(
        config_for,
        tg,
        sections={"access": {"allowed_users": ["telegram:111"], "admins": ["telegram:111"], "unauthorized_dm": "pair"}},
    )
    async with gateway(cfg) as (app, _adapter):
        tg.push_private(222, "hello?")
        [notice] = await answered(tg, app, 1, 222)
        code = re.search(r"pairing code is (\S+?)\.", notice["text"]).group(1)
        assert not fake_llm.requests

        tg.push_private(111, f"/pair {code}")
        [approved] = await answered(tg, app, 1, 111)
        assert "telegram:222" in approved["text"]

        tg.push_private(222, "hello again")
        sent = await answered(tg, app, 2, 222)
        assert sent[-1]["text"] == "ok: hello again"


# ----------------------------------------------------------------------------- groups


async def test_two_group_members_have_separate_lanes_and_memories(tg, fake_llm, config_for):
    fake_llm.responder = memory_saving_responder
    async with gateway(tg_config(config_for, tg)) as (app, _adapter):
        a1 = tg.push_group(GROUP, 1, f"@{BOT} remember that my {SECRET}", username="alice")
        sent = await answered(tg, app, 1, GROUP)
        assert sent[0]["text"].startswith("done:")
        assert sent[0]["reply_to_message"]["message_id"] == a1.message_id

        b1 = tg.push_group(GROUP, 2, f"@{BOT} what is the locker code?", username="bob")
        sent = await answered(tg, app, 2, GROUP)
        assert sent[-1]["reply_to_message"]["message_id"] == b1.message_id

        a2 = tg.push_group(GROUP, 1, f"@{BOT} what did I ask you to remember?", username="alice")
        sent = await answered(tg, app, 3, GROUP)
        assert sent[-1]["reply_to_message"]["message_id"] == a2.message_id

    bob_requests = requests_from(fake_llm, "what is the locker code?")
    assert bob_requests
    for request in bob_requests:
        dumped = json.dumps(request)
        assert "4711-QX" not in dumped, "bob's request carried alice's secret"
        assert "remember that my" not in dumped, "bob's lane carried alice's messages"
        assert f"@{BOT}" not in last_user_text(request)  # mention stripped
    alice_requests = requests_from(fake_llm, "what did I ask you to remember?")
    assert alice_requests and any("4711-QX" in json.dumps(r) for r in alice_requests)
    assert not any("locker code?" in json.dumps(r) for r in alice_requests)


async def test_mention_gating(tg, fake_llm, config_for):
    async with gateway(tg_config(config_for, tg)) as (app, _adapter):
        tg.push_group(GROUP, 1, "anyone up for lunch-7Q?")
        tg.push_group(GROUP, 2, "@someone_else ping-8Z")
        tg.push_group(GROUP, 3, "/help@another_bot")
        await tg.wait_acked()
        assert await app.drain(10)
        assert not fake_llm.requests and not tg.sent_messages(GROUP)

        asked = tg.push_group(GROUP, 1, f"@{BOT} now you")
        sent = await answered(tg, app, 1, GROUP)
        assert sent[0]["text"] == "ok: now you"
        follow = tg.push_group(GROUP, 1, "and a follow-up", reply_to_bot_message_id=sent[0]["message_id"])
        sent = await answered(tg, app, 2, GROUP)
        assert sent[-1]["reply_to_message"]["message_id"] == follow.message_id
        tg.push_group(GROUP, 1, f"/help@{BOT}")
        sent = await answered(tg, app, 3, GROUP)
        assert "/new" in sent[-1]["text"]
    assert [last_user_text(r) for r in fake_llm.requests] and all(
        "lunch-7Q" not in json.dumps(r) and "ping-8Z" not in json.dumps(r) for r in fake_llm.requests
    )
    assert asked.message_id < follow.message_id


async def test_forum_topic(tg, fake_llm, config_for):
    async with gateway(tg_config(config_for, tg)) as (app, _adapter):
        tg.ensure_topic(FORUM, 42, "Planning")
        first = tg.push_topic(FORUM, 42, 1, f"@{BOT} start planning", username="alice")
        [sent] = await answered(tg, app, 1, FORUM)
        assert sent["message_thread_id"] == 42 and sent["is_topic_message"]
        assert sent["reply_to_message"]["message_id"] == first.message_id
        assert sent["text"].startswith("ok: ") and sent["text"].endswith("start planning")  # shared lane: names shown
        actions = [c for c in tg.calls_of("sendChatAction") if c["chat_id"] == FORUM]
        assert actions and all(c.get("message_thread_id") == 42 for c in actions)

        # the topic is one shared lane: bob's turn sees alice's message
        tg.push_topic(FORUM, 42, 2, f"@{BOT} what are we planning?", username="bob")
        sent = await answered(tg, app, 2, FORUM)
        assert sent[-1]["message_thread_id"] == 42
        [req] = requests_from(fake_llm, "what are we planning?")
        assert "start planning" in json.dumps(req)


# ----------------------------------------------------------------------------- delivery


def long_answer() -> str:
    parts: list[str] = []
    n = 0
    while len("\n".join(parts)) < 10_000:
        parts.append(f"Step {n} 😀: " + "this part explains what happens next, in some detail. " * 4)
        parts.append("```python")
        parts.extend(f"value_{n}_{i} = compute({n}, {i})  # <{n}.{i}> & done" for i in range(25))
        parts.append("```")
        n += 1
    return "\n".join(parts)


async def test_long_reply_with_code_fences(tg, fake_llm, config_for):
    text = long_answer()
    assert len(text) >= 10_000
    code_lines = [line for line in text.split("\n") if line.startswith("value_")]
    fake_llm.script(reply(text))
    async with gateway(tg_config(config_for, tg)) as (app, _adapter):
        asked = tg.push_private(111, "explain everything")
        await tg.wait_sent(3, 111, timeout=20)
        assert await app.drain(20)
        sent = tg.sent_messages(111)
    assert len(sent) >= 3
    # every chunk within the limit, accepted with its markup on the first try
    assert all(utf16_len(m["text"]) <= 4096 for m in sent)
    assert all(m["_params"].get("parse_mode") == "HTML" for m in sent)
    assert [s for meth, s in tg.responses if meth == "sendMessage"] == [200] * len(sent)
    # the first chunk replies to the question, the others do not
    assert sent[0]["reply_to_message"]["message_id"] == asked.message_id
    assert all("reply_to_message" not in m for m in sent[1:])
    # fences balanced in every chunk: code only ever inside <pre>, never as loose text
    for m in sent:
        markup = m["_params"]["text"]
        assert markup.count("<pre>") == markup.count("</pre>")
        outside = re.sub(r"<pre>.*?</pre>", "", markup, flags=re.S)
        assert "compute(" not in outside
    # nothing lost, nothing doubled, in order
    visible_lines = [line for m in sent for line in m["text"].split("\n") if line.startswith("value_")]
    assert visible_lines == list(code_lines)


async def test_flood_control_on_first_send(tg, fake_llm, config_for):
    tg.fail_next("sendMessage", status=429, retry_after=1)
    async with gateway(tg_config(config_for, tg)) as (app, _adapter):
        asked = tg.push_private(111, "hi")
        [sent] = await answered(tg, app, 1, 111)
        await asyncio.sleep(0.3)
    assert sent["text"] == "ok: hi" and sent["reply_to_message"]["message_id"] == asked.message_id
    assert [s for meth, s in tg.responses if meth == "sendMessage"] == [429, 200]
    assert len(tg.sent_messages(111)) == 1


async def test_bot_removed_from_group_is_not_retried(tg, fake_llm, config_for):
    async with gateway(tg_config(config_for, tg)) as (app, _adapter):
        tg.fail_next("sendMessage", status=403, description="Forbidden: bot was kicked from the supergroup chat")
        tg.push_group(GROUP, 1, f"@{BOT} hello")
        await tg.wait_for(lambda: len(tg.calls_of("sendMessage")) >= 1)
        assert await app.drain(10)
        await asyncio.sleep(0.3)
    assert len(tg.calls_of("sendMessage")) == 1 and not tg.sent_messages(GROUP)


# ----------------------------------------------------------------------------- restart


async def test_restart_with_updates_queued_while_down(tg, fake_llm, config_for):
    cfg = tg_config(config_for, tg)
    async with gateway(cfg) as (app, _adapter):
        one = tg.push_private(111, "one")
        await answered(tg, app, 1, 111)

    # while the gateway is down: new messages queue up at Telegram, and the update of
    # "one" comes again (as when the process dies before its offset was confirmed)
    two = tg.push_private(111, "two")
    three = tg.push_group(GROUP, 5, f"@{BOT} three")
    four = tg.push_private(111, "four")
    tg.updates.insert(0, one.update)

    async with gateway(cfg) as (app, _adapter):
        await tg.wait_sent(3, 111, timeout=20)
        await tg.wait_sent(1, GROUP, timeout=20)
        await tg.wait_acked()
        assert await app.drain(20)
        await asyncio.sleep(0.5)

    for pushed, chat in ((one, 111), (two, 111), (three, GROUP), (four, 111)):
        assert len(replies_to(tg, chat, pushed.message_id)) == 1, f"message {pushed.message_id} answered != once"
    assert [m["text"] for m in tg.sent_messages(111)] == ["ok: one", "ok: two", "ok: four"]
    assert len(requests_from(fake_llm, "one")) == 1
    assert not tg.pending_updates


async def test_redelivered_update_is_answered_once(tg, fake_llm, config_for):
    async with gateway(tg_config(config_for, tg)) as (app, _adapter):
        one = tg.push_private(111, "only once")
        await answered(tg, app, 1, 111)
        tg.push_update({"message": one.update["message"]})  # the same message in a new update
        tg.push_private(111, "next")
        await answered(tg, app, 2, 111)
        await asyncio.sleep(0.3)
    assert [m["text"] for m in tg.sent_messages(111)] == ["ok: only once", "ok: next"]


# ----------------------------------------------------------------------------- webhook


async def test_webhook_with_wrong_secret(tg, fake_llm, config_for, monkeypatch):
    monkeypatch.setenv(SECRET_ENV, "right-secret_123")
    port = free_port()
    cfg = tg_config(
        config_for,
        tg,
        mode="webhook",
        webhook={
            "listen": "127.0.0.1",
            "port": port,
            "path": "/telegram",
            "public_url": f"http://127.0.0.1:{port}",
            "secret_token_env": SECRET_ENV,
        },
    )
    async with gateway(cfg) as (app, _adapter):
        await tg.wait_for(lambda: tg.webhook["url"] == f"http://127.0.0.1:{port}/telegram")
        assert tg.webhook["secret_token"] == "right-secret_123"
        update = tg.push_private(111, "via webhook")
        assert await tg.post_to_webhook(update, secret_token="wrong-secret") == 403
        assert await tg.post_to_webhook(update, secret_token=None) == 403
        assert await app.drain(5)
        assert not fake_llm.requests and not tg.sent_messages(111)

        # the refused request changed nothing: the genuine delivery is answered
        assert await tg.post_to_webhook(update) == 200
        [sent] = await answered(tg, app, 1, 111)
        assert sent["text"] == "ok: via webhook"
        # Telegram retrying the same update is not answered twice
        assert await tg.post_to_webhook(update) == 200
        assert await app.drain(5)
        await asyncio.sleep(0.3)
        assert len(tg.sent_messages(111)) == 1
        assert not tg.calls_of("getUpdates")


async def test_lone_surrogate_text_is_refused_clearly_and_acknowledged(tg, fake_llm, config_for):
    async with gateway(tg_config(config_for, tg)) as (app, _adapter):
        # "@hermes_test_bot hi \ud800": the mention entity makes the adapter slice UTF-16
        text = f"@{BOT} hi \ud800 there"
        tg.push_group(GROUP, 222, text, entities=[{"type": "mention", "offset": 0, "length": len(BOT) + 1}])
        tg.push_private(111, "broken \udc00 text", entities=[])
        [group_reply] = await answered(tg, app, 1, GROUP)
        [dm_reply] = await answered(tg, app, 1, 111)
        assert "invalid characters" in group_reply["text"] and "invalid characters" in dm_reply["text"]
        assert not fake_llm.requests
        # the updates were acknowledged (not redelivered forever), and the next message works
        tg.push_private(111, "all good now")
        sent = await answered(tg, app, 2, 111)
        assert sent[-1]["text"] == "ok: all good now"
        assert len([m for m in tg.sent_messages(111) if "invalid characters" in m["text"]]) == 1


async def test_shared_group_new_undo_forget_need_a_telegram_chat_admin(tg, fake_llm, config_for):
    cfg = tg_config(
        config_for, tg, {"tenancy": {"group_sessions_per_user": False}, "limits": {"rate_limit_per_minute": 100}}
    )
    tg.chat_admins[GROUP][9] = "administrator"
    tg.chat_admins[GROUP][8] = "creator"
    async with gateway(cfg) as (app, _adapter):
        tg.push_group(GROUP, 2, f"@{BOT} the plan is the blue door", username="bob")
        await answered(tg, app, 1, GROUP)
        for i, command in enumerate(("/new", "/undo", "/forget"), start=2):
            tg.push_group(GROUP, 2, command, username="bob")
            sent = await answered(tg, app, i, GROUP)
            assert "only the chat's admins" in sent[-1]["text"], sent[-1]
        assert any(c[0] == "getChatMember" and int(c[1]["user_id"]) == 2 for c in tg.calls)
        tg.push_group(GROUP, 9, "/undo", username="mod")
        sent = await answered(tg, app, 5, GROUP)
        assert sent[-1]["text"].startswith("Took back")
        tg.push_group(GROUP, 8, "/new", username="owner")
        sent = await answered(tg, app, 6, GROUP)
        assert sent[-1]["text"].startswith("Started a new conversation")


async def test_whoami_in_a_group_points_to_a_private_chat(tg, fake_llm, config_for):
    cfg = tg_config(config_for, tg, {"tenancy": {"identity_links": {"alice": ["telegram:1", "discord:77"]}}})
    async with gateway(cfg) as (app, _adapter):
        tg.push_group(GROUP, 1, "/whoami", username="alice")
        [sent] = await answered(tg, app, 1, GROUP)
        assert "private chat" in sent["text"] and "discord:77" not in sent["text"]
        assert "link-alice" not in sent["text"]
        tg.push_private(1, "/whoami", username="alice")
        [private] = await answered(tg, app, 1, 1)
        assert "discord:77" in private["text"]


async def test_link_code_pasted_in_a_telegram_group_is_burnt(tg, fake_llm, config_for):
    code_re = re.compile(r"\b([A-Z2-9]{5}-[A-Z2-9]{5})\b")
    async with gateway(tg_config(config_for, tg, {"limits": {"rate_limit_per_minute": 100}})) as (app, _adapter):
        tg.push_private(1, "/link", username="alice")
        [issued] = await answered(tg, app, 1, 1)
        code = code_re.search(issued["text"]).group(1)
        tg.push_group(GROUP, 1, f"@{BOT} my code is {code}", username="alice")
        await answered(tg, app, 1, GROUP)
        await app.linking.wait_idle(10)
        sent = tg.sent_messages(1)
        assert len(sent) == 2 and "cancelled" in sent[-1]["text"] and code not in sent[-1]["text"]
        assert not any("cancelled" in m["text"] for m in tg.sent_messages(GROUP))
        tg.push_private(2, f"/link {code}", username="mallory")
        [refused] = await answered(tg, app, 1, 2)
        assert "unknown, expired or already used" in refused["text"]
        assert app.links.as_dict() == {}


async def test_link_code_pasted_in_a_group_without_mention_is_burnt(tg, fake_llm, config_for):
    """The adapter drops group messages that don't mention the bot (the default), but a live
    link code in one is still burnt, and nothing is answered or recorded for it."""
    from tests.test_linking import CODE_RE

    async with gateway(tg_config(config_for, tg)) as (app, _adapter):
        tg.push_private(111, "/link", username="alice")
        [issued] = await answered(tg, app, 1, 111)
        code = CODE_RE.search(issued["text"]).group(1)
        tg.push_group(-100200, 111, f"here is my code {code} for you")  # no mention of the bot
        notices = await answered(tg, app, 2, 111)
        assert "cancelled" in notices[-1]["text"]
        assert tg.sent_messages(-100200) == []  # the group gets no answer
        tg.push_private(222, f"/link {code}", username="mallory")
        [refused] = await answered(tg, app, 1, 222)
        assert "unknown, expired or already used" in refused["text"]
        assert app.links.name_for("telegram:222") is None


# ----------------------------------------------------------------------------- tool confirmations


async def test_a_confirm_tool_in_a_group_asks_with_buttons_only_the_asker_can_press(tg, fake_llm, config_for):
    """docs/concepts.md#tool-confirmations, through the real adapter: the question carries
    Allow / Deny, another member's press gets an alert and changes nothing, the asker's
    Allow runs the call, and the question then says so without buttons."""
    from tests.fakes.llm import tool_call

    fake_llm.script(tool_call("session_search", {"query": "lunch"}), reply("Searched, nothing yet."))
    sections = {"tools": {"session_search": {"confirm": True}}, "limits": {"rate_limit_per_minute": 1000}}
    async with gateway(tg_config(config_for, tg, sections)) as (app, _adapter):
        tg.push_group(GROUP, 1, f"@{BOT} search for lunch")
        [question] = await tg.wait_sent(1, GROUP)
        buttons = [b["text"] for row in question["reply_markup"]["inline_keyboard"] for b in row]
        assert buttons == ["Allow", "Deny"] and "session_search" in question["text"]
        other = tg.press_button(GROUP, question["message_id"], 2, text="Allow")
        refusal = await tg.wait_answered(other)
        assert refusal["show_alert"] is True and "Only the person who asked" in refusal["text"]
        assert len(fake_llm.requests) == 1, "another member's press runs nothing"
        mine = tg.press_button(GROUP, question["message_id"], 1, text="Allow")
        assert (await tg.wait_answered(mine))["show_alert"] is not True
        sent = await answered(tg, app, 2, GROUP)
        assert sent[-1]["text"] == "Searched, nothing yet."
        [result] = [json.loads(m["content"]) for m in fake_llm.requests[-1]["messages"] if m["role"] == "tool"]
        assert result["success"] is True
        edit = [e for e in tg.edits if e["message_id"] == question["message_id"]][-1]
        assert edit["text"].endswith("Allowed.") and not edit.get("reply_markup")
