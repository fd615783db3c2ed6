"""Erased means erased: once a message is answered and its reply sent, neither its text nor
the reply can be read from gateway.db or its -wal file, while the gateway keeps running."""

from __future__ import annotations

from tests.conftest import RecordingAdapter, dm, say
from tests.fakes.llm import reply
from tests.test_stop_busy import until


def _bytes(cfg) -> bytes:
    out = b""
    for name in ("gateway.db", "gateway.db-wal"):
        path = cfg.data_dir / name
        if path.exists():
            out += path.read_bytes()
    return out


async def test_answered_text_and_sent_replies_leave_gateway_db_and_its_wal_while_running(config_for, fake_llm):
    from gateway.build import build_gateway

    cfg = config_for()
    adapter = RecordingAdapter()
    app = build_gateway(cfg, [adapter])
    app.inbox.erase_checkpoint_s = 0.05
    await app.start()
    try:
        fake_llm.script(reply("the answer is ZEBRA-REPLY-4417"))
        assert await say(app, adapter, dm("una", "my locker code is QUOKKA-ASK-9981")) == [
            "the answer is ZEBRA-REPLY-4417"
        ]
        await until(lambda: b"QUOKKA-ASK-9981" not in _bytes(cfg) and b"ZEBRA-REPLY-4417" not in _bytes(cfg))
        assert app._started  # still running: the erase did not wait for a stop
    finally:
        await app.stop()
    assert b"QUOKKA-ASK-9981" not in _bytes(cfg) and b"ZEBRA-REPLY-4417" not in _bytes(cfg)
