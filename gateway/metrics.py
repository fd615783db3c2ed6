"""Counters, gauges and histograms of one gateway, rendered as Prometheus text by hand.

A `Metrics` object belongs to one `GatewayApp` (no module globals, no registry). Labels
are restricted to `platform`, `kind` and `outcome`, and every label value is squeezed to
a short `[a-z0-9_]` token, so a user id, chat id or tenant id can never become a label:
ids are not passed in, and anything unexpected is reduced to `other`.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from agent.llm import LLMError

# no label may name a tenant, a chat or a user; `tool` names a tool the operator configured
# (a built-in, a web tool, or an MCP server's tool as NAME__tool)
ALLOWED_LABELS = frozenset({"platform", "kind", "outcome", "tool"})
_VALUE_RE = re.compile(r"[a-z][a-z0-9_]{0,31}")
TURN_BUCKETS = (0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)

LabelValues = tuple[str, ...]


def label_value(value: object) -> str:
    """A safe label value: lower-case `[a-z0-9_]`, starting with a letter, at most 32 chars;
    anything else (digits-only ids, long strings, punctuation) becomes `other`."""
    text = str(value).lower().replace("-", "_")
    return text if _VALUE_RE.fullmatch(text) else "other"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _fmt(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if float(value).is_integer():
        return str(int(value))
    return repr(float(value))


class _Metric:
    kind = "untyped"

    def __init__(self, name: str, help_text: str, labels: Iterable[str] = ()) -> None:
        self.name = name
        self.help = help_text
        self.labels = tuple(labels)
        bad = set(self.labels) - ALLOWED_LABELS
        if bad:
            raise ValueError(f"{name}: label(s) {sorted(bad)} not allowed (only {sorted(ALLOWED_LABELS)})")

    def _key(self, labels: dict[str, Any]) -> LabelValues:
        if set(labels) != set(self.labels):
            raise ValueError(f"{self.name} takes labels {self.labels}, got {sorted(labels)}")
        return tuple(label_value(labels[n]) for n in self.labels)

    def render(self) -> list[str]:
        raise NotImplementedError  # every concrete metric renders itself

    def _labelset(self, key: LabelValues, extra: str = "") -> str:
        parts = [f'{n}="{_escape(v)}"' for n, v in zip(self.labels, key, strict=False)]
        if extra:
            parts.append(extra)
        return "{" + ",".join(parts) + "}" if parts else ""

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]


class Counter(_Metric):
    kind = "counter"

    def __init__(self, name: str, help_text: str, labels: Iterable[str] = ()) -> None:
        super().__init__(name, help_text, labels)
        self._values: dict[LabelValues, float] = {}

    def inc(self, amount: float = 1.0, **labels: Any) -> None:
        key = self._key(labels)
        self._values[key] = self._values.get(key, 0.0) + amount

    def value(self, **labels: Any) -> float:
        return self._values.get(self._key(labels), 0.0)

    def render(self) -> list[str]:
        lines = self.header()
        for key in sorted(self._values):
            lines.append(f"{self.name}{self._labelset(key)} {_fmt(self._values[key])}")
        return lines


class Gauge(_Metric):
    """A gauge whose samples come from a callback at scrape time (or are set directly)."""

    kind = "gauge"

    def __init__(
        self,
        name: str,
        help_text: str,
        labels: Iterable[str] = (),
        collect: Callable[[], dict[LabelValues, float] | float] | None = None,
    ) -> None:
        super().__init__(name, help_text, labels)
        self._collect = collect
        self._values: dict[LabelValues, float] = {}

    def set(self, value: float, **labels: Any) -> None:
        self._values[self._key(labels)] = value

    def add(self, amount: float, **labels: Any) -> None:
        key = self._key(labels)
        self._values[key] = self._values.get(key, 0.0) + amount

    def samples(self) -> dict[LabelValues, float]:
        if self._collect is None:
            return dict(self._values)
        got = self._collect()
        if not isinstance(got, dict):
            return {(): float(got)}
        return {tuple(label_value(v) for v in k): float(v) for k, v in got.items()}

    def render(self) -> list[str]:
        lines = self.header()
        samples = self.samples()
        for key in sorted(samples):
            lines.append(f"{self.name}{self._labelset(key)} {_fmt(samples[key])}")
        return lines


class CollectedCounter(Gauge):
    """A counter whose running totals are kept by their owner and read at scrape time."""

    kind = "counter"


class Histogram(_Metric):
    kind = "histogram"

    def __init__(
        self, name: str, help_text: str, labels: Iterable[str] = (), buckets: Iterable[float] = TURN_BUCKETS
    ) -> None:
        super().__init__(name, help_text, labels)
        self.buckets = tuple(sorted(buckets))
        self._counts: dict[LabelValues, list[int]] = {}
        self._sums: dict[LabelValues, float] = {}

    def observe(self, value: float, **labels: Any) -> None:
        key = self._key(labels)
        counts = self._counts.setdefault(key, [0] * (len(self.buckets) + 1))
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                counts[i] += 1
        counts[-1] += 1  # +Inf
        self._sums[key] = self._sums.get(key, 0.0) + value

    def count(self, **labels: Any) -> int:
        counts = self._counts.get(self._key(labels))
        return counts[-1] if counts else 0

    def render(self) -> list[str]:
        lines = self.header()
        for key in sorted(self._counts):
            counts = self._counts[key]
            for bound, n in zip((*self.buckets, math.inf), counts, strict=False):
                le = 'le="' + _fmt(bound) + '"'
                lines.append(f"{self.name}_bucket{self._labelset(key, le)} {n}")
            lines.append(f"{self.name}_sum{self._labelset(key)} {_fmt(self._sums[key])}")
            lines.append(f"{self.name}_count{self._labelset(key)} {counts[-1]}")
        return lines


class Metrics:
    """Every metric the gateway exports. Owned by one GatewayApp."""

    def __init__(self) -> None:
        self.started_at = time.time()
        self.inbound = Counter(
            "hermes_inbound_messages_total",
            "Platform messages received (duplicates included).",
            ["platform", "outcome"],
        )
        self.turns = Counter(
            "hermes_turns_total",
            "Lane jobs finished: agent turns (kind=turn) and chat commands (kind=command).",
            ["platform", "kind", "outcome"],
        )
        self.turn_seconds = Histogram(
            "hermes_turn_duration_seconds", "Wall time of an agent turn, from start to delivery.", ["platform"]
        )
        self.llm_requests = Counter("hermes_llm_requests_total", "Chat completion requests by outcome.", ["outcome"])
        self.llm_errors = Counter(
            "hermes_llm_errors_total", "Failed chat completion requests (after retries) by error kind.", ["kind"]
        )
        self.compressions = Counter("hermes_compressions_total", "Context compressions by outcome.", ["outcome"])
        self.reviews = Counter(
            "hermes_memory_reviews_total",
            "Background memory/skill reviews by trigger (kind=nudge|flush) and outcome.",
            ["kind", "outcome"],
        )
        self.refusals = Counter(
            "hermes_refusals_total",
            "Messages refused with a notice (rate_limited, too_long, busy, unauthorized, ...).",
            ["platform", "kind"],
        )
        self.rate_limited = Counter(
            "hermes_rate_limit_refusals_total", "Messages refused by the per-person rate limit.", ["platform"]
        )
        self.links = Counter(
            "hermes_identity_links_total", "Identity link operations by kind and outcome.", ["kind", "outcome"]
        )
        self.deliveries = Counter(
            "hermes_deliveries_total",
            "Outbox chunks by outcome: sent, refused (chat gone), expired (given up "
            "after delivery.max_age_s), retried (a failed attempt).",
            ["platform", "outcome"],
        )
        self.in_flight = Gauge("hermes_turns_in_progress", "Lane jobs running now.", ["platform"])
        # budgets (docs/concepts.md#budgets): gateway-wide totals, never per tenant
        self.llm_tokens = Counter(
            "hermes_llm_tokens_total",
            "Model tokens used, from the responses' usage (kind=prompt|completion).",
            ["kind"],
        )
        self.llm_cost = Counter("hermes_llm_cost_total", "Model cost at the configured prices (llm.*price*).")
        self.budget_refusals = Counter(
            "hermes_budget_refusals_total", "Model calls refused because the tenant's budget was used up."
        )
        # tools (docs/concepts.md#tools): per tool, never per tenant
        self.tool_calls = Counter(
            "hermes_tool_calls_total",
            "Tool calls by tool and outcome (ok | error | refused: not allowed for the speaker | "
            "denied: not confirmed).",
            ["tool", "outcome"],
        )
        self.cluster: ClusterMetrics | None = None  # cluster mode only: enable_cluster()
        self._gauges: list[Gauge] = []
        self._platforms: tuple[str, ...] = ()

    # ----- recording helpers (called by the gateway) ---------------------------------
    def refused(self, platform: str, kind: str) -> None:
        self.refusals.inc(platform=platform, kind=kind)
        if kind == "rate_limited":
            self.rate_limited.inc(platform=platform)

    def llm_result(self, error_kind: str | None) -> None:
        if error_kind is None:
            self.llm_requests.inc(outcome="ok")
        else:
            self.llm_requests.inc(outcome="error")
            self.llm_errors.inc(kind=error_kind)

    def model_usage(self, prompt_tokens: int, completion_tokens: int, cost: float) -> None:
        """One model call's usage (the meter's sink, agent/metering.py)."""
        self.llm_tokens.inc(prompt_tokens, kind="prompt")
        self.llm_tokens.inc(completion_tokens, kind="completion")
        self.llm_cost.inc(cost)

    def budget_refused(self) -> None:
        self.budget_refusals.inc()

    def tool_call(self, tool: str, outcome: str) -> None:
        """One tool call's outcome (the tool box's sink, agent/toolkit.py)."""
        self.tool_calls.inc(tool=tool, outcome=outcome)

    def compression(self, outcome: str = "ok") -> None:
        self.compressions.inc(outcome=outcome)

    def review(self, trigger: str, outcome: str) -> None:
        self.reviews.inc(kind=trigger, outcome=outcome)

    def turn_done(self, platform: str, kind: str, outcome: str, seconds: float | None) -> None:
        self.turns.inc(platform=platform, kind=kind, outcome=outcome)
        if seconds is not None:
            self.turn_seconds.observe(seconds, platform=platform)

    def enable_cluster(self, cluster: ClusterMetrics | None = None) -> ClusterMetrics:
        """Cluster mode: add the claim and failover metrics (the node's own, if given) to /metrics."""
        if cluster is not None:
            self.cluster = cluster
        elif self.cluster is None:
            self.cluster = ClusterMetrics()
        return self.cluster

    # ----- scrape-time gauges ----------------------------------------------------------
    def bind(
        self,
        *,
        platforms: Iterable[str],
        open_profiles: Callable[[], float],
        queue_depth: Callable[[], dict[str, int]],
        adapters_up: Callable[[], dict[str, bool | None]],
        skipped_events: Callable[[], dict[str, int]] = dict,
    ) -> None:
        """Attach the gauges read from the running gateway at scrape time."""
        self._platforms = tuple(platforms)
        for p in self._platforms:
            self.in_flight.add(0, platform=p)

        def depth() -> dict[LabelValues, float]:
            out: dict[LabelValues, float] = {(p,): 0 for p in self._platforms}
            for platform, n in queue_depth().items():
                out[(platform,)] = out.get((platform,), 0) + n
            return out

        def up() -> dict[LabelValues, float]:
            return {(p,): 1.0 if ok else 0.0 for p, ok in adapters_up().items() if ok is not None}

        def skipped() -> dict[LabelValues, float]:
            return {(p,): float(n) for p, n in skipped_events().items()}

        self._gauges = [
            Gauge("hermes_open_profiles", "Tenant profiles open now.", collect=open_profiles),
            Gauge(
                "hermes_queue_depth", "Messages waiting in lane queues (not yet running).", ["platform"], collect=depth
            ),
            Gauge(
                "hermes_adapter_connected",
                "1 when the platform adapter reports it is connected, 0 when not (absent when unknown).",
                ["platform"],
                collect=up,
            ),
            CollectedCounter(
                "hermes_adapter_events_skipped_total",
                "Platform events the adapter could not parse and skipped (the connection went on).",
                ["platform"],
                collect=skipped,
            ),
            Gauge("hermes_start_time_seconds", "Unix time the gateway started.", collect=lambda: self.started_at),
        ]

    def render(self) -> str:
        """The Prometheus text exposition (format 0.0.4)."""
        lines: list[str] = []
        for metric in (
            self.inbound,
            self.turns,
            self.turn_seconds,
            self.llm_requests,
            self.llm_errors,
            self.llm_tokens,
            self.llm_cost,
            self.budget_refusals,
            self.tool_calls,
            self.compressions,
            self.reviews,
            self.refusals,
            self.rate_limited,
            self.links,
            self.deliveries,
            self.in_flight,
            *self._gauges,
            *(self.cluster.metrics() if self.cluster is not None else ()),
        ):
            lines.extend(metric.render())
        return "\n".join(lines) + "\n"


class ClusterMetrics:
    """A cluster node's claim and failover figures. The node's runtime calls the recording
    helpers; the ingress election records its own role changes."""

    def __init__(self) -> None:
        self.lanes_claimed = Counter("hermes_cluster_lanes_claimed_total", "Lanes this node claimed to run.")
        self.takeovers = Counter(
            "hermes_cluster_lease_takeovers_total",
            "Leases that moved to this node from another one (kind=tenant|ingress).",
            ["kind"],
        )
        self.fenced = Counter(
            "hermes_cluster_fenced_writes_total",
            "Work refused because this node's lease had gone: kind=turn (a turn stopped, nothing "
            "committed), kind=send (a recorded chunk left for the lease's new holder).",
            ["kind"],
        )
        self.lease_busy = Counter(
            "hermes_cluster_lease_busy_total", "Claimed lanes given back because another node held the tenant."
        )
        self.leases_lost = Counter(
            "hermes_cluster_leases_lost_total", "Tenant leases this node lost (taken over, expired, not renewed)."
        )
        self.heartbeat_failures = Counter(
            "hermes_cluster_heartbeat_failures_total", "Heartbeats that failed or found the node lease expired."
        )
        self.ingress = Counter(
            "hermes_cluster_ingress_changes_total",
            "Ingress roles gained, lost or released by this node "
            "(kind=telegram_polling|telegram_webhook|discord_shard).",
            ["kind", "outcome"],
        )
        self.ingress_held = Gauge("hermes_cluster_ingress_roles", "Ingress roles this node holds now.")
        self.tenants_held = Gauge("hermes_cluster_tenant_leases", "Tenant leases this node holds now.")
        self.ingress_held.set(0)
        self.tenants_held.set(0)

    def lane_claimed(self, n: int = 1) -> None:
        self.lanes_claimed.inc(n)

    def lease_taken_over(self, kind: str) -> None:
        self.takeovers.inc(kind=kind)

    def fenced_out(self, kind: str) -> None:
        self.fenced.inc(kind=kind)

    def ingress_changed(self, kind: str, outcome: str, held: int) -> None:
        self.ingress.inc(kind=kind, outcome=outcome)
        self.ingress_held.set(held)

    def metrics(self) -> tuple[_Metric, ...]:
        return (
            self.lanes_claimed,
            self.takeovers,
            self.fenced,
            self.lease_busy,
            self.leases_lost,
            self.heartbeat_failures,
            self.ingress,
            self.ingress_held,
            self.tenants_held,
        )


class InstrumentedLLM:
    """Wraps an LLM client so every `chat` call is counted (errors by `LLMError.kind`) and
    its last outcome is known to /healthz. Everything else is passed through."""

    def __init__(self, inner: Any, metrics: Metrics) -> None:
        self._inner = inner
        self._metrics = metrics
        self.last_ok_at: float | None = None
        self.last_error_at: float | None = None
        self.last_error_kind: str | None = None
        self.last_error: LLMError | None = None  # the console chat explains it to the operator

    async def chat(self, *args: Any, **kwargs: Any) -> Any:
        from agent.llm import LLMError

        try:
            result = await self._inner.chat(*args, **kwargs)
        except LLMError as err:
            self.last_error_at, self.last_error_kind, self.last_error = time.monotonic(), err.kind, err
            self._metrics.llm_result(err.kind)
            raise
        self.last_ok_at = time.monotonic()
        self._metrics.llm_result(None)
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def __repr__(self) -> str:
        return f"InstrumentedLLM({self._inner!r})"
