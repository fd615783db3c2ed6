"""Reminders in cluster mode (docs/cluster.md#reminders): the `Reminders` of gateway/modes.py.

Each tenant's reminders.json stays the truth; `reminder_due` in PostgreSQL holds one row per
current occurrence (tenant, reminder id, due time), which every node scans for due work.
The lease holder keeps the rows in step with the file (`sync`, after a change and whenever a
profile opens under a new lease). A due occurrence is fired by the node that takes the
tenant's lease: in one transaction fenced by the lease's epoch its row is marked fired and
the occurrence is recorded in the shared inbox (deduplicated by its message id), so a node
that lost the lease fires nothing and no occurrence is recorded twice. Then the file moves
on (next occurrence, or the one-off removed). A crash between the fire and the file leaves a
fired row for an occurrence the file still has: the next sync moves the file on instead of
firing again. The lane runs the occurrence like a single node's (gateway/turns.py), and its
delivery goes through the fenced outbox like every answer.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from agent.reminders import Reminder, ReminderStore
from core.errors import LeaseLost
from core.lanes import Lane
from core.messages import InboundMessage
from gateway.cluster.inbox import insert_inbound
from gateway.cluster.leases import fenced
from gateway.cluster.node import ClusterNode, HeldLease, LeaseBusy
from gateway.cluster.runner import to_inbound
from gateway.reminders import MAX_SLEEP_S, occurrence
from tenancy.keys import tenant_dir

log = logging.getLogger("hermes.reminders")

LaneOf = Callable[[InboundMessage], Awaitable[Lane | None]]
"""The lane an occurrence goes to (identity links as they are now), None: it cannot be placed."""

SCAN_LIMIT = 100  # tenants looked at per scan (the most overdue first)

_DUE_TENANTS = """SELECT tenant FROM reminder_due
   WHERE (fired_at IS NULL AND due_at <= %(now)s)
      OR (fired_at IS NOT NULL AND fired_at < now() - make_interval(secs => %(ttl)s))
   GROUP BY tenant ORDER BY min(due_at) LIMIT %(limit)s"""


def _key(reminder: Reminder) -> tuple[int, float]:
    return (reminder.id, reminder.due)


class PgReminders:
    """Scans the due index, fires due occurrences under their tenant's lease, and keeps
    the index in step with the profiles."""

    def __init__(self, node: ClusterNode, data_dir: Path, lane_of: LaneOf, *, poll_s: float) -> None:
        self.node = node
        self.data_dir = data_dir
        self.lane_of = lane_of
        self.poll_s = min(poll_s, MAX_SLEEP_S)  # another node's new reminder is seen this often
        self.clock: Callable[[], float] = time.time  # tests move it forward
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None

    # ----- the Reminders protocol -------------------------------------------------------
    async def open(self) -> None:
        return None  # the table is a migration (gateway/cluster/migrations.py)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="cluster-reminders")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def note(self, tenant_id: str, due: float | None, lower_only: bool) -> None:
        """The tenant's file changed (this node holds its lease): bring its rows in step.
        Before a write (`lower_only`) nothing is needed: a crash before the sync leaves the
        turn that wrote unfinished, and its next run opens the profile, which syncs."""
        if lower_only:
            return
        held = await self.node.hold(tenant_id)
        try:
            await self.sync(tenant_id, held)
        finally:
            await self.node.unhold(held)
        self._wake.set()

    async def tick(self) -> int:
        """Fire every due occurrence whose tenant this node can take; how many were recorded."""
        async with self.node.pool.connection() as conn:
            rows = await (
                await conn.execute(_DUE_TENANTS, {"now": self.clock(), "ttl": self.node.ttl, "limit": SCAN_LIMIT})
            ).fetchall()
        fired = 0
        for row in rows:
            try:
                held = await self.node.hold(row["tenant"])
            except LeaseBusy:  # its holder fires it (its scan sees the same row)
                continue
            try:
                fired += await self.fire_due(row["tenant"], held)
            except LeaseLost as lost:  # another node has the tenant now, and fires what is due
                log.warning("reminders of a tenant not fired here: %s", lost)
            except Exception as exc:  # one tenant's trouble (an unreadable file) holds no other
                log.warning("could not fire the due reminders of a tenant (%s: %s)", type(exc).__name__, exc)
            finally:
                await self.node.unhold(held)
        return fired

    # ----- under a held lease ---------------------------------------------------------------
    async def opened(self, tenant_id: str, held: HeldLease) -> None:
        """A profile opened under a new lease: its rows are rebuilt from its file (what a
        holder that died between the file and the index left is put right)."""
        if not (tenant_dir(self.data_dir, tenant_id) / "reminders.json").exists():
            return
        try:
            await self.sync(tenant_id, held)
        except (ValueError, KeyError, TypeError) as exc:  # a damaged file must not keep the profile shut
            log.warning(
                "reminders.json of an opened profile is unreadable (%s); its reminders are not indexed",
                type(exc).__name__,
            )

    async def sync(self, tenant_id: str, held: HeldLease) -> None:
        """Make the tenant's rows the file's current occurrences, fenced by `held`; an
        occurrence the file still has but that was fired already moves the file on first."""
        store = ReminderStore(tenant_dir(self.data_dir, tenant_id), guard=held.check)
        for _ in range(3):  # a fired occurrence moves the file on once; then it is in step
            items = {_key(r): r for r in await store.all()}
            async with fenced(self.node.pool, held.lease) as conn:
                rows = await (
                    await conn.execute(
                        "SELECT reminder_id, due_at, fired_at FROM reminder_due WHERE tenant = %s FOR UPDATE",
                        (tenant_id,),
                    )
                ).fetchall()
                have = {(int(r["reminder_id"]), float(r["due_at"])): r["fired_at"] is not None for r in rows}
                for rid, due in have.keys() - items.keys():
                    await conn.execute(
                        "DELETE FROM reminder_due WHERE tenant = %s AND reminder_id = %s AND due_at = %s",
                        (tenant_id, rid, due),
                    )
                for key in items.keys() - have.keys():
                    r = items[key]
                    await conn.execute(
                        """INSERT INTO reminder_due (tenant, reminder_id, due_at, principal)
                           VALUES (%s, %s, %s, %s) ON CONFLICT DO NOTHING""",
                        (tenant_id, r.id, r.due, f"{r.chat.platform}:{r.chat.user_id}"),
                    )
            fired = [items[k] for k, was_fired in have.items() if was_fired and k in items]
            if not fired:
                return
            for r in fired:  # fired before the file moved on (its node died): move it on now
                held.check()
                await store.advance(r.id, r.due, self.clock())

    async def fire_due(self, tenant_id: str, held: HeldLease) -> int:
        """Fire the tenant's due occurrences under `held`; how many were newly recorded."""
        await self.sync(tenant_id, held)
        store = ReminderStore(tenant_dir(self.data_dir, tenant_id), guard=held.check)
        now = self.clock()
        recorded = 0
        for reminder in await store.all():
            if reminder.due > now:
                break
            msg = occurrence(reminder, tenant_id)
            inbound = to_inbound(msg, await self.lane_of(msg))
            held.check()
            async with fenced(self.node.pool, held.lease) as conn:
                claimed = await (
                    await conn.execute(
                        """UPDATE reminder_due SET fired_at = now(), fired_epoch = %s, fired_by = %s
                           WHERE tenant = %s AND reminder_id = %s AND due_at = %s AND fired_at IS NULL
                           RETURNING 1""",
                        (held.epoch, self.node.node_id, tenant_id, reminder.id, reminder.due),
                    )
                ).fetchone()
                if claimed is not None and await insert_inbound(conn, inbound) is not None:
                    recorded += 1
                    log.info(
                        "reminder fired %.1f s after its time",
                        now - reminder.due,
                        extra={"event": "reminder_fired", "tenant": tenant_id, "epoch": held.epoch},
                    )
            held.check()
            await store.advance(reminder.id, reminder.due, now)
        await self.sync(tenant_id, held)
        return recorded

    # ----- the loop -----------------------------------------------------------------------
    async def _run(self) -> None:
        while True:
            self._wake.clear()  # before the scan: a change noted from now on is not missed
            try:
                await self.tick()
                async with self.node.pool.connection() as conn:
                    row = await (
                        await conn.execute("SELECT min(due_at) AS due FROM reminder_due WHERE fired_at IS NULL")
                    ).fetchone()
                due = row["due"] if row is not None else None
                wait = self.poll_s if due is None else due - self.clock()
                if wait <= 0:  # due, and held by another node, which fires it: look again after a while
                    wait = min(self.poll_s, self.node.ttl / 3)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("reminder scan failed (%s); trying again shortly", exc)
                wait = self.poll_s
            try:
                await asyncio.wait_for(self._wake.wait(), max(0.05, min(wait, self.poll_s)))
            except TimeoutError:
                pass


__all__ = ["PgReminders"]
