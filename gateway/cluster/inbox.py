"""The shared inbox and lane claims.

An inbound message is recorded (deduplicated by platform, chat and message id) before the
platform is acknowledged; it joins its lane's queue. A node claims one free lane at a time,
the one whose oldest pending message arrived first, and runs that lane's messages in
arrival order until it releases the claim. Claims die with the node's lease: the next
claimer reaps the lanes of nodes that stopped heartbeating.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from psycopg.types.json import Jsonb

from core.errors import LeaseLost
from gateway.cluster.db import ClusterError, Conn, Pool
from gateway.cluster.wakeups import NOTIFY_SQL


class NotClaimed(ClusterError, LeaseLost):
    """This node no longer holds the lane (its node lease expired and the lane was reaped)."""


@dataclass(frozen=True)
class Inbound:
    """A message as it arrives from a platform."""

    platform: str
    chat_id: str
    message_id: str
    lane: str
    tenant: str
    payload: dict[str, Any]
    #: a Discord interaction's follow-up webhook (`ReplyHandle.stored()`), kept apart from
    #: the payload and erased once the message is done
    reply_handle: dict[str, Any] | None = None


@dataclass(frozen=True)
class PendingMessage:
    id: int
    lane: str
    tenant: str
    platform: str
    chat_id: str
    message_id: str
    payload: dict[str, Any]
    received_at: datetime
    answered: bool  # the turn ran; only its unsent reply chunks remain
    reply_handle: dict[str, Any] | None = None  # see `Inbound.reply_handle`


@dataclass(frozen=True)
class Claim:
    lane: str
    tenant: str
    node_id: str
    messages: list[PendingMessage]  # pending, in arrival order (at most the claim's limit)


async def record_inbound(pool: Pool, msg: Inbound) -> int | None:
    """Commit the message to the inbox; its id, or None for a duplicate delivery (already recorded)."""
    async with pool.connection() as conn, conn.transaction():
        return await insert_inbound(conn, msg)


async def insert_inbound(conn: Conn, msg: Inbound) -> int | None:
    """`record_inbound` inside the caller's transaction (a reminder's fence, gateway/cluster/reminders.py)."""
    cur = await conn.execute(
        """INSERT INTO inbox (platform, chat_id, message_id, lane, tenant, payload, reply_handle)
           VALUES (%s, %s, %s, %s, %s, %s, %s)
           ON CONFLICT (platform, chat_id, message_id) DO NOTHING RETURNING id""",
        (
            msg.platform,
            msg.chat_id,
            msg.message_id,
            msg.lane,
            msg.tenant,
            Jsonb(msg.payload),
            Jsonb(msg.reply_handle) if msg.reply_handle is not None else None,
        ),
    )
    row = await cur.fetchone()
    if row is None:
        return None
    await conn.execute(
        """INSERT INTO lanes AS l (lane, tenant, head_id) VALUES (%s, %s, %s)
           ON CONFLICT (lane) DO UPDATE SET head_id = coalesce(l.head_id, EXCLUDED.head_id)""",
        (msg.lane, msg.tenant, row["id"]),
    )
    await conn.execute(NOTIFY_SQL)  # delivered on commit: idle nodes wake up and claim
    return int(row["id"])


_REAP = """UPDATE lanes SET claimed_by = NULL, claimed_at = NULL
           WHERE claimed_by IS NOT NULL AND NOT EXISTS (
               SELECT 1 FROM nodes n WHERE n.node_id = lanes.claimed_by AND n.lease_expires_at > now())"""

CLAIM_SQL = """SELECT lane, tenant FROM lanes
               WHERE claimed_by IS NULL AND head_id IS NOT NULL
               ORDER BY head_id LIMIT 1 FOR UPDATE SKIP LOCKED"""


async def reap_expired_claims(pool: Pool) -> int:
    """Free the lanes of nodes whose lease expired (or that left); how many were freed."""
    async with pool.connection() as conn:
        return (await conn.execute(_REAP)).rowcount


async def claim_lane(pool: Pool, node_id: str, limit: int = 100) -> Claim | None:
    """Claim the free lane whose oldest pending message arrived first; None if there is none.
    Concurrent claimers skip each other's candidate rows, so no lane is handed out twice."""
    await reap_expired_claims(pool)
    async with pool.connection() as conn, conn.transaction():
        alive = await (
            await conn.execute("SELECT 1 FROM nodes WHERE node_id = %s AND lease_expires_at > now()", (node_id,))
        ).fetchone()
        if alive is None:
            raise NotClaimed(f"node {node_id} has no live lease (register it or let it heartbeat)")
        row = await (await conn.execute(CLAIM_SQL)).fetchone()
        if row is None:
            return None
        await conn.execute(
            "UPDATE lanes SET claimed_by = %s, claimed_at = now() WHERE lane = %s", (node_id, row["lane"])
        )
        messages = await _pending(conn, row["lane"], limit)
        return Claim(row["lane"], row["tenant"], node_id, messages)


