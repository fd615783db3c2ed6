"""The optional HTTP listener (`observability.listen`): `/healthz` and `/metrics`.

`/healthz` answers JSON with one entry per check and HTTP 200 when every check passes
(503 otherwise):
- `adapters.<platform>`: the adapter's own connection state. An adapter reports it through
  a `status: str` attribute (or property) that starts with `connected` when it is
  connected (anything else, e.g. `connecting` or `failed: bad token`, means not), or
  through `is_connected: bool`; `down_since` (`time.monotonic()`) says since when it is
  not. A `failed` platform (final: a rejected token, a refused intent, a port in use)
  fails the check at once; one still connecting fails it once it has been down longer
  than `observability.unhealthy_after_s` (`down_s` says for how long). An adapter that
  reports nothing is shown as `unknown` and does not fail the check.
- `llm`: reachable or not. A request answered in the last two minutes says yes; a recent
  failure of kind unavailable/auth/not_found/config says no; otherwise `GET <base_url>/models`
  is probed (at most every 30 s).
- `models` (with `llm.models`): each offer probed as `doctor` does (at most every 30 s). A
  down offer never fails the check: `status` is `degraded`, since only the tenants that
  chose it wait.
- `data_dir`: a temp file can be written, fsynced and removed.
- `profiles`: how many profiles are quarantined as damaged (their lanes wait for a
  repair). It never fails the check: with one or more, `status` is `degraded` (HTTP 200),
  since everyone else is served.
- `cluster` (cluster mode): the database is reachable and migrated, this node's membership
  is alive, and the leases it holds (how many tenants, which ingress roles).

`/metrics` is the Prometheus text format of `gateway.metrics.Metrics`.
Nothing here carries a user, chat or tenant id.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from core.protocols import ReportsConnected, ReportsStatus, TracksDowntime
from core.settings import parse_listen

if TYPE_CHECKING:  # pragma: no cover
    from core.protocols import Adapter
    from core.settings import Config
    from gateway.metrics import InstrumentedLLM, Metrics
    from tenancy.profiles import ProfileManager

log = logging.getLogger("hermes.observability")

RECENT_S = 120.0
PROBE_TTL_S = 30.0
UNREACHABLE_KINDS = frozenset({"unavailable", "auth", "not_found", "config"})
METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def local_url(listen: str, path: str = "/healthz") -> str:
    """The URL a local client (the `health` command) uses to reach the listener."""
    host, port = parse_listen(listen)
    if host in ("0.0.0.0", "", "*"):  # noqa: S104 (recognising it, not binding)
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}{path}"


def adapter_state(adapter: Any) -> tuple[bool | None, str]:
    """(connected?, status text) of an adapter; (None, "unknown") when it doesn't say."""
    try:
        if isinstance(adapter, ReportsStatus) and isinstance(adapter.status, str):
            return adapter.status.startswith("connected"), adapter.status
        if isinstance(adapter, ReportsConnected) and isinstance(adapter.is_connected, bool):
            return adapter.is_connected, "connected" if adapter.is_connected else "disconnected"
    except Exception as err:  # a broken property must not break /healthz
        return False, f"status unavailable ({type(err).__name__})"
    return None, "unknown"


@dataclass(frozen=True)
class Observed:
    """What `/healthz` and `/metrics` read of the running gateway."""

    cfg: Config
    metrics: Metrics
    profiles: ProfileManager
    adapters: Mapping[str, Adapter]
    #: platform -> (connected?, status text), a failed start included
    platform_states: Callable[[], dict[str, tuple[bool | None, str]]]
    llm_monitor: InstrumentedLLM | None = None
    #: cluster mode: the database and this node's leases (gateway/cluster/health.py)
    cluster_health: Callable[[], Awaitable[tuple[bool, dict[str, Any]]]] | None = None


