"""The delivery outbox (`outbox` table in `<data_dir>/gateway.db`, next to the inbox).

Every reply, notice and refusal is recorded here per chunk, in the same transaction that
marks its inbound message(s) answered, before the first send. A `Deliverer` then sends
each chat's chunks in order and marks each one sent the moment the platform accepted it;
a chunk that fails is retried with backoff (honouring the platform's `retry_after`) while
the gateway runs and after a restart, and given up only after `delivery.max_age_s`. A
chunk the platform refuses for good (the bot was removed from the chat) is not retried.

An edit of a sent chunk (progress notices, streamed drafts) is a row too (`edit_of`), so
it keeps its place in the chat's order. Like the inbox, the text is erased once it is
sent: this shared database holds no tenant's conversation.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import secrets
import sqlite3
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Literal, Protocol, TypeVar, cast

import aiosqlite

from agent.vault import DataKey, VaultError
from core.backoff import backoff_delay
from core.messages import DeliveryDeferred, InboundMessage, OutboundKind, OutboundMessage, SentMessage
from core.protocols import Adapter
from core.settings import DeliveryConfig
from gateway.inbox import Inbox, pending_place
from gateway.metrics import Metrics
from gateway.sealing import PREFIX, sealed

log = logging.getLogger("hermes.outbox")
T = TypeVar("T")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS outbox (
    id INTEGER PRIMARY KEY AUTOINCREMENT,  -- the chunk id; the order within a chat
    platform TEXT NOT NULL,
    chat_id TEXT NOT NULL,
    thread_id TEXT,
    kind TEXT NOT NULL,
    reply_to TEXT,
    edit_of INTEGER,                 -- an edit of that chunk instead of a new message
    text TEXT,                       -- while unsent, then NULL
    nonce TEXT NOT NULL,             -- idempotency key, the same on every resend
    created_at REAL NOT NULL,        -- wall clock, only for the age across restarts
    status TEXT NOT NULL,            -- pending | sent | refused | expired
    sent_id TEXT                     -- the platform's message id once sent
);
CREATE INDEX IF NOT EXISTS outbox_pending ON outbox(status, platform, chat_id, id);
"""


# what a chunk is to a stream: a draft of an answer (or its edit), a progress notice, the
# edit that ends one; cluster mode's ledger reads it after a takeover
# (docs/cluster.md#streaming-and-progress-notices), gateway.db does not keep it
StreamRole = Literal["draft", "progress", "progress_end"]


@dataclass(frozen=True)
class Draft:
    """One chunk to record: a new message, or (with `edit_of`) new text for a sent one."""

    platform: str
    chat_id: str
    thread_id: str | None
    text: str
    kind: OutboundKind = "reply"
    reply_to: str | None = None  # an edit that falls back to a new message replies to it
    edit_of: int | None = None
    stream: StreamRole | None = None


@dataclass(frozen=True)
class Chunk:
    id: int
    platform: str
    chat_id: str
    thread_id: str | None
    kind: OutboundKind
    reply_to: str | None
    edit_of: int | None
    text: str
    nonce: str
    created_at: float


class Ledger(Protocol):
    """What the Deliverer needs of an outbox: this module's `Outbox` (gateway.db) or
    cluster mode's `ClusterOutbox` (PostgreSQL)."""

    TRANSIENT: tuple[type[BaseException], ...]  # database failures to wait out and retry

    async def next_for(self, platform: str, chat_id: str) -> Chunk | None: ...
    def may_send(self, chunk: Chunk) -> bool: ...
    # seconds an edit of `chunk` may take before it must not land any more (None: no bound)
    def time_left(self, chunk: Chunk) -> float | None: ...
    # False: the mark was not recorded (cluster mode: the lane is no longer this node's)
    async def mark_sent(self, chunk_id: int, sent_id: str) -> bool | None: ...
    async def give_up(self, chunk_id: int, status: str) -> bool | None: ...
    async def sent_message(self, chunk_id: int) -> SentMessage | None: ...
    async def status(self, chunk_id: int) -> str | None: ...
    async def pending_chats(self) -> list[tuple[str, str]]: ...


def chunk_place(nonce: str) -> str:
    """What a chunk's seal is bound to: its row's idempotency key (unique, known before the insert)."""
    return f"gateway.db/outbox/{nonce}"


