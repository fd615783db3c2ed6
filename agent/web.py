"""web_fetch: one public web page (HTML, PDF or text) as text for the model, behind an SSRF guard.

The fetcher is shared by every tenant, so it keeps nothing between fetches (no cookies, no
credentials, no proxy from the environment) and refuses any address that is not on the public
internet: loopback, private, link-local, cloud metadata, CGNAT, multicast, reserved, and the
IPv4-mapped / 6to4 / NAT64 forms of these. The check runs after DNS resolution, on the first
URL and on every redirect hop, and the connection goes to exactly the addresses that were
checked (see `_PinnedResolver`). `WebPolicy.allow_hosts` lets the operator reach named internal
hosts (or one port of them) anyway.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import re
import socket
from dataclasses import dataclass
from html.parser import HTMLParser
from typing import Any, Literal, Protocol

import aiohttp
import html2text
from aiohttp.abc import AbstractResolver, ResolveResult
from yarl import URL

from agent.attachments import clip, pdf_text

__all__ = [
    "USER_AGENT",
    "WEB_FETCH_TOOL",
    "FetchedPage",
    "Resolver",
    "SystemResolver",
    "WebError",
    "WebFetcher",
    "WebPolicy",
    "WebRefused",
    "WebToolError",
    "tool_json",
    "web_fetch_call",
]

log = logging.getLogger("hermes.web")

USER_AGENT = "hermes-gateway/0.1 (+web_fetch)"
_ACCEPT = "text/html,application/xhtml+xml,application/pdf;q=0.9,text/plain;q=0.8,application/json;q=0.8,*/*;q=0.1"
_REDIRECTS = frozenset({301, 302, 303, 307, 308})
_CHUNK = 64 * 1024

_HTML_TYPES = frozenset({"text/html", "application/xhtml+xml"})
_TEXT_TYPES = frozenset({"text/plain", "text/markdown", "application/json", "text/csv"})

WEB_FETCH_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "web_fetch",
        "description": (
            "Fetch one public web page (HTML, PDF or plain text) and read it as text. Use it for a URL "
            "the person gave or one a web search found. Cite the URL you used in your answer. Pages on "
            "private or internal networks are refused; long pages are cut (truncated: true)."
        ),
        "parameters": {
            "type": "object",
            "properties": {"url": {"type": "string", "description": "The full http:// or https:// URL."}},
            "required": ["url"],
        },
    },
}


class WebToolError(Exception):
    """A web tool failed; the message says why in words fit for the model."""


class WebRefused(WebToolError):
    """The guard said no: the URL or an address it resolves to is not to be fetched."""


class WebError(WebToolError):
    """The fetch or search failed: network, HTTP status, timeout, size, unreadable content."""


@dataclass(frozen=True)
class WebPolicy:
    """What web_fetch may reach and how much it reads.

    `allow_hosts` entries are `host` or `host:port` (`[v6]:port` for an IPv6 literal), lower
    case; a listed host skips the address check (only on that port when one is given)."""

    allow_hosts: frozenset[str] = frozenset()
    max_bytes: int = 2_000_000
    timeout_s: float = 15.0
    max_redirects: int = 5
    max_chars: int = 20_000  # text handed to the model


@dataclass(frozen=True)
class FetchedPage:
    url: str  # the final URL, after redirects
    title: str  # the HTML <title>; "" for other types
    text: str
    content_type: str
    truncated: bool  # the body was cut at max_bytes or the text at max_chars


class Resolver(Protocol):
    """A host name to the IP addresses (strings) a connection to it may use."""

    async def resolve(self, host: str, port: int) -> list[str]: ...


class SystemResolver:
    """The system's DNS through the event loop's `getaddrinfo`."""

    async def resolve(self, host: str, port: int) -> list[str]:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
        return list(dict.fromkeys(str(info[4][0]) for info in infos))


# ----------------------------------------------------------------------------- the guard

_METADATA = frozenset(ipaddress.ip_address(a) for a in ("169.254.169.254", "fd00:ec2::254", "100.100.100.200"))
_CGNAT = ipaddress.ip_network("100.64.0.0/10")
_PRIVATE = tuple(ipaddress.ip_network(n) for n in ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "fc00::/7"))
_NAT64 = (ipaddress.ip_network("64:ff9b::/96"), ipaddress.ip_network("64:ff9b:1::/48"))


def _refusal_reason(address: str) -> str | None:
    """Why a connection to `address` is refused ("a private address"), None when it is public."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return "not an IP address"
    if isinstance(ip, ipaddress.IPv6Address):
        # an IPv6 form that carries an IPv4 address reaches that IPv4 address
        embedded = ip.ipv4_mapped or ip.sixtofour
        if embedded is None and any(ip in net for net in _NAT64):
            embedded = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
        if embedded is not None:
            inner = _refusal_reason(str(embedded))
            return f"{inner} (as {embedded})" if inner else None
    if ip in _METADATA:
        return "a cloud metadata address"
    if ip.is_unspecified:
        return "an unspecified address"
    if ip.is_loopback:
        return "a loopback address"
    if ip.is_link_local:
        return "a link-local address"
    if ip in _CGNAT:
        return "a shared (CGNAT) address"
    if any(ip in net for net in _PRIVATE):
        return "a private address"
    if ip.is_multicast:
        return "a multicast address"
    if ip.is_reserved:
        return "a reserved address"
    if not ip.is_global:
        return "not a public address"
    return None


