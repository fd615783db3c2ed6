"""The inbox write-combines: concurrent record()/finish() calls from many lanes share one
statement (one transaction), and every caller still learns its own outcome."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path

from core.messages import InboundMessage
from gateway.inbox import Inbox
from gateway.outbox import Draft, Outbox
from gateway.reminders import ReminderScheduler


def message(chat: int, n: int) -> InboundMessage:
    return InboundMessage(
        platform="telegram",
        chat_id=f"c{chat}",
        chat_type="dm",
        user_id=f"u{chat}",
        user_name="X",
        message_id=f"m{n}",
        text=f"hello {n}",
    )


async def test_concurrent_records_from_many_lanes_share_one_transaction(tmp_path: Path) -> None:
    inbox = Inbox(tmp_path / "gateway.db")
    await inbox.open()
    try:
        statements: list[str] = []
        await inbox.db.set_trace_callback(statements.append)
        msgs = [message(i % 10, i) for i in range(60)]
        dupes = [message(0, 0), message(3, 13)]  # already in the same burst
        results = await asyncio.gather(*(inbox.record(m) for m in msgs + dupes))
        assert results == [True] * 60 + [False, False]
        inserts = [s for s in statements if s.lstrip().upper().startswith("INSERT")]
        assert 1 <= len(inserts) < 10
        assert await inbox.record(message(5, 5)) is False  # seen before, in an earlier batch

        statements.clear()
        await asyncio.gather(*(inbox.finish(m, "replied") for m in msgs[:40]))
        updates = [s for s in statements if "UPDATE" in s.upper()]
        assert 1 <= len(updates) < 10
        assert [m.message_id for m in await inbox.pending()] == [m.message_id for m in msgs[40:]]
    finally:
        await inbox.close()
    with sqlite3.connect(tmp_path / "gateway.db") as db:  # durable, and the text of answered ones is gone
        done = db.execute(
            "SELECT count(*) FROM inbound WHERE status='done' AND outcome='replied' AND payload IS NULL"
        ).fetchone()[0]
        pending = db.execute("SELECT count(*) FROM inbound WHERE status='pending' AND payload IS NOT NULL").fetchone()[
            0
        ]
    assert (done, pending) == (40, 20)


async def test_a_failed_batch_fails_every_caller_in_it_and_the_next_batch_works(tmp_path: Path) -> None:
    inbox = Inbox(tmp_path / "gateway.db")
    await inbox.open()
    try:
        await inbox.db.execute(
            "CREATE TEMP TRIGGER no_more BEFORE INSERT ON inbound BEGIN SELECT RAISE(ABORT, 'disk full'); END"
        )
        results = await asyncio.gather(*(inbox.record(message(1, i)) for i in range(5)), return_exceptions=True)
        assert all(isinstance(r, sqlite3.Error) for r in results)
        await inbox.db.execute("DROP TRIGGER no_more")
        assert await asyncio.gather(*(inbox.record(message(1, i)) for i in range(5))) == [True] * 5
    finally:
        await inbox.close()


async def test_reminder_index_reads_never_make_the_inbox_report_database_locked(tmp_path: Path) -> None:
    """The scheduler reads its index on the inbox's connection while the outbox's marks
    connection commits and other writes queue on the inbox's: no read may keep a snapshot
    open between two hops (the inbox's next write then failed with "database is locked")."""
    inbox = Inbox(tmp_path / "gateway.db")
    await inbox.open()
    outbox = Outbox(inbox)
    await outbox.open()
    handed: list[InboundMessage] = []

    async def submit(msg: InboundMessage) -> bool:
        handed.append(msg)
        return True

    scheduler = ReminderScheduler(lambda: inbox.db, tmp_path, submit)
    await scheduler.open()
    try:
        for n in range(40):
            for t in range(5):  # due index entries (of tenants with no reminders left), so the read has rows
                await scheduler.note(f"tenant{t}", 1.0, False)
            (chunk,) = await outbox.record([Draft("telegram", "c1", None, f"answer {n}")])
            # queued in this order: the index read, a mark on the other connection, inbox writes
            await asyncio.gather(
                scheduler.tick(), outbox.mark_sent(chunk, f"s{n}"), *(inbox.put(f"k{i}", str(n)) for i in range(20))
            )
        assert await inbox.get("k19") == "39" and handed == []
    finally:
        await outbox.close()
        await inbox.close()
