"""Delivering reminders: an index of next-due times per tenant in gateway.db, and a
scheduler that reads only the due tenants' `reminders.json` (never every profile).

A due occurrence becomes a synthetic inbound message (`message_id`
`reminder:<owner>:<id>:<due>`, the owner a digest of the tenant and the reminder's creation,
so two people's reminders for one minute in one chat never share an id), recorded in the inbox like any platform message: the inbox's dedupe makes it happen once
even if the scheduler runs again after a crash, and its replay delivers it after a restart.
The lane worker then records the reminder as an assistant message in the lane's session
and sends it (`deliver_text`); recording and sending follow the same path as every reply.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiosqlite

from agent.messages import StoredMessage
from agent.provenance import reminder_record
from agent.reminders import Reminder, ReminderStore
from agent.vault import TenantKeys
from core.messages import InboundMessage
from tenancy.keys import chat_tenant_id, tenant_dir

log = logging.getLogger("hermes.reminders")

PREFIX = "reminder:"
LATE_AFTER_S = 120.0  # delivered later than this after its time: the message says it is late
MAX_SLEEP_S = 30.0  # the scheduler looks at the index at least this often

_SCHEMA = """
CREATE TABLE IF NOT EXISTS reminder_due (
    tenant_id TEXT PRIMARY KEY,
    due_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS reminder_due_at ON reminder_due(due_at);
"""


def is_reminder(msg: InboundMessage) -> bool:
    """A reminder occurrence (no platform message id has this form)."""
    return msg.message_id.startswith(PREFIX)


def occurrence(reminder: Reminder, tenant_id: str) -> InboundMessage:
    """The synthetic inbound message of a reminder's current occurrence (kept by `tenant_id`),
    in the lane it was set in."""
    chat = reminder.chat
    owner = hashlib.sha256(f"{tenant_id}\0{reminder.id}\0{reminder.created_at!r}".encode()).hexdigest()[:16]
    return InboundMessage(
        platform=chat.platform,
        chat_id=chat.chat_id,
        chat_type=chat.chat_type,
        thread_id=chat.thread_id,
        # a file from before the flag was kept: the thread's own tenant keeps only private threads
        private_thread=chat.private_thread
        or (chat.thread_id is not None and tenant_id == chat_tenant_id(chat.platform, chat.thread_id)),
        user_id=chat.user_id,
        user_name=chat.user_name,
        message_id=f"{PREFIX}{owner}:{reminder.id}:{reminder.due:.3f}",
        text=reminder.text,
        timestamp=reminder.due,
        mentions_bot=True,
    )


def delivery_text(msg: InboundMessage, now: float) -> str:
    """What the chat sees: the reminder, addressed in groups, with a note when it is late."""
    who = f" for {msg.user_name}" if msg.chat_type != "dm" and msg.user_name else ""
    text = f"⏰ Reminder{who}: {msg.text}"
    late = now - msg.timestamp
    if late > LATE_AFTER_S:
        text += f"\n(This is late: it was due {_ago(late)} ago, while I was offline.)"
    return text


def _ago(seconds: float) -> str:
    minutes = int(seconds // 60)
    if minutes < 60:
        return f"{minutes} minute{'s' if minutes != 1 else ''}"
    hours = minutes // 60
    if hours < 48:
        return f"{hours} hour{'s' if hours != 1 else ''}"
    return f"{hours // 24} days"


def delivered_uid(msg: InboundMessage) -> str:
    digest = hashlib.sha256(f"{msg.platform}\0{msg.chat_id}\0{msg.message_id}".encode()).hexdigest()
    return f"rem-{digest[:32]}"


def delivered_message(session_id: str, msg: InboundMessage, text: str) -> StoredMessage:
    """The reminder as the lane's history keeps it (its uid makes a replay store it once)."""
    meta: dict[str, Any] = {"reminder": msg.message_id}
    number = msg.message_id.removeprefix(PREFIX).split(":")[1:2]  # reminder:<owner>:<id>:<due>
    if number and number[0].isdigit():  # what /why says of it (docs/concepts.md#why-an-answer-said-what-it-said)
        meta["provenance"] = reminder_record(int(number[0]), msg.timestamp)
    return StoredMessage(session_id=session_id, role="assistant", content=text, uid=delivered_uid(msg), meta=meta)


class ReminderScheduler:
    """Wakes when the earliest indexed reminder is due and hands due occurrences to `submit`
    (which records them in the inbox; False: recorded before, e.g. by a run that crashed)."""

    def __init__(
        self,
        db: Callable[[], aiosqlite.Connection],
        data_dir: Path,
        submit: Callable[[InboundMessage], Awaitable[bool]],
        keys: TenantKeys | None = None,
    ) -> None:
        """`keys`: tenants' data keys (reminders.json is sealed in an encrypted profile)."""
        self._db = db
        self._data_dir = data_dir
        self._keys = keys if keys is not None else TenantKeys(None)
        self._submit = submit
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.clock: Callable[[], float] = time.time  # tests move it forward

    async def open(self) -> None:
        await self._db().executescript(_SCHEMA)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="reminders")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            except Exception:
                log.exception("reminder scheduler ended with an error")
            self._task = None

    async def note(self, tenant_id: str, due: float | None, lower_only: bool) -> None:
        """Record a tenant's next due time (None: nothing left); `lower_only` never delays it."""
        db = self._db()
        if due is None:
            if not lower_only:
                await db.execute("DELETE FROM reminder_due WHERE tenant_id=?", (tenant_id,))
        elif lower_only:
            await db.execute(
                "INSERT INTO reminder_due(tenant_id, due_at) VALUES (?, ?) ON CONFLICT(tenant_id) "
                "DO UPDATE SET due_at=MIN(due_at, excluded.due_at)",
                (tenant_id, due),
            )
        else:
            await db.execute(
                "INSERT INTO reminder_due(tenant_id, due_at) VALUES (?, ?) ON CONFLICT(tenant_id) "
                "DO UPDATE SET due_at=excluded.due_at",
                (tenant_id, due),
            )
        self._wake.set()

    async def _run(self) -> None:
        while True:
            try:
                await self.tick()
                # one hop that finishes the statement: a SELECT left open between two hops holds
                # a read snapshot, and an inbox write queued between them then fails with
                # "database is locked" once the outbox's marks connection has committed
                rows = list(await self._db().execute_fetchall("SELECT MIN(due_at) FROM reminder_due"))
                due = rows[0][0] if rows else None
                wait = MAX_SLEEP_S if due is None else due - self.clock()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("reminder scheduler failed; trying again shortly")
                wait = MAX_SLEEP_S
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), max(0.05, min(wait, MAX_SLEEP_S)))
            except TimeoutError:
                pass

    async def tick(self) -> int:
        """Hand over every due occurrence; returns how many were newly recorded."""
        now = self.clock()
        rows = await self._db().execute_fetchall(
            "SELECT tenant_id FROM reminder_due WHERE due_at <= ? ORDER BY due_at", (now,)
        )
        handed = 0
        for (tenant_id,) in rows:
            path = tenant_dir(self._data_dir, tenant_id)
            store = ReminderStore(await asyncio.to_thread(self._keys.files, tenant_id, path))
            for reminder in await store.all():
                if reminder.due > now:
                    break
                if await self._submit(occurrence(reminder, tenant_id)):
                    handed += 1
                await store.advance(reminder.id, reminder.due, now)
            await self.note(tenant_id, await store.next_due(), False)
        return handed
