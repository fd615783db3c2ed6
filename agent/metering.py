"""The one gate every model call serving a tenant goes through (docs/concepts.md#budgets):
check the tenant's budget before the call, reserve an estimate in its ledger, take a
fair-share slot (agent/fairshare.py), call, and settle the count from the response's usage.

Turns, compression summaries and background reviews call `Meter.chat` with the `Payer`
of the lane they serve, built by `Meter.payer` from the profile and the lane and passed
explicitly (no context variable, no module state). A shared lane pays from the chat's own
tenant under `budgets.per_chat`; a person's lanes from the person's under `per_person`;
`access.admins` are counted but never capped while `budgets.exempt_admins` holds.
Cost = prompt tokens x price_in + completion tokens x price_out (per million tokens) of the
model requested: the `llm.models` offer naming it, else the `llm` section's prices; no
price, no cost (tokens are still counted).
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta, tzinfo
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable
from zoneinfo import ZoneInfo

from agent.fairshare import FairShare
from agent.ledger import LIMIT_KEYS, NANOS, ProfileLedger, Totals, over_cap
from agent.llm import ChatResult, LLMClient, LLMError, LLMTimeout
from core.settings import BudgetLimits, BudgetsConfig, LLMConfig

if TYPE_CHECKING:
    from agent.messages import StoredMessage
    from agent.profile import Profile
    from core.lanes import Lane, LaneKind

log = logging.getLogger("hermes.agent")

Notify = Callable[[str, str], Awaitable[None]]
#: image parts are counted as this many characters in a call's estimate (not their base64)
_IMAGE_CHARS = 4000
_UTC = ZoneInfo("UTC")


class Ledger(Protocol):
    """Where one tenant's counts live: its profile's state.db (agent/ledger.py) on a single
    node; a cluster backend must make each method atomic across nodes."""

    async def reserve(
        self, call_id: str, day: str, month: str, tokens: int, cost_nanos: int, limits: dict[str, float | None]
    ) -> tuple[Totals, bool]:
        """Under the caps, count the estimate: (use before it, whether it was reserved)."""
        ...

    async def settle(self, call_id: str, day: str, month: str, tokens: int, cost_nanos: int) -> None:
        """Replace the call's estimate by its usage (may be written with the next write)."""
        ...

    async def totals(self, day: str, month: str) -> Totals: ...

    async def mark_once(self, key: str) -> bool:
        """Record a notice of a period as said; False when it was already."""
        ...


@runtime_checkable
class StoreLedger(Protocol):
    """A ledger in the profile's own state.db (agent/ledger.py): a call's reservation can
    ride in the turn's write of the person's message instead of a storage call of its own
    (docs/concepts.md#budgets)."""

    def reserving(self, r: Reservation) -> Callable[[Any], bool]:
        """A function of a state.db connection inside a transaction that makes `r`
        (True) or finds a cap reached (False, `r.before` says the use)."""
        ...


class UsageSink(Protocol):
    """Gateway-wide totals (`/metrics`): no tenant is named."""

    def model_usage(self, prompt_tokens: int, completion_tokens: int, cost: float) -> None: ...

    def budget_refused(self) -> None: ...


@dataclass(frozen=True)
class Payer:
    """Whose budget a model call is counted to; `ledger` None: counted to nobody (an agent
    built without a gateway, e.g. in tests)."""

    tenant_id: str
    kind: LaneKind
    exempt: bool
    zone: tzinfo
    ledger: Ledger | None
    limits: dict[str, float | None]  # the caps that apply: budgets.* with the tenant's override

    @property
    def capped(self) -> bool:
        return self.ledger is not None and not self.exempt and any(v is not None for v in self.limits.values())


@dataclass
class Reservation:
    """A model call's estimate, counted before the call; made by `Meter.chat` or, folded
    into the turn's first write, by the ledger's `reserving` (then passed to `Meter.chat`)."""

    call_id: str
    period: Period
    tokens: int
    cost_nanos: int
    limits: dict[str, float | None]
    before: Totals = field(default_factory=lambda: Totals())  # the use before this call


