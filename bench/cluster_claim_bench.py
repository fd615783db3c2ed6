"""Claim + complete throughput of the cluster PostgreSQL layer with 1, 2 and 3 nodes.

Each node is a separate process with its own asyncio loop, a real `ClusterNode` (pool,
registration, heartbeats, tenant leases) and the node's real outbox
(`gateway.cluster.ledger.ClusterOutbox`). Per round: a fresh schema, `--messages`
messages spread over `--lanes` lanes, then every node loops: claim the oldest free lane,
hold the tenant's lease, and for each pending message record a one-chunk reply and mark
the message answered (`ClusterOutbox.record`), take the chunk (`next_for`) and mark it sent
(`mark_sent`), then release the lane and the lease; until nothing is left. No model, no
platform: this is the database's share of a turn. Prints messages/s per node count, median
of `--runs` runs with min–max spread.

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
from urllib.parse import quote

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from core.messages import InboundMessage
from core.settings import ClusterConfig
from gateway.cluster.db import open_pool
from gateway.cluster.inbox import Inbound, claim_lane, record_inbound, release_lane
from gateway.cluster.ledger import ClusterOutbox
from gateway.cluster.migrations import migrate
from gateway.cluster.node import ClusterNode, LeaseBusy
from gateway.outbox import Draft

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
    sep = "&" if "?" in dsn else "?"
    cfg = ClusterConfig(postgres_dsn_env="HERMES_BENCH_DSN", node_id=node_id, lease_ttl_s=TTL)
    node = ClusterNode(cfg, f"{dsn}{sep}options={quote(f'-c search_path={schema}')}", pool_size=2)
    outbox = ClusterOutbox(node)
    done = 0
    await node.start()
    try:
        ready.put(node_id)
        await asyncio.to_thread(go.wait)  # every node connected before the clock starts
        while (claim := await claim_lane(node.pool, node_id)) is not None:
            try:
                held = await node.hold(claim.tenant)
            except LeaseBusy:  # another node still holds the tenant: leave the lane for later
                await release_lane(node.pool, node_id, claim.lane)
                continue
            node.claims[claim.lane] = held
            for msg in claim.messages:
                inbound = InboundMessage(
                    platform=msg.platform,
                    chat_id=msg.chat_id,
                    chat_type="dm",
                    user_id=msg.chat_id,
                    message_id=msg.message_id,
                )
                reply = Draft(msg.platform, msg.chat_id, None, f"reply to {msg.message_id}")
                await outbox.record([reply], finish=[(inbound, "answered")], source=inbound)
                while (chunk := await outbox.next_for(msg.platform, msg.chat_id)) is not None:
                    await outbox.mark_sent(chunk.id, f"sent-{chunk.id}")
                done += 1
            del node.claims[claim.lane]
            await release_lane(node.pool, node_id, claim.lane)
            await node.unhold(held)  # a real node keeps it while the profile stays open
        return done
    finally:
        await node.stop()


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
