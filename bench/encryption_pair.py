#!/usr/bin/env python3
"""What per-tenant encryption costs: the gateway benchmark plain and with
`storage.encryption: per_tenant`, alternating in fresh processes, `--runs` pairs (default
3); medians of CPU per turn with the min-max spread and the ratio (docs/privacy.md#what-it-costs).

    python bench/encryption_pair.py --tenants 1000 --messages 5 --runs 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def run_once(tenants: int, messages: int, encrypted: bool) -> dict[str, Any]:
    cmd = [sys.executable, str(HERE / "gateway_bench.py"), "--tenants", str(tenants), "--messages", str(messages)]
    cmd += ["--json", "--no-raw", *(["--encryption"] if encrypted else [])]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    result: dict[str, Any] = json.loads(out.stdout)["gateway"]
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tenants", type=int, default=1000)
    p.add_argument("--messages", type=int, default=5)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    runs: dict[str, list[dict[str, Any]]] = {"plain": [], "per_tenant": []}
    for _ in range(args.runs):
        runs["plain"].append(run_once(args.tenants, args.messages, False))
        runs["per_tenant"].append(run_once(args.tenants, args.messages, True))
    summary: dict[str, Any] = {}
    for name, results in runs.items():
        cpu = [r["cpu_ms_per_turn"] for r in results]
        summary[name] = {
            "cpu_ms_per_turn": [statistics.median(cpu), min(cpu), max(cpu)],
            "turns_per_s": statistics.median(r["turns_per_s"] for r in results),
            "peak_rss_mib": statistics.median(r["peak_rss_kib"] / 1024 for r in results),
        }
    ratios = [
        e["cpu_ms_per_turn"] / p["cpu_ms_per_turn"] for p, e in zip(runs["plain"], runs["per_tenant"], strict=True)
    ]
    summary["ratio"] = [statistics.median(ratios), min(ratios), max(ratios)]
    if args.json:
        print(json.dumps(summary))
        return 0
    for name in ("plain", "per_tenant"):
        s = summary[name]
        med, lo, hi = s["cpu_ms_per_turn"]
        print(
            f"{name:>10}: {med:.2f} ms CPU/turn ({lo:.2f}–{hi:.2f}), {s['turns_per_s']:.0f} turns/s, {s['peak_rss_mib']:.0f} MiB"
        )
    med, lo, hi = summary["ratio"]
    print(f"     ratio: {med:.3f} ({lo:.3f}–{hi:.3f}) per pair, {args.tenants} x {args.messages}, {args.runs} pairs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
