"""The web tools' contract: web_fetch reads public pages as text behind an SSRF guard,
web_search maps three providers' results; both answer the model with JSON and never raise.

Every server is a real one on 127.0.0.1 (tests/fakes/web.py), reached only through
`allow_hosts`; names resolve through a static map, so nothing touches real DNS or the internet.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

import pytest

from agent.web import (
    USER_AGENT,
    WEB_FETCH_TOOL,
    WebError,
    WebFetcher,
    WebPolicy,
    WebRefused,
    WebToolError,
    web_fetch_call,
)
from agent.web_search import WEB_SEARCH_TOOL, SearchHit, SearchSettings, WebSearch, web_search_call
from tests.fakes.web import (
    LONG_TEXT_CHARS,
    PDF_LINES,
    PLAIN_LATIN1,
    FakeSearchAPI,
    PageServer,
    StaticResolver,
    closed_port,
)

KEY = "sk-test-KEY-0123456789"


@pytest.fixture
async def pages():
    async with PageServer() as server:
        yield server


@pytest.fixture
async def make_fetcher():
    """WebFetcher(policy) over a static resolver where pages.test is 127.0.0.1 (allowed) and
    `names` add more; every fetcher is closed after the test."""
    made: list[WebFetcher] = []

    def build(names: dict[str, list[str]] | None = None, *, allow: set[str] | None = None, **policy):
        resolver = StaticResolver({"pages.test": ["127.0.0.1"], **(names or {})})
        allow_hosts = frozenset({"pages.test"} if allow is None else allow)
        fetcher = WebFetcher(WebPolicy(allow_hosts=allow_hosts, **policy), resolver=resolver)
        fetcher.test_resolver = resolver  # type: ignore[attr-defined]
        made.append(fetcher)
        return fetcher

    yield build
    for fetcher in made:
        await fetcher.aclose()


def page_url(pages: PageServer, path: str, host: str = "pages.test") -> str:
    return pages.url(path, host=host)


# --------------------------------------------------------------------------- reading pages


async def test_a_page_is_fetched_as_readable_text_with_its_title(pages, make_fetcher):
    page = await make_fetcher().fetch(page_url(pages, "/page"))

    assert page.title == "The Hermes Field Guide"
    assert page.content_type == "text/html"
    assert page.url == page_url(pages, "/page")
    assert "# Field Guide" in page.text
    assert "first point" in page.text and "second point" in page.text
    # links kept as Markdown, relative ones made absolute against the page's URL
    assert f"[people]({page_url(pages, '/people')})" in page.text
    assert "[agent](https://example.org/agent)" in page.text
    # images, scripts and styles are gone
    assert "banner" not in page.text and "![" not in page.text
    assert "trackingSecret" not in page.text and "script in the body" not in page.text
    assert "hotpink" not in page.text
    assert page.truncated is False


async def test_a_pdf_is_read_as_text(pages, make_fetcher):
    page = await make_fetcher().fetch(page_url(pages, "/doc.pdf"))

    assert page.content_type == "application/pdf"
    for line in PDF_LINES:
        assert line in page.text
    assert page.truncated is False


async def test_plain_text_is_decoded_with_its_declared_charset(pages, make_fetcher):
    fetcher = make_fetcher()
    page = await fetcher.fetch(page_url(pages, "/plain"))
    assert page.text == PLAIN_LATIN1  # as UTF-8 the Latin-1 bytes would be replacement characters

    data = await fetcher.fetch(page_url(pages, "/data.json"))
    assert data.content_type == "application/json"
    assert json.loads(data.text) == {"name": "hermes", "tools": ["web_fetch", "web_search"]}


async def test_long_text_is_cut_at_max_chars_with_the_truncated_flag(pages, make_fetcher):
    fetcher = make_fetcher(max_chars=1000)
    page = await fetcher.fetch(page_url(pages, "/long"))
    assert len(page.text) == 1000 and page.truncated is True

    result = json.loads(await web_fetch_call(fetcher, {"url": page_url(pages, "/long")}))
    assert result["success"] is True and result["truncated"] is True and len(result["content"]) == 1000

    whole = await make_fetcher(max_chars=LONG_TEXT_CHARS).fetch(page_url(pages, "/long"))
    assert whole.truncated is False


async def test_an_unsupported_type_is_a_clear_tool_error(pages, make_fetcher):
    fetcher = make_fetcher()
    with pytest.raises(WebError, match="image/png"):
        await fetcher.fetch(page_url(pages, "/image.png"))

    result = json.loads(await web_fetch_call(fetcher, {"url": page_url(pages, "/image.png")}))
    assert result["success"] is False
    assert "image/png" in result["error"] and "HTML, PDF and text" in result["error"]


async def test_an_http_error_status_is_reported_with_its_status(pages, make_fetcher):
    with pytest.raises(WebError, match="HTTP 404"):
        await make_fetcher().fetch(page_url(pages, "/missing"))


# --------------------------------------------------------------------------- the SSRF guard

BAD_ADDRESSES = [
    ("127.0.0.1", "a loopback address"),
    ("10.0.0.1", "a private address"),
    ("172.16.5.4", "a private address"),
    ("192.168.1.1", "a private address"),
    ("169.254.169.254", "a cloud metadata address"),
    ("169.254.10.10", "a link-local address"),
    ("100.100.100.200", "a cloud metadata address"),
    ("100.64.0.1", "a shared (CGNAT) address"),
    ("0.0.0.0", "an unspecified address"),
    ("224.0.0.1", "a multicast address"),
    ("240.0.0.1", "a reserved address"),
    ("::1", "a loopback address"),
    ("::", "an unspecified address"),
    ("fe80::1", "a link-local address"),
    ("fd12:3456::1", "a private address"),
    ("fd00:ec2::254", "a cloud metadata address"),
    ("ff02::1", "a multicast address"),
    ("::ffff:127.0.0.1", "a loopback address (as 127.0.0.1)"),
    ("::ffff:169.254.169.254", "a cloud metadata address (as 169.254.169.254)"),
    ("2002:0a00:0001::1", "a private address (as 10.0.0.1)"),  # 6to4
    ("64:ff9b::7f00:1", "a loopback address (as 127.0.0.1)"),  # NAT64
]


@pytest.mark.parametrize(("address", "reason"), BAD_ADDRESSES)
async def test_a_name_resolving_to_a_private_address_is_refused(pages, make_fetcher, address, reason):
    fetcher = make_fetcher({"evil.test": [address]})

    with pytest.raises(WebRefused) as refused:
        await fetcher.fetch(page_url(pages, "/page", host="evil.test"))

    assert str(refused.value) == f"refused: evil.test resolves to {address}, {reason}"
    assert pages.requests == []


async def test_a_name_is_refused_when_any_of_its_addresses_is_bad(make_fetcher):
    fetcher = make_fetcher(
        {"mixed.test": ["93.184.215.14", "10.0.0.1"], "public.test": ["93.184.215.14", "2606:4700::1111"]}
    )

    with pytest.raises(WebRefused, match=r"mixed\.test resolves to 10\.0\.0\.1, a private address"):
        await fetcher.checked_addresses("mixed.test", 443)
    # public answers pass, exactly as resolved: these are the addresses the connection may use
    assert await fetcher.checked_addresses("public.test", 443) == ["93.184.215.14", "2606:4700::1111"]


@pytest.mark.parametrize(
    ("host", "reason"),
    [
        ("127.0.0.1", "a loopback address"),
        ("[::ffff:7f00:1]", "a loopback address (as 127.0.0.1)"),
        ("2130706433", "not an IP address"),
    ],
)
async def test_an_ip_address_in_the_url_is_checked_too(pages, make_fetcher, host, reason):
    with pytest.raises(WebRefused, match="refused: .* is " + reason.replace("(", r"\(").replace(")", r"\)")):
        await make_fetcher().fetch(page_url(pages, "/page", host=host))
    assert pages.requests == []


async def test_the_system_resolver_is_the_default_and_its_answer_is_checked(pages):
    # localhost comes from /etc/hosts: the system resolver, and no network
    refused = WebFetcher(WebPolicy())
    allowed = WebFetcher(WebPolicy(allow_hosts=frozenset({"localhost"})))
    try:
        with pytest.raises(WebRefused, match=r"refused: localhost resolves to (127\.0\.0\.1|::1), a loopback address"):
            await refused.fetch(page_url(pages, "/page", host="localhost"))
        assert pages.requests == []
        assert (await allowed.fetch(page_url(pages, "/page", host="localhost"))).title == "The Hermes Field Guide"
    finally:
        await refused.aclose()
        await allowed.aclose()


async def test_the_connection_goes_to_the_address_that_was_checked(pages, make_fetcher):
    # pages.test exists only in the test's resolver: the fetch can only succeed by connecting
    # to the answer that resolver gave, and it is asked once (no second lookup to rebind)
    fetcher = make_fetcher()
    page = await fetcher.fetch(page_url(pages, "/page"))

    assert page.title == "The Hermes Field Guide"
    assert fetcher.test_resolver.lookups == [("pages.test", pages.port)]


@pytest.mark.parametrize("address", ["127.0.0.1", "10.0.0.1", "169.254.169.254"])
async def test_a_redirect_to_a_private_address_is_refused_after_the_redirect_is_resolved(pages, make_fetcher, address):
    fetcher = make_fetcher({"internal.test": [address]})
    target = page_url(pages, "/page", host="internal.test")

    with pytest.raises(WebRefused, match=rf"refused: internal\.test resolves to {address}"):
        await fetcher.fetch(page_url(pages, f"/to?url={target}"))

    assert pages.paths() == ["/to"]  # the allowed first hop was fetched, the second never
    assert [host for host, _ in fetcher.test_resolver.lookups] == ["pages.test", "internal.test"]


async def test_a_redirect_to_something_that_is_not_a_url_is_an_error(pages, make_fetcher):
    with pytest.raises(WebError, match="redirected to something that is not a URL"):
        await make_fetcher().fetch(page_url(pages, "/to?url=http://pages.test:99999/page"))


@pytest.mark.parametrize("target", ["file:///etc/passwd", "http://user:secret@pages.test/page"])
async def test_a_redirect_to_a_url_the_guard_refuses_is_refused(pages, make_fetcher, target):
    with pytest.raises(WebRefused):
        await make_fetcher().fetch(page_url(pages, f"/to?url={target}"))
    assert pages.paths() == ["/to"]


async def test_allow_hosts_with_a_port_allows_only_that_port(pages, make_fetcher):
    async with PageServer() as other:
        by_ip = make_fetcher(allow={f"127.0.0.1:{pages.port}"})
        assert (await by_ip.fetch(pages.url("/page"))).title == "The Hermes Field Guide"
        with pytest.raises(WebRefused, match=r"127\.0\.0\.1 is a loopback address"):
            await by_ip.fetch(other.url("/page"))

        by_name = make_fetcher(allow={f"pages.test:{pages.port}"})
        assert (await by_name.fetch(page_url(pages, "/page"))).title == "The Hermes Field Guide"
        with pytest.raises(WebRefused, match=r"pages\.test resolves to 127\.0\.0\.1"):
            await by_name.fetch(page_url(other, "/page"))
        assert other.requests == []


async def test_allow_hosts_without_a_port_allows_every_port(pages, make_fetcher):
    async with PageServer() as other:
        fetcher = make_fetcher(allow={"pages.test"})
        await fetcher.fetch(page_url(pages, "/page"))
        await fetcher.fetch(page_url(other, "/page"))
        assert other.paths() == ["/page"]


# --------------------------------------------------------------------------- redirects, caps


async def test_a_redirect_chain_is_followed_to_its_final_url(pages, make_fetcher):
    page = await make_fetcher().fetch(page_url(pages, "/hop/3"))

    assert page.url == page_url(pages, "/hop/0")
    assert page.title == "The Hermes Field Guide"
    assert pages.paths() == ["/hop/3", "/hop/2", "/hop/1", "/hop/0"]


async def test_more_redirects_than_allowed_is_an_error(pages, make_fetcher):
    fetcher = make_fetcher(max_redirects=2)
    assert (await fetcher.fetch(page_url(pages, "/hop/2"))).url.endswith("/hop/0")

    with pytest.raises(WebError, match="more than 2 redirects"):
        await fetcher.fetch(page_url(pages, "/hop/3"))


async def test_the_size_cap_cuts_a_huge_body_without_reading_it_all(pages, make_fetcher):
    # /huge never ends: a fetcher that read it all would run into the time cap instead
    fetcher = make_fetcher(max_bytes=100_000, max_chars=1_000_000, timeout_s=10)
    page = await fetcher.fetch(page_url(pages, "/huge"))

    assert page.truncated is True
    assert len(page.text) == 100_000 and set(page.text) == {"x"}
    # the connection was dropped: the server stops soon after, having sent a few buffers' worth
    await asyncio.wait_for(pages.huge_done.wait(), 5)
    assert pages.huge_sent < 32 * 1024 * 1024


async def test_a_pdf_bigger_than_the_size_cap_is_an_error(pages, make_fetcher):
    with pytest.raises(WebError, match="the PDF is too big"):
        await make_fetcher(max_bytes=200).fetch(page_url(pages, "/doc.pdf"))


async def test_the_time_cap_ends_a_slow_fetch(pages, make_fetcher):
    started = time.monotonic()
    with pytest.raises(WebError, match=r"pages\.test did not answer within 0\.5 s"):
        await make_fetcher(timeout_s=0.5).fetch(page_url(pages, "/slow?s=30"))
    assert time.monotonic() - started < 3


async def test_the_time_cap_covers_all_redirect_hops_together(pages, make_fetcher):
    # each hop (0.4 s) is well inside the cap; four of them are not
    with pytest.raises(WebError, match="did not answer within 1 s"):
        await make_fetcher(timeout_s=1.0).fetch(page_url(pages, "/hop/4?s=0.4"))


# --------------------------------------------------------------------------- nothing carried over


async def test_no_cookie_carries_from_one_fetch_to_the_next(pages, make_fetcher):
    fetcher = make_fetcher()
    await fetcher.fetch(page_url(pages, "/set-cookie"))
    echoed = json.loads((await fetcher.fetch(page_url(pages, "/echo"))).text)

    assert "Cookie" not in echoed
    assert all("Cookie" not in r["headers"] for r in pages.requests)


async def test_a_fetch_sends_its_own_user_agent_and_nothing_from_the_environment(
    pages, make_fetcher, monkeypatch, tmp_path
):
    # a proxy that is not there and a .netrc with credentials: a fetcher that trusted the
    # environment would fail on the proxy or send the password
    netrc = tmp_path / "netrc"
    netrc.write_text("machine pages.test login someone password hunter2\n")
    netrc.chmod(0o600)
    monkeypatch.setenv("NETRC", str(netrc))
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.setenv(name, f"http://127.0.0.1:{closed_port()}")
    for name in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)

    echoed = json.loads((await make_fetcher().fetch(page_url(pages, "/echo"))).text)

    assert echoed["User-Agent"] == USER_AGENT
    assert "Authorization" not in echoed and "Proxy-Authorization" not in echoed


async def test_the_session_is_made_on_the_first_fetch_and_again_after_aclose(pages, make_fetcher):
    fetcher = make_fetcher()  # built outside any request: no session (and no loop needed) yet
    assert fetcher._session is None
    await fetcher.fetch(page_url(pages, "/page"))
    first = fetcher._session
    await fetcher.fetch(page_url(pages, "/plain"))
    assert fetcher._session is first

    await fetcher.aclose()
    assert first is not None and first.closed
    assert (await fetcher.fetch(page_url(pages, "/page"))).title


# --------------------------------------------------------------------------- the tool call


def test_the_fetch_tool_schema_asks_for_one_url_and_a_citation():
    function = WEB_FETCH_TOOL["function"]
    assert function["name"] == "web_fetch"
    assert function["parameters"]["required"] == ["url"]
    assert function["parameters"]["properties"]["url"]["type"] == "string"
    assert "cite the url" in function["description"].lower()


async def test_a_successful_tool_call_answers_with_url_title_and_content(pages, make_fetcher):
    result = json.loads(await web_fetch_call(make_fetcher(), {"url": page_url(pages, "/hop/1")}))

    assert result == {
        "success": True,
        "url": page_url(pages, "/hop/0"),
        "title": "The Hermes Field Guide",
        "content": result["content"],
        "truncated": False,
    }
    assert "# Field Guide" in result["content"]


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        (None, "url must be a non-empty string"),
        (42, "url must be a non-empty string"),
        ("   ", "url must be a non-empty string"),
        ("file:///etc/passwd", "only http:// and https:// URLs are fetched, not file:"),
        ("ftp://pages.test/x", "only http:// and https:// URLs are fetched, not ftp:"),
        ("pages.test/page", "not a URL without a scheme"),
        ("http://user:pw@pages.test:{port}/page", "URLs with a user name or password are not fetched"),
        ("http://evil.test:{port}/page", "refused: evil.test resolves to 127.0.0.1, a loopback address"),
        ("http://nowhere.test/", "nowhere.test could not be resolved"),
        ("http://127.0.0.1:{closed}/", "could not connect to 127.0.0.1"),
        ("http://pages.test:{port}/missing", "pages.test answered HTTP 404"),
    ],
)
async def test_the_tool_call_never_raises_and_says_why(pages, make_fetcher, url, expected):
    closed = closed_port()
    fetcher = make_fetcher({"evil.test": ["127.0.0.1"]}, allow={"pages.test", f"127.0.0.1:{closed}"})
    args = {} if url is None else {"url": url.format(port=pages.port, closed=closed) if isinstance(url, str) else url}

    result = json.loads(await web_fetch_call(fetcher, args))

    assert result["success"] is False
    assert expected in result["error"]


class _BrokenResolver:
    async def resolve(self, host: str, port: int) -> list[str]:
        raise RuntimeError("resolver bug while looking up ?token=hunter2")


async def test_an_unexpected_failure_is_a_generic_tool_error_and_is_logged(caplog):
    fetcher = WebFetcher(WebPolicy(), resolver=_BrokenResolver())
    caplog.set_level(logging.INFO, logger="hermes.web")
    try:
        result = json.loads(await web_fetch_call(fetcher, {"url": "http://broken.test/p?token=hunter2"}))
    finally:
        await fetcher.aclose()

    assert result == {"success": False, "error": "the page could not be fetched (an internal error)"}
    logged = [r for r in caplog.records if r.levelno >= logging.INFO]
    assert any("broken.test" in r.getMessage() and "RuntimeError" in r.getMessage() for r in logged)
    assert not any("hunter2" in r.getMessage() for r in logged)


async def test_logs_name_the_host_but_never_the_query_string(pages, make_fetcher, caplog):
    caplog.set_level(logging.INFO, logger="hermes.web")
    fetcher = make_fetcher({"evil.test": ["10.0.0.1"]})
    await fetcher.fetch(page_url(pages, "/page?token=s3cr3t"))
    await fetcher.fetch(page_url(pages, "/hop/1?s=0&token=s3cr3t"))
    await web_fetch_call(fetcher, {"url": page_url(pages, "/page?token=s3cr3t", host="evil.test")})

    messages = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
    assert any("pages.test" in m for m in messages) and any("evil.test" in m for m in messages)
    assert not any("s3cr3t" in m or "token=" in m for m in messages)


def test_both_errors_are_web_tool_errors():
    assert issubclass(WebRefused, WebToolError) and issubclass(WebError, WebToolError)
    assert not issubclass(WebRefused, WebError)


# --------------------------------------------------------------------------- web search


@pytest.fixture
async def search_api():
    async with FakeSearchAPI(api_key=KEY) as api:
        yield api


@pytest.fixture
async def make_search():
    made: list[WebSearch] = []

    def build(**settings) -> WebSearch:
        search = WebSearch(SearchSettings(**settings))
        made.append(search)
        return search

    yield build
    for search in made:
        await search.aclose()


EXPECTED_HITS = [
    SearchHit("Hermes & friends", "https://one.example/a", "The first result"),
    SearchHit("Second", "https://two.example/b", "Another one"),
    SearchHit("Third", "https://three.example/c", "And a third"),
    SearchHit("Fourth", "https://four.example/d", "Fourth"),
]


async def test_searxng_is_asked_for_json_results_and_they_are_mapped(search_api, make_search):
    search = make_search(provider="searxng", base_url=search_api.base_url + "/")

    hits = await search.search("hermes gateway", limit=3)

    assert hits == EXPECTED_HITS[:3]
    (request,) = search_api.requests
    assert request["method"] == "GET" and request["query"] == {"q": "hermes gateway", "format": "json"}


async def test_brave_gets_the_query_and_the_key_only_in_its_header(search_api, make_search):
    search = make_search(provider="brave", base_url=search_api.base_url, api_key=KEY)

    hits = await search.search("hermes gateway", limit=3)

    assert hits == EXPECTED_HITS[:3]  # <strong> marks and entities are gone from the text
    (request,) = search_api.requests
    assert request["query"] == {"q": "hermes gateway", "count": "3"}
    assert request["headers"]["X-Subscription-Token"] == KEY
    assert "Authorization" not in request["headers"]
    assert KEY not in request["url"] and KEY not in request["body"]
    assert [name for name, value in request["headers"].items() if KEY in value] == ["X-Subscription-Token"]


async def test_tavily_gets_the_query_posted_and_the_key_as_a_bearer_token(search_api, make_search):
    search = make_search(provider="tavily", base_url=search_api.base_url, api_key=KEY)

    hits = await search.search("hermes gateway", limit=3)

    assert hits == EXPECTED_HITS[:3]
    (request,) = search_api.requests
    assert request["method"] == "POST"
    assert request["json"] == {"query": "hermes gateway", "max_results": 3}
    assert request["headers"]["Authorization"] == f"Bearer {KEY}"
    assert KEY not in request["url"] and KEY not in request["body"]
    assert [name for name, value in request["headers"].items() if KEY in value] == ["Authorization"]


async def test_the_limit_defaults_to_max_results_and_is_never_over_ten(search_api, make_search):
    search = make_search(provider="brave", base_url=search_api.base_url, api_key=KEY, max_results=2)
    assert len(await search.search("q")) == 2
    await search.search("q", limit=50)
    await search.search("q", limit=0)
    assert [r["query"]["count"] for r in search_api.requests] == ["2", "10", "1"]

    searxng = make_search(provider="searxng", base_url=search_api.base_url)
    assert len(await searxng.search("q", limit=1)) == 1  # SearXNG takes no count: cut on our side


def _fail_status(api: FakeSearchAPI) -> None:
    api.fail_next(500)


def _fail_malformed(api: FakeSearchAPI) -> None:
    api.malformed_next()


def _fail_slow(api: FakeSearchAPI) -> None:
    api.delay_s = 5


@pytest.mark.parametrize("provider", ["brave", "tavily"])
@pytest.mark.parametrize(
    ("make_trouble", "expected"),
    [
        (_fail_status, "answered HTTP 500"),
        (_fail_malformed, "not JSON"),
        (_fail_slow, "did not answer within 0.5 s"),
    ],
)
async def test_a_search_error_never_contains_the_api_key(
    search_api, make_search, caplog, provider, make_trouble, expected
):
    caplog.set_level(logging.DEBUG)
    make_trouble(search_api)  # the fake's error answers quote the key they were sent
    search = make_search(provider=provider, base_url=search_api.base_url, api_key=KEY, timeout_s=0.5)

    with pytest.raises(WebError) as failed:
        await search.search("hermes")
    make_trouble(search_api)
    result = json.loads(await web_search_call(search, {"query": "hermes"}))

    assert result["success"] is False and expected in result["error"]

    assert expected in str(failed.value)
    assert KEY not in str(failed.value) and KEY not in result["error"] and KEY not in repr(search.settings)
    assert KEY not in caplog.text


@pytest.mark.parametrize("provider", ["brave", "tavily"])
async def test_a_wrong_key_is_reported_without_either_key(search_api, make_search, provider):
    wrong = "sk-wrong-key-9876543210"
    search = make_search(provider=provider, base_url=search_api.base_url, api_key=wrong)

    result = json.loads(await web_search_call(search, {"query": "hermes"}))

    assert result["success"] is False
    assert "HTTP 401" in result["error"] and "API key" in result["error"]
    assert wrong not in result["error"] and KEY not in result["error"]


async def test_a_searxng_without_json_output_says_what_to_turn_on(search_api, make_search):
    search_api.searxng_json = False  # SearXNG's default settings.yml: html only, json is a 403
    search = make_search(provider="searxng", base_url=search_api.base_url)

    with pytest.raises(WebError, match=r"HTTP 403.*enable the json format"):
        await search.search("hermes")


async def test_the_search_tool_call_never_raises_and_says_why(search_api, make_search):
    search = make_search(provider="searxng", base_url=search_api.base_url)

    ok = json.loads(await web_search_call(search, {"query": " hermes ", "limit": "seven"}))  # a bad limit: the default
    assert ok == {
        "success": True,
        "results": [{"title": h.title, "url": h.url, "snippet": h.snippet} for h in EXPECTED_HITS],
    }
    assert search_api.requests[-1]["query"]["q"] == "hermes"

    for args in ({}, {"query": ""}, {"query": 7}):
        assert json.loads(await web_search_call(search, args)) == {
            "success": False,
            "error": "query must be a non-empty string",
        }

    search_api.fail_next(502)
    failed = json.loads(await web_search_call(search, {"query": "hermes"}))
    assert failed == {"success": False, "error": "the SearXNG search answered HTTP 502"}

    down = make_search(provider="searxng", base_url=f"http://127.0.0.1:{closed_port()}")
    unreachable = json.loads(await web_search_call(down, {"query": "hermes"}))
    assert unreachable["success"] is False and "could not be reached" in unreachable["error"]


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"provider": "searxng"}, "needs a base_url"),
        ({"provider": "brave"}, "needs an API key"),
        ({"provider": "tavily", "base_url": "http://127.0.0.1:1"}, "needs an API key"),
    ],
)
def test_settings_without_what_the_provider_needs_are_refused(settings, message):
    with pytest.raises(ValueError, match=message):
        WebSearch(SearchSettings(**settings))


def test_the_search_tool_schema_takes_a_query_and_a_bounded_limit():
    function = WEB_SEARCH_TOOL["function"]
    assert function["name"] == "web_search"
    assert function["parameters"]["required"] == ["query"]
    assert function["parameters"]["properties"]["limit"] == {"type": "integer", "minimum": 1, "maximum": 10}
    assert "cite the urls you used" in function["description"].lower()
