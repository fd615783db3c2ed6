"""Fake web servers for the web tools: real aiohttp servers on 127.0.0.1, and a static resolver.

    async with PageServer() as pages:
        resolver = StaticResolver({"pages.test": ["127.0.0.1"]})
        fetcher = WebFetcher(WebPolicy(allow_hosts=frozenset({"pages.test"})), resolver=resolver)
        await fetcher.fetch(pages.url("/page", host="pages.test"))
        assert pages.paths() == ["/page"]

`PageServer` serves an HTML page, a PDF, text in Latin-1, JSON, long text, an endless body
(`/huge`, counting what it sent in `huge_sent` and setting `huge_done` when the client went
away), a slow answer (`/slow?s=`), a redirect chain (`/hop/<n>?s=`, each hop waiting `s`
seconds), a redirect to any URL (`/to?url=`), a 404, a PNG, a cookie setter and `/echo` (the
request's headers as JSON). Every request is recorded as {"path", "query", "headers"}.

`FakeSearchAPI` answers as SearXNG (`GET /search`), Brave (`GET /res/v1/web/search`, key in
`X-Subscription-Token`) and Tavily (`POST /search`, `Authorization: Bearer`), checks the
query and the key, and records {"provider", "method", "url", "headers", "json"}. A wrong key
is a 401 whose body quotes the key it got, as does a `fail_next` error: the client must never
pass a body on. `malformed_next()` answers 200 with something that is not JSON.
"""

from __future__ import annotations

import asyncio
import json
import socket
from typing import Any

from aiohttp import web

from tests.fakes.serve import serve_on_loopback
from tests.media_files import pdf, png

PAGE_HTML = """<!doctype html>
<html><head>
<title>  The Hermes   Field Guide </title>
<style>body { color: hotpink; } .tracker { display: none }</style>
<script>window.trackingSecret = "do-not-read-me";</script>
</head><body>
<h1>Field Guide</h1>
<p>Hermes carries messages between <a href="/people">people</a> and the
<a href="https://example.org/agent">agent</a>.</p>
<img src="/banner.png" alt="a banner image">
<script>console.log("script in the body");</script>
<ul><li>first point</li><li>second point</li></ul>
</body></html>
"""

PDF_LINES = ("Quarterly report", "Revenue grew by twelve percent")
PLAIN_LATIN1 = "Café crème, déjà vu, naïve façade"
LONG_TEXT_CHARS = 50_000


