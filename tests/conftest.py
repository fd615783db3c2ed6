"""Shared fixtures: a fake LLM server, configs over tmp data dirs, a recording adapter."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import pytest

from adapters.base import InboundMessage, InboundSink, OutboundMessage, SentMessage
from gateway.config import Config, parse_config
from tests.fakes.llm import FakeLLM


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
    """A config over `data_dir` talking to the fake LLM; `sections` merge into the YAML dict."""
    data: dict[str, Any] = {
        "data_dir": str(data_dir),
        "llm": {"base_url": llm_url, "model": "fake-model", "max_retries": 1, "timeout_s": 10},
        "storage": {"fsync": "never"},
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


class RecordingAdapter:
    """A real adapter for an in-memory platform: inbound messages are pushed by the test,
    everything the gateway sends is recorded. Used to test the gateway without a network."""

    can_edit = True

    def __init__(self, platform: str = "testchat", max_message_length: int = 4000) -> None:
        self.platform = platform
        self.max_message_length = max_message_length
        self.sent: list[OutboundMessage] = []
        self.edits: list[tuple[SentMessage, str]] = []
        self.typing_calls = 0
        self.sink: InboundSink | None = None
        self._ids = itertools.count(1)

    @staticmethod
    def measure(text: str) -> int:
        return len(text)

    async def start(self, sink: InboundSink) -> None:
        self.sink = sink

    async def stop(self) -> None:
        self.sink = None

    async def send(self, message: OutboundMessage) -> SentMessage | None:
        self.sent.append(message)
        return SentMessage(chat_id=message.chat_id, message_id=f"bot-{next(self._ids)}", thread_id=message.thread_id)

    async def edit(self, sent: SentMessage, text: str) -> bool:
        self.edits.append((sent, text))
        return True

    async def typing(self, chat_id: str, thread_id: str | None) -> None:
        self.typing_calls += 1

    def texts(self, chat_id: str | None = None) -> list[str]:
        return [m.text for m in self.sent if chat_id is None or m.chat_id == chat_id]


_msg_ids = itertools.count(1)


def dm(user: str, text: str, *, platform: str = "testchat", message_id: str | None = None,
       name: str | None = None) -> InboundMessage:
    return InboundMessage(platform=platform, chat_id=f"dm-{user}", chat_type="dm", user_id=user,
                          user_name=name or user, message_id=message_id or f"m{next(_msg_ids)}", text=text)


def group(chat: str, user: str, text: str, *, platform: str = "testchat", thread_id: str | None = None,
          message_id: str | None = None) -> InboundMessage:
    return InboundMessage(platform=platform, chat_id=chat, chat_type="thread" if thread_id else "group",
                          thread_id=thread_id, user_id=user, user_name=user,
                          message_id=message_id or f"m{next(_msg_ids)}", text=text, mentions_bot=True)


async def say(app, adapter: RecordingAdapter, msg: InboundMessage, timeout: float = 20) -> list[str]:
    """Deliver `msg` through the adapter's sink, wait for the turn, return what was sent."""
    before = len(adapter.sent)
    assert adapter.sink is not None, "adapter not started"
    await adapter.sink(msg)
    assert await app.drain(timeout), "turn did not finish"
    return [m.text for m in adapter.sent[before:]]
