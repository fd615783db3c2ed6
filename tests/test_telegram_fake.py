"""The fake Bot API itself behaves like Telegram where the adapter relies on it."""

from __future__ import annotations

import asyncio
import json

import aiohttp

from tests.fakes.telegram_api import FakeTelegram, make_entities


async def call(session: aiohttp.ClientSession, tg: FakeTelegram, method: str, token: str | None = None, **params):
    url = f"{tg.base_url}{token or tg.token}/{method}"
    async with session.post(url, json=params) as resp:
        return resp.status, await resp.json()


async def test_token_methods_and_long_polling():
    async with FakeTelegram(token="1:A") as tg, aiohttp.ClientSession() as s:
        status, body = await call(s, tg, "getMe", token="1:B")
        assert status == 401 and body == {"ok": False, "error_code": 401, "description": "Unauthorized"}
        status, body = await call(s, tg, "noSuchMethod")
        assert status == 404
        status, body = await call(s, tg, "getMe")
        assert body["result"]["is_bot"] and body["result"]["username"] == tg.bot_username

        # long poll: waits, then returns an update pushed meanwhile
        poll = asyncio.create_task(call(s, tg, "getUpdates", timeout=5))
        await asyncio.sleep(0.2)
        assert not poll.done()
        first = tg.push_private(1, "hi")
        status, body = await poll
        assert [u["update_id"] for u in body["result"]] == [first.update_id]
        # not confirmed yet: delivered again
        _, body = await call(s, tg, "getUpdates", timeout=0)
        assert len(body["result"]) == 1 and tg.acked_offset is None
        # the offset confirms it
        _, body = await call(s, tg, "getUpdates", offset=first.update_id + 1, timeout=0)
        assert body["result"] == [] and tg.acked_offset == first.update_id + 1 and not tg.pending_updates

        # a newer getUpdates ends a waiting one with 409
        older = asyncio.create_task(call(s, tg, "getUpdates", timeout=5))
        await asyncio.sleep(0.2)
        _, _ = await call(s, tg, "getUpdates", timeout=0)
        status, body = await older
        assert status == 409 and "terminated by other getUpdates" in body["description"]


async def test_form_encoded_like_ptb_and_html_checks():
    async with FakeTelegram(token="1:A") as tg, aiohttp.ClientSession() as s:
        tg.add_chat(5, "private")
        form = {
            "chat_id": "5",
            "text": "123",
            "reply_parameters": json.dumps({"message_id": 77, "allow_sending_without_reply": True}),
        }
        async with s.post(f"{tg.base_url}1:A/sendMessage", data=form) as resp:
            body = await resp.json()
        assert body["ok"] and body["result"]["text"] == "123" and "reply_to_message" not in body["result"]
        status, body = await call(s, tg, "sendMessage", chat_id=5, text="<b>unclosed", parse_mode="HTML")
        assert status == 400 and "can't parse entities" in body["description"]
        status, body = await call(s, tg, "sendMessage", chat_id=5, text="<b>x</b> &lt;y&gt;", parse_mode="HTML")
        assert body["result"]["text"] == "x <y>"
        status, body = await call(s, tg, "sendMessage", chat_id=5, text="x" * 4097)
        assert status == 400 and "too long" in body["description"]
        status, body = await call(s, tg, "sendMessage", chat_id=6, text="x")
        assert status == 400 and "chat not found" in body["description"]
        tg.fail_next("sendMessage", status=429, retry_after=3)
        status, body = await call(s, tg, "sendMessage", chat_id=5, text="x")
        assert status == 429 and body["parameters"] == {"retry_after": 3}
        assert [m["text"] for m in tg.sent_messages(5)] == ["123", "x <y>"]
        assert [name for name, _ in tg.calls].count("sendMessage") == 6


def test_entities_use_utf16_offsets():
    assert make_entities("/start@my_bot go") == [{"type": "bot_command", "offset": 0, "length": 13}]
    assert make_entities("😀 @some_bot") == [{"type": "mention", "offset": 3, "length": 9}]
    assert make_entities("mail a@b.com") == []
