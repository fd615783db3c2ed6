"""The tools' shared clients, built once per gateway from `tools` (docs/concepts.md#tools):
the web fetcher, the search client and the MCP hub, with the rules, as one `ToolServices`
for every agent, closed when the gateway stops."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from agent.toolkit import ToolServices, ToolSink
from core.settings import Config


@dataclass
class ToolClients:
    """What `build_tools` made, and how to close it."""

    services: ToolServices
    closers: list[Callable[[], Awaitable[None]]] = field(default_factory=list)

    async def aclose(self) -> None:
        for close in self.closers:
            await close()


def build_tools(cfg: Config, sink: ToolSink | None) -> ToolClients:
    """The tools `cfg` turns on; nothing is connected or started until a call needs it."""
    return ToolClients(ToolServices(cfg.tools, {}, None, sink))


__all__ = ["ToolClients", "build_tools"]
