"""Claim + complete throughput of the cluster PostgreSQL layer with 1, 2 and 3 nodes.

Each node is a separate process with its own asyncio loop and connection pool (as separate
gateway nodes would be). Per round: a fresh schema, `--messages` messages spread over
`--lanes` lanes, then every node loops: claim the oldest free lane, take the tenant's
lease, and for each pending message record a one-chunk reply (`finish_turn`) and mark it
sent (`mark_sent`), then release the lane; until nothing is left. No model, no platform:
this is the database's share of a turn. The tenant lease is released with the lane. Prints messages/s per node count, median of
`--runs` runs with min–max spread.

    .venv/bin/python bench/cluster_claim_bench.py [--messages 3000] [--lanes 300] [--runs 3] [--dsn DSN]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import statistics
import sys
import time
import uuid
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gateway.cluster.db import open_pool
from gateway.cluster.inbox import Inbound, claim_lane, record_inbound, release_lane
from gateway.cluster.leases import acquire_lease, register_node, release_lease
from gateway.cluster.migrations import migrate
from gateway.cluster.outbox import finish_turn, mark_sent, unsent_replies

TTL = 30.0


async def _fill(dsn: str, schema: str, messages: int, lanes: int) -> None:
    pool = await open_pool(dsn, schema=schema, max_size=2)
    try:
        await migrate(pool)
        for i in range(messages):
            lane = f"lane-{i % lanes}"
            await record_inbound(
                pool, Inbound("telegram", f"chat-{lane}", str(i), lane, f"tenant-{lane}", {"text": f"message {i}"})
            )
    finally:
        await pool.close()


async def _node(dsn: str, schema: str, node_id: str, ready: mp.Queue, go: mp.Event) -> int:  # type: ignore[valid-type]
    pool = await open_pool(dsn, schema=schema, max_size=2)
    done = 0
    try:
        await register_node(pool, node_id, TTL)
        ready.put(node_id)
        await asyncio.to_thread(go.wait)  # every node connected before the clock starts
        while (claim := await claim_lane(pool, node_id)) is not None:
            lease = await acquire_lease(pool, claim.tenant, node_id, TTL)
            if lease is None:  # another node still holds the tenant: leave the lane for later
                await release_lane(pool, node_id, claim.lane)
                continue
            for msg in claim.messages:
                await finish_turn(pool, lease, node_id, msg.id, [{"text": f"reply to {msg.message_id}"}])
                for entry in await unsent_replies(pool, claim.lane):
                    await mark_sent(pool, lease, node_id, entry)
                done += 1
            await release_lane(pool, node_id, claim.lane)
            await release_lease(pool, lease)  # a real node keeps it while the profile stays open
        return done
    finally:
        await pool.close()


def _node_process(
    dsn: str,
    schema: str,
    node_id: str,
    ready: mp.Queue,
    go: mp.Event,  # type: ignore[valid-type]
    out: mp.Queue,
) -> None:
    out.put(asyncio.run(_node(dsn, schema, node_id, ready, go)))


def one_run(dsn: str, nodes: int, messages: int, lanes: int) -> float:
    schema = f"hermes_bench_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f'CREATE SCHEMA "{schema}"')
    try:
        asyncio.run(_fill(dsn, schema, messages, lanes))
        ctx = mp.get_context("spawn")
        out: mp.Queue = ctx.Queue()
        ready: mp.Queue = ctx.Queue()
        go = ctx.Event()
        procs = [
            ctx.Process(target=_node_process, args=(dsn, schema, f"node-{i}", ready, go, out)) for i in range(nodes)
        ]
        for p in procs:
            p.start()
        for _ in procs:
            ready.get()
        start = time.perf_counter()
        go.set()
        counts = [out.get() for _ in procs]
        elapsed = time.perf_counter() - start
        for p in procs:
            p.join()
        if sum(counts) != messages:
            raise SystemExit(f"{nodes} nodes completed {sum(counts)} of {messages} messages")
        return messages / elapsed
    finally:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA "{schema}" CASCADE')


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dsn", default=os.environ.get("HERMES_TEST_PG_DSN", "postgresql://postgres@127.0.0.1:5432/test"))
    ap.add_argument("--messages", type=int, default=3000)
    ap.add_argument("--lanes", type=int, default=300)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    with psycopg.connect(args.dsn) as conn:
        version = conn.execute("SHOW server_version").fetchone()[0]
    print(
        f"PostgreSQL {version}, {os.cpu_count()} CPUs, {args.messages} messages in {args.lanes} lanes, "
        f"median of {args.runs} runs"
    )
    for nodes in (1, 2, 3):
        rates = [one_run(args.dsn, nodes, args.messages, args.lanes) for _ in range(args.runs)]
        print(
            f"{nodes} node(s): {statistics.median(rates):7.0f} messages/s  "
            f"(min {min(rates):.0f}, max {max(rates):.0f})",
            flush=True,
        )


if __name__ == "__main__":
    main()
