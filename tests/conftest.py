"""Shared fixtures: a fake LLM server, configs over tmp data dirs, a recording adapter."""

from __future__ import annotations

import itertools
from contextlib import asynccontextmanager
from typing import Any

import pytest

from adapters.loopback import LoopbackAdapter
from core.messages import InboundMessage
from core.settings import Config, parse_config
from tests.fakes.llm import FakeLLM
from tests.pg import pool, schema  # noqa: F401 (fixtures: a fresh PostgreSQL schema per test)
from tests.statedb import refuse_stdlib_beside_apsw

refuse_stdlib_beside_apsw()


@pytest.fixture(autouse=True)
def _keep_logging_config():
    """The CLI configures logging process-wide; put it back for the tests that follow."""
    import logging as _logging

    root = _logging.getLogger()
    names = ("httpx", "httpcore", "aiosqlite", "discord", "telegram", "aiohttp.access")
    saved = (root.level, list(root.handlers), {n: _logging.getLogger(n).level for n in names})
    yield
    root.setLevel(saved[0])
    root.handlers[:] = saved[1]
    for n, level in saved[2].items():
        _logging.getLogger(n).setLevel(level)


@pytest.fixture
async def fake_llm():
    async with FakeLLM() as llm:
        yield llm


def make_config(data_dir, llm_url: str, **sections: Any) -> Config:
    """A config over `data_dir` talking to the fake LLM; `sections` merge into the YAML dict.

    Background reviews (memory nudges, flushes, skill nudges) are off unless a test turns
    them on: they are extra model requests that other tests do not script for."""
    data: dict[str, Any] = {
        "data_dir": str(data_dir),
        "llm": {"base_url": llm_url, "model": "fake-model", "max_retries": 1, "timeout_s": 10},
        "storage": {"fsync": "never"},
        "memory": {"nudge_interval": 0, "flush_min_turns": 0},
        "skills": {"creation_nudge_interval": 0},
    }
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key] = {**data[key], **value}
        else:
            data[key] = value
    return parse_config(data)


@pytest.fixture
def config_for(tmp_path, fake_llm):
    def build(**sections: Any) -> Config:
        return make_config(tmp_path / "data", fake_llm.base_url, **sections)

    return build


class RecordingAdapter(LoopbackAdapter):
    """The loopback adapter on a test platform, with a helper to read what was sent."""

    def __init__(self, platform: str = "testchat", max_message_length: int = 4000) -> None:
        super().__init__(platform, max_message_length)

    def texts(self, chat_id: str | None = None) -> list[str]:
        return [m.text for m in self.sent if chat_id is None or m.chat_id == chat_id]


_msg_ids = itertools.count(1)


def dm(
    user: str, text: str, *, platform: str = "testchat", message_id: str | None = None, name: str | None = None
) -> InboundMessage:
    return InboundMessage(
        platform=platform,
        chat_id=f"dm-{user}",
        chat_type="dm",
        user_id=user,
        user_name=name or user,
        message_id=message_id or f"m{next(_msg_ids)}",
        text=text,
    )


def group(
    chat: str,
    user: str,
    text: str,
    *,
    platform: str = "testchat",
    thread_id: str | None = None,
    message_id: str | None = None,
) -> InboundMessage:
    return InboundMessage(
        platform=platform,
        chat_id=chat,
        chat_type="thread" if thread_id else "group",
        thread_id=thread_id,
        user_id=user,
        user_name=user,
        message_id=message_id or f"m{next(_msg_ids)}",
        text=text,
        mentions_bot=True,
    )


async def say(app, adapter: RecordingAdapter, msg: InboundMessage, timeout: float = 20) -> list[str]:
    """Deliver `msg` through the adapter's sink, wait for the turn, return what was sent."""
    before = len(adapter.sent)
    assert adapter.sink is not None, "adapter not started"
    await adapter.sink(msg)
    assert await app.drain(timeout), "turn did not finish"
    return [m.text for m in adapter.sent[before:]]


@asynccontextmanager
async def running_gateway(config_for, **sections):
    """A started GatewayApp with one RecordingAdapter ("testchat"), stopped afterwards;
    `sections` override the config (rate limit raised so tests never hit it)."""
    from gateway.build import build_gateway

    sections.setdefault("limits", {"rate_limit_per_minute": 1000})
    adapter = RecordingAdapter()
    app = build_gateway(config_for(**sections), [adapter])
    await app.start()
    try:
        yield app, adapter
    finally:
        await app.stop()


@asynccontextmanager
async def telegram_gateway(cfg: Config):
    """A started single-node gateway with a real Telegram adapter for `cfg` (which points
    it at a fake Bot API), quick to retry; stopped and closed afterwards."""
    from adapters.telegram import TelegramAdapter
    from gateway.build import build_gateway

    adapter = TelegramAdapter.from_config(cfg.platforms.telegram, backoff_initial_s=0.05, backoff_max_s=0.5)
    app = build_gateway(cfg, [adapter])
    await app.start()
    try:
        yield app
    finally:
        await app.stop()
        await adapter.aclose()
