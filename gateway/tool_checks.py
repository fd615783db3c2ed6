"""`doctor`'s checks of the tools (docs/concepts.md#tools): the search provider answers a
query with the configured key, and every MCP server starts and lists its tools, so "ok"
means the next call can work."""

from __future__ import annotations

import shutil

from core.settings import Config


async def check_web_search(cfg: Config) -> tuple[bool, str]:
    from agent.web import WebToolError
    from agent.web_search import SearchSettings, WebSearch

    t = cfg.tools.web_search
    assert t.provider is not None
    key = t.api_key()
    if t.provider != "searxng" and not key:
        return False, f"{t.provider}: the variable {t.api_key_env} is not set, so every search would fail"
    search = WebSearch(SearchSettings(t.provider, t.base_url, key, t.max_results, t.timeout_s))
    try:
        hits = await search.search("hermes", 1)
    except WebToolError as err:
        return False, f"{t.provider}: {err}"
    finally:
        await search.aclose()
    return True, f"{t.provider} answered ({len(hits)} result{'s' if len(hits) != 1 else ''} for a test query)"


async def check_mcp_servers(cfg: Config) -> list[tuple[bool | None, str, str]]:
    """One line per server: started and listed (a per-tenant server: its program found)."""
    from agent.mcp_tools import McpHub
    from gateway.tooling import mcp_spec

    out: list[tuple[bool | None, str, str]] = []
    shared = {n: s for n, s in cfg.tools.mcp.servers.items() if not s.per_tenant}
    for name, server in cfg.tools.mcp.servers.items():
        if server.per_tenant:
            found = server.command is None or shutil.which(server.command) is not None
            detail = "started per tenant at first use; not started here"
            if not found:
                out.append((False, f"MCP {name}", f"the command {server.command!r} is not found"))
            else:
                out.append((None, f"MCP {name}", detail))
    if shared:
        hub = McpHub([mcp_spec(n, s) for n, s in shared.items()])
        try:
            for name in shared:
                count, why = await hub.probe(name, "doctor")
                if why is None:
                    out.append((True, f"MCP {name}", f"started, {count} tool{'s' if count != 1 else ''}"))
                else:
                    out.append((False, f"MCP {name}", why))
        finally:
            await hub.close()
    return out


__all__ = ["check_mcp_servers", "check_web_search"]
