"""The LLM client's HTTP transport: httpx's API over aiohttp's connection pool.

Why: httpcore's pool checks every idle connection (a `getpeername` and a `poll` each) each
time a request starts or ends, and with many requests in flight it hands one idle
connection to several waiting requests, which then retry the whole check; at 64 turns in
flight that bookkeeping was the largest cost on the event loop (docs/benchmarks/2026-12-01-notes.md#second-pass-cpu-per-turn-issue-13).
`httpx-aiohttp` (a maintained transport) keeps httpx's requests, responses, streaming and
exceptions and lets aiohttp's pool and C parser carry the bytes: measured, the gateway's
CPU per turn fell by about a third. Same limits as httpx's defaults (100 connections, 20 kept
alive) and the same TLS and `SSL_CERT_*` handling (`httpx.create_ssl_context`). When
`HTTP(S)_PROXY`/`ALL_PROXY` (and not `NO_PROXY`) applies to the endpoint, the transport is
left to httpx, which honours them.
"""

from __future__ import annotations

import urllib.request
from urllib.parse import urlsplit

import aiohttp
import httpx
from httpx_aiohttp import AiohttpTransport


class _Transport(AiohttpTransport):
    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.userinfo:
            # httpx already turned `user:pass@` into the Authorization header; aiohttp refuses
            # a URL that carries them as well
            request.url = request.url.copy_with(username=None, password=None)
        try:
            return await super().handle_async_request(request)
        except httpx.ConnectTimeout as exc:
            # httpx-aiohttp files every aiohttp connection error under ConnectTimeout; a
            # connection that was made and then dropped or refused is not a timeout
            cause = exc.__cause__
            if isinstance(cause, aiohttp.ServerDisconnectedError):
                raise httpx.RemoteProtocolError(str(cause) or "server disconnected", request=request) from cause
            if isinstance(cause, aiohttp.ClientConnectorError):  # its str() adds "ssl:default" noise
                raise httpx.ConnectError(str(cause.os_error), request=request) from cause
            if isinstance(cause, aiohttp.ClientOSError):
                raise httpx.ReadError(str(cause), request=request) from cause
            raise


def llm_transport(base_url: str) -> httpx.AsyncBaseTransport | None:
    """The transport for an LLM endpoint: aiohttp's pool, or None (httpx's own, which
    mounts the proxy) when a proxy from the environment applies to `base_url`."""
    if env_proxy_applies(base_url):
        return None
    return _Transport(limits=httpx.Limits(max_connections=100, max_keepalive_connections=20), trust_env=True)


def env_proxy_applies(url: str) -> bool:
    """True when HTTP(S)_PROXY / ALL_PROXY (and not NO_PROXY) route `url` through a proxy."""
    parts = urlsplit(url)
    proxies = urllib.request.getproxies_environment()
    if not (proxies.get(parts.scheme) or proxies.get("all")):
        return False
    bypass = urllib.request.proxy_bypass_environment  # type: ignore[attr-defined]  # not in typeshed
    return not bypass(parts.hostname or "", proxies)