def _looks_like_ip(host: str) -> bool:
    """aiohttp's own test for an IP literal: such a host is connected to without asking the resolver."""
    return ":" in host or host.replace(".", "").isdigit()


@dataclass(frozen=True)
class _Guard:
    policy: WebPolicy
    resolver: Resolver

    def allowed(self, host: str, port: int) -> bool:
        name = host.lower().rstrip(".")
        entries = self.policy.allow_hosts
        return name in entries or f"{name}:{port}" in entries or f"[{name}]:{port}" in entries

    def check_literal(self, host: str, port: int) -> None:
        """Refuse a URL whose host is an IP literal that is not public (the resolver never sees it)."""
        if _looks_like_ip(host) and not self.allowed(host, port):
            reason = _refusal_reason(host)
            if reason:
                raise WebRefused(f"refused: {host} is {reason}")

    async def addresses(self, host: str, port: int) -> list[str]:
        """The addresses `host` resolves to, every one of them checked; raises WebRefused."""
        try:
            found = await self.resolver.resolve(host, port)
        except OSError:
            raise WebError(f"{host} could not be resolved") from None
        if not found:
            raise WebError(f"{host} could not be resolved")
        if not self.allowed(host, port):
            for address in found:
                reason = _refusal_reason(address)
                if reason:
                    log.info("web_fetch refused %s: %s is %s", host, address, reason)
                    raise WebRefused(f"refused: {host} resolves to {address}, {reason}")
        return found


class _PinnedResolver(AbstractResolver):
    """aiohttp's resolver for the fetcher: the check and the connection share one DNS answer.

    aiohttp connects to exactly the addresses this returns, so resolving and checking here
    (with the DNS cache off) leaves no second lookup a rebinding name could answer differently.
    Connecting to an IP with a hand-set Host header would do the same, but would take TLS
    verification and SNI away from aiohttp's own handling of the URL's host name; this keeps it.
    """

    def __init__(self, guard: _Guard) -> None:
        self._guard = guard

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        results: list[ResolveResult] = []
        for address in await self._guard.addresses(host, port):
            fam = socket.AF_INET6 if ":" in address else socket.AF_INET
            if family in (socket.AF_UNSPEC, fam):
                flags = socket.AI_NUMERICHOST | socket.AI_NUMERICSERV
                results.append(ResolveResult(hostname=host, host=address, port=port, family=fam, proto=0, flags=flags))
        if not results:
            raise WebError(f"{host} has no address of the wanted family")
        return results

    async def close(self) -> None:
        return None


# ----------------------------------------------------------------------------- content