class PageServer:
    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.huge_sent = 0
        self.huge_done = asyncio.Event()
        self._closing = asyncio.Event()
        self._runner: web.AppRunner | None = None
        self.port = 0

    def url(self, path: str, *, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}{path}"

    def paths(self) -> list[str]:
        return [r["path"] for r in self.requests]

    async def start(self) -> PageServer:
        app = web.Application(middlewares=[self._record])
        routes = {
            "/page": self._page,
            "/doc.pdf": self._pdf,
            "/plain": self._plain,
            "/data.json": self._json,
            "/long": self._long,
            "/huge": self._huge,
            "/slow": self._slow,
            "/hop/{n}": self._hop,
            "/to": self._to,
            "/missing": self._missing,
            "/image.png": self._png,
            "/set-cookie": self._set_cookie,
            "/echo": self._echo,
        }
        for path, handler in routes.items():
            app.router.add_get(path, handler)
        self._runner, self.port = await serve_on_loopback(app)
        return self

    async def stop(self) -> None:
        self._closing.set()  # ends /slow and /huge handlers still running
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> PageServer:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    @web.middleware
    async def _record(self, request: web.Request, handler: Any) -> web.StreamResponse:
        self.requests.append({"path": request.path, "query": dict(request.query), "headers": dict(request.headers)})
        return await handler(request)

    async def _wait(self, seconds: float) -> None:
        try:
            await asyncio.wait_for(self._closing.wait(), seconds)
        except TimeoutError:
            pass

    async def _page(self, request: web.Request) -> web.Response:
        return web.Response(text=PAGE_HTML, content_type="text/html", charset="utf-8")

    async def _pdf(self, request: web.Request) -> web.Response:
        return web.Response(body=pdf(*PDF_LINES), content_type="application/pdf")

    async def _plain(self, request: web.Request) -> web.Response:
        return web.Response(
            body=PLAIN_LATIN1.encode("latin-1"), headers={"Content-Type": "text/plain; charset=ISO-8859-1"}
        )

    async def _json(self, request: web.Request) -> web.Response:
        return web.json_response({"name": "hermes", "tools": ["web_fetch", "web_search"]})

    async def _long(self, request: web.Request) -> web.Response:
        return web.Response(text="word " * (LONG_TEXT_CHARS // 5), content_type="text/plain")

    async def _huge(self, request: web.Request) -> web.StreamResponse:
        """An endless body: a client that reads it all never finishes."""
        resp = web.StreamResponse(headers={"Content-Type": "text/plain"})
        await resp.prepare(request)
        chunk = b"x" * 65536
        try:
            while not self._closing.is_set():
                await resp.write(chunk)
                self.huge_sent += len(chunk)
        except (ConnectionError, OSError):
            pass
        finally:
            self.huge_done.set()
        return resp

    async def _slow(self, request: web.Request) -> web.Response:
        await self._wait(float(request.query.get("s", "30")))
        return web.Response(text="finally", content_type="text/plain")

    async def _hop(self, request: web.Request) -> web.Response:
        n = int(request.match_info["n"])
        await self._wait(float(request.query.get("s", "0")))
        if n <= 0:
            return web.Response(text=PAGE_HTML, content_type="text/html")
        query = f"?{request.query_string}" if request.query_string else ""
        return web.Response(status=302, headers={"Location": f"/hop/{n - 1}{query}"})  # a relative Location

    async def _to(self, request: web.Request) -> web.Response:
        return web.Response(status=302, headers={"Location": request.query["url"]})

    async def _missing(self, request: web.Request) -> web.Response:
        return web.Response(status=404, text="no such page", content_type="text/plain")

    async def _png(self, request: web.Request) -> web.Response:
        return web.Response(body=png(), content_type="image/png")

    async def _set_cookie(self, request: web.Request) -> web.Response:
        resp = web.Response(text="<title>cookie</title><p>a cookie was set</p>", content_type="text/html")
        resp.set_cookie("session", "tenant-a-secret", max_age=3600)
        return resp

    async def _echo(self, request: web.Request) -> web.Response:
        return web.json_response(dict(request.headers))


class StaticResolver:
    """A `Resolver` over a fixed map (name -> addresses); other names fail as DNS would.
    Records every lookup as (host, port)."""

    def __init__(self, answers: dict[str, list[str]]) -> None:
        self.answers = answers
        self.lookups: list[tuple[str, int]] = []

    async def resolve(self, host: str, port: int) -> list[str]:
        self.lookups.append((host, port))
        if host not in self.answers:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return list(self.answers[host])


def closed_port() -> int:
    """A port on 127.0.0.1 that nothing listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


SEARCH_RESULTS: list[dict[str, str]] = [
    {"title": "Hermes &amp; friends", "url": "https://one.example/a", "snippet": "The <strong>first</strong> result"},
    {"title": "Second", "url": "https://two.example/b", "snippet": "Another one"},
    {"title": "Third", "url": "https://three.example/c", "snippet": "And a third"},
    {"title": "Fourth", "url": "https://four.example/d", "snippet": "Fourth"},
]


class FakeSearchAPI:
    def __init__(self, *, api_key: str) -> None:
        self.api_key = api_key
        self.results = list(SEARCH_RESULTS)
        self.requests: list[dict[str, Any]] = []
        self.delay_s = 0.0  # every answer waits this long (a timeout test)
        self.searxng_json = True  # False: the SearXNG answers json as its default settings do (403)
        self._fail: list[int] = []
        self._malformed = 0
        self._closing = asyncio.Event()
        self._runner: web.AppRunner | None = None
        self.port = 0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def fail_next(self, status: int = 500) -> None:
        self._fail.append(status)

    def malformed_next(self) -> None:
        self._malformed += 1

    async def start(self) -> FakeSearchAPI:
        app = web.Application()
        app.router.add_get("/search", self._searxng)
        app.router.add_post("/search", self._tavily)
        app.router.add_get("/res/v1/web/search", self._brave)
        self._runner, self.port = await serve_on_loopback(app)
        return self

    async def stop(self) -> None:
        self._closing.set()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> FakeSearchAPI:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def _record(self, provider: str, request: web.Request) -> dict[str, Any]:
        body = await request.text()
        record = {
            "provider": provider,
            "method": request.method,
            "url": str(request.rel_url),
            "query": dict(request.query),
            "headers": dict(request.headers),
            "body": body,
            "json": json.loads(body) if body else None,
        }
        self.requests.append(record)
        if self.delay_s:
            try:
                await asyncio.wait_for(self._closing.wait(), self.delay_s)
            except TimeoutError:
                pass
        return record

    def _canned(self, key_seen: str) -> web.Response | None:
        """The scripted failure, if one is due; its body quotes the key it was sent."""
        if self._fail:
            return web.json_response({"error": f"server trouble for key {key_seen}"}, status=self._fail.pop(0))
        if self._malformed:
            self._malformed -= 1
            return web.Response(text=f"<html>oops {key_seen}", content_type="application/json")
        return None

    async def _searxng(self, request: web.Request) -> web.Response:
        await self._record("searxng", request)
        if request.query.get("format") != "json" or not self.searxng_json:
            return web.Response(status=403, text="Forbidden")
        if not request.query.get("q"):
            return web.json_response({"error": "no query"}, status=400)
        canned = self._canned("")
        if canned is not None:
            return canned
        results = [{"title": r["title"], "url": r["url"], "content": r["snippet"]} for r in self.results]
        return web.json_response({"query": request.query["q"], "results": results})

    async def _brave(self, request: web.Request) -> web.Response:
        await self._record("brave", request)
        token = request.headers.get("X-Subscription-Token", "")
        if token != self.api_key:
            return web.json_response({"error": {"detail": f"invalid subscription token {token}"}}, status=401)
        if not request.query.get("q"):
            return web.json_response({"error": "no query"}, status=422)
        canned = self._canned(token)
        if canned is not None:
            return canned
        count = int(request.query.get("count", "20"))
        results = [{"title": r["title"], "url": r["url"], "description": r["snippet"]} for r in self.results[:count]]
        return web.json_response({"type": "search", "web": {"type": "search", "results": results}})

    async def _tavily(self, request: web.Request) -> web.Response:
        record = await self._record("tavily", request)
        auth = request.headers.get("Authorization", "")
        if auth != f"Bearer {self.api_key}":
            return web.json_response({"detail": {"error": f"Unauthorized: invalid API key {auth}"}}, status=401)
        body = record["json"] or {}
        if not isinstance(body.get("query"), str) or not body["query"]:
            return web.json_response({"detail": {"error": "query is required"}}, status=400)
        canned = self._canned(auth)
        if canned is not None:
            return canned
        count = int(body.get("max_results", 5))
        results = [
            {"title": r["title"], "url": r["url"], "content": r["snippet"], "score": 0.9} for r in self.results[:count]
        ]
        return web.json_response({"query": body["query"], "results": results, "response_time": 0.1})
