"""Cluster bench: throughput and failover time of real `hermes-gateway run` nodes with 1,
2 and 3 nodes, `--runs` runs each (alternating), median and min–max; `--write FILE` puts
the table into FILE (BENCHMARKS.md) between the `bench:cluster-nodes` markers.

    python -m bench.cluster_bench [--runs 3] [--nodes 1 2 3] [--messages 400] [--people 200]
        [--lease-ttl 5] [--write BENCHMARKS.md]

The nodes, the fakes and the load balancer are bench/cluster_storm.py's (one shared data
dir, one fresh PostgreSQL schema per run, Telegram webhooks round-robin).

- throughput: `--messages` messages from `--people` people handed to the load balancer at
  once (private chats only); answered messages per second from the first hand-over to the
  last answer. Each node paces its Telegram sends under Telegram's limits (1 a second per
  chat, 30 a second overall), so one node cannot exceed 30 answers a second.
- failover: one person sends a message every 0.25 s; once a node answered them, that node
  is SIGKILLed; the figure is the time from the kill to the first answer to that person
  from another node (their lane had to wait for the dead node's lease to lapse, be
  claimed elsewhere and the turn run again). With one node there is no other node: the
  node is restarted at once and the figure is kill to the restarted process's first answer.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.cluster_storm import BASE_DSN, ClusterStorm, fresh_schema, pg_reachable, write_section  # noqa: E402

START, END = "<!-- bench:cluster-nodes:start -->", "<!-- bench:cluster-nodes:end -->"


def _quiet(_: str) -> None:
    pass


async def _wait_answered(storm: ClusterStorm, tokens: set[str], timeout: float) -> float | None:
    """Monotonic time of the last first-answer once every token is answered; None on timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        first: dict[str, float] = {}
        for token, copy in storm._answers():
            first.setdefault(token, copy.at)
        if tokens <= first.keys():
            return max(first[t] for t in tokens)
        await asyncio.sleep(0.1)
    return None


async def throughput(workdir: Path, dsn: str, nodes: int, messages: int, people: int, ttl: float) -> dict[str, Any]:
    storm = ClusterStorm(
        workdir,
        dsn,
        nodes=nodes,
        messages=0,
        people=people,
        kill_every=None,
        lease_ttl_s=ttl,
        model_latency_s=0.05,
        group_share=0.0,  # Telegram allows a group 20 messages a minute: the gate would be the figure
    )
    async with storm.up():
        counters: dict[tuple[str, str], int] = defaultdict(int)
        t0 = time.monotonic()
        tokens = set()
        for n in range(1, messages + 1):
            token, pushed, key = storm._next_message(n, counters)
            storm.send(token, pushed, key)
            tokens.add(token)
        await storm.close_ingress()
        last = await _wait_answered(storm, tokens, timeout=300)
        by_node: dict[str, int] = defaultdict(int)
        for _, copy in storm._answers():
            by_node[copy.node] += 1
    if last is None:
        return {"ok": False, "why": "not every message was answered within 300 s"}
    return {"ok": True, "msg_s": messages / (last - t0), "by_node": dict(by_node)}


async def failover(workdir: Path, dsn: str, nodes: int, ttl: float) -> dict[str, Any]:
    storm = ClusterStorm(workdir, dsn, nodes=nodes, messages=0, people=1, kill_every=None, lease_ttl_s=ttl)
    async with storm.up():
        user = storm.users[0]
        key = f"tg:{user}"
        sent: list[str] = []
        stop = asyncio.Event()

        async def sender() -> None:
            for n in range(1, 100_000):
                if stop.is_set():
                    return
                token = f"tk{n}x{n - 1}"
                pushed = storm.tg.push_private(user, f"hello {token}")
                storm.pushed[token] = ("tg", key, str(user), n - 1)
                storm.send(token, pushed, key)
                sent.append(token)
                await asyncio.sleep(0.25)

        task = asyncio.create_task(sender())
        try:
            victim = None
            deadline = time.monotonic() + 60
            while victim is None and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
                answers = [c for t, c in storm._answers() if storm.pushed.get(t, ("", ""))[1] == key]
                if len(answers) >= 3:  # warmed up: the lane is running on some node
                    victim = next(n for n in storm.nodes if n.name == answers[-1].node)
            if victim is None:
                return {"ok": False, "why": "no answer within 60 s"}
            t_kill = time.monotonic()
            storm._kill(victim)
            if nodes == 1:
                assert victim.proc is not None
                await victim.proc.wait()
                await storm._spawn(victim)
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                after = [
                    c
                    for t, c in storm._answers()
                    if storm.pushed.get(t, ("", ""))[1] == key
                    and c.at > t_kill
                    and (nodes == 1 or c.node != victim.name)
                ]
                if after:
                    return {"ok": True, "failover_s": after[0].at - t_kill, "victim": victim.name, "by": after[0].via}
                await asyncio.sleep(0.02)
            return {"ok": False, "why": "no answer after the kill within 120 s"}
        finally:
            stop.set()
            task.cancel()


