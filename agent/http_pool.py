"""An HTTP transport that spreads requests over a few small httpx connection pools.

Why: httpcore's pool checks every idle connection (a `getpeername` and a `poll` each) every
time a request starts or ends, and with many requests in flight it hands one idle
connection to several waiting requests, which then retry the whole check. One big pool
makes that cost grow with the number of connections; several small ones keep it bounded.
Same totals as httpx's defaults (100 connections, 20 kept alive), same TLS and
`SSL_CERT_*` handling; each request goes to the pool with the fewest requests in flight.
"""

from __future__ import annotations

import urllib.request
from collections.abc import AsyncIterator, Callable
from urllib.parse import urlsplit

import httpx

SHARDS = 4
MAX_CONNECTIONS = 100  # httpx's default, over all shards
MAX_KEEPALIVE = 20  # httpx's default, over all shards


class _Released(httpx.AsyncByteStream):
    """A response body that frees its shard's slot once it is closed."""

    def __init__(self, stream: httpx.AsyncByteStream, release: Callable[[], None]) -> None:
        self._stream = stream
        self._release: Callable[[], None] | None = release

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self._stream:
            yield chunk

    async def aclose(self) -> None:
        try:
            await self._stream.aclose()
        finally:
            release, self._release = self._release, None
            if release is not None:
                release()


class ShardedTransport(httpx.AsyncBaseTransport):
    """`shards` httpx transports; a request goes to the least busy one."""

    def __init__(self, shards: int = SHARDS, *, trust_env: bool = True) -> None:
        limits = httpx.Limits(
            max_connections=MAX_CONNECTIONS // shards, max_keepalive_connections=max(1, MAX_KEEPALIVE // shards)
        )
        self._pools = [httpx.AsyncHTTPTransport(limits=limits, trust_env=trust_env) for _ in range(shards)]
        self.in_flight = [0] * shards  # requests sent and not yet closed, per shard

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        i = min(range(len(self._pools)), key=self.in_flight.__getitem__)
        self.in_flight[i] += 1

        def release() -> None:
            self.in_flight[i] -= 1

        try:
            resp = await self._pools[i].handle_async_request(request)
        except BaseException:
            release()
            raise
        assert isinstance(resp.stream, httpx.AsyncByteStream)
        return httpx.Response(
            resp.status_code, headers=resp.headers, stream=_Released(resp.stream, release), extensions=resp.extensions
        )

    async def aclose(self) -> None:
        for pool in self._pools:
            await pool.aclose()


def env_proxy_applies(url: str) -> bool:
    """True when HTTP(S)_PROXY / ALL_PROXY (and not NO_PROXY) route `url` through a proxy;
    then the caller leaves the transport to httpx, which honours them."""
    parts = urlsplit(url)
    proxies = urllib.request.getproxies_environment()
    if not (proxies.get(parts.scheme) or proxies.get("all")):
        return False
    bypass = urllib.request.proxy_bypass_environment  # type: ignore[attr-defined]  # not in typeshed
    return not bypass(parts.hostname or "", proxies)
