"""The gateway's durable inbox (`<data_dir>/gateway.db`): every platform message is
recorded before it is acknowledged, answered at most once, and replayed after a crash.

The message text is kept only while the message is pending and erased once it has been
answered, so this shared database holds no tenant's conversation; with encryption on, it is
sealed with its tenant's key meanwhile (gateway/sealing.py, docs/privacy.md#encryption-at-rest). Erased for real: the
connections run with `secure_delete` (freed bytes are zeroed), and within
`ERASE_CHECKPOINT_S` of an erase a `wal_checkpoint(TRUNCATE)` empties the `-wal` file, which
would otherwise keep the old page images (and so the text) until SQLite reused them.

`record` and `finish` are write-combined: calls made while a batch is being written are
queued and go together as one statement (one transaction) when it is done; each caller
still returns only after its own row is durable.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sqlite3
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Generic, TypeVar, cast

import aiosqlite

from agent.fileio import private_file, private_mkdir
from agent.vault import VaultError
from core.messages import InboundMessage
from gateway.sealing import MessageSeal, sealed

T = TypeVar("T")
log = logging.getLogger("hermes.inbox")
ERASE_CHECKPOINT_S = 30.0  # an erased text leaves gateway.db-wal at most this long after

_SCHEMA = """
CREATE TABLE IF NOT EXISTS inbound (
    platform TEXT NOT NULL,
    chat_id TEXT NOT NULL,
    message_id TEXT NOT NULL,
    received_at REAL NOT NULL,
    status TEXT NOT NULL,            -- pending | done
    outcome TEXT,                    -- replied | refused | duplicate | error ...
    payload TEXT,                    -- the InboundMessage JSON while pending, then NULL
    PRIMARY KEY (platform, chat_id, message_id)
);
CREATE INDEX IF NOT EXISTS inbound_pending ON inbound(status, received_at);
CREATE TABLE IF NOT EXISTS kv (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""


Item = TypeVar("Item")
Result = TypeVar("Result")
MAX_BATCH = 256  # rows per statement (4-6 variables each, far below SQLite's limit)


class WriteCombiner(Generic[Item, Result]):
    """Coalesces concurrent calls into batches: `write` gets every item queued since the
    last batch started and returns one result per item, in order."""

    def __init__(self, write: Callable[[list[Item]], Awaitable[list[Result]]], max_batch: int = MAX_BATCH) -> None:
        self._write = write
        self._max = max_batch
        self._queue: list[tuple[Item, asyncio.Future[Result]]] = []
        self._task: asyncio.Task[None] | None = None

    async def submit(self, item: Item) -> Result:
        fut: asyncio.Future[Result] = asyncio.get_running_loop().create_future()
        self._queue.append((item, fut))
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._drain())
        return await asyncio.shield(fut)  # a cancelled caller's row is still written

    async def _drain(self) -> None:
        try:
            while self._queue:
                batch, self._queue = self._queue[: self._max], self._queue[self._max :]
                try:
                    results = await self._write([item for item, _ in batch])
                except Exception as exc:
                    for _, fut in batch:
                        if not fut.done():
                            fut.set_exception(exc)
                    continue
                for (_, fut), result in zip(batch, results, strict=False):
                    if not fut.done():
                        fut.set_result(result)
        finally:
            self._task = None


def _place(platform: str, chat_id: str, message_id: str) -> str:
    return f"gateway.db/inbox/{platform}\0{chat_id}\0{message_id}"


def pending_place(platform: str, chat_id: str, message_id: str) -> str:
    """What the pending payload of that row is sealed for (`row_place` by its key)."""
    return _place(platform, chat_id, message_id)


def row_place(msg: InboundMessage) -> str:
    """What a pending payload's seal is bound to: its row (so it opens in no other)."""
    return _place(msg.platform, msg.chat_id, msg.message_id)


