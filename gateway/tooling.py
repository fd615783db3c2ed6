"""The tools' shared clients, built once per gateway from `tools` (docs/concepts.md#tools):
the web fetcher, the search client and the MCP hub, with the rules, as one `ToolServices`
for every agent, closed when the gateway stops. Nothing connects or starts here; each
client does on the first call that needs it."""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from agent.toolkit import ToolServices, ToolSink, WebTool
from core.settings import Config, McpServerConfig

if TYPE_CHECKING:
    from agent.mcp_tools import McpServerSpec


@dataclass
class ToolClients:
    """What `build_tools` made, and how to close it."""

    services: ToolServices
    closers: list[Callable[[], Awaitable[None]]] = field(default_factory=list)

    async def aclose(self) -> None:
        for close in self.closers:
            await close()


def mcp_spec(name: str, server: McpServerConfig) -> McpServerSpec:
    """A server's spec with its header values read from their variables now."""
    from agent.mcp_tools import McpServerSpec

    headers = {header: os.environ.get(var, "") for header, var in server.headers_env.items()}
    env = {**server.env, **{name: os.environ.get(var, "") for name, var in server.env_from.items()}}
    return McpServerSpec(
        name=name,
        command=server.command,
        args=tuple(server.args),
        env=env,
        url=server.url,
        headers=headers,
        per_tenant=server.per_tenant,
        call_timeout_s=server.timeout_s,
        max_output_chars=server.max_output_chars,
    )


def build_tools(cfg: Config, sink: ToolSink | None) -> ToolClients:
    """The tools `cfg` turns on; nothing is connected or started until a call needs it. A
    tool's modules are imported only when it is on (a gateway without tools pays nothing)."""
    t = cfg.tools
    web: dict[str, WebTool] = {}
    closers: list[Callable[[], Awaitable[None]]] = []
    if t.web_fetch.enabled:
        from agent.web import WEB_FETCH_TOOL, WebFetcher, WebPolicy, web_fetch_call

        fetcher = WebFetcher(
            WebPolicy(
                allow_hosts=frozenset(t.web.allow_hosts),
                max_bytes=t.web_fetch.max_bytes,
                timeout_s=t.web_fetch.timeout_s,
                max_chars=t.web_fetch.max_chars,
            )
        )

        async def fetch(args: dict[str, Any]) -> str:
            return await web_fetch_call(fetcher, args)

        web["web_fetch"] = WebTool(WEB_FETCH_TOOL, fetch)
        closers.append(fetcher.aclose)
    if t.web_search.provider is not None:
        from agent.web_search import WEB_SEARCH_TOOL, SearchSettings, WebSearch, web_search_call

        search = WebSearch(
            SearchSettings(
                provider=t.web_search.provider,
                base_url=t.web_search.base_url,
                api_key=t.web_search.api_key(),
                max_results=t.web_search.max_results,
                timeout_s=t.web_search.timeout_s,
            )
        )

        async def find(args: dict[str, Any]) -> str:
            return await web_search_call(search, args)

        web["web_search"] = WebTool(WEB_SEARCH_TOOL, find)
        closers.append(search.aclose)
    hub = None
    if t.mcp.servers:
        from agent.mcp_tools import McpHub

        hub = McpHub([mcp_spec(name, server) for name, server in t.mcp.servers.items()])
        closers.append(hub.close)
    return ToolClients(ToolServices(t, web, hub, sink), closers)


__all__ = ["ToolClients", "build_tools", "mcp_spec"]