def reseal_rows(db_path: Path, old: DataKey, new: DataKey) -> int:
    """Every pending payload and unsent chunk of `old`'s tenant in gateway.db sealed again
    under `new`, in one transaction, before the old key is shredded (a tenant re-keyed by
    `/forget all`, docs/privacy.md#delete-is-crypto-shredding); how many rows. A row already
    under `new` (an interrupted rekey finished again) is left as it is."""
    if not db_path.exists():
        return 0
    tenant = base64.urlsafe_b64encode(old.tenant_id.encode("utf-8")).decode("ascii")
    head = f"{PREFIX}{tenant}:"

    def again(value: str, place: str) -> str | None:
        raw = base64.b64decode(value[len(head) :])
        try:
            new.open(raw, place)
            return None
        except VaultError:
            return head + base64.b64encode(new.seal(old.open(raw, place), place)).decode("ascii")

    con = sqlite3.connect(db_path, timeout=30.0, isolation_level=None)
    try:
        con.execute("BEGIN IMMEDIATE")
        done = 0
        try:
            like = head.replace("_", "\\_").replace("%", "\\%") + "%"
            for platform, chat_id, message_id, payload in con.execute(
                "SELECT platform, chat_id, message_id, payload FROM inbound WHERE payload LIKE ? ESCAPE '\\'", (like,)
            ).fetchall():
                value = again(payload, pending_place(platform, chat_id, message_id))
                if value is not None:
                    con.execute(
                        "UPDATE inbound SET payload=? WHERE platform=? AND chat_id=? AND message_id=?",
                        (value, platform, chat_id, message_id),
                    )
                    done += 1
            has_outbox = con.execute("SELECT 1 FROM sqlite_master WHERE name='outbox'").fetchone()
            rows = (
                con.execute("SELECT id, text, nonce FROM outbox WHERE text LIKE ? ESCAPE '\\'", (like,)).fetchall()
                if has_outbox
                else []
            )
            for chunk_id, text, nonce in rows:
                value = again(text, chunk_place(nonce))
                if value is not None:
                    con.execute("UPDATE outbox SET text=? WHERE id=?", (value, chunk_id))
                    done += 1
            con.execute("COMMIT")
        except BaseException:
            con.execute("ROLLBACK")
            raise
        return done
    finally:
        con.close()