class Inbox:
    """Dedupe and replay log of inbound platform messages."""

    def __init__(self, path: Path, *, fsync: str = "batch", seal: MessageSeal | None = None) -> None:
        """`seal` (storage.encryption per_tenant): pending payloads and unsent chunks are
        kept sealed with their tenant's data key."""
        self.path = path
        self.fsync = fsync
        self.seal = seal
        self._db: aiosqlite.Connection | None = None
        self._records: WriteCombiner[tuple[InboundMessage, str], bool] = WriteCombiner(self._record_batch)
        self._finishes: WriteCombiner[tuple[InboundMessage, str], None] = WriteCombiner(self._finish_batch)
        self.erase_checkpoint_s = ERASE_CHECKPOINT_S  # tests shorten it
        self._erased = False  # text was erased since the last checkpoint
        self._checkpointer: asyncio.Task | None = None

    async def open(self) -> None:
        private_mkdir(self.path.parent)
        private_file(self.path)  # SQLite gives -wal/-shm the database file's mode
        # autocommit: each statement is its own durable transaction, one thread hop each
        self._db = await aiosqlite.connect(self.path, isolation_level=None)
        await self._db.execute("PRAGMA journal_mode=WAL")
        await self._db.execute(f"PRAGMA synchronous={'FULL' if self.fsync == 'always' else 'NORMAL'}")
        await self._db.execute("PRAGMA busy_timeout=5000")
        await self._db.execute("PRAGMA secure_delete=ON")
        await self._db.executescript(_SCHEMA)
        self._checkpointer = asyncio.create_task(self._checkpoints(), name="gateway.db erase")

    async def close(self) -> None:
        if self._checkpointer is not None:
            self._checkpointer.cancel()
            try:
                await self._checkpointer
            except asyncio.CancelledError:
                pass
            self._checkpointer = None
        if self._db is not None:
            try:
                await self.checkpoint()
            except sqlite3.Error:
                log.warning(
                    "gateway.db: could not checkpoint on close; erased text stays in its -wal file until the next start"
                )
            await self._db.close()
            self._db = None

    def erased(self) -> None:
        """Text was erased (an answered message, a sent chunk): checkpoint soon."""
        self._erased = True

    async def checkpoint(self) -> bool:
        """Copy the WAL into the database and truncate it (so no erased text stays in it);
        False when a reader kept it from finishing (tried again later)."""
        rows = list(await self.db.execute_fetchall("PRAGMA wal_checkpoint(TRUNCATE)"))
        done = not rows or rows[0][0] == 0
        if not done:
            self._erased = True
        return done

    async def _checkpoints(self) -> None:
        while True:
            await asyncio.sleep(self.erase_checkpoint_s)
            if not self._erased:
                continue
            self._erased = False
            try:
                await self.checkpoint()
            except sqlite3.Error as err:
                self._erased = True
                log.warning("gateway.db: checkpoint after an erase failed (%s); trying again", err)

    @property
    def db(self) -> aiosqlite.Connection:
        if self._db is None:
            raise RuntimeError("inbox is not open")
        return self._db

    async def record(self, msg: InboundMessage) -> bool:
        """Durably record `msg` as pending; False if this platform message was seen before."""
        _ = self.db  # fail now, not inside a batch, when the inbox is closed
        return await self._records.submit((msg, await self._payload(msg)))

    async def _payload(self, msg: InboundMessage) -> str:
        """The JSON kept while `msg` is pending: sealed with its tenant's key when encryption
        is on; a message with no tenant (refused at once) keeps none of its text."""
        payload = msg.model_dump_json()
        if self.seal is None:
            return payload
        kept = await self.seal.seal(msg, payload, row_place(msg))
        if kept is not None:
            return kept
        blank = {"text": "", "attachments": (), "user_name": "", "reply_to_text": None, "reply_to_author": ""}
        return msg.model_copy(update=blank).model_dump_json()

    async def _record_batch(self, items: list[tuple[InboundMessage, str]]) -> list[bool]:
        """One INSERT for the batch; RETURNING names the rows that were new."""
        now = time.time()
        params: list[object] = []
        msgs = [m for m, _ in items]
        for m, payload in items:
            params += [m.platform, m.chat_id, m.message_id, now, payload]
        rows = await self.db.execute_fetchall(
            "INSERT OR IGNORE INTO inbound(platform, chat_id, message_id, received_at, status, payload) VALUES "
            + ",".join(["(?, ?, ?, ?, 'pending', ?)"] * len(msgs))
            + " RETURNING platform, chat_id, message_id",
            params,
        )
        new = {tuple(r) for r in rows}
        out = []
        for m in msgs:  # the same message twice in one batch: only the first is new
            key = (m.platform, m.chat_id, m.message_id)
            out.append(key in new)
            new.discard(key)
        return out

    async def forget(self, msg: InboundMessage) -> None:
        """Drop a still-pending record, so the platform's redelivery is taken in afresh."""
        await self.db.execute(
            "DELETE FROM inbound WHERE platform=? AND chat_id=? AND message_id=? AND status='pending'",
            (msg.platform, msg.chat_id, msg.message_id),
        )

    async def finish(self, msg: InboundMessage, outcome: str) -> None:
        """Mark `msg` answered (or refused) and forget its text."""
        _ = self.db
        await self._finishes.submit((msg, outcome))

    async def _finish_batch(self, items: list[tuple[InboundMessage, str]]) -> list[None]:
        """One UPDATE for the batch (the last outcome wins if a message appears twice)."""
        last = {(m.platform, m.chat_id, m.message_id): outcome for m, outcome in items}
        params: list[object] = [x for key, outcome in last.items() for x in (*key, outcome)]
        await self.db.execute(
            "WITH v(p, c, m, o) AS (VALUES " + ",".join(["(?, ?, ?, ?)"] * len(last)) + ") "
            "UPDATE inbound SET status='done', outcome=v.o, payload=NULL FROM v "
            "WHERE inbound.platform=v.p AND inbound.chat_id=v.c AND inbound.message_id=v.m",
            params,
        )
        self._erased = True
        return [None] * len(items)

    @staticmethod
    def finish_sync(con: sqlite3.Connection, msg: InboundMessage, outcome: str) -> None:
        """`finish` as one statement inside a caller's transaction (see `atomically`)."""
        con.execute(
            "UPDATE inbound SET status='done', outcome=?, payload=NULL WHERE platform=? AND chat_id=? AND message_id=?",
            (outcome, msg.platform, msg.chat_id, msg.message_id),
        )

    async def atomically(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """Run `fn(connection)` as one transaction in a single hop to the database thread,
        so no other statement on this connection can interleave; rolled back if it raises."""

        def run(con: sqlite3.Connection) -> T:
            con.execute("BEGIN IMMEDIATE")
            try:
                result = fn(con)
                con.execute("COMMIT")
                return result
            except BaseException:
                if con.in_transaction:  # SQLite may have rolled back itself (e.g. disk full)
                    con.execute("ROLLBACK")
                raise

        self._erased = True  # such a transaction may finish messages (finish_sync)
        return await self.db._execute(run, self.db._conn)  # aiosqlite's own thread hop

    async def pending(self) -> list[InboundMessage]:
        """Messages recorded but never answered (a crash or stop mid-turn), oldest first."""
        out = []
        # every read is one hop (execute_fetchall): a cursor left open across awaits would
        # hold a stale snapshot for the statements other tasks run in between
        rows = await self.db.execute_fetchall(
            "SELECT platform, chat_id, message_id, payload FROM inbound WHERE status='pending' ORDER BY received_at"
        )
        for platform, chat_id, message_id, payload in rows:
            if sealed(payload):
                place = _place(platform, chat_id, message_id)
                try:
                    payload = await self.seal.open(payload, place) if self.seal is not None else None
                except VaultError as err:  # its tenant was deleted (key destroyed): nothing to answer
                    log.warning("a pending %s message cannot be replayed: %s", platform, err)
                    await self.db.execute(
                        "UPDATE inbound SET status='done', outcome='unreadable', payload=NULL "
                        "WHERE platform=? AND chat_id=? AND message_id=?",
                        (platform, chat_id, message_id),
                    )
                    self._erased = True
                    continue
            try:
                out.append(InboundMessage.model_validate(json.loads(payload)))
            except (ValueError, TypeError):
                continue
        return out

    async def status(self, platform: str, chat_id: str, message_id: str) -> str | None:
        rows = cast(  # aiosqlite types it Iterable; at runtime it is cursor.fetchall(), a list
            "list[sqlite3.Row]",
            await self.db.execute_fetchall(
                "SELECT status FROM inbound WHERE platform=? AND chat_id=? AND message_id=?",
                (platform, chat_id, message_id),
            ),
        )
        return rows[0][0] if rows else None

    async def get(self, key: str) -> str | None:
        rows = cast(  # aiosqlite types it Iterable; at runtime it is cursor.fetchall(), a list
            "list[sqlite3.Row]", await self.db.execute_fetchall("SELECT value FROM kv WHERE key=?", (key,))
        )
        return rows[0][0] if rows else None

    async def put(self, key: str, value: str | None) -> None:
        if value is None:
            await self.db.execute("DELETE FROM kv WHERE key=?", (key,))
        else:
            await self.db.execute("INSERT OR REPLACE INTO kv(key, value) VALUES (?, ?)", (key, value))

    async def prune(self, older_than_s: float) -> int:
        """Forget answered messages received more than `older_than_s` ago, so gateway.db
        stays small over months; platforms never redeliver that late."""
        cur = await self.db.execute(
            "DELETE FROM inbound WHERE status='done' AND received_at < ?", (time.time() - older_than_s,)
        )
        return cur.rowcount
