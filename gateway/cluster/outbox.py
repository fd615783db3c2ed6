"""The shared outbox: a turn's reply chunks are recorded, fenced by the tenant's lease, in
the same transaction that marks the message answered; they are sent in order by whichever
node holds the lane, and a chunk's `sent_at` is fenced too. After a failover the next
holder of the lane finds the unsent chunks with `unsent_replies` and sends them, in order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from psycopg.types.json import Jsonb

from gateway.cluster.db import Pool, fetch_one
from gateway.cluster.inbox import lock_claimed_lane, refresh_lane_head
from gateway.cluster.leases import Lease, fenced


@dataclass(frozen=True)
class OutboxEntry:
    id: int
    inbox_id: int
    seq: int
    lane: str
    platform: str
    chat_id: str
    body: dict[str, Any]


async def finish_turn(pool: Pool, lease: Lease, node_id: str, inbox_id: int, chunks: list[dict[str, Any]]) -> list[int]:
    """Record the reply chunks of the turn for `inbox_id` and mark it answered, all or nothing
    and only under a current lease (FencedOut) on a lane this node holds (NotClaimed).
    A message answered already keeps its first reply (idempotent). No chunks: done at once."""
    async with fenced(pool, lease) as conn:
        msg = await (
            await conn.execute(
                "SELECT lane, tenant, platform, chat_id, answered_at FROM inbox WHERE id = %s", (inbox_id,)
            )
        ).fetchone()
        if msg is None:
            raise ValueError(f"no inbox message {inbox_id}")
        if msg["tenant"] != lease.tenant:
            raise ValueError(f"inbox message {inbox_id} belongs to another tenant than the lease")
        await lock_claimed_lane(conn, msg["lane"], node_id)
        if msg["answered_at"] is not None:
            cur = await conn.execute("SELECT id FROM outbox WHERE inbox_id = %s ORDER BY seq", (inbox_id,))
            return [r["id"] for r in await cur.fetchall()]
        ids = []
        for seq, body in enumerate(chunks):
            row = await fetch_one(
                conn,
                """INSERT INTO outbox (inbox_id, seq, lane, tenant, platform, chat_id, body, epoch)
                         VALUES (%s, %s, %s, %s, %s, %s, %s, %s) RETURNING id""",
                (inbox_id, seq, msg["lane"], msg["tenant"], msg["platform"], msg["chat_id"], Jsonb(body), lease.epoch),
            )
            ids.append(row["id"])
        await conn.execute(
            """UPDATE inbox SET answered_at = now(), done_epoch = %s,
                                  done_at = CASE WHEN %s THEN now() END WHERE id = %s""",
            (lease.epoch, not chunks, inbox_id),
        )
        if not chunks:
            await refresh_lane_head(conn, msg["lane"])
        return ids


async def unsent_replies(pool: Pool, lane: str) -> list[OutboxEntry]:
    """The lane's recorded but unsent chunks, in the order they must go out."""
    async with pool.connection() as conn:
        cur = await conn.execute(
            """SELECT id, inbox_id, seq, lane, platform, chat_id, body FROM outbox
               WHERE lane = %s AND sent_at IS NULL ORDER BY inbox_id, seq""",
            (lane,),
        )
        return [
            OutboxEntry(r["id"], r["inbox_id"], r["seq"], r["lane"], r["platform"], r["chat_id"], r["body"])
            for r in await cur.fetchall()
        ]


async def mark_sent(pool: Pool, lease: Lease, node_id: str, entry: OutboxEntry) -> None:
    """The platform accepted this chunk. Fenced; when it was the message's last unsent chunk
    the inbox message is done and the lane's head moves on."""
    async with fenced(pool, lease) as conn:
        await lock_claimed_lane(conn, entry.lane, node_id)
        cur = await conn.execute(
            "UPDATE outbox SET sent_at = now(), sent_epoch = %s WHERE id = %s AND tenant = %s AND sent_at IS NULL",
            (lease.epoch, entry.id, lease.tenant),
        )
        if cur.rowcount == 0:
            return  # sent already (or not this tenant's): nothing to do
        left = await (
            await conn.execute(
                "SELECT 1 FROM outbox WHERE inbox_id = %s AND sent_at IS NULL LIMIT 1", (entry.inbox_id,)
            )
        ).fetchone()
        if left is None:
            await conn.execute("UPDATE inbox SET done_at = now() WHERE id = %s AND done_at IS NULL", (entry.inbox_id,))
            await refresh_lane_head(conn, entry.lane)
