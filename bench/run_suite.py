#!/usr/bin/env python3
"""`make bench`: the gateway benchmark at 1,000 tenants x 5 and 10,000 tenants x 2 messages,
each run `--runs` times (default 3, alternating, each in a fresh process so peak RSS and
thread counts are its own), each followed by `turn_floor.py` on the same work and LRU size
(the bare minimum a turn costs in one CPython process), medians with the min-max spread;
`--write FILE` puts the table into FILE (BENCHMARKS.md) between the `bench:gateway-suite`
markers.

    python bench/run_suite.py --runs 3 --write BENCHMARKS.md
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
START, END = "<!-- bench:gateway-suite:start -->", "<!-- bench:gateway-suite:end -->"
CONFIGS = [(1000, 5), (10000, 2)]


def run_once(tenants: int, messages: int, extra: list[str]) -> dict[str, Any]:
    cmd = [
        sys.executable,
        str(HERE / "gateway_bench.py"),
        "--tenants",
        str(tenants),
        "--messages",
        str(messages),
        "--json",
        *extra,
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    res: dict[str, Any] = json.loads(out.stdout)
    floor = [sys.executable, str(HERE / "turn_floor.py"), "--tenants", str(tenants), "--messages", str(messages)]
    max_open = res["args"].get("max_open", 256)
    out = subprocess.run([*floor, "--max-open", str(max_open), "--json"], capture_output=True, text=True, check=True)
    res["floor"] = json.loads(out.stdout)
    return res


def figures(res: dict[str, Any]) -> dict[str, float]:
    g, probes = res["gateway"], res["gateway"]["probes"]
    return {
        "turns_s": g["turns_per_s"],
        "share": 100 * res.get("share_of_raw", float("nan")),
        "raw_msg_s": res.get("raw", {}).get("messages_per_s", float("nan")),
        "cpu_ms": g["cpu_ms_per_turn"],
        "storage_cpu_ms": g.get("storage_cpu_ms_per_turn", float("nan")),
        "calls": g.get("storage_calls_per_turn", float("nan")),
        "warm_ms": probes.get("warm", {}).get("overhead_p50_ms", float("nan")),
        "cold_ms": probes.get("cold", {}).get("overhead_p50_ms", float("nan")),
        "warm_calls": probes.get("warm", {}).get("storage_calls_per_turn", float("nan")),
        "threads": g["peak_threads"],
        "rss_mib": g["peak_rss_kib"] / 1024,
        "fds": g["peak_fds"],
        "floor_turns_s": res.get("floor", {}).get("turns_per_s", float("nan")),
        "floor_cpu_ms": res.get("floor", {}).get("cpu_ms_per_turn", float("nan")),
    }


def spread(values: list[float], fmt: str) -> str:
    med = statistics.median(values)
    if len(values) == 1:
        return fmt.format(med)
    return f"{fmt.format(med)} ({fmt.format(min(values))}–{fmt.format(max(values))})"


def table(results: dict[tuple[int, int], list[dict[str, Any]]]) -> str:
    cols = [
        ("turns/s", "turns_s", "{:.0f}"),
        ("share of raw", "share", "{:.1f} %"),
        ("raw msg/s", "raw_msg_s", "{:.0f}"),
        ("CPU / turn", "cpu_ms", "{:.2f} ms"),
        ("of it in storage calls", "storage_cpu_ms", "{:.2f} ms"),
        ("unloaded overhead p50: open", "warm_ms", "{:.2f} ms"),
        ("reopened", "cold_ms", "{:.2f} ms"),
        ("storage calls / warm turn", "warm_calls", "{:.2f}"),
        ("threads at peak", "threads", "{:.0f}"),
        ("peak RSS", "rss_mib", "{:.0f} MiB"),
        ("peak fds", "fds", "{:.0f}"),
        ("floor turns/s", "floor_turns_s", "{:.0f}"),
        ("floor CPU / turn", "floor_cpu_ms", "{:.2f} ms"),
    ]
    lines = [
        "| tenants × msgs | runs | " + " | ".join(c[0] for c in cols) + " |",
        "| --- | --- | " + " | ".join("---" for _ in cols) + " |",
    ]
    for (t, m), runs in results.items():
        figs = [figures(r) for r in runs]
        cells = [spread([f[key] for f in figs], fmt) for _, key, fmt in cols]
        lines.append(f"| {t:,} × {m} | {len(runs)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def problems(results: dict[tuple[int, int], list[dict[str, Any]]]) -> list[str]:
    out = []
    for (t, m), runs in results.items():
        for r in runs:
            g = r["gateway"]
            bad = {k: v for k, v in g["leftovers"].items() if v}
            if g["failures"] or not g["drained"] or bad or r.get("warnings"):
                out.append(
                    f"{t}×{m}: failures {g['failures']}, drained {g['drained']}, leftovers {bad}, "
                    f"warnings {list(r.get('warnings', {}))[:2]}"
                )
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--write", type=Path, default=None, help="update this markdown file between the markers")
    args, extra = p.parse_known_args()
    results: dict[tuple[int, int], list[dict[str, Any]]] = {c: [] for c in CONFIGS}
    t0 = time.time()
    load0 = os.getloadavg()[0]
    for i in range(args.runs):
        for tenants, messages in CONFIGS:
            print(f"run {i + 1}/{args.runs}: {tenants} tenants x {messages} ...", file=sys.stderr, flush=True)
            results[(tenants, messages)].append(run_once(tenants, messages, extra))
    any_run = results[CONFIGS[0]][0]
    m = any_run["machine"]
    opened = sorted({r["args"].get("max_open") for runs in results.values() for r in runs} - {None})
    head = (
        f"Machine: {m['nproc']} vCPU ({m['cpu']}), {m['memory']}, Python {m['python']}, SQLite {m['sqlite']}, "
        f"{any_run.get('disk', '?')}. Code: {m['git']}. {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(t0))}, "
        f"{(time.time() - t0) / 60:.1f} min; load average {load0:.2f} at the start, "
        f"{os.getloadavg()[0]:.2f} at the end (the machine is shared: wall-clock figures are noisy, "
        "CPU / turn is the steadier one). Median of the runs, min–max in brackets; `fsync: batch`, "
        "64 in flight, the shipped open-profile cache (the default `storage.memory_budget_mib`: "
        f"{', '.join(map(str, opened)) or '?'} profiles open at most), zero-latency model in another process. *Floor*: "
        "`bench/turn_floor.py` right after each run, same tenants, order, concurrency and LRU size."
    )
    body = head + "\n\n" + table(results)
    issues = problems(results)
    body += "\n\nProblems: " + ("; ".join(issues) if issues else "none (no failure, warning or leftover in any run).")
    print(body)
    if args.write is not None:
        text = args.write.read_text(encoding="utf-8")
        if START in text and END in text:
            before, rest = text.split(START, 1)
            after = rest.split(END, 1)[1]
            text = before + START + "\n" + body + "\n" + END + after
        else:
            text = text.rstrip("\n") + "\n\n" + START + "\n" + body + "\n" + END + "\n"
        args.write.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