class Observability:
    """The health and metrics HTTP server of one gateway."""

    def __init__(self, parts: Observed, listen: str) -> None:
        self.parts = parts
        self.listen = listen
        self.host, self.port = parse_listen(listen)
        self._runner: Any = None
        self._probe: tuple[float, bool, str] | None = None
        self._probe_lock = asyncio.Lock()
        self._offer_probes: dict[str, tuple[float, bool, str]] = {}  # llm.models name -> (at, ok, detail)
        self._seen_down: dict[str, float] = {}  # platform -> first seen down (adapters without down_since)

    @property
    def bound_port(self) -> int:
        """The actual port (useful with port 0)."""
        if self._runner is None:
            return self.port
        for site in self._runner.sites:
            server = getattr(site, "_server", None)
            if server is not None and server.sockets:
                return server.sockets[0].getsockname()[1]
        return self.port

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host  # noqa: S104
        return f"http://{host}:{self.bound_port}"

    async def start(self) -> None:
        from aiohttp import web

        web_app = web.Application()
        web_app.router.add_get("/healthz", self._healthz)
        web_app.router.add_get("/metrics", self._metrics)
        web_app.router.add_get("/", self._index)
        runner = web.AppRunner(web_app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, self.host, self.port, reuse_address=True)
        try:
            await site.start()
        except OSError:
            await runner.cleanup()
            raise
        self._runner = runner
        log.info("health and metrics on http://%s:%d (/healthz, /metrics)", self.host, self.bound_port)

    async def stop(self) -> None:
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()

    # ----- checks -----------------------------------------------------------------------
    async def health(self) -> tuple[bool, dict[str, Any]]:
        adapters = self.platforms()
        llm_ok, llm_detail = await self.llm_health()
        from gateway.doctor import check_data_dir

        dd_ok, dd_detail = await asyncio.to_thread(check_data_dir, self.parts.cfg)
        checks = {
            "adapters": adapters,
            "llm": {"ok": llm_ok, "reachable": llm_ok, "detail": llm_detail},
            "data_dir": {"ok": dd_ok, "writable": dd_ok, "detail": dd_detail},
        }
        healthy = llm_ok and dd_ok and all(a["ok"] for a in adapters.values())
        if self.parts.cluster_health is not None:
            cluster_ok, checks["cluster"] = await self.parts.cluster_health()
            healthy = healthy and cluster_ok
        # an offered model that is down holds only the tenants that chose it: degraded, not down
        offers = await self.offer_health()
        if offers:
            checks["models"] = {name: {"ok": ok, "detail": detail} for name, (ok, detail) in offers.items()}
        models_down = any(not ok for ok, _ in offers.values())
        # a damaged profile holds only its own lanes: degraded, not down (the others are served)
        quarantined = len(self.parts.profiles.quarantined)
        checks["profiles"] = {
            "ok": True,
            "quarantined": quarantined,
            "detail": f"{quarantined} damaged, their messages wait; see `hermes-gateway doctor`"
            if quarantined
            else "every profile opened so far opens",
        }
        body = {
            "status": "unhealthy" if not healthy else "degraded" if quarantined or models_down else "ok",
            "checks": checks,
            "uptime_s": round(time.time() - self.parts.metrics.started_at, 1),
            "open_profiles": self.parts.profiles.open_count,
        }
        return healthy, body

    def platforms(self) -> dict[str, dict[str, Any]]:
        """The `adapters` check: each platform's state, red when failed or down too long."""
        now = time.monotonic()
        grace = self.parts.cfg.observability.unhealthy_after_s
        out: dict[str, dict[str, Any]] = {}
        for platform, (connected, status) in self.parts.platform_states().items():
            entry: dict[str, Any] = {"ok": True, "connected": connected, "status": status}
            if connected is False:
                adapter = self.parts.adapters[platform]
                since = adapter.down_since if isinstance(adapter, TracksDowntime) else None
                if not isinstance(since, float):
                    since = self._seen_down.setdefault(platform, now)
                down_s = max(now - since, 0.0)
                entry["ok"] = not status.startswith("failed") and down_s < grace
                entry["down_s"] = round(down_s, 1)
            else:
                self._seen_down.pop(platform, None)
            out[platform] = entry
        return out

    async def llm_health(self) -> tuple[bool, str]:
        monitor = self.parts.llm_monitor
        now = time.monotonic()
        if monitor is not None:
            ok_at, err_at, kind = monitor.last_ok_at, monitor.last_error_at, monitor.last_error_kind
            if ok_at is not None and now - ok_at < RECENT_S and (err_at is None or ok_at >= err_at):
                return True, f"answered a request {now - ok_at:.0f}s ago"
            if err_at is not None and now - err_at < RECENT_S and kind in UNREACHABLE_KINDS:
                return False, f"the last request failed ({kind}) {now - err_at:.0f}s ago"
        async with self._probe_lock:
            if self._probe is not None and now - self._probe[0] < PROBE_TTL_S:
                return self._probe[1], self._probe[2]
            from gateway.doctor import check_llm

            try:
                ok, detail = await asyncio.wait_for(check_llm(self.parts.cfg), timeout=15)
            except TimeoutError:
                ok, detail = False, "probe timed out"
            except Exception as err:
                ok, detail = False, f"probe failed ({type(err).__name__})"
            self._probe = (time.monotonic(), ok, detail)
            return ok, detail

    async def offer_health(self) -> dict[str, tuple[bool, str]]:
        """Each `llm.models` offer probed as `doctor` does (at most every PROBE_TTL_S)."""
        cfg = self.parts.cfg
        out: dict[str, tuple[bool, str]] = {}
        for name in cfg.llm.models:
            probe = self._offer_probes.get(name)
            if probe is None or time.monotonic() - probe[0] >= PROBE_TTL_S:
                from gateway.doctor import check_llm

                try:
                    offer = cfg.model_copy(update={"llm": cfg.llm.for_offer(name)})
                    ok, detail = await asyncio.wait_for(check_llm(offer), timeout=15)
                except TimeoutError:
                    ok, detail = False, "probe timed out"
                except Exception as err:
                    ok, detail = False, f"probe failed ({type(err).__name__})"
                probe = self._offer_probes[name] = (time.monotonic(), ok, detail)
            out[name] = (probe[1], probe[2])
        return out

    # ----- handlers ---------------------------------------------------------------------
    async def _healthz(self, request: Any) -> Any:
        from aiohttp import web

        healthy, body = await self.health()
        return web.Response(
            status=200 if healthy else 503, text=json.dumps(body, indent=1), content_type="application/json"
        )

    async def _metrics(self, request: Any) -> Any:
        from aiohttp import web

        return web.Response(
            body=self.parts.metrics.render().encode("utf-8"), headers={"Content-Type": METRICS_CONTENT_TYPE}
        )

    async def _index(self, request: Any) -> Any:
        from aiohttp import web

        return web.Response(text="hermes-gateway: /healthz /metrics\n")


def probe_health(listen: str, timeout: float = 5.0) -> tuple[int, str]:
    """GET /healthz from a separate process (the `health` command); (status, body).
    Status 0 means the listener could not be reached."""
    import urllib.error
    import urllib.request

    url = local_url(listen)
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 (local URL)
            return resp.status, resp.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode("utf-8", "replace")
    except (urllib.error.URLError, OSError) as err:
        return 0, f"cannot reach {url}: {getattr(err, 'reason', err)}"
