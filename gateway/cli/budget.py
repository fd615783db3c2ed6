"""`budget show|set|reset REF`: one tenant's model budget (docs/operator-guide.md#costs-and-budgets).

The counts live in the tenant's own state.db (agent/ledger.py), or in PostgreSQL in cluster
mode (gateway/cluster/budgets.py); these commands run the same code as the gateway, in one
transaction each, and work while it runs: the gateway reads the override and the counts on
every model call, so `budget set` lifts a cap at once.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

import apsw

from agent import ledger
from agent.ledger import LIMIT_KEYS, NANOS
from agent.metering import effective_limits, period_of
from agent.reminders import ReminderStore
from core.settings import Config
from gateway.cli.common import CONFIG_HELP, admin_keyring, admin_links, guard
from gateway.runlock import AdminError
from gateway.tenants import TenantInfo, find_tenant, profile_files, profile_key

if TYPE_CHECKING:
    from gateway.cluster.budgets import PgLedger

T = TypeVar("T")


def _in_ledger(cfg: Config, info: TenantInfo, fn: Callable[[apsw.Connection], T]) -> T | None:
    """Run `fn` in one transaction of the tenant's state.db (None: it has none yet), keyed
    with the tenant's key when encrypted (docs/privacy.md#encryption-at-rest).

    APSW, like the gateway's store: two SQLite libraries with one file open in one process
    do not see each other's locks, and the stdlib's close can truncate the shared-memory
    index under APSW's mapping (a bus error), as when this runs inside a live gateway's process."""
    path = info.path / "state.db"
    if not path.exists():
        return None
    key = profile_key(admin_keyring(cfg), info)
    try:
        db = apsw.Connection(str(path), flags=apsw.SQLITE_OPEN_READWRITE)
    except apsw.Error as err:
        raise AdminError(f"cannot read or write the budget in {path}: {err}") from err
    try:
        if key is not None:
            db.execute(key.db_pragma()).fetchall()
        db.set_busy_timeout(10000)
        db.execute("BEGIN IMMEDIATE")
        try:
            ledger.ensure_tables(db)  # a profile no store opened since the ledger came
            result = fn(db)
        except BaseException:
            db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")
        return result
    except apsw.Error as err:
        raise AdminError(f"cannot read or write the budget in {path}: {err}") from err
    finally:
        db.close()


def _in_cluster(cfg: Config, info: TenantInfo, fn: Callable[[PgLedger], Awaitable[T]]) -> T:
    """Run `fn` on the tenant's counts in PostgreSQL (cluster mode keeps them there)."""
    # psycopg and gateway/cluster are imported only in cluster mode (docs/cluster.md)
    from gateway.cluster.budgets import with_cluster_ledger
    from gateway.cluster.db import ClusterError

    try:
        return with_cluster_ledger(cfg, info.tenant_id, fn)
    except ClusterError as err:
        raise AdminError(f"cannot read or write the budget of {info.tenant_id} in PostgreSQL: {err}") from err


def _status(cfg: Config, info: TenantInfo) -> dict[str, Any]:
    files = profile_files(cfg, info)
    zone = ReminderStore(files).zone_now()
    period = period_of(zone, time.time())
    if cfg.cluster.enabled:
        totals = _in_cluster(cfg, info, lambda pg: pg.totals(period.day, period.month))
    else:
        totals = _in_ledger(cfg, info, lambda db: ledger.totals(db, period.day, period.month)) or ledger.Totals()
    override = ledger.read_override(files)
    base = cfg.budgets.per_person if info.kind == "person" else cfg.budgets.per_chat
    return {
        "tenant": info.tenant_id,
        "kind": info.kind,
        "time_zone": str(zone),
        "day": period.day,
        "month": period.month,
        "used": {
            "tokens_today": totals.day_tokens,
            "cost_today": totals.day_cost_nanos / NANOS,
            "tokens_this_month": totals.month_tokens,
            "cost_this_month": totals.month_cost_nanos / NANOS,
        },
        "limits": effective_limits(base, override),
        "override": override,
    }


