"""`doctor` (check the config, the data directory, the model and the platforms) and
`health` (ask a running gateway's /healthz) (docs/operator-guide.md#health-and-metrics)."""

from __future__ import annotations

import argparse
import asyncio
import sys

from core.settings import Config
from gateway.cli.common import guard, setup_logging


def register_doctor(sub: argparse._SubParsersAction) -> None:
    doctor = sub.add_parser("doctor", help="check the config, the data directory, the model and the platforms")
    doctor.add_argument("--deep", action="store_true", help="also run integrity_check on every profile's state.db")


def register_health(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("health", help="ask the running gateway's /healthz (exit 0 when healthy)")
    p.add_argument("--listen", default=None, help="host:port (default: observability.listen)")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for an answer (default 5)")
    p.add_argument("-q", "--quiet", action="store_true", help="print nothing; only the exit status tells")
    p.set_defaults(handler=guard(cmd_health))


def cmd_doctor(cfg: Config, args: argparse.Namespace) -> int:
    from gateway.doctor import run_doctor

    setup_logging(cfg, quiet=True)
    return asyncio.run(run_doctor(cfg, deep=args.deep))


def cmd_health(cfg: Config, args: argparse.Namespace) -> int:
    from gateway.observability import probe_health

    listen = args.listen or cfg.observability.listen
    if not listen:
        print("observability.listen is not set in the config; there is no health endpoint to ask.", file=sys.stderr)
        return 2
    status, body = probe_health(listen, timeout=args.timeout)
    if not args.quiet:
        print(body.strip())
    return 0 if status == 200 else 1
