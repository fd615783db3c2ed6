"""Edges of "private stays private": broken Unicode at the door, owner-only files, and the
shared-lane commands only a chat's admins may use."""

from __future__ import annotations

import json

from adapters.base import InboundMessage
from gateway.app import GatewayApp
from tests.conftest import RecordingAdapter, dm, say


async def test_lone_surrogates_get_a_clear_refusal_and_never_raise_in_the_sink(config_for, fake_llm):
    adapter = RecordingAdapter("testchat")
    app = GatewayApp(config_for(), [adapter])
    await app.start()
    try:
        # broken text: refused in words, never stored, never sent to the model
        out = await say(app, adapter, dm("111", "hello \ud800 world"))
        assert len(out) == 1 and "invalid characters" in out[0]
        assert fake_llm.requests == []
        # a broken user name or user id: the same clear refusal
        bad_name = InboundMessage(platform="testchat", chat_id="dm-111", chat_type="dm", user_id="111",
                                  user_name="\udcff", message_id="m-bad-name", text="hi")
        out = await say(app, adapter, bad_name)
        assert "invalid characters" in out[0]
        bad_user = bad_name.model_copy(update={"user_id": "1\ud834", "user_name": "x", "message_id": "m-bad-user"})
        out = await say(app, adapter, bad_user)
        assert "invalid characters" in out[0]
        # broken chat or message ids: nowhere to answer; dropped with a log line, no exception
        before = len(adapter.sent)
        for field in ("chat_id", "message_id", "thread_id"):
            await adapter.sink(bad_name.model_copy(update={field: "x\udfff", "user_name": "ok"}))
        assert await app.drain(10)
        assert len(adapter.sent) == before
        assert fake_llm.requests == []
        # nothing of it reached gateway.db, and the next good message is answered as usual
        raw = b"".join(p.read_bytes() for p in app.cfg.data_dir.glob("gateway.db*"))
        assert b"m-bad-name" not in raw and b"m-bad-user" not in raw
        out = await say(app, adapter, dm("111", "hello world"))
        assert out == ["ok: hello world"]
        assert json.dumps(fake_llm.requests).count("hello world") >= 1
    finally:
        await app.stop()
