"""One way for a fake to listen: an aiohttp app on 127.0.0.1, on a free port."""

from __future__ import annotations

from typing import Any

from aiohttp import web


async def serve_on_loopback(app: web.Application, **runner: Any) -> tuple[web.AppRunner, int]:
    """Start `app` on 127.0.0.1 at a port the OS picks: (the runner to clean up, the port)."""
    started = web.AppRunner(app, access_log=None, **runner)
    await started.setup()
    site = web.TCPSite(started, "127.0.0.1", 0)
    await site.start()
    return started, site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
