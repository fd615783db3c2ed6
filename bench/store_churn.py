#!/usr/bin/env python3
"""The session store alone under profile churn: what a turn that reopens its profile costs.

    python bench/store_churn.py --profiles 600 --concurrency 64 --io-threads 4

Creates `--profiles` profiles (one session, one turn each), then twice over walks them all,
`--concurrency` at a time, doing exactly a churned turn's storage: `SessionStore.open`,
`get_or_start`, append the person's message, append the answer (the turn's last write),
close. No gateway, no model. Prints process CPU per turn (all threads) and
turns/s: the ceiling the storage path puts on the gateway when every turn reopens a
profile, and how much of a gateway turn's CPU it is.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from agent.messages import StoredMessage  # noqa: E402
from agent.sessions.pool import StoragePool  # noqa: E402
from agent.sessions.store import SessionStore  # noqa: E402


async def run(args: argparse.Namespace, root: Path) -> tuple[float, float]:
    pool = StoragePool(args.io_threads)

    async def turn(i: int) -> None:
        store = await SessionStore(root / f"p{i}", "batch", pool=pool).open()
        try:
            sid, _ = await store.get_or_start("dm:1", source="bench")
            await store.append(StoredMessage(session_id=sid, role="user", content="hello there " * 10))
            await store.append(StoredMessage(session_id=sid, role="assistant", content="an answer " * 30))
        finally:
            await store.close()

    async def walk() -> None:
        todo = iter(range(args.profiles))

        async def worker() -> None:
            for i in todo:
                await turn(i)

        await asyncio.gather(*(worker() for _ in range(args.concurrency)))

    try:
        await walk()  # create every profile
        cpu0, t0 = time.process_time(), time.perf_counter()
        for _ in range(2):
            await walk()
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - t0
    finally:
        pool.shutdown()
    turns = 2 * args.profiles
    return 1000 * cpu / turns, turns / wall


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--profiles", type=int, default=600)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--io-threads", type=int, default=4)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="hermes-store-") as tmp:
        cpu_ms, turns_s = asyncio.run(run(args, Path(tmp)))
    print(
        f"store churn: {args.profiles} profiles, {args.concurrency} at a time, io_threads {args.io_threads}: "
        f"{cpu_ms:.2f} ms CPU per reopened turn (process), {turns_s:.0f} turns/s"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
