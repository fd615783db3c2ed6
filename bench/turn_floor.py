#!/usr/bin/env python3
"""The floor under a gateway turn: what one CPython process pays for the bare minimum.

    python bench/turn_floor.py --tenants 1000 --messages 5 --concurrency 64 [--max-open 256]

Per turn, and nothing else: the raw ceiling's storage of the person's message (a journal
line on an O_APPEND fd, one SQLite transaction with the real schema and its FTS trigger),
one chat-completion request to the same fake model `gateway_bench.py` uses (aiohttp, one
shared session, JSON in and out), then the answer stored the same way. All of it on the
event loop (no thread hop, no GIL hand-off), `fsync: batch` done by the same 50 ms syncer
as the raw ceiling. No tenancy, inbox, outbox, prompt building, tokenizer, memory or
metrics. With `--max-open` below `--tenants` the least recently used tenant's connection is
closed and reopened like the gateway's profile LRU does.

What it tells: the gateway's CPU-per-turn target (1.5 ms, the whole gateway) against the CPU
this bare loop needs on the same machine. Prints one line per run; `--json` for a dict.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import sys
import tempfile
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.gateway_bench import FakeLLMProcess, RawTenant, fsync_and_close, git_state, schedule, tenant_user  # noqa: E402


class FloorTenant(RawTenant):
    """RawTenant opened the way the store opens a profile: `agent.sessions.db.connect`, which
    runs the schema script only when `PRAGMA user_version` says it has not run yet."""

    def __init__(self, root: Path, t: int) -> None:
        from agent.sessions.db import connect

        prof = root / "profiles" / tenant_user(t)
        (prof / "sessions").mkdir(parents=True, exist_ok=True)
        self.sid = f"20250101_000000_{t:08x}"
        self.fd = os.open(prof / "sessions" / f"{self.sid}.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        self.db = connect(prof / "state.db", "batch")
        self.dirty = False


async def run(args: argparse.Namespace, root: Path, base_url: str) -> dict[str, Any]:
    import aiohttp

    open_: OrderedDict[int, RawTenant] = OrderedDict()
    locks = [asyncio.Lock() for _ in range(args.tenants)]
    work = iter(schedule(args.tenants, args.messages, args.order))
    reopened = 0
    seen: set[int] = set()
    url = f"{base_url}/chat/completions"
    stop = asyncio.Event()

    def tenant(t: int) -> RawTenant:
        nonlocal reopened
        rt = open_.pop(t, None)
        if rt is None:
            rt = FloorTenant(root, t)
            reopened += t in seen
            seen.add(t)
            # the least recently used tenants not in a turn (as the gateway's LRU skips busy profiles)
            idle = [k for k in open_ if not locks[k].locked()]
            for k in idle[: max(0, len(open_) - args.max_open + 1)]:
                old = open_.pop(k)
                if old.dirty:
                    os.fsync(old.fd)
                old.close()
        open_[t] = rt
        return rt

    async def syncer() -> None:
        while not stop.is_set():
            await asyncio.sleep(0.05)
            fds = [os.dup(rt.fd) for rt in open_.values() if rt.dirty]
            for rt in open_.values():
                rt.dirty = False
            await asyncio.to_thread(fsync_and_close, fds)

    n = 0
    async with aiohttp.ClientSession() as http:

        async def worker() -> None:
            nonlocal n
            for t, i in work:
                async with locks[t]:
                    n += 1
                    rt = tenant(t)
                    text = f"Hello, this is message {i + 1} from tenant {t}. How are you? [m{n}]"
                    rt.store(f"in-{n}", "user", text, "batch")
                    body = {
                        "model": "bench-model",
                        "messages": [
                            {"role": "system", "content": "You are helpful."},
                            {"role": "user", "content": text},
                        ],
                    }
                    async with http.post(url, json=body) as resp:
                        answer = (await resp.json())["choices"][0]["message"]["content"]
                    rt.store(f"out-{n}", "assistant", answer, "batch")

        sync_task = asyncio.create_task(syncer())
        cpu0, t0 = time.process_time(), time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        elapsed, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        stop.set()
        await sync_task
    for rt in open_.values():
        rt.close()
    turns = args.tenants * args.messages
    return {
        "turns": turns,
        "turns_per_s": round(turns / elapsed, 1),
        "cpu_ms_per_turn": round(1000 * cpu / turns, 3),
        "reopened": reopened,
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tenants", type=int, default=1000)
    p.add_argument("--messages", type=int, default=5)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--max-open", type=int, default=100_000, help="connections kept open (LRU); default: all")
    p.add_argument("--order", choices=["interleaved", "grouped"], default="interleaved")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    with FakeLLMProcess() as fake, tempfile.TemporaryDirectory(prefix="hermes-floor-") as tmp:
        res = asyncio.run(run(args, Path(tmp), fake.base_url))
    res.update(code=git_state(), loadavg=os.getloadavg()[0], max_open=args.max_open)
    if args.json:
        print(json.dumps(res))
    else:
        print(
            f"floor: {args.tenants} tenants x {args.messages}, {args.concurrency} in flight, max_open {args.max_open}: "
            f"{res['turns_per_s']:.0f} turns/s, {res['cpu_ms_per_turn']:.2f} ms CPU/turn (process), "
            f"{res['reopened']} reopens, peak RSS {res['peak_rss_mib']} MiB, code {res['code']}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