class Outbox:
    """The ledger. Shares the inbox's connection, so a turn's completion and its chunks
    commit in one transaction."""

    TRANSIENT: tuple[type[BaseException], ...] = (sqlite3.Error, OSError)

    def __init__(self, inbox: Inbox) -> None:
        self.inbox = inbox
        self._marks: aiosqlite.Connection | None = None

    async def open(self) -> None:
        await self.inbox.db.executescript(_SCHEMA)
        # "accepted -> marked sent" is the duplicate window: marks get their own connection
        # (and thread), so they never queue behind the inbox's statements
        self._marks = await aiosqlite.connect(self.inbox.path, isolation_level=None)
        await self._marks.execute("PRAGMA busy_timeout=5000")
        await self._marks.execute("PRAGMA secure_delete=ON")  # a sent chunk's text is zeroed, not freed
        await self._marks.execute(f"PRAGMA synchronous={'FULL' if self.inbox.fsync == 'always' else 'NORMAL'}")

    async def close(self) -> None:
        if self._marks is not None:
            await self._marks.close()
            self._marks = None

    @property
    def _mark_db(self) -> aiosqlite.Connection:
        return self._marks or self.inbox.db

    async def record(
        self,
        drafts: Sequence[Draft],
        *,
        finish: Sequence[tuple[InboundMessage, str]] = (),
        source: InboundMessage | None = None,
    ) -> list[int]:
        """Record `drafts` as pending chunks and mark `finish` answered, atomically.
        Returns the chunk ids in order. (`source`, the message they answer, names the tenant
        whose key seals their text; cluster mode's outbox files chunks under its lane.)"""
        now = time.time()
        nonces = [str(secrets.randbits(63)) for _ in drafts]
        texts = [await self._kept(d.text, nonce, source) for d, nonce in zip(drafts, nonces, strict=True)]

        def write(con: sqlite3.Connection) -> list[int]:
            ids = []
            for d, nonce, text in zip(drafts, nonces, texts, strict=True):
                cur = con.execute(
                    "INSERT INTO outbox(platform, chat_id, thread_id, kind, reply_to, edit_of, text, nonce,"
                    " created_at, status) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, 'pending')",
                    (
                        d.platform,
                        d.chat_id,
                        d.thread_id,
                        d.kind,
                        d.reply_to,
                        d.edit_of,
                        text,
                        nonce,
                        now,
                    ),
                )
                ids.append(int(cast(int, cur.lastrowid)))  # set by the successful INSERT above
            for msg, outcome in finish:
                Inbox.finish_sync(con, msg, outcome)
            return ids

        return await self.inbox.atomically(write)

    async def _kept(self, text: str, nonce: str, source: InboundMessage | None) -> str:
        """A chunk's text as gateway.db keeps it until sent: sealed with the key of the
        tenant whose message it answers when encryption is on (gateway/sealing.py)."""
        seal = self.inbox.seal
        if seal is None or source is None:
            return text
        kept = await seal.seal(source, text, chunk_place(nonce))
        return text if kept is None else kept  # no tenant: a refusal of an unroutable chat, no one's text

    def may_send(self, chunk: Chunk) -> bool:
        return True  # one node: nobody else could send it

    def time_left(self, chunk: Chunk) -> float | None:
        return None  # one node: nobody else edits the chat meanwhile

    async def mark_sent(self, chunk_id: int, sent_id: str) -> None:
        await self._mark_db.execute(
            "UPDATE outbox SET status='sent', sent_id=?, text=NULL WHERE id=?", (sent_id, chunk_id)
        )
        self.inbox.erased()

    async def give_up(self, chunk_id: int, status: str) -> None:
        """`refused` (the chat is gone for the bot) or `expired` (older than max_age_s)."""
        await self._mark_db.execute("UPDATE outbox SET status=?, text=NULL WHERE id=?", (status, chunk_id))
        self.inbox.erased()

    async def next_for(self, platform: str, chat_id: str) -> Chunk | None:
        """The chat's oldest unsent chunk."""
        rows = cast(  # aiosqlite types it Iterable; at runtime it is cursor.fetchall(), a list
            "list[sqlite3.Row]",
            await self.inbox.db.execute_fetchall(
                "SELECT id, platform, chat_id, thread_id, kind, reply_to, edit_of, text, nonce, created_at"
                " FROM outbox WHERE status='pending' AND platform=? AND chat_id=? ORDER BY id LIMIT 1",
                (platform, chat_id),
            ),
        )
        row = rows[0] if rows else None
        if not row:
            return None
        text = row[7] or ""
        if sealed(text) and self.inbox.seal is not None:
            try:
                text = await self.inbox.seal.open(text, chunk_place(row[8]))
            except VaultError as err:  # its tenant was deleted (key destroyed): nothing to send
                log.warning("an unsent %s chunk cannot be read: %s", platform, err)
                await self.give_up(row[0], "expired")
                return await self.next_for(platform, chat_id)
        return Chunk(row[0], row[1], row[2], row[3], row[4], row[5], row[6], text, row[8], row[9])

    async def sent_message(self, chunk_id: int) -> SentMessage | None:
        """Where chunk `chunk_id` landed, if it was sent."""
        rows = cast(  # aiosqlite types it Iterable; at runtime it is cursor.fetchall(), a list
            "list[sqlite3.Row]",
            await self.inbox.db.execute_fetchall(
                "SELECT chat_id, thread_id, sent_id FROM outbox WHERE id=? AND status='sent'", (chunk_id,)
            ),
        )
        row = rows[0] if rows else None
        return SentMessage(chat_id=row[0], thread_id=row[1], message_id=row[2]) if row else None

    async def status(self, chunk_id: int) -> str | None:
        rows = cast(  # aiosqlite types it Iterable; at runtime it is cursor.fetchall(), a list
            "list[sqlite3.Row]",
            await self.inbox.db.execute_fetchall("SELECT status FROM outbox WHERE id=?", (chunk_id,)),
        )
        return rows[0][0] if rows else None

    async def pending_chats(self) -> list[tuple[str, str]]:
        rows = await self.inbox.db.execute_fetchall(
            "SELECT DISTINCT platform, chat_id FROM outbox WHERE status='pending'"
        )
        return [(p, c) for p, c in rows]

    async def prune(self, older_than_s: float) -> int:
        cur = await self.inbox.db.execute(
            "DELETE FROM outbox WHERE status!='pending' AND created_at < ?", (time.time() - older_than_s,)
        )
        return cur.rowcount


