"""The LLM client's transport (aiohttp's pool under httpx's API), against the FakeLLM
server on 127.0.0.1."""

from __future__ import annotations

import asyncio
import socket
import threading

import pytest
from httpx_aiohttp import AiohttpTransport

from agent.http_pool import env_proxy_applies
from agent.llm import LLMClient, LLMError, LLMUnavailable
from tests.fakes.llm import FakeLLM, disconnect, reply

USER = [{"role": "user", "content": "hello there"}]


@pytest.fixture
async def llm():
    async with FakeLLM() as server:
        yield server


async def test_concurrent_calls_each_get_their_own_answer_and_connections_are_reused(llm: FakeLLM) -> None:
    gate = threading.Event()
    arrived: list[str] = []

    async def held(request: dict) -> object:
        arrived.append(request["messages"][-1]["content"])
        while not gate.is_set():  # the server's own loop: wait for the test to let go
            await asyncio.sleep(0.005)
        return reply(f"answer to {request['messages'][-1]['content']}")

    llm.responder = held
    client = LLMClient(llm.base_url, "fake-model", max_retries=0)
    try:
        calls = [asyncio.create_task(client.chat([{"role": "user", "content": f"q{i}"}])) for i in range(8)]
        while len(arrived) < 8:  # all eight in flight at once: eight connections
            await asyncio.sleep(0.005)
        gate.set()
        results = await asyncio.wait_for(asyncio.gather(*calls), 30)
        assert [r.content for r in results] == [f"answer to q{i}" for i in range(8)]
        for i in range(16):  # one at a time: the pool's kept-alive connections carry them
            assert (await client.chat([{"role": "user", "content": f"r{i}"}])).content == f"answer to r{i}"
        assert len(set(llm.peers)) == 8
    finally:
        gate.set()
        await client.aclose()


async def test_a_dropped_connection_fails_that_call_and_the_next_one_works(llm: FakeLLM) -> None:
    llm.script(disconnect(), reply("after"))
    client = LLMClient(llm.base_url, "fake-model", max_retries=0)
    try:
        with pytest.raises(LLMError):
            await client.chat(USER)
        assert (await client.chat(USER, on_text=lambda _t: None)).content == "after"
    finally:
        await client.aclose()


def test_a_proxy_from_the_environment_leaves_the_transport_to_httpx(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (
        "HTTP_PROXY",
        "http_proxy",
        "HTTPS_PROXY",
        "https_proxy",
        "ALL_PROXY",
        "all_proxy",
        "NO_PROXY",
        "no_proxy",
    ):
        monkeypatch.delenv(name, raising=False)
    assert not env_proxy_applies("https://api.example.invalid/v1")
    monkeypatch.setenv("HTTPS_PROXY", "http://127.0.0.1:3128")
    assert env_proxy_applies("https://api.example.invalid/v1")
    assert not env_proxy_applies("http://127.0.0.1:8080/v1")  # plain http: HTTPS_PROXY does not apply
    monkeypatch.setenv("NO_PROXY", "api.example.invalid")
    assert not env_proxy_applies("https://api.example.invalid/v1")
    monkeypatch.delenv("NO_PROXY")
    client = LLMClient("https://api.example.invalid/v1", "m")
    assert not isinstance(client._http._transport, AiohttpTransport)  # httpx mounts the proxy itself
    monkeypatch.delenv("HTTPS_PROXY")
    assert isinstance(LLMClient("https://api.example.invalid/v1", "m")._http._transport, AiohttpTransport)


async def test_a_refused_connection_is_reported_as_unreachable_not_as_a_timeout() -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = LLMClient(f"http://127.0.0.1:{port}/v1", "fake-model", max_retries=0)
    try:
        with pytest.raises(LLMUnavailable) as info:
            await client.chat(USER)
    finally:
        await client.aclose()
    text = str(info.value)
    assert "cannot reach" in text and "ConnectError" in text
    assert "timed out" not in text and "ssl:default" not in text
