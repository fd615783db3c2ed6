"""web_search: a search engine's results (title, URL, snippet) for the model.

Three providers: a SearXNG instance (`GET /search?format=json`), Brave Search's API and
Tavily's. The endpoint is the operator's choice (config), not the model's, so it is not
put through web_fetch's SSRF guard: a SearXNG on the LAN is the normal case. The API key
comes from the caller (read from the environment) and only ever goes into its one request
header: never into a URL, a log line or an error message.
"""

from __future__ import annotations

import asyncio
import html
import json
import logging
import re
from dataclasses import dataclass, field
from typing import Any, Literal

import aiohttp
from yarl import URL

from agent.web import WebError, tool_json

__all__ = ["WEB_SEARCH_TOOL", "SearchHit", "SearchSettings", "WebSearch", "web_search_call"]

log = logging.getLogger("hermes.web_search")

Provider = Literal["searxng", "brave", "tavily"]

MAX_LIMIT = 10  # the schema's bound on `limit`
_SNIPPET_CHARS = 500
_OFFICIAL = {"brave": "https://api.search.brave.com", "tavily": "https://api.tavily.com"}
_PATHS = {"searxng": "/search", "brave": "/res/v1/web/search", "tavily": "/search"}
_NAMES = {"searxng": "SearXNG", "brave": "Brave", "tavily": "Tavily"}

WEB_SEARCH_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "web_search",
        "description": (
            "Search the web: titles, URLs and short snippets of the top results. Use web_fetch on a "
            "result to read the page itself. Cite the URLs you used."
        ),
        "parameters": {
            "type": "object",
            "properties": {
                "query": {"type": "string"},
                "limit": {"type": "integer", "minimum": 1, "maximum": MAX_LIMIT},
            },
            "required": ["query"],
        },
    },
}


@dataclass(frozen=True)
class SearchSettings:
    """One search provider; `base_url` is required for searxng and replaces the official
    endpoint's root for brave/tavily; `api_key` is required for brave/tavily."""

    provider: Provider
    base_url: str | None = None
    api_key: str | None = field(default=None, repr=False)  # kept out of any log line that prints the settings
    max_results: int = 5  # when the model gives no limit
    timeout_s: float = 15.0


@dataclass(frozen=True)
class SearchHit:
    title: str
    url: str
    snippet: str