class BudgetExceeded(Exception):
    """The tenant's budget is used up: no model call was made. `say` is True the first time
    in the period (the sentence goes to the chat); later messages are finished quietly."""

    def __init__(self, text: str, say: bool) -> None:
        super().__init__(text)
        self.text = text
        self.say = say


@dataclass(frozen=True)
class Period:
    """The day and month a moment falls in, in the payer's time zone."""

    day: str  # YYYY-MM-DD
    month: str  # YYYY-MM
    day_ends: datetime
    month_ends: datetime


def period_of(zone: tzinfo, now: float) -> Period:
    local = datetime.fromtimestamp(now, zone)
    midnight = datetime(local.year, local.month, local.day, tzinfo=zone) + timedelta(days=1)
    midnight = datetime(midnight.year, midnight.month, midnight.day, tzinfo=zone)
    nxt = datetime(local.year + (local.month == 12), local.month % 12 + 1, 1, tzinfo=zone)
    return Period(local.strftime("%Y-%m-%d"), local.strftime("%Y-%m"), midnight, nxt)


def effective_limits(limits: BudgetLimits, override: dict[str, float | None]) -> dict[str, float | None]:
    """The config's caps with the operator's per-tenant override (`budget set`) on top."""
    out: dict[str, float | None] = {k: getattr(limits, k) for k in LIMIT_KEYS}
    out.update({k: override[k] for k in LIMIT_KEYS if k in override})
    return out


def price_of(llm: LLMConfig, model: str) -> tuple[float, float]:
    """(in, out) price per million tokens of `model`: its `llm.models` offer, else `llm`'s."""
    offer = next((o for o in llm.models.values() if o.model == model), None)
    p_in = offer.price_in_per_mtok if offer is not None and offer.price_in_per_mtok is not None else None
    p_out = offer.price_out_per_mtok if offer is not None and offer.price_out_per_mtok is not None else None
    return (
        p_in if p_in is not None else llm.price_in_per_mtok or 0.0,
        p_out if p_out is not None else llm.price_out_per_mtok or 0.0,
    )


def cost_nanos(prices: tuple[float, float], prompt_tokens: int, completion_tokens: int) -> int:
    """Cost in nano-units: tokens x price per million = tokens x price x 1000 nano-units."""
    return round(prompt_tokens * prices[0] * 1000 + completion_tokens * prices[1] * 1000)


def estimate_prompt_tokens(messages: list[dict[str, Any]]) -> int:
    """A generous token estimate of a request (about 3 characters a token, images at a
    fixed size): what is reserved before the call."""
    chars = 0
    for m in messages:
        content = m.get("content")
        if isinstance(content, str):
            chars += len(content)
        elif isinstance(content, list):
            for part in content:
                if isinstance(part, dict) and part.get("type") == "text":
                    chars += len(str(part.get("text", "")))
                else:
                    chars += _IMAGE_CHARS
        if m.get("tool_calls"):
            chars += len(json.dumps(m["tool_calls"], ensure_ascii=False))
        chars += 48  # role and framing
    return chars // 3 + 16


def estimate_stored_tokens(history: list[StoredMessage]) -> int:
    """A request's prompt estimate from its stored messages' cached token counts (no wire
    is built): what a reservation made ahead of the call counts (`Meter.ahead`)."""
    total = 0
    for m in history:
        n = m.token_count
        total += n if n is not None else len(str(m.content or "")) // 3 + 16
    return total + 16


def _money(nanos: int) -> str:
    return f"${nanos / NANOS:,.2f}" if nanos >= NANOS // 100 or nanos == 0 else f"${nanos / NANOS:,.4f}"


