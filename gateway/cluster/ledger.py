"""The inbox and outbox of a cluster node, in PostgreSQL, behind the faces GatewayApp and
the Deliverer use on a single node (gateway/inbox.py, gateway/outbox.py).

Every write happens for a lane this node has claimed (`ClusterNode.claims`): the lane row
is locked and checked (`lock_claimed_lane`), the node's own lease must be alive, and a
commit for a tenant runs in `fenced()` under the claim's tenant lease and epoch, after the
local deadline check. A chunk is only handed to the Deliverer (`next_for`) while its lane
is claimed by this node, so two nodes never send the same chunk, except in the window no
platform lets us close (accepted, then the sender died before marking it).
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Sequence
from typing import Any, NoReturn

import psycopg
import psycopg_pool
from psycopg.types.json import Jsonb

from core.errors import LeaseLost
from core.messages import InboundMessage, SentMessage
from gateway.cluster.db import Conn, fetch_one
from gateway.cluster.inbox import NotClaimed, lock_claimed_lane, refresh_lane_head
from gateway.cluster.leases import FencedOut, Lease, fenced
from gateway.cluster.node import ClusterNode, HeldLease
from gateway.outbox import Chunk, Draft

log = logging.getLogger("hermes.cluster")

# a progress notice whose node died before ending it (docs/cluster.md#streaming-and-progress-notices)
NOTICE_CUT_OFF = (
    "Compression was cut off: the server doing it stopped, and another one has taken over your conversation."
)


# what a done message keeps of its payload: who sent it where (a delete still finds a
# person's messages in other lanes, gateway/cluster/erase.py), not what it said
# (docs/cluster.md#the-postgresql-layer)
ERASED_PAYLOAD = (
    "jsonb_build_object('platform', payload->'platform', 'chat_id', payload->'chat_id', "
    "'message_id', payload->'message_id', 'user_id', payload->'user_id')"
)


class NotRecorded(LookupError):
    """A reply for a message that is not in the shared inbox (it is sent directly instead)."""


def _key(msg: InboundMessage) -> tuple[str, str, str]:
    return (msg.platform, msg.chat_id, msg.message_id)


async def insert_chunk(
    conn: Conn,
    inbox_id: int,
    seq: int,
    lane: str,
    tenant: str,
    platform: str,
    chat_id: str,
    body: dict[str, Any],
    lease: Lease,
) -> int:
    """Record one chunk (a reply, a draft, an edit) under `lease`: the statement that
    inserts it is the one that checks the lease is current, so a stale epoch's draft or
    edit is never recorded, whatever was checked before. Raises FencedOut."""
    row = await (
        await conn.execute(
            """INSERT INTO outbox (inbox_id, seq, lane, tenant, platform, chat_id, body, epoch)
               SELECT %s, %s, %s, %s, %s, %s, %s, l.epoch FROM tenant_leases l
               WHERE l.tenant = %s AND l.holder = %s AND l.epoch = %s AND l.expires_at > now()
               RETURNING id""",
            (inbox_id, seq, lane, tenant, platform, chat_id, Jsonb(body), lease.tenant, lease.holder, lease.epoch),
        )
    ).fetchone()
    if row is None:
        raise FencedOut(f"lease on {lease.tenant} at epoch {lease.epoch} is no longer held by {lease.holder}")
    return int(row["id"])


class ClusterInbox:
    """The inbox face: `finish`, `status`, the shared key-value pairs, `prune`. Messages
    are recorded by the ingress (`gateway.cluster.inbox.record_inbound`), not here."""

    def __init__(self, node: ClusterNode, outbox: ClusterOutbox) -> None:
        self.node = node
        self.outbox = outbox

    async def open(self) -> None:
        return None

    async def close(self) -> None:
        return None

    @property
    def db(self) -> NoReturn:
        raise RuntimeError("cluster mode keeps no gateway.db; the inbox is in PostgreSQL")

    async def pending(self) -> list[InboundMessage]:
        """Nothing to replay at start: pending messages are claimed lane by lane."""
        return []

    async def finish(self, msg: InboundMessage, outcome: str) -> None:
        """Mark `msg` done without a reply (refused quietly, empty, ...)."""
        await self.outbox.record([], finish=[(msg, outcome)], source=msg)

    async def status(self, platform: str, chat_id: str, message_id: str) -> str | None:
        async with self.node.pool.connection() as conn:
            row = await (
                await conn.execute(
                    "SELECT done_at FROM inbox WHERE platform = %s AND chat_id = %s AND message_id = %s",
                    (platform, chat_id, message_id),
                )
            ).fetchone()
        if row is None:
            return None
        return "pending" if row["done_at"] is None else "done"

    async def get(self, key: str) -> str | None:
        async with self.node.pool.connection() as conn:
            row = await (await conn.execute("SELECT value FROM shared_kv WHERE key = %s", (key,))).fetchone()
        return row["value"] if row else None

    async def put(self, key: str, value: str | None) -> None:
        async with self.node.pool.connection() as conn:
            if value is None:
                await conn.execute("DELETE FROM shared_kv WHERE key = %s", (key,))
            else:
                await conn.execute(
                    "INSERT INTO shared_kv (key, value) VALUES (%s, %s) ON CONFLICT (key) DO UPDATE SET value = EXCLUDED.value, updated_at = now()",
                    (key, value),
                )

    async def prune(self, older_than_s: float) -> int:
        """Forget messages done longer ago than `older_than_s` (their chunks go with them)."""
        async with self.node.pool.connection() as conn:
            cur = await conn.execute(
                "DELETE FROM inbox WHERE done_at IS NOT NULL AND done_at < now() - make_interval(secs => %s)",
                (older_than_s,),
            )
            return cur.rowcount


class ClusterOutbox:
    """The outbox face: `record` for the app, `next_for`/`mark_sent`/... for the Deliverer."""

    # failures the Deliverer waits out and retries (the database restarting)
    TRANSIENT: tuple[type[BaseException], ...] = (psycopg.OperationalError, psycopg_pool.PoolTimeout, OSError)

    def __init__(self, node: ClusterNode) -> None:
        self.node = node
        self._lanes: dict[int, str] = {}  # chunk id -> lane, for the check right before a send

    async def open(self) -> None:
        return None

    async def close(self) -> None:
        return None

    async def prune(self, older_than_s: float) -> int:
        return 0  # settled chunks go with their inbox message (ClusterInbox.prune)

    async def record(
        self,
        drafts: Sequence[Draft],
        *,
        finish: Sequence[tuple[InboundMessage, str]] = (),
        source: InboundMessage | None = None,
    ) -> list[int]:
        """Record `drafts` (attached to `source`, else the last finished message) and mark
        `finish` answered, in one transaction fenced by the claim's tenant lease. Messages
        answered before keep their first answer: nothing is recorded twice."""
        msgs = ([source] if source is not None else []) + [m for m, _ in finish]
        if not msgs:
            raise ValueError("a record needs the message it answers")
        rows = await self._inbox_rows(msgs)
        anchor = rows.get(_key(source if source is not None else finish[-1][0]))
        if anchor is None:
            raise NotRecorded("the message is not in the shared inbox")
        lane = anchor["lane"]
        held = self.node.claims.get(lane)
        if held is None:
            raise NotClaimed(f"lane {lane} is not claimed by {self.node.node_id}")
        held.check()
        async with fenced(self.node.pool, held.lease) as conn:
            await self._lock_lane(conn, lane)
            targets = [rows[_key(m)] for m, _ in finish if _key(m) in rows]
            fresh = {
                r["id"]
                for r in await (
                    await conn.execute(
                        "SELECT id FROM inbox WHERE id = ANY(%s) AND answered_at IS NULL",
                        ([t["id"] for t in targets],),
                    )
                ).fetchall()
            }
            if finish and not fresh:
                return []  # answered already (a second run of the same messages)
            ids = []
            if drafts:
                base = await fetch_one(
                    conn, "SELECT coalesce(max(seq) + 1, 0) AS s FROM outbox WHERE inbox_id = %s", (anchor["id"],)
                )
                for i, d in enumerate(drafts):
                    body = {
                        "text": d.text,
                        "kind": d.kind,
                        "thread_id": d.thread_id,
                        "reply_to": d.reply_to,
                        "edit_of": d.edit_of,
                        "stream": d.stream,
                        "nonce": str(secrets.randbits(63)),
                        "created_at": time.time(),
                    }
                    chunk_id = await insert_chunk(
                        conn,
                        anchor["id"],
                        base["s"] + i,
                        lane,
                        anchor["tenant"],
                        d.platform,
                        d.chat_id,
                        body,
                        held.lease,
                    )
                    ids.append(chunk_id)
                    self._lanes[chunk_id] = lane
            for m, outcome in finish:
                r = rows.get(_key(m))
                if r is None or r["id"] not in fresh:
                    continue
                await conn.execute(
                    """UPDATE inbox SET answered_at = now(), outcome = %s, done_epoch = %s,
                           done_at = CASE WHEN EXISTS (SELECT 1 FROM outbox o
                                         WHERE o.inbox_id = inbox.id AND o.sent_at IS NULL)
                                     THEN NULL ELSE now() END,
                           reply_handle = CASE WHEN EXISTS (SELECT 1 FROM outbox o
                                         WHERE o.inbox_id = inbox.id AND o.sent_at IS NULL)
                                     THEN reply_handle END,
                           payload = CASE WHEN EXISTS (SELECT 1 FROM outbox o
                                         WHERE o.inbox_id = inbox.id AND o.sent_at IS NULL)
                                     THEN payload ELSE """
                    + ERASED_PAYLOAD
                    + """ END
                       WHERE id = %s""",
                    (outcome, held.epoch, r["id"]),
                )
            await refresh_lane_head(conn, lane)
            return ids

    async def _inbox_rows(self, msgs: list[InboundMessage]) -> dict[tuple[str, str, str], Any]:
        keys = list({_key(m) for m in msgs})
        async with self.node.pool.connection() as conn:
            cur = await conn.execute(
                """SELECT id, platform, chat_id, message_id, lane, tenant FROM inbox
                   WHERE (platform, chat_id, message_id) IN (SELECT * FROM unnest(%s::text[], %s::text[], %s::text[]))""",
                ([k[0] for k in keys], [k[1] for k in keys], [k[2] for k in keys]),
            )
            return {(r["platform"], r["chat_id"], r["message_id"]): r for r in await cur.fetchall()}

    async def _lock_lane(self, conn: Conn, lane: str) -> None:
        """Inside a transaction: the lane is still ours and so is the node's own lease."""
        await lock_claimed_lane(conn, lane, self.node.node_id)
        alive = await (
            await conn.execute(
                "SELECT 1 FROM nodes WHERE node_id = %s AND lease_expires_at > now()", (self.node.node_id,)
            )
        ).fetchone()
        if alive is None:
            raise NotClaimed(f"node {self.node.node_id} has no live lease")

    # ----- streams after a takeover (docs/cluster.md#streaming-and-progress-notices) --------
    async def drafts_of(self, msgs: Sequence[InboundMessage]) -> list[SentMessage]:
        """The draft messages an earlier run of a turn for `msgs` (still unanswered) left in
        the chat, in order, as handles (message_id: the chunk id): the new run's draft and
        final text edit them instead of starting another draft."""
        keys = list({_key(m) for m in msgs})
        if not keys:
            return []
        async with self.node.pool.connection() as conn:
            cur = await conn.execute(
                """SELECT o.id, o.chat_id, o.body->>'thread_id' AS thread_id FROM outbox o
                   JOIN inbox i ON i.id = o.inbox_id
                   WHERE (i.platform, i.chat_id, i.message_id) IN
                         (SELECT * FROM unnest(%s::text[], %s::text[], %s::text[]))
                     AND i.answered_at IS NULL AND o.outcome = 'sent' AND o.sent_id IS NOT NULL
                     AND o.body->>'stream' = 'draft' AND o.body->>'edit_of' IS NULL
                   ORDER BY o.id""",
                ([k[0] for k in keys], [k[1] for k in keys], [k[2] for k in keys]),
            )
            rows = await cur.fetchall()
        return [SentMessage(chat_id=r["chat_id"], thread_id=r["thread_id"], message_id=str(r["id"])) for r in rows]

    async def tidy_after_takeover(self, lane: str, held: HeldLease) -> tuple[int, int]:
        """Before a claimed lane runs: what an earlier epoch left half-streamed. Its unsent
        drafts and progress notices are superseded (the final text replaces them; nobody saw
        them), and each progress notice it sent but never ended is edited to say the work was
        cut off, so no notice claims "in progress" forever. Returns (superseded, ended)."""
        held.check()
        async with fenced(self.node.pool, held.lease) as conn:
            await self._lock_lane(conn, lane)
            cur = await conn.execute(
                """UPDATE outbox SET sent_at = now(), sent_epoch = %s, outcome = 'superseded', body = body - 'text'
                   WHERE lane = %s AND sent_at IS NULL AND epoch < %s AND body->>'stream' IN ('draft', 'progress')""",
                (held.epoch, lane, held.epoch),
            )
            superseded = cur.rowcount
            if superseded:  # an answered message whose last unsent chunks those were is done
                await conn.execute(
                    """UPDATE inbox SET done_at = now() WHERE lane = %s AND done_at IS NULL
                       AND answered_at IS NOT NULL
                       AND NOT EXISTS (SELECT 1 FROM outbox o WHERE o.inbox_id = inbox.id AND o.sent_at IS NULL)""",
                    (lane,),
                )
            cur = await conn.execute(
                """SELECT o.id, o.inbox_id, o.tenant, o.platform, o.chat_id, o.body->>'thread_id' AS thread_id
                   FROM outbox o JOIN inbox i ON i.id = o.inbox_id AND i.lane = %s AND i.done_at IS NULL
                   WHERE o.epoch < %s AND o.outcome = 'sent' AND o.body->>'stream' = 'progress'
                     AND NOT EXISTS (SELECT 1 FROM outbox e WHERE e.inbox_id = o.inbox_id
                                     AND e.body->>'edit_of' = o.id::text)
                   ORDER BY o.id""",
                (lane, held.epoch),
            )
            opened = await cur.fetchall()
            for row in opened:
                base = await fetch_one(
                    conn, "SELECT max(seq) + 1 AS s FROM outbox WHERE inbox_id = %s", (row["inbox_id"],)
                )
                body = {
                    "text": NOTICE_CUT_OFF,
                    "kind": "notice",
                    "thread_id": row["thread_id"],
                    "reply_to": None,
                    "edit_of": int(row["id"]),
                    "stream": "progress_end",
                    "nonce": str(secrets.randbits(63)),
                    "created_at": time.time(),
                }
                chunk_id = await insert_chunk(
                    conn,
                    row["inbox_id"],
                    base["s"],
                    lane,
                    row["tenant"],
                    row["platform"],
                    row["chat_id"],
                    body,
                    held.lease,
                )
                self._lanes[chunk_id] = lane
            await refresh_lane_head(conn, lane)
        if superseded or opened:
            log.info(
                "lane taken over mid-stream: %d unsent draft or notice chunk(s) superseded, %d notice(s) ended",
                superseded,
                len(opened),
            )
        return superseded, len(opened)

    # ----- the outbox face (the Deliverer) ------------------------------------------------
    async def next_for(self, platform: str, chat_id: str) -> Chunk | None:
        """The chat's oldest unsent chunk among the lanes this node has claimed."""
        async with self.node.pool.connection() as conn:
            row = await (
                await conn.execute(
                    """SELECT o.id, o.lane, o.platform, o.chat_id, o.body FROM outbox o
                       JOIN lanes l ON l.lane = o.lane AND l.claimed_by = %s
                       WHERE o.platform = %s AND o.chat_id = %s AND o.sent_at IS NULL
                         AND EXISTS (SELECT 1 FROM nodes WHERE node_id = %s AND lease_expires_at > now())
                       ORDER BY o.id LIMIT 1""",
                    (self.node.node_id, platform, chat_id, self.node.node_id),
                )
            ).fetchone()
        if row is None:
            return None
        b = row["body"]
        self._lanes[int(row["id"])] = row["lane"]
        return Chunk(
            int(row["id"]),
            row["platform"],
            row["chat_id"],
            b.get("thread_id"),
            b.get("kind", "reply"),
            b.get("reply_to"),
            b.get("edit_of"),
            b.get("text") or "",
            b.get("nonce") or "0",
            float(b.get("created_at") or time.time()),
        )

    def time_left(self, chunk: Chunk) -> float | None:
        """How long this node may still edit the chat for the chunk's lane (its lease's local
        deadline, which ends before another node could take the tenant)."""
        held = self.node.claims.get(self._lanes.get(chunk.id, ""))
        if held is None or held.lost:
            return 0.0
        return max(0.0, held.deadline - time.monotonic())

    def may_send(self, chunk: Chunk) -> bool:
        """Right before the send: the chunk's lane is claimed here under a live lease."""
        held = self.node.claims.get(self._lanes.get(chunk.id, ""))
        if held is not None and held.valid():
            return True
        self.node.metrics.fenced_out("send")
        return False

    async def mark_sent(self, chunk_id: int, sent_id: str) -> bool:
        return await self._settle(chunk_id, "sent", sent_id)

    async def give_up(self, chunk_id: int, status: str) -> bool:
        return await self._settle(chunk_id, status, None)

    async def _settle(self, chunk_id: int, outcome: str, sent_id: str | None) -> bool:
        """The chunk left (or will never leave); when it was its message's last unsent
        chunk of an answered message, the message is done. A lane that is no longer ours
        is left alone: its next holder sends the chunk again (the documented window), and
        False tells the Deliverer the chunk is still unsent (this node may be that holder)."""
        lane = self._lanes.pop(chunk_id, None)
        held = self.node.claims.get(lane or "")
        try:
            async with self.node.pool.connection() as conn, conn.transaction():
                row = await (
                    await conn.execute("SELECT inbox_id, lane FROM outbox WHERE id = %s", (chunk_id,))
                ).fetchone()
                if row is None:
                    return True
                await self._lock_lane(conn, row["lane"])
                await conn.execute(
                    """UPDATE outbox SET sent_at = now(), sent_epoch = %s, outcome = %s, sent_id = %s,
                              body = body - 'text' WHERE id = %s AND sent_at IS NULL""",
                    (held.epoch if held is not None else None, outcome, sent_id, chunk_id),
                )
                cur = await conn.execute(
                    """UPDATE inbox SET done_at = now(), reply_handle = NULL, payload = """
                    + ERASED_PAYLOAD
                    + """
                       WHERE id = %s AND done_at IS NULL AND answered_at IS NOT NULL
                       AND NOT EXISTS (SELECT 1 FROM outbox WHERE inbox_id = %s AND sent_at IS NULL)""",
                    (row["inbox_id"], row["inbox_id"]),
                )
                if cur.rowcount:
                    await refresh_lane_head(conn, row["lane"])
            return True
        except (NotClaimed, LeaseLost) as exc:
            log.warning(
                "chunk %d was sent but could not be marked (%s); its lane's next holder resends it", chunk_id, exc
            )
            return False

    async def sent_message(self, chunk_id: int) -> SentMessage | None:
        async with self.node.pool.connection() as conn:
            row = await (
                await conn.execute(
                    "SELECT chat_id, body, sent_id FROM outbox WHERE id = %s AND outcome = 'sent'", (chunk_id,)
                )
            ).fetchone()
        if row is None or row["sent_id"] is None:
            return None
        return SentMessage(chat_id=row["chat_id"], thread_id=row["body"].get("thread_id"), message_id=row["sent_id"])

    async def status(self, chunk_id: int) -> str | None:
        async with self.node.pool.connection() as conn:
            row = await (
                await conn.execute("SELECT sent_at, outcome FROM outbox WHERE id = %s", (chunk_id,))
            ).fetchone()
        if row is None:
            return None
        return "pending" if row["sent_at"] is None else (row["outcome"] or "sent")

    async def pending_chats(self) -> list[tuple[str, str]]:
        """Nothing to resume at start: a lane's unsent chunks go out when it is claimed."""
        return []

    async def unsent_chats(self, lane: str) -> list[tuple[str, str, int]]:
        """(platform, chat, last unsent chunk id) of every chat the lane has unsent chunks in."""
        async with self.node.pool.connection() as conn:
            cur = await conn.execute(
                """SELECT platform, chat_id, max(id) AS last FROM outbox
                   WHERE lane = %s AND sent_at IS NULL GROUP BY platform, chat_id""",
                (lane,),
            )
            return [(r["platform"], r["chat_id"], int(r["last"])) for r in await cur.fetchall()]