def _spread(values: list[float], fmt: str) -> str:
    if not values:
        return "-"
    med = fmt.format(statistics.median(values))
    return med if len(values) == 1 else f"{med} ({fmt.format(min(values))}–{fmt.format(max(values))})"


def machine_line(t0: float, load0: float) -> str:
    """Machine, code, PostgreSQL, time and load (`load0`: the 1-minute load average at `t0`),
    for a BENCHMARKS.md section."""
    from bench.gateway_bench import git_state, machine_info

    m = machine_info()
    try:
        import psycopg

        with psycopg.connect(BASE_DSN, connect_timeout=3) as conn:
            row = conn.execute("SHOW server_version").fetchone()
            pg = f"PostgreSQL {row[0].split()[0]}" if row else "PostgreSQL ?"
    except Exception:
        pg = "PostgreSQL ?"
    return (
        f"Machine: {m['nproc']} vCPU ({m['cpu']}), {m['memory']}, Python {platform.python_version()}, {pg} "
        f"(local, default settings). Code: {git_state()}. {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(t0))}, "
        f"{(time.time() - t0) / 60:.1f} min; load average {load0:.2f} at the start, "
        f"{os.getloadavg()[0]:.2f} at the end (shared machine)."
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--nodes", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--messages", type=int, default=400)
    ap.add_argument("--people", type=int, default=200)
    ap.add_argument("--lease-ttl", type=float, default=5.0)
    ap.add_argument("--write", type=Path)
    args = ap.parse_args(argv)
    import logging

    logging.getLogger("aiohttp.server").setLevel(logging.CRITICAL)
    why = pg_reachable()
    if why is not None:
        print(f"error: PostgreSQL at {BASE_DSN} is unreachable ({why})", file=sys.stderr)
        return 2
    t0, load0 = time.time(), os.getloadavg()[0]
    tput: dict[int, list[dict[str, Any]]] = defaultdict(list)
    fail: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for i in range(args.runs):
        for n in args.nodes:
            for kind in ("throughput", "failover"):
                print(f"run {i + 1}/{args.runs}: {n} node(s), {kind} ...", file=sys.stderr, flush=True)
                with tempfile.TemporaryDirectory(prefix="cluster-bench-") as tmp, fresh_schema() as dsn:
                    if kind == "throughput":
                        res = asyncio.run(throughput(Path(tmp), dsn, n, args.messages, args.people, args.lease_ttl))
                        tput[n].append(res)
                    else:
                        res = asyncio.run(failover(Path(tmp), dsn, n, args.lease_ttl))
                        fail[n].append(res)
                print(f"  {res}", file=sys.stderr, flush=True)
    lines = [
        "| nodes | runs | answered messages/s | failover: kill → first answer by another node (s) |",
        "| --- | --- | --- | --- |",
    ]
    problems = []
    for n in args.nodes:
        ok_t = [r["msg_s"] for r in tput[n] if r["ok"]]
        ok_f = [r["failover_s"] for r in fail[n] if r["ok"]]
        problems += [f"{n} node(s): {r['why']}" for r in tput[n] + fail[n] if not r["ok"]]
        label = "restart of the one node: kill → its first answer" if n == 1 else ""
        cell_f = _spread(ok_f, "{:.2f}") + (f" ({label})" if label else "")
        lines.append(f"| {n} | {args.runs} | {_spread(ok_t, '{:.1f}')} | {cell_f} |")
    body = (
        f"`python -m bench.cluster_bench --runs {args.runs} --messages {args.messages} --people {args.people} "
        f"--lease-ttl {args.lease_ttl:g}` — {machine_line(t0, load0)} Median of the runs, min–max in brackets; "
        f"fake model latency 0–50 ms (throughput) and 0–150 ms (failover); lease_ttl_s {args.lease_ttl:g}.\n\n"
        + "\n".join(lines)
        + "\n\nProblems: "
        + ("; ".join(problems) if problems else "none (every run answered every message).")
    )
    print(body)
    if args.write:
        write_section(args.write, body, START, END)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