class _TitleParser(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self._in_title = False
        self.done = False

    def handle_starttag(self, tag: str, _attrs: list[tuple[str, str | None]]) -> None:
        if tag == "title" and not self.done:
            self._in_title = True

    def handle_endtag(self, tag: str) -> None:
        if tag == "title" and self._in_title:
            self._in_title, self.done = False, True

    def handle_data(self, data: str) -> None:
        if self._in_title:
            self.parts.append(data)


def _title_of(html: str) -> str:
    parser = _TitleParser()
    end = html.lower().find("</title")
    parser.feed(html[: end + 8] if end >= 0 else html)
    return " ".join("".join(parser.parts).split())


def _html_text(html: str, base_url: str) -> str:
    converter = html2text.HTML2Text(baseurl=base_url)
    converter.ignore_images = True
    converter.ignore_links = False
    converter.body_width = 0  # no hard wrapping: the model reads lines, not a terminal
    return re.sub(r"\n{3,}", "\n\n", converter.handle(html)).strip()


def _decode(data: bytes, charset: str | None) -> str:
    try:
        return data.decode(charset or "utf-8", errors="replace")
    except LookupError:  # a charset Python does not know
        return data.decode("utf-8", errors="replace")


Kind = Literal["html", "pdf", "text"]


def _kind_of(content_type: str) -> Kind | None:
    if content_type in _HTML_TYPES:
        return "html"
    if content_type == "application/pdf":
        return "pdf"
    if content_type in _TEXT_TYPES:
        return "text"
    return None


@dataclass
class _Body:
    url: str
    content_type: str
    charset: str | None
    data: bytes
    cut: bool


def _page_of(body: _Body, max_chars: int) -> FetchedPage:
    """The body as text (CPU work: html2text, pypdf), run off the event loop."""
    kind = _kind_of(body.content_type)
    title = ""
    if kind == "pdf":
        text = pdf_text(body.data, max_chars)
        if text is None:
            raise WebError("the PDF could not be read (broken or encrypted)")
        if not text.strip():
            raise WebError("the PDF has no text layer (a scan?)")
    else:
        decoded = _decode(body.data, body.charset)
        if kind == "html":
            title = _title_of(decoded)
            text = _html_text(decoded, body.url)
        else:
            text = decoded.strip()
    text, clipped = clip(text, max_chars)
    return FetchedPage(body.url, title, text, body.content_type, body.cut or clipped)


# ----------------------------------------------------------------------------- the fetcher


@dataclass
class _Progress:
    host: str = ""


class WebFetcher:
    """Fetches pages under one `WebPolicy`; one instance is shared by every tenant."""

    def __init__(self, policy: WebPolicy, *, resolver: Resolver | None = None) -> None:
        self.policy = policy
        self._guard = _Guard(policy, resolver or SystemResolver())
        self._session: aiohttp.ClientSession | None = None

    async def checked_addresses(self, host: str, port: int) -> list[str]:
        """The addresses a connection to `host:port` would use, each one checked (WebRefused if any is bad)."""
        self._guard.check_literal(host, port)
        if _looks_like_ip(host):
            return [host]
        return await self._guard.addresses(host, port)

    async def fetch(self, url: str) -> FetchedPage:
        """`url` (following redirects) as text; raises WebRefused or WebError."""
        progress = _Progress()
        try:
            async with asyncio.timeout(self.policy.timeout_s):
                body = await self._download(_parse(url), progress)
        except TimeoutError:
            raise WebError(f"{progress.host} did not answer within {self.policy.timeout_s:g} s") from None
        return await asyncio.to_thread(_page_of, body, self.policy.max_chars)

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _session_now(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(resolver=_PinnedResolver(self._guard), use_dns_cache=False, limit=64)
            self._session = aiohttp.ClientSession(
                connector=connector,
                cookie_jar=aiohttp.DummyCookieJar(),  # nothing of one person's fetch reaches the next
                trust_env=False,  # no proxy, no .netrc credentials from the environment
                headers={"User-Agent": USER_AGENT, "Accept": _ACCEPT},
                timeout=aiohttp.ClientTimeout(total=self.policy.timeout_s),
            )
        return self._session

    async def _download(self, url: URL, progress: _Progress) -> _Body:
        session = self._session_now()
        for _hop in range(self.policy.max_redirects + 1):
            host, port = url.raw_host or "", url.port or 0
            progress.host = host
            self._guard.check_literal(host, port)
            try:
                async with session.get(url, allow_redirects=False) as resp:
                    if resp.status in _REDIRECTS:
                        resp.close()
                        location = resp.headers.get("Location")
                        if not location:
                            raise WebError(f"{host} answered HTTP {resp.status} without a Location")
                        url = _redirect_target(url, location)
                        log.info("web_fetch %s: HTTP %d redirect to %s", host, resp.status, url.raw_host)
                        continue
                    return await self._read(resp, url, host)
            except TimeoutError:
                raise  # aiohttp's own timeouts are ClientErrors too: reported as a timeout by fetch()
            except aiohttp.ClientConnectorCertificateError:
                raise WebError(f"{host}'s TLS certificate could not be verified") from None
            except aiohttp.ClientSSLError:
                raise WebError(f"the TLS connection to {host} failed") from None
            except aiohttp.ClientConnectorError:
                raise WebError(f"could not connect to {host}") from None
            except aiohttp.InvalidURL:
                raise WebError(f"not a URL that can be fetched (host {host})") from None
            except aiohttp.ClientError as err:
                raise WebError(f"the connection to {host} failed ({type(err).__name__})") from None
        raise WebError(f"more than {self.policy.max_redirects} redirects (last host {progress.host})")

    async def _read(self, resp: aiohttp.ClientResponse, url: URL, host: str) -> _Body:
        """The body, streamed and cut at `max_bytes`, once status and type say it is readable."""
        if resp.status >= 400:
            resp.close()
            raise WebError(f"{host} answered HTTP {resp.status}")
        content_type = resp.content_type.lower()
        kind = _kind_of(content_type)
        if kind is None:
            resp.close()
            raise WebError(f"{content_type} is not something web_fetch can read (it reads HTML, PDF and text)")
        limit = self.policy.max_bytes
        if kind == "pdf" and (resp.content_length or 0) > limit:
            resp.close()
            raise WebError(f"the PDF is too big (over {limit} bytes)")
        data = bytearray()
        cut = False
        async for chunk in resp.content.iter_chunked(_CHUNK):
            room = limit - len(data)
            if len(chunk) > room:
                data += chunk[:room]
                cut = True
                resp.close()  # drop the connection: the rest of the body is never read
                break
            data += chunk
        if cut and kind == "pdf":
            raise WebError(f"the PDF is too big (over {limit} bytes)")
        log.info(
            "web_fetch %s: HTTP %d %s, %d bytes%s", host, resp.status, content_type, len(data), " (cut)" if cut else ""
        )
        return _Body(str(url), content_type, resp.charset, bytes(data), cut)


def _parse(raw: str) -> URL:
    """A URL the fetcher may try: http(s), a host, no user name or password."""
    try:
        url = URL(raw.strip())
    except (ValueError, TypeError):
        raise WebError("not a valid URL") from None
    scheme = url.scheme.lower()
    if scheme not in ("http", "https"):
        raise WebRefused(
            f"refused: only http:// and https:// URLs are fetched, not {scheme + ':' if scheme else 'a URL without a scheme'}"
        )
    if url.raw_user is not None or url.raw_password is not None:
        raise WebRefused("refused: URLs with a user name or password are not fetched")
    if not url.raw_host:
        raise WebError("not a valid URL (no host)")
    return url.with_fragment(None)


def _redirect_target(url: URL, location: str) -> URL:
    """Where a `Location` (absolute or relative to `url`) points, checked as a first URL would be."""
    try:
        target = url.join(URL(location))
    except (ValueError, TypeError):
        raise WebError(f"{url.raw_host} redirected to something that is not a URL") from None
    return _parse(str(target))


def _host_of(raw: str) -> str:
    try:
        return URL(raw.strip()).raw_host or "?"
    except (ValueError, TypeError):
        return "?"


def tool_json(payload: dict[str, Any]) -> str:
    """A tool result for the model: JSON, non-ASCII kept as it is."""
    return json.dumps(payload, ensure_ascii=False)


async def web_fetch_call(fetcher: WebFetcher, args: dict[str, Any]) -> str:
    """Run one web_fetch tool call: the JSON result for the model; never raises."""
    url = args.get("url")
    if not isinstance(url, str) or not url.strip():
        return tool_json({"success": False, "error": "url must be a non-empty string"})
    try:
        page = await fetcher.fetch(url)
    except WebToolError as err:
        return tool_json({"success": False, "error": str(err)})
    except Exception as err:
        # the message may quote the URL (and its query string): the host and the type only
        log.warning("web_fetch of %s failed unexpectedly (%s)", _host_of(url), type(err).__name__)
        log.debug("web_fetch failure", exc_info=True)
        return tool_json({"success": False, "error": "the page could not be fetched (an internal error)"})
    return tool_json(
        {"success": True, "url": page.url, "title": page.title, "content": page.text, "truncated": page.truncated}
    )