class Deliverer:
    """Sends the outbox: one worker per chat while it has unsent chunks, in chunk order."""

    def __init__(
        self,
        outbox: Ledger,
        adapters: Mapping[str, Adapter],
        metrics: Metrics,
        cfg: DeliveryConfig,
        *,
        clock: Callable[[], float] | None = None,
        wall: Callable[[], float] | None = None,
    ) -> None:
        self.outbox, self.adapters, self.metrics, self.cfg = outbox, adapters, metrics, cfg
        self._clock = clock or (lambda: time.monotonic())
        self._wall = wall or (lambda: time.time())
        self._workers: dict[tuple[str, str], asyncio.Task] = {}
        self._again: set[tuple[str, str]] = set()  # kicked while its worker was finishing
        self._waiting: set[tuple[str, str]] = set()  # workers sleeping in backoff
        self._waiters: dict[int, asyncio.Future] = {}
        self._first_seen: dict[int, tuple[float, float]] = {}  # chunk id -> (age then, clock then)
        # chunks this run marked (recent ones): never sent again, whatever a stale read says
        self._settled: dict[int, None] = {}

    # ----- the public face --------------------------------------------------------------
    def kick(self, platform: str, chat_id: str) -> None:
        """Make sure the chat's chunks are being sent."""
        key = (platform, chat_id)
        if key in self._workers:
            self._again.add(key)
            return
        self._workers[key] = asyncio.create_task(self._work(key), name="deliver")

    async def resume(self) -> None:
        """After a start: send what a previous run left unsent."""
        chats = await self.outbox.pending_chats()
        if chats:
            log.info("resuming delivery in %d chat(s)", len(chats))
        for platform, chat_id in chats:
            self.kick(platform, chat_id)

    async def wait(self, chunk_id: int, timeout: float) -> SentMessage | None:
        """Where chunk `chunk_id` landed, waiting up to `timeout` for it to be sent."""
        fut = self._waiters.setdefault(chunk_id, asyncio.get_running_loop().create_future())
        status = await self.outbox.status(chunk_id)
        if status is not None and status != "pending":
            self._waiters.pop(chunk_id, None)
            return await self.outbox.sent_message(chunk_id)
        try:
            return await asyncio.wait_for(asyncio.shield(fut), timeout)
        except TimeoutError:
            self._waiters.pop(chunk_id, None)
            return None

    @property
    def busy(self) -> bool:
        """True while some chat has chunks being sent (not merely waiting out a backoff)."""
        return any(key not in self._waiting for key in self._workers)

    async def drain(self, timeout: float | None) -> bool:
        """Wait until nothing is being sent (workers only in backoff count as idle)."""
        deadline = None if timeout is None else self._clock() + timeout
        while self.busy:
            if deadline is not None and self._clock() >= deadline:
                return False
            await asyncio.sleep(0.01)
        return True

    async def close(self, timeout: float) -> None:
        """Let sends in progress finish (bounded), then stop; the rest goes on next start."""
        await self.drain(timeout)
        tasks = list(self._workers.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # ----- the worker -------------------------------------------------------------------
    def _age(self, chunk: Chunk) -> float:
        """Seconds since the chunk was recorded: the wall clock only bridges a restart;
        within a run, monotonic time counts, so a clock jump neither expires nor keeps it."""
        seen = self._first_seen.get(chunk.id)
        if seen is None:
            seen = self._first_seen[chunk.id] = (max(0.0, self._wall() - chunk.created_at), self._clock())
        return seen[0] + (self._clock() - seen[1])

    def _resolve(self, chunk_id: int, sent: SentMessage | None, marked: bool | None = True) -> None:
        self._first_seen.pop(chunk_id, None)
        if marked is not False:  # an unrecorded mark: the chunk is still unsent when read again
            self._settled[chunk_id] = None
            if len(self._settled) > 4096:
                del self._settled[next(iter(self._settled))]
        fut = self._waiters.pop(chunk_id, None)
        if fut is not None and not fut.done():
            fut.set_result(sent)

    async def _work(self, key: tuple[str, str]) -> None:
        platform, chat_id = key
        failures = 0
        try:
            while True:
                chunk = await self._db(lambda: self.outbox.next_for(platform, chat_id), key)
                if chunk is not None and chunk.id in self._settled:
                    await asyncio.sleep(0.01)  # a read older than our own committed mark: read again
                    continue
                if chunk is None:
                    if key in self._again:
                        self._again.discard(key)
                        continue
                    return
                self._again.discard(key)
                adapter = self.adapters.get(platform)
                if self._age(chunk) > self.cfg.max_age_s:
                    log.error(
                        "gave up delivering a %s chunk after %.0f s (delivery.max_age_s)", platform, self._age(chunk)
                    )
                    await self._db(partial(self.outbox.give_up, chunk.id, "expired"), key)
                    self.metrics.deliveries.inc(platform=platform, outcome="expired")
                    self._resolve(chunk.id, None)
                    continue
                if not self.outbox.may_send(chunk):
                    return  # cluster mode: the chunk's lane is no longer ours; its next holder sends it
                try:
                    if adapter is None:
                        raise DeliveryDeferred(f"no {platform} adapter running")
                    sent = await self._deliver(adapter, chunk)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    failures += 1
                    delay = self._backoff(failures, getattr(exc, "retry_after", None))
                    self.metrics.deliveries.inc(platform=platform, outcome="retried")
                    log.warning(
                        "%s delivery failed (%s); retrying in %.1f s",
                        platform,
                        exc if isinstance(exc, DeliveryDeferred) else type(exc).__name__,
                        delay,
                    )
                    await self._pause(key, delay)
                    continue
                failures = 0
                # the platform has it: mark it at once (a crash before this line is the window
                # docs/concepts.md#delivery documents); a failing database is retried, never the send
                if sent is None:
                    marked = await self._db(partial(self.outbox.give_up, chunk.id, "refused"), key)
                    self.metrics.deliveries.inc(platform=platform, outcome="refused")
                else:
                    marked = await self._db(partial(self.outbox.mark_sent, chunk.id, sent.message_id), key)
                    self.metrics.deliveries.inc(platform=platform, outcome="sent")
                self._resolve(chunk.id, sent, marked)
        finally:
            self._workers.pop(key, None)
            self._again.discard(key)

    async def _pause(self, key: tuple[str, str], delay: float) -> None:
        self._waiting.add(key)
        try:
            await asyncio.sleep(delay)
        finally:
            self._waiting.discard(key)

    async def _db(self, op: Callable[[], Awaitable[T]], key: tuple[str, str]) -> T:
        """Run a gateway.db step of the worker, retrying while the database fails (locked,
        disk full): giving up here would lose the chunk or send it twice."""
        failures = 0
        while True:
            try:
                return await op()
            except self.outbox.TRANSIENT as exc:
                failures += 1
                delay = self._backoff(failures, None)
                log.error("outbox: the database failed (%s); retrying in %.1f s", exc, delay)
                await self._pause(key, delay)

    def _backoff(self, failures: int, retry_after: float | None) -> float:
        if retry_after is not None and retry_after > 0:
            return float(retry_after)
        return backoff_delay(failures, self.cfg.retry_initial_s, self.cfg.retry_max_s, jitter=0.2)

    async def _deliver(self, adapter: Adapter, chunk: Chunk) -> SentMessage | None:
        """One attempt: send the chunk, or edit the message it edits (falling back to a
        new message when the edit does not work)."""
        if chunk.edit_of is not None:
            target = await self.outbox.sent_message(chunk.edit_of)
            # cluster mode: an edit still waiting (flood pacing, 429) when this node's lease
            # ends is dropped, so it cannot land over the new holder's final text
            # (docs/cluster.md#streaming-and-progress-notices)
            if (
                target is not None
                and adapter.can_edit
                and await self._while_ours(chunk, _safe_edit(adapter, target, chunk.text))
            ):
                return target
            if not self.outbox.may_send(chunk):
                raise DeliveryDeferred("the lane is no longer this node's")
        out = OutboundMessage(
            chat_id=chunk.chat_id,
            thread_id=chunk.thread_id,
            text=chunk.text,
            kind=chunk.kind,
            reply_to_message_id=chunk.reply_to,
            nonce=chunk.nonce,
            may_send=partial(self.outbox.may_send, chunk),  # re-checked after the adapter's own waits
        )
        return await adapter.send(out)

    async def _while_ours(self, chunk: Chunk, edit: Awaitable[bool]) -> bool:
        """Await `edit`, cancelled (DeliveryDeferred) once the ledger's `time_left` for the
        chunk runs out; renewals that extend it meanwhile are honoured."""
        task = asyncio.ensure_future(edit)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=self.outbox.time_left(chunk))
                if done:
                    return task.result()
                left = self.outbox.time_left(chunk)
                if left is not None and left <= 0:
                    raise DeliveryDeferred("the lease ran out while the edit waited")
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task


async def _safe_edit(adapter: Adapter, sent: SentMessage, text: str) -> bool:
    try:
        return await adapter.edit(sent, text)
    except Exception:
        log.debug("edit failed", exc_info=True)
        return False