def cmd_budget_show(cfg: Config, args: argparse.Namespace) -> int:
    data = _status(cfg, find_tenant(cfg, args.tenant, admin_links(cfg)))
    if args.json:
        print(json.dumps(data, indent=1))
        return 0
    used, limits = data["used"], data["limits"]

    def cap(key: str) -> str:
        value = limits[key]
        mark = " (override)" if key in data["override"] else ""
        return "no cap" + mark if value is None else f"{value:,}{mark}"

    print(f"tenant:      {data['tenant']} ({data['kind']}), days in {data['time_zone']}")
    print(
        f"today:       {used['tokens_today']:,} tokens (cap {cap('tokens_per_day')}), "
        f"{used['cost_today']:.4f} (cap {cap('cost_per_day')})"
    )
    print(
        f"this month:  {used['tokens_this_month']:,} tokens (cap {cap('tokens_per_month')}), "
        f"{used['cost_this_month']:.4f} (cap {cap('cost_per_month')})"
    )
    return 0


def _limit(kind: type[int] | type[float]) -> Callable[[str], int | float | None]:
    def parse(text: str) -> int | float | None:
        if text.strip().lower() in ("none", "off"):
            return None
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number (or 'none' for no cap)") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"{text!r} must be above 0 (or 'none' for no cap)")
        return value

    return parse


def cmd_budget_set(cfg: Config, args: argparse.Namespace) -> int:
    info = find_tenant(cfg, args.tenant, admin_links(cfg))
    given = {k: getattr(args, k) for k in LIMIT_KEYS if getattr(args, k) is not ...}
    if not given and not args.default:
        raise AdminError("name at least one of --tokens-per-day, --tokens-per-month, --cost-per-day, --cost-per-month")

    files = profile_files(cfg, info)
    override = {} if args.default else ledger.read_override(files)
    override.update(given)
    ledger.write_override(files, override)
    shown = ", ".join(f"{k}={'none' if v is None else v}" for k, v in override.items()) or "the config's limits"
    print(f"{info.tenant_id}: budget now {shown}")
    return 0


def cmd_budget_reset(cfg: Config, args: argparse.Namespace) -> int:
    info = find_tenant(cfg, args.tenant, admin_links(cfg))
    if cfg.cluster.enabled:
        _in_cluster(cfg, info, lambda pg: pg.reset())
    else:
        _in_ledger(cfg, info, ledger.reset)
    print(f"{info.tenant_id}: usage counts reset to zero (its limits are unchanged)")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add `budget show|set|reset` to the command line."""
    tenant_help = "tenant id (telegram-111), principal (telegram:111) or profile directory name"
    budget = sub.add_parser("budget", help="show, set or reset a tenant's model budget")
    bsub = budget.add_subparsers(dest="budget_command", required=True)
    p = bsub.add_parser("show", help="today's and this month's use and the caps that apply")
    p.add_argument("tenant", help=tenant_help)
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(handler=guard(cmd_budget_show))
    p = bsub.add_parser("set", help="a per-tenant override of the budgets.* caps ('none': no cap)")
    p.add_argument("tenant", help=tenant_help)
    for key in LIMIT_KEYS:
        p.add_argument(
            f"--{key.replace('_', '-')}",
            dest=key,
            default=...,
            type=_limit(int if key.startswith("tokens") else float),
            metavar="N" if key.startswith("tokens") else "X",
            help=f"this tenant's {key.replace('_', ' ')} ('none': no cap); unnamed caps keep the config's",
        )
    p.add_argument("--default", action="store_true", help="drop the override first (the config's caps apply)")
    p.set_defaults(handler=guard(cmd_budget_set))
    p = bsub.add_parser("reset", help="set the tenant's counts back to zero (caps unchanged)")
    p.add_argument("tenant", help=tenant_help)
    p.set_defaults(handler=guard(cmd_budget_reset))
    for p in bsub.choices.values():
        p.add_argument("-c", "--config", dest="config", default=argparse.SUPPRESS, help=CONFIG_HELP)