async def pending_messages(pool: Pool, lane: str, limit: int = 100) -> list[PendingMessage]:
    """The lane's pending messages in arrival order."""
    async with pool.connection() as conn:
        return await _pending(conn, lane, limit)


async def _pending(conn: Conn, lane: str, limit: int) -> list[PendingMessage]:
    cur = await conn.execute(
        """SELECT id, lane, tenant, platform, chat_id, message_id, payload, received_at, answered_at, reply_handle
           FROM inbox WHERE lane = %s AND done_at IS NULL ORDER BY id LIMIT %s""",
        (lane, limit),
    )
    return [
        PendingMessage(
            r["id"],
            r["lane"],
            r["tenant"],
            r["platform"],
            r["chat_id"],
            r["message_id"],
            r["payload"],
            r["received_at"],
            r["answered_at"] is not None,
            r["reply_handle"],
        )
        for r in await cur.fetchall()
    ]


# An interaction token is usable 15 minutes from its interaction, which was created before
# the message was received: past that, only the `ephemeral` flag is kept (a private answer
# must still not be posted in the channel). Done messages lose the whole handle when they
# are marked done (gateway/cluster/ledger.py).
REPLY_HANDLE_LIFE_S = 15 * 60
_SPEND_HANDLES = """UPDATE inbox SET reply_handle = jsonb_build_object('ephemeral', reply_handle->'ephemeral')
                    WHERE reply_handle ? 'token' AND received_at < now() - make_interval(secs => %s)"""


async def spend_expired_handles(pool: Pool) -> int:
    """Erase the interaction tokens that can no longer be used; how many."""
    async with pool.connection() as conn:
        return (await conn.execute(_SPEND_HANDLES, (REPLY_HANDLE_LIFE_S,))).rowcount


async def lock_claimed_lane(conn: Conn, lane: str, node_id: str) -> None:
    """Inside a transaction: lock the lane row and check this node still holds it."""
    row = await (await conn.execute("SELECT claimed_by FROM lanes WHERE lane = %s FOR UPDATE", (lane,))).fetchone()
    if row is None or row["claimed_by"] != node_id:
        raise NotClaimed(f"lane {lane} is not claimed by {node_id}")


async def refresh_lane_head(conn: Conn, lane: str) -> None:
    """Inside a transaction holding the lane row: point `head_id` at the oldest pending message.
    A separate statement after the row lock, so it sees every insert that committed before."""
    await conn.execute(
        """UPDATE lanes SET head_id = (SELECT min(id) FROM inbox WHERE lane = %s AND done_at IS NULL)
           WHERE lane = %s""",
        (lane, lane),
    )


async def release_lane(pool: Pool, node_id: str, lane: str) -> bool:
    """Give the lane back (its turn is over); False if this node no longer held it."""
    async with pool.connection() as conn, conn.transaction():
        try:
            await lock_claimed_lane(conn, lane, node_id)
        except NotClaimed:
            return False
        await refresh_lane_head(conn, lane)
        await conn.execute("UPDATE lanes SET claimed_by = NULL, claimed_at = NULL WHERE lane = %s", (lane,))
        await conn.execute(NOTIFY_SQL)  # the lane may still have work for another node
        return True