class WebSearch:
    """Searches one provider; one instance is shared by every tenant (it keeps no cookies)."""

    def __init__(self, settings: SearchSettings) -> None:
        if settings.provider not in _PATHS:
            raise ValueError(f"unknown search provider {settings.provider!r}")
        if settings.provider == "searxng" and not settings.base_url:
            raise ValueError("the searxng provider needs a base_url")
        if settings.provider in ("brave", "tavily") and not settings.api_key:
            raise ValueError(f"the {settings.provider} provider needs an API key")
        self.settings = settings
        base = (settings.base_url or _OFFICIAL[settings.provider]).rstrip("/")
        self._endpoint = URL(base + _PATHS[settings.provider])
        self._name = _NAMES[settings.provider]
        self._session: aiohttp.ClientSession | None = None

    async def search(self, query: str, limit: int | None = None) -> list[SearchHit]:
        """The top results for `query`, at most `limit` (default `max_results`, never over 10)."""
        n = max(1, min(self.settings.max_results if limit is None else limit, MAX_LIMIT))
        try:
            async with asyncio.timeout(self.settings.timeout_s):
                body = await self._request(query, n)
        except TimeoutError:
            raise self._error(f"the {self._name} search did not answer within {self.settings.timeout_s:g} s") from None
        hits = self._hits(body)[:n]
        log.info("web_search via %s (%s): %d results", self._name, self._endpoint.host, len(hits))
        return hits

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _session_now(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                cookie_jar=aiohttp.DummyCookieJar(),
                # the operator's endpoint in the operator's environment: HTTP(S)_PROXY applies,
                # as it does to the LLM endpoint (agent/http_pool.py)
                trust_env=True,
                headers={"Accept": "application/json"},
                timeout=aiohttp.ClientTimeout(total=self.settings.timeout_s),
            )
        return self._session

    async def _request(self, query: str, n: int) -> Any:
        session = self._session_now()
        provider, key = self.settings.provider, self.settings.api_key or ""
        try:
            if provider == "searxng":
                request = session.get(self._endpoint, params={"q": query, "format": "json"})
            elif provider == "brave":
                request = session.get(
                    self._endpoint, params={"q": query, "count": str(n)}, headers={"X-Subscription-Token": key}
                )
            else:
                request = session.post(
                    self._endpoint, json={"query": query, "max_results": n}, headers={"Authorization": f"Bearer {key}"}
                )
            async with request as resp:
                if resp.status >= 400:
                    # the body is never quoted: a server may echo the key back in it
                    raise self._error(self._status_message(resp.status))
                data = await resp.read()
        except TimeoutError:
            raise  # aiohttp's own timeouts are ClientErrors too: reported as a timeout by search()
        except aiohttp.ClientError as err:
            log.warning("web_search via %s (%s) failed: %s", self._name, self._endpoint.host, type(err).__name__)
            raise self._error(f"the {self._name} search could not be reached ({type(err).__name__})") from None
        try:
            return json.loads(data)
        except (ValueError, UnicodeDecodeError):
            raise self._error(f"the {self._name} search sent an answer that is not JSON") from None

    def _status_message(self, status: int) -> str:
        log.warning("web_search via %s (%s) answered HTTP %d", self._name, self._endpoint.host, status)
        if self.settings.provider == "searxng" and status == 403:
            return "the SearXNG instance refused JSON results (HTTP 403): the operator must enable the json format"
        if status in (401, 403):
            return (
                f"the {self._name} search rejected the request (HTTP {status}): the operator should check its API key"
            )
        if status == 429:
            return f"the {self._name} search is rate limited right now (HTTP 429)"
        return f"the {self._name} search answered HTTP {status}"

    def _hits(self, body: Any) -> list[SearchHit]:
        if self.settings.provider == "brave":
            web = body.get("web") if isinstance(body, dict) else None
            # Brave leaves `web` out when nothing was found
            items, snippet_key = (web.get("results") if isinstance(web, dict) else []), "description"
        else:
            items, snippet_key = (body.get("results") if isinstance(body, dict) else None), "content"
        if not isinstance(items, list):
            raise self._error(f"the {self._name} search sent an answer without results")
        hits = []
        for item in items:
            if not isinstance(item, dict):
                continue
            url = item.get("url")
            if not isinstance(url, str) or not url.startswith(("http://", "https://")):
                continue
            title = _plain(item.get("title")) or url
            hits.append(SearchHit(title, url, _plain(item.get(snippet_key))[:_SNIPPET_CHARS]))
        return hits

    def _error(self, message: str) -> WebError:
        key = self.settings.api_key
        # every message is built from our own words; this only guards against a future slip
        return WebError(message.replace(key, "***") if key else message)


def _plain(value: object) -> str:
    """A snippet or title as plain text: Brave marks matches with <strong>, entities escaped."""
    if not isinstance(value, str):
        return ""
    return " ".join(html.unescape(re.sub(r"<[^>]{0,200}>", "", value)).split())


async def web_search_call(search: WebSearch, args: dict[str, Any]) -> str:
    """Run one web_search tool call: the JSON result for the model; never raises."""
    query = args.get("query")
    if not isinstance(query, str) or not query.strip():
        return tool_json({"success": False, "error": "query must be a non-empty string"})
    limit = args.get("limit")
    if not isinstance(limit, int) or isinstance(limit, bool):
        limit = None
    try:
        hits = await search.search(query.strip(), limit)
    except WebError as err:
        return tool_json({"success": False, "error": str(err)})
    except Exception as err:
        log.warning("web_search failed unexpectedly (%s)", type(err).__name__)
        log.debug("web_search failure", exc_info=True)
        return tool_json({"success": False, "error": "the search failed (an internal error)"})
    results = [{"title": h.title, "url": h.url, "snippet": h.snippet} for h in hits]
    return tool_json({"success": True, "results": results})
