"""The LLM client's sharded connection pools, against the FakeLLM server on 127.0.0.1."""

from __future__ import annotations

import asyncio
import threading

import pytest

from agent.http_pool import ShardedTransport, env_proxy_applies
from agent.llm import LLMClient, LLMError
from tests.fakes.llm import FakeLLM, disconnect, reply

USER = [{"role": "user", "content": "hello there"}]


@pytest.fixture
async def llm():
    async with FakeLLM() as server:
        yield server


def shards_of(client: LLMClient) -> ShardedTransport:
    transport = client._http._transport
    assert isinstance(transport, ShardedTransport)
    return transport


async def test_concurrent_calls_spread_over_the_pools_and_every_slot_is_freed(llm: FakeLLM) -> None:
    gate = threading.Event()
    arrived: list[int] = []

    async def held(request: dict) -> object:
        arrived.append(1)
        while not gate.is_set():  # the server's own loop: wait for the test to let go
            await asyncio.sleep(0.005)
        return reply(f"answer {len(arrived)}")

    llm.responder = held
    client = LLMClient(llm.base_url, "fake-model", max_retries=0)
    try:
        pools = shards_of(client)
        calls = [asyncio.create_task(client.chat(USER)) for _ in range(8)]
        while len(arrived) < 8:
            await asyncio.sleep(0.005)
        assert pools.in_flight == [2, 2, 2, 2]
        gate.set()
        results = await asyncio.wait_for(asyncio.gather(*calls), 30)
        assert all(r.content and r.content.startswith("answer") for r in results)
        assert pools.in_flight == [0, 0, 0, 0]
    finally:
        gate.set()
        await client.aclose()


async def test_a_dropped_connection_frees_its_slot(llm: FakeLLM) -> None:
    llm.script(disconnect(), reply("after"))
    client = LLMClient(llm.base_url, "fake-model", max_retries=0)
    try:
        with pytest.raises(LLMError):
            await client.chat(USER)
        assert shards_of(client).in_flight == [0, 0, 0, 0]
        assert (await client.chat(USER, on_text=lambda _t: None)).content == "after"
        assert shards_of(client).in_flight == [0, 0, 0, 0]
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
    assert not isinstance(client._http._transport, ShardedTransport)  # httpx mounts the proxy itself
    monkeypatch.delenv("HTTPS_PROXY")
    assert isinstance(LLMClient("https://api.example.invalid/v1", "m")._http._transport, ShardedTransport)