def _when(ends: datetime, now: float) -> str:
    left = max(0, int(ends.timestamp() - now))
    hours, minutes = left // 3600, left % 3600 // 60
    span = f"{hours} h {minutes} min" if hours else f"{minutes} min"
    return f"{ends.strftime('%d %b %Y %H:%M')} {ends.tzname() or 'UTC'}, in {span}"


@dataclass(frozen=True)
class _Cap:
    key: str  # a LIMIT_KEYS entry
    used: int  # tokens, or cost in nano-units
    cap: int

    @property
    def daily(self) -> bool:
        return self.key.endswith("_day")

    def describe(self) -> str:
        if self.key.startswith("tokens"):
            return f"{self.used:,} of {self.cap:,} tokens"
        return f"{_money(self.used)} of {_money(self.cap)}"


def _caps(limits: dict[str, float | None], t: Totals) -> list[_Cap]:
    used = {
        "tokens_per_day": t.day_tokens,
        "tokens_per_month": t.month_tokens,
        "cost_per_day": t.day_cost_nanos,
        "cost_per_month": t.month_cost_nanos,
    }
    caps = []
    for key in ("tokens_per_month", "cost_per_month", "tokens_per_day", "cost_per_day"):  # the later reset first
        cap = limits.get(key)
        if cap is not None:
            caps.append(_Cap(key, used[key], int(cap) if key.startswith("tokens") else round(cap * NANOS)))
    return caps


@dataclass(frozen=True)
class AudioCharge:
    """Transcription for one payer at `transcription.price_per_minute`: checked before,
    counted after (gateway/media.py)."""

    meter: Meter
    payer: Payer
    price_per_minute: float

    async def check(self) -> None:
        await self.meter.check(self.payer)

    async def minutes(self, seconds: float) -> None:
        await self.meter.charge_cost(self.payer, round(seconds / 60 * self.price_per_minute * NANOS))


