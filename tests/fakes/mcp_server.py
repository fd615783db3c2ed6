"""A real MCP server for the MCP hub's tests, built with the SDK's MCPServer.

Run as `python tests/fakes/mcp_server.py [--http PORT] [--tag VALUE]`: stdio by default,
streamable HTTP on 127.0.0.1:PORT with `--http`. Its tools exercise each way a call can
end: an answer, a slow answer, a big answer, a tool error, and the process dying.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError


def build_server(tag: str) -> MCPServer:
    """The fake server; `tag` is what `whoami` reports as its command-line tag."""
    server: MCPServer = MCPServer("fake-mcp", log_level="WARNING")

    @server.tool()
    def echo(text: str) -> str:
        """Return the text unchanged."""
        return text

    @server.tool()
    def add(a: float, b: float) -> str:
        """Add two numbers."""
        total = a + b
        return str(int(total)) if total == int(total) else str(total)

    @server.tool()
    async def slow(seconds: float) -> str:
        """Sleep `seconds`, then answer."""
        await asyncio.sleep(seconds)
        return f"slept {seconds}"

    @server.tool()
    def crash() -> str:
        """Kill this server's own process at once, without answering."""
        os._exit(3)

    @server.tool()
    def big(n: int) -> str:
        """Return `n` characters."""
        return "x" * n

    @server.tool()
    def whoami() -> str:
        """This process: its --tag, its FAKE_MCP_TAG, and whether HERMES_SECRET_CANARY reached it."""
        return json.dumps(
            {
                "tag": tag,
                "env_tag": os.environ.get("FAKE_MCP_TAG"),
                "canary_visible": "HERMES_SECRET_CANARY" in os.environ,
                "pid": os.getpid(),
            }
        )

    @server.tool()
    def fails() -> str:
        """Always answer with a tool error result."""
        raise ToolError("this tool always fails")

    return server


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--http", type=int, metavar="PORT", help="serve streamable HTTP on 127.0.0.1:PORT")
    parser.add_argument("--tag", default="", help="reported by the whoami tool")
    options = parser.parse_args()
    server = build_server(options.tag)
    if options.http is not None:
        server.run("streamable-http", host="127.0.0.1", port=options.http)
    else:
        server.run()


if __name__ == "__main__":
    main()
