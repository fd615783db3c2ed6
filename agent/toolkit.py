"""Who may use which tool, and the tools beyond the tenant's own stores (docs/concepts.md#tools).

Every tool, built-in or from an MCP server, has a rule: `allow` (a tier) and `confirm`. A
turn's `ToolBox` offers a lane only the tools its speaker may use and refuses a call the
model makes anyway; a tool with `confirm` waits for the person's press first. The web
fetcher, the search client and the MCP hub are built once by the gateway's factory and
shared by every turn (they carry nothing from one tenant's call to another's).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass
from typing import Any, Protocol

from core.settings import ToolAllow, ToolsConfig

log = logging.getLogger("hermes.agent")

BUILTIN_TOOLS = ("memory", "session_search", "skill_manage", "reminders")
WEB_TOOLS = ("web_fetch", "web_search")

#: (tool name, the question to show) -> None when the person allowed it, else why not
ConfirmGate = Callable[[str, str], Awaitable[str | None]]

_WHY = {
    "dm": "can only be used in a direct message with me",
    "owner": "is only for the operator, in a direct message",
    "chat_admin": "is only for this chat's admins",
    "admin": "is only for the operator",
}


@dataclass(frozen=True)
class Speaker:
    """Who a turn's tool calls serve, as far as the tiers ask (docs/concepts.md#who-may-use-a-tool)."""

    dm: bool  # the lane is the person alone with the bot
    operator: bool = False  # the speaker is one of `access.admins`
    chat_admin: bool = False  # the speaker moderates the chat on the platform


def permits(allow: ToolAllow, who: Speaker) -> bool:
    """Whether `who` may use a tool whose rule is `allow`."""
    if allow == "everyone":
        return True
    if allow == "dm":
        return who.dm
    if allow == "owner":
        return who.dm and who.operator
    if allow == "chat_admin":
        return who.dm or who.chat_admin or who.operator
    return who.operator  # admin


def refusal(name: str, allow: ToolAllow) -> str:
    return f"the tool {name} {_WHY.get(allow, 'is not available here')}"


class McpTools(Protocol):
    """The MCP hub as the tool box sees it (agent/mcp_tools.py)."""

    async def tools(self, tenant: str, servers: Collection[str] | None = None) -> list[Any]:
        """The servers' tools (`McpTool`: server, name, qualified, description, openai_tool())."""
        ...

    async def call(self, tenant: str, qualified: str, arguments: dict[str, Any]) -> str: ...


class ToolSink(Protocol):
    """Gateway-wide tool counts (`/metrics`): per tool, never per tenant."""

    def tool_call(self, tool: str, outcome: str) -> None:
        """`outcome`: ok | error | refused | denied."""
        ...


@dataclass(frozen=True)
class WebTool:
    """One web tool: its schema and its call (agent/web.py, agent/web_search.py)."""

    schema: dict[str, Any]
    call: Callable[[dict[str, Any]], Awaitable[str]]


@dataclass(frozen=True)
class ToolServices:
    """What the gateway's factory built for the tools: the rules and the shared clients."""

    rules: ToolsConfig
    web: dict[str, WebTool]  # web_fetch / web_search when configured
    mcp: McpTools | None = None
    sink: ToolSink | None = None

    def rule(self, name: str, mcp_server: str | None = None, mcp_tool: str | None = None) -> tuple[ToolAllow, bool]:
        """(allow, confirm) of a tool."""
        if mcp_server is not None and mcp_tool is not None:
            server = self.rules.mcp.servers.get(mcp_server)
            return server.rule(mcp_tool) if server is not None else ("admin", True)
        if name in BUILTIN_TOOLS:
            r = getattr(self.rules, name)
            return r.allow, r.confirm
        if name == "web_fetch":
            return self.rules.web_fetch.allow, self.rules.web_fetch.confirm
        if name == "web_search":
            return self.rules.web_search.allow, self.rules.web_search.confirm
        return "admin", True

    def mcp_servers_for(self, who: Speaker) -> frozenset[str]:
        """The MCP servers with a tool `who` may use (by the server's rule or a tool's own)."""
        return frozenset(
            name
            for name, server in self.rules.mcp.servers.items()
            if permits(server.allow, who)
            or any(t.allow is not None and permits(t.allow, who) for t in server.tools.values())
        )

    def count(self, tool: str, outcome: str) -> None:
        if self.sink is not None:
            self.sink.tool_call(tool, outcome)


#: the rules of a gateway that configured no tools: the built-ins for everyone, as always
DEFAULT_SERVICES = ToolServices(ToolsConfig(), {})


def question(agent_name: str, tool: str, arguments: dict[str, Any], limit: int = 600) -> str:
    """What a confirmation asks: the tool and its arguments, cut to fit a chat message."""
    args = json.dumps(arguments, ensure_ascii=False, sort_keys=True)
    if len(args) > limit:
        args = args[: limit - 1] + "…"
    return f"{agent_name} wants to use the tool {tool} with {args}. Allow it?"


def failed(result: str) -> bool:
    """A tool result that says it did not work (`success: false`)."""
    try:
        data = json.loads(result)
    except (TypeError, ValueError):
        return False
    return isinstance(data, dict) and data.get("success") is False


__all__ = [
    "BUILTIN_TOOLS",
    "DEFAULT_SERVICES",
    "WEB_TOOLS",
    "ConfirmGate",
    "McpTools",
    "Speaker",
    "ToolServices",
    "ToolSink",
    "WebTool",
    "failed",
    "permits",
    "question",
    "refusal",
]