class Meter:
    """The gate: budgets, the ledger and the fair share of every model call (see above)."""

    def __init__(
        self,
        llm: LLMConfig,
        budgets: BudgetsConfig | None = None,
        *,
        admins: frozenset[str] = frozenset(),
        fair: FairShare | None = None,
        ledger_for: Callable[[Profile], Ledger] | None = None,
        sink: UsageSink | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.llm = llm
        self.budgets = budgets or BudgetsConfig()
        self.admins = admins
        self.fair = fair or FairShare(llm.max_concurrency)
        self._ledger_for = ledger_for
        self._sink = sink
        self.clock = clock

    @classmethod
    def for_profiles(
        cls,
        llm: LLMConfig,
        budgets: BudgetsConfig,
        *,
        admins: frozenset[str],
        sink: UsageSink | None = None,
        clock: Callable[[], float] = time.time,
        ledger_for: Callable[[Profile], Ledger] | None = None,
    ) -> Meter:
        """The gateway's meter: each tenant's ledger in its profile's state.db, or where
        `ledger_for` keeps it (PostgreSQL in cluster mode, gateway/cluster/budgets.py)."""
        return cls(
            llm,
            budgets,
            admins=admins,
            fair=FairShare(llm.max_concurrency),
            ledger_for=ledger_for or (lambda profile: ProfileLedger(profile.sessions)),
            sink=sink,
            clock=clock,
        )

    # ----- who pays --------------------------------------------------------------------
    async def payer(self, profile: Profile, lane: Lane) -> Payer:
        """The payer of a call serving `lane` (in `profile`, the lane's tenant): its time
        zone (a person's, from their reminders; UTC for a chat) and caps, as their files
        say now (re-read only when one changed: no thread hop on a turn)."""
        person = lane.kind == "person"
        zone = await profile.time_zone() if person else _UTC
        override = await profile.budget_override()
        base = self.budgets.per_person if person else self.budgets.per_chat
        exempt = self.budgets.exempt_admins and lane.principal in self.admins
        ledger = self._ledger_for(profile) if self._ledger_for is not None else None
        return Payer(profile.tenant_id, lane.kind, exempt, zone, ledger, effective_limits(base, override))

    # ----- the gate --------------------------------------------------------------------
    async def check(self, payer: Payer | None) -> None:
        """Raise `BudgetExceeded` when a cap of the payer is reached (no call may be made)."""
        if payer is None or payer.ledger is None or not payer.capped:
            return
        period = period_of(payer.zone, self.clock())
        used = await payer.ledger.totals(period.day, period.month)
        if over_cap(used, payer.limits) is not None:
            await self._refuse(payer, used)

    async def _refuse(self, payer: Payer, used: Totals) -> None:
        assert payer.ledger is not None
        now = self.clock()
        period = period_of(payer.zone, now)
        key = over_cap(used, payer.limits) or "tokens_per_day"
        cap = next(c for c in _caps(payer.limits, used) if c.key == key)
        say = await payer.ledger.mark_once(f"refused:{period.day if cap.daily else period.month}")
        if self._sink is not None:
            self._sink.budget_refused()
        who = "You have" if payer.kind == "person" else "This chat has"
        which = "today's" if cap.daily else "this month's"
        ends = period.day_ends if cap.daily else period.month_ends
        raise BudgetExceeded(
            f"{who} used {which} model budget ({cap.describe()}), so I can't answer until it resets on "
            f"{_when(ends, now)}.",
            say,
        )

    def ahead(self, payer: Payer | None, client: LLMClient, prompt_tokens: int, max_tokens: int) -> Reservation | None:
        """A reservation for the next call of `payer` to be made inside the turn's write
        (`StoreLedger.reserving`); None when its ledger lives elsewhere (cluster mode)."""
        if payer is None or not isinstance(payer.ledger, StoreLedger):
            return None
        prices = price_of(self.llm, client.model)
        return Reservation(
            secrets.token_hex(8),
            period_of(payer.zone, self.clock()),
            prompt_tokens + max_tokens,
            cost_nanos(prices, prompt_tokens, max_tokens),
            payer.limits if payer.capped else {},
        )

    async def refuse(self, payer: Payer, r: Reservation) -> None:
        """A folded reservation found a cap reached: raise `BudgetExceeded`."""
        await self._refuse(payer, r.before)

    async def release(self, payer: Payer, r: Reservation) -> None:
        """A reservation no call used (the turn ended first): its estimate is taken back."""
        if payer.ledger is not None:
            await payer.ledger.settle(r.call_id, r.period.day, r.period.month, 0, 0)

    async def chat(
        self,
        payer: Payer | None,
        client: LLMClient,
        messages: list[dict[str, Any]],
        *,
        notify: Notify | None = None,
        reserved: Reservation | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        """One model call for `payer`: checked and reserved (one ledger write, unless
        `reserved` says the turn's write made it), fairly scheduled, settled from the
        response's usage."""
        model = str(kwargs.get("model") or client.model)
        prices = price_of(self.llm, model)
        est_prompt = estimate_prompt_tokens(messages)
        est_out = int(kwargs.get("max_tokens") or self.llm.answer_max_tokens())
        ledger = payer.ledger if payer is not None else None
        if reserved is not None:
            period, call_id, before = reserved.period, reserved.call_id, reserved.before
        else:
            period = period_of(payer.zone if payer is not None else _UTC, self.clock())
            call_id = secrets.token_hex(8)
            before = Totals()
            if payer is not None and ledger is not None:
                limits = payer.limits if payer.capped else {}
                est_cost = cost_nanos(prices, est_prompt, est_out)
                before, ok = await ledger.reserve(
                    call_id, period.day, period.month, est_prompt + est_out, est_cost, limits
                )
                if not ok:
                    await self._refuse(payer, before)
        try:
            async with self.fair.slot(payer.tenant_id if payer is not None else "-"):
                result = await client.chat(messages, **kwargs)
        except LLMError as err:
            if ledger is not None and not isinstance(err, LLMTimeout):  # answered with an error: nothing used
                await ledger.settle(call_id, period.day, period.month, 0, 0)
            raise
        usage = result.usage
        if usage is None:  # the server said nothing: the estimate stays counted
            p, c = est_prompt, est_out
        else:
            p, c = usage.prompt_tokens, usage.completion_tokens
        cost = cost_nanos(prices, p, c)
        if ledger is not None:
            await ledger.settle(call_id, period.day, period.month, p + c, cost)
        if self._sink is not None:
            self._sink.model_usage(p, c, cost / NANOS)
        if notify is not None and payer is not None and payer.capped:
            after = Totals(
                before.day_tokens + p + c,
                before.day_cost_nanos + cost,
                before.month_tokens + p + c,
                before.month_cost_nanos + cost,
            )
            await self._warn(payer, after, notify)
        return result

    async def _warn(self, payer: Payer, used: Totals, notify: Notify) -> None:
        """Say once per period that `budgets.warn_at` of a cap is used."""
        assert payer.ledger is not None
        now = self.clock()
        period = period_of(payer.zone, now)
        for cap in _caps(payer.limits, used):
            if cap.used < cap.cap * self.budgets.warn_at:
                continue
            if not await payer.ledger.mark_once(f"warned:{cap.key}:{period.day if cap.daily else period.month}"):
                continue
            who = "You have" if payer.kind == "person" else "This chat has"
            which = "today's" if cap.daily else "this month's"
            ends = period.day_ends if cap.daily else period.month_ends
            await notify(
                "warning",
                f"{who} used {100 * cap.used // max(cap.cap, 1)}% of {which} model budget ({cap.describe()}); "
                f"it resets on {_when(ends, now)}.",
            )
            return

    async def charge_cost(self, payer: Payer, nanos: int) -> None:
        """Count a cost that is known when it is incurred (a transcription's minutes)."""
        if payer.ledger is not None and nanos > 0:
            period = period_of(payer.zone, self.clock())
            call_id = secrets.token_hex(8)
            await payer.ledger.reserve(call_id, period.day, period.month, 0, nanos, {})
            await payer.ledger.settle(call_id, period.day, period.month, 0, nanos)
        if self._sink is not None:
            self._sink.model_usage(0, 0, nanos / NANOS)

    # ----- /usage ----------------------------------------------------------------------
    async def report(self, payer: Payer) -> list[str]:
        """Today's and this month's use and what is left, as lines for `/usage`."""
        if payer.ledger is None:
            return []
        now = self.clock()
        period = period_of(payer.zone, now)
        t = await payer.ledger.totals(period.day, period.month)
        limits = payer.limits
        lines = []
        for label, tokens, cost, tkey, ckey, ends in (
            ("Today", t.day_tokens, t.day_cost_nanos, "tokens_per_day", "cost_per_day", period.day_ends),
            ("This month", t.month_tokens, t.month_cost_nanos, "tokens_per_month", "cost_per_month", period.month_ends),
        ):
            line = f"{label}: {tokens:,} tokens, {_money(cost)}"
            left = []
            token_cap, cost_cap = limits.get(tkey), limits.get(ckey)
            if not payer.exempt and token_cap is not None:
                left.append(f"{max(0, int(token_cap) - tokens):,} of {int(token_cap):,} tokens")
            if not payer.exempt and cost_cap is not None:
                cap = round(cost_cap * NANOS)
                left.append(f"{_money(max(0, cap - cost))} of {_money(cap)}")
            if left:
                line += f"; left: {', '.join(left)} (resets {_when(ends, now)})"
            lines.append(line)
        if payer.exempt:
            lines.append("You are an admin: counted, never capped.")
        return lines


__all__ = [
    "AudioCharge",
    "BudgetExceeded",
    "Ledger",
    "Meter",
    "Payer",
    "Period",
    "Reservation",
    "StoreLedger",
    "UsageSink",
    "cost_nanos",
    "effective_limits",
    "estimate_prompt_tokens",
    "estimate_stored_tokens",
    "period_of",
    "price_of",
]
