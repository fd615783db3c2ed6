"""SessionStore: one tenant profile's sessions and messages, owning its I/O.

Every store call is one round trip to the shared storage pool: a blocking function that
gets this profile's connection and journal handed in and does journal write, SQLite
insert and FTS update together. Calls of one store run one at a time. The live sessions
stay in memory while the profile is open (history, compression state, routes), so a turn
writes but does not read state.db; usage counters and compression state ride along with
the turn's next journaled write (or the next call).
"""

from __future__ import annotations

import asyncio
import dataclasses
import fcntl
import json
import logging
import os
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, TypeVar

import apsw

from agent.fileio import private_file, private_mkdir
from agent.messages import StoredMessage
from agent.sessions import db as q
from agent.sessions.codec import (
    check_session_id,
    clean,
    clean_str,
    conversation_order,
    dumps,
    end_line,
    flags_line,
    message_line,
    now,
    prepare_messages,
    row_msg,
    start_line,
)
from agent.sessions.errors import SessionStoreError, StaleRouteError, UnknownSessionError, WriteRefused
from agent.sessions.journal import Journal
from agent.sessions.pool import StoragePool, default_pool
from agent.sessions.reconcile import reconcile
from agent.sessions.search import clamp_limit, search
from agent.sessions.write import Lines, Tx, journaled
from agent.vault import DataKey

log = logging.getLogger("agent.sessions")

FsyncPolicy = Literal["always", "batch", "never"]
LIVE_CACHE = 16  # sessions per profile whose history/compression state stay in memory
_START_KW = frozenset({"source", "user_id", "model"})

T = TypeVar("T")
#: a step of a write's transaction that may refuse the whole write (False)
Gate = Callable[[apsw.Connection], bool]


@dataclasses.dataclass
class _Live:
    """What the store keeps in memory of one session (None = not loaded)."""

    history: list[StoredMessage] | None = None  # active, uncompacted, conversation order
    compression: dict[str, Any] | None = None


@dataclasses.dataclass
class _Soft:
    """Counter and compression-state writes waiting for the next transaction."""

    usage: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    states: dict[str, str] = dataclasses.field(default_factory=dict)
    later: list[Callable[[apsw.Connection], None]] = dataclasses.field(default_factory=list)  # transact(soft=True)

    def __bool__(self) -> bool:
        return bool(self.usage or self.states or self.later)

    def apply(self, db: apsw.Connection) -> None:
        ts = now()
        for sid, (i, o) in self.usage.items():
            q.add_usage(db, sid, i, o)
        for sid, text in self.states.items():
            q.put_compression_state(db, sid, text, ts)
        for fn in self.later:
            try:
                fn(db)
            except apsw.Error:  # never let a queued extra hold back the write it rides on
                log.exception("a queued state.db write failed; skipped")

    def merge_older(self, older: _Soft) -> None:
        """Put back writes of a failed call under newer ones queued meanwhile."""
        for sid, (i, o) in older.usage.items():
            cur = self.usage.setdefault(sid, [0, 0])
            cur[0] += i
            cur[1] += o
        for sid, text in older.states.items():
            self.states.setdefault(sid, text)
        self.later[:0] = older.later


class _Call:
    """What one pool job of one store works on, handed in explicitly."""

    __slots__ = ("db", "journal", "soft", "soft_done")

    def __init__(self, db: apsw.Connection, journal: Journal, soft: _Soft | None) -> None:
        self.db = db
        self.journal = journal
        self.soft = soft
        self.soft_done = soft is None

    def journaled(self, lines: Lines, tx: Tx | None = None, gate: Gate | None = None) -> None:
        """The dual write, with the pending soft writes and then `gate` in its transaction:
        a gate that says no rolls all of it back (and withdraws the lines)."""
        soft = None if self.soft_done else self.soft
        extra: Tx | None = soft.apply if soft is not None else None
        if gate is not None:

            def extra(db: apsw.Connection) -> None:
                if soft is not None:
                    soft.apply(db)
                if not gate(db):
                    raise WriteRefused("the write's gate said no")

        journaled(self.db, self.journal, lines, tx, extra)
        self.soft_done = True

    def flush_soft(self) -> None:
        if not self.soft_done:
            with q.Transaction(self.db):
                self.soft.apply(self.db)  # type: ignore[union-attr]
            self.soft_done = True


def _allowed(guard: Callable[[], None] | None, profile_dir: Path) -> bool:
    """Whether `guard` lets a closing store write (it says no by raising)."""
    if guard is None:
        return True
    try:
        guard()
    except Exception as exc:
        log.warning("profile %s closed without writing its pending counters: %s", profile_dir.name, exc)
        return False
    return True


class SessionStore:
    """Sessions and messages of one tenant profile (`profile_dir`)."""

    def __init__(
        self,
        profile_dir: Path,
        fsync: FsyncPolicy = "batch",
        *,
        pool: StoragePool | None = None,
        guard: Callable[[], None] | None = None,
        journal_mode: q.JournalMode = "wal",
        profile_lock: bool = True,
        key: DataKey | None = None,
    ) -> None:
        """`key` is the tenant's data key for a caller that has it (an open's `before` may
        return it instead; docs/privacy.md#encryption-at-rest). `guard` is called before every storage call and may raise to refuse it (cluster
        mode: the tenant lease is gone); a refused close writes nothing. `journal_mode`
        "delete" suits a network filesystem. `profile_lock` False leaves the one-writer rule
        to the caller (cluster mode's tenant lease) instead of an flock on this host."""
        if fsync not in ("always", "batch", "never"):
            raise ValueError(f"fsync must be always|batch|never, not {fsync!r}")
        self.profile_dir = Path(profile_dir)
        self.fsync: FsyncPolicy = fsync
        self._guard = guard
        self._journal_mode: q.JournalMode = journal_mode
        self._profile_lock = profile_lock
        self.db_path = self.profile_dir / "state.db"
        self.sessions_dir = self.profile_dir / "sessions"
        self._pool = pool or default_pool()
        self._journal = Journal(self.sessions_dir, fsync, self._pool.syncer, key)
        self._db: apsw.Connection | None = None
        self._lock = asyncio.Lock()
        self._lock_fd: int | None = None
        self._routes: dict[str, str] = {}  # session_key -> live session id
        self._live: OrderedDict[str, _Live] = OrderedDict()
        self._soft = _Soft()
        #: the tenant's data key (or set by open's `before`): state.db and journal lines sealed
        self.key: DataKey | None = key

    # ------------------------------------------------------------------ lifecycle

    async def open(self, before: Callable[[], DataKey | None] | None = None) -> SessionStore:
        """Open state.db (schema only when its version is older) and reconcile it with the
        journals. `before` runs first in the same pool job (the caller's checks of the
        profile directory: no extra hop) and returns the tenant's data key when its profile
        is encrypted (docs/privacy.md#encryption-at-rest); if it raises, nothing is opened."""
        if self._db is not None:
            return self

        def job() -> apsw.Connection:
            if before is not None:
                self.key = before()
            self._journal.key = self.key  # before the first line is read or written
            return self._open_blocking()

        self._db = await self._pool.run(job)
        return self

    def _open_blocking(self) -> apsw.Connection:
        private_mkdir(self.sessions_dir)
        if self._guard is not None:
            self._guard()
        if self._profile_lock:
            self._take_profile_lock()
        db: apsw.Connection | None = None
        try:  # whatever fails (a descriptor limit too) releases the profile lock again
            private_file(self.db_path)  # SQLite gives -wal/-shm the database file's mode
            db = q.connect(self.db_path, self.fsync, self._journal_mode, key=self.key)
            reconcile(db, self._journal)
            return db
        except BaseException:
            if db is not None:
                db.close()
            self._journal.close()
            self._release_profile_lock()
            raise

    def _take_profile_lock(self) -> None:
        """One writer per profile: a second SessionStore on the same directory would corrupt offsets."""
        fd = os.open(self.sessions_dir / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            raise SessionStoreError(f"{self.profile_dir} is already open by another SessionStore") from e
        self._lock_fd = fd

    def _release_profile_lock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    async def close(self) -> None:
        """Write pending counters, fsync every journal written to, close."""
        if self._db is None:
            return
        async with self._lock:
            db = self._db
            if db is None:
                return
            self._db = None
            soft, self._soft = self._soft, _Soft()
            self._routes.clear()
            self._live.clear()

            guard = self._guard

            def job() -> None:
                try:
                    try:
                        if _allowed(guard, self.profile_dir):  # refused: pending counters dropped, nothing written
                            _Call(db, self._journal, soft or None).flush_soft()
                    finally:
                        self._journal.close()
                finally:
                    try:
                        db.close()
                    finally:
                        self._release_profile_lock()

            await self._pool.run(job)

    async def sync(self) -> None:
        """Fsync every journal written since the last fsync, whatever the policy."""
        await self._call(lambda c: c.journal.fsync_dirty(True))

    async def __aenter__(self) -> SessionStore:
        return await self.open()

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, _tb: TracebackType | None
    ) -> None:
        await self.close()

    # ------------------------------------------------------------------ the call

    def _require_db(self) -> apsw.Connection:
        if self._db is None:
            raise SessionStoreError("session store is not open")
        return self._db

    async def _call(
        self,
        fn: Callable[[_Call], T],
        *,
        then: Callable[[T], None] | None = None,
        soft_first: bool = True,
    ) -> T:
        """Run `fn` as one pool job under this store's lock, shielded so a cancelled caller
        can't split journal and db. Pending soft writes go first (`soft_first`) or inside
        `fn`'s journaled transaction. `then` updates the in-memory state on the loop."""
        self._require_db()

        async def locked() -> T:
            async with self._lock:
                db = self._require_db()
                soft, self._soft = self._soft, _Soft()
                call = _Call(db, self._journal, soft or None)

                guard = self._guard

                def job() -> T:
                    if guard is not None:
                        guard()  # on the storage thread, right before the write
                    if soft_first:
                        call.flush_soft()
                    result = fn(call)
                    call.flush_soft()
                    return result

                try:
                    result = await self._pool.run(job)
                except BaseException:
                    if not call.soft_done and call.soft is not None:
                        self._soft.merge_older(call.soft)
                    raise
                if then is not None:
                    then(result)
                return result

        task = asyncio.ensure_future(locked())
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
        return await asyncio.shield(task)

    def _remember(self, sid: str) -> _Live:
        live = self._live.get(sid)
        if live is None:
            live = self._live[sid] = _Live()
            while len(self._live) > LIVE_CACHE:
                self._live.popitem(last=False)
        else:
            self._live.move_to_end(sid)
        return live

    def _forget_history(self, *sids: str) -> None:
        for sid in sids or list(self._live):
            live = self._live.get(sid)
            if live is not None:
                live.history = None

    def _ended(self, sid: str) -> None:
        self._live.pop(sid, None)
        for key in [k for k, v in self._routes.items() if v == sid]:
            del self._routes[key]

    # ------------------------------------------------------------------ sessions

    async def start_session(
        self,
        session_key: str,
        *,
        source: str = "",
        user_id: str = "",
        model: str = "",
        parent_session_id: str | None = None,
        route: bool = True,
    ) -> str:
        """Create a session (journaled first); with `route`, point the lane at it atomically."""

        def job(c: _Call) -> str:
            return self._start(
                c,
                session_key,
                source=source,
                user_id=user_id,
                model=model,
                parent_session_id=parent_session_id,
                route=route,
            )

        def then(sid: str) -> None:
            self._started(sid, session_key if route else None)

        return await self._call(job, then=then, soft_first=False)

    def _started(self, sid: str, session_key: str | None) -> None:
        live = self._remember(sid)
        live.history, live.compression = [], {}
        if session_key is not None:
            self._routes[session_key] = sid

    def _start(
        self,
        c: _Call,
        session_key: str,
        *,
        source: str = "",
        user_id: str = "",
        model: str = "",
        parent_session_id: str | None = None,
        route: bool = True,
    ) -> str:
        if parent_session_id is not None:
            check_session_id(parent_session_id)
        sid = c.journal.new_session_id()
        ts = now()
        kw = {"source": source, "user_id": user_id, "model": model}
        line = start_line(sid, session_key, parent=parent_session_id, route=route, ts=ts, **kw)

        def tx(db: apsw.Connection) -> None:
            q.insert_session(db, sid, session_key, parent=parent_session_id, ts=ts, **kw)
            if route:
                q.set_route(db, session_key, sid, ts)

        c.journaled({sid: [line]}, tx)
        return sid

    async def end_session(self, session_id: str, reason: str) -> None:
        """Mark a session ended and drop any route to it. Ending twice is a no-op."""
        check_session_id(session_id)

        def job(c: _Call) -> None:
            info = q.session_row(c.db, session_id)
            if info["ended_at"] is not None:
                return
            ts = now()
            c.journaled(
                {session_id: [end_line(session_id, reason, ts)]}, lambda db: q.apply_end(db, session_id, reason, ts)
            )

        await self._call(job, then=lambda _: self._ended(session_id), soft_first=False)

    async def rotate(
        self,
        session_key: str,
        old_session_id: str,
        reason: str,
        *,
        carry: list[StoredMessage] | None = None,
        compact_uids: list[str] | None = None,
        **start_kwargs: Any,
    ) -> str:
        """End `old_session_id` and start its child, moving the lane's route, in one transaction.

        The child inherits source/user_id/model unless given. `carry` messages (any session_id;
        they are re-homed) become the child's first messages and `compact_uids` of the old
        session are flagged compacted, in the same journal write and transaction.
        Raises StaleRouteError when the old session already ended or the lane routes elsewhere
        (a concurrent rotate).
        """
        check_session_id(old_session_id)
        unknown = set(start_kwargs) - _START_KW
        if unknown:
            raise TypeError(f"rotate() got unexpected arguments: {sorted(unknown)}")
        carried = prepare_messages(list(carry or []), check_session=False)

        def job(c: _Call) -> str:
            db = c.db
            old = q.session_row(db, old_session_id)
            if old["ended_at"] is not None:
                raise StaleRouteError(f"session {old_session_id} already ended ({old['end_reason']})")
            cur = db.execute("SELECT session_id FROM routes WHERE session_key=?", (session_key,)).fetchone()
            if cur is not None and cur[0] != old_session_id:
                raise StaleRouteError(f"lane {session_key!r} routes to {cur[0]}, not {old_session_id}")
            kw = {k: start_kwargs.get(k, old[k] or "") for k in _START_KW}
            new_id = c.journal.new_session_id()
            ts = now()
            msgs = [dataclasses.replace(m, session_id=new_id) for m in carried]
            if q.existing_uids(db, [m.uid for m in msgs]):
                raise ValueError("rotate(carry=...) messages need fresh uids")
            flagged = q.uids_of(db, old_session_id, list(compact_uids or []))
            old_lines: list[dict[str, Any]] = [end_line(old_session_id, reason, ts)]
            if flagged:
                old_lines.insert(0, flags_line(flagged, None, True, reason, ts))

            def tx(db: apsw.Connection) -> None:
                q.apply_end(db, old_session_id, reason, ts, move_routes_to=new_id)
                q.insert_session(db, new_id, session_key, parent=old_session_id, ts=ts, **kw)
                q.set_route(db, session_key, new_id, ts)
                q.insert_messages(db, msgs)
                if flagged:
                    q.apply_flags(db, flagged, None, True)

            c.journaled(
                {
                    old_session_id: old_lines,
                    new_id: [
                        start_line(new_id, session_key, parent=old_session_id, route=True, ts=ts, **kw),
                        *(message_line(m) for m in msgs),
                    ],
                },
                tx,
            )
            return new_id

        def then(new_id: str) -> None:
            self._ended(old_session_id)
            self._routes[session_key] = new_id
            self._remember(new_id).compression = {}

        return await self._call(job, then=then, soft_first=False)

    async def route(self, session_key: str) -> str | None:
        """The live (not ended) session id of a lane, or None."""
        sid = self._routes.get(session_key)
        if sid is not None and self._db is not None:
            return sid

        def then(found: str | None) -> None:
            if found is not None:
                self._routes[session_key] = found

        return await self._call(lambda c: q.live_route(c.db, session_key), then=then)

    async def get_or_start(self, session_key: str, **kw: Any) -> tuple[str, bool]:
        """The lane's live session, starting (and routing) one if there is none. A session
        found in state.db is loaded (history, compression state) in the same call."""
        unknown = set(kw) - _START_KW - {"parent_session_id"}
        if unknown:
            raise TypeError(f"get_or_start() got unexpected arguments: {sorted(unknown)}")
        sid = self._routes.get(session_key)
        if sid is not None and self._db is not None:
            return sid, False

        def job(c: _Call) -> tuple[str, bool, list[StoredMessage] | None, dict[str, Any] | None]:
            found = q.live_route(c.db, session_key)
            if found is None:
                return self._start(c, session_key, route=True, **kw), True, None, None
            return found, False, self._load_history(c.db, found), self._load_state(c.db, found)

        def then(res: tuple[str, bool, list[StoredMessage] | None, dict[str, Any] | None]) -> None:
            sid, created, history, state = res
            if created:
                self._started(sid, session_key)
            else:
                self._routes[session_key] = sid
                live = self._remember(sid)
                live.history, live.compression = history, state

        res = await self._call(job, then=then, soft_first=False)
        return res[0], res[1]

    # ------------------------------------------------------------------ messages

    async def append(self, msg: StoredMessage) -> StoredMessage:
        """Store one message (journal first). Re-appending a known uid is a no-op."""
        return (await self.append_many([msg]))[0]

    async def append_many(self, msgs: list[StoredMessage], *, gate: Gate | None = None) -> list[StoredMessage]:
        """Store messages in one transaction, in list order. Returns them as stored.

        Pending usage counters and compression state commit in the same transaction, and
        then `gate` (a budget reservation): when it says no, nothing is stored and
        `WriteRefused` is raised. Lone surrogates in strings are replaced with U+FFFD
        (UTF-8 cannot carry them).
        """
        if not msgs and gate is None:
            return []
        cleaned = prepare_messages(msgs)
        cached = {m.session_id for m in cleaned if m.session_id in self._live}

        def job(c: _Call) -> list[StoredMessage]:
            for sid in sorted({m.session_id for m in cleaned} - cached):
                q.session_row(c.db, sid)
            known = q.existing_uids(c.db, [m.uid for m in cleaned])
            fresh: list[StoredMessage] = []
            lines: dict[str, list[dict[str, Any]]] = {}
            for m in cleaned:
                if m.uid not in known:
                    known.add(m.uid)
                    fresh.append(m)
                    lines.setdefault(m.session_id, []).append(message_line(m))
            if fresh:
                c.journaled(lines, lambda db: q.insert_messages(db, fresh), gate)
            elif gate is not None:
                c.flush_soft()
                with q.Transaction(c.db):
                    if not gate(c.db):
                        raise WriteRefused("the write's gate said no")
            return fresh

        def then(fresh: list[StoredMessage]) -> None:
            for m in fresh:
                live = self._live.get(m.session_id)
                if live is None or live.history is None:
                    continue
                if isinstance(m.meta, dict) and "after_uid" in m.meta:
                    live.history = None  # placement: reload in conversation order when asked
                elif m.active and not m.compacted:
                    live.history.append(m)

        await self._call(job, then=then, soft_first=False)
        return cleaned

    async def compact(
        self, session_id: str, uids: list[str], messages: list[StoredMessage], *, reason: str = "compression"
    ) -> int:
        """Append `messages` to `session_id` and flag its `uids` compacted, atomically: one
        journal write (message lines, then a flags event) and one SQLite transaction.
        Returns how many messages were flagged."""
        check_session_id(session_id)
        cleaned = prepare_messages(messages)
        if any(m.session_id != session_id for m in cleaned):
            raise ValueError("compact() messages must belong to the compacted session")

        def job(c: _Call) -> int:
            q.session_row(c.db, session_id)
            known = q.existing_uids(c.db, [m.uid for m in cleaned])
            fresh = [m for m in cleaned if m.uid not in known]
            flagged = q.uids_of(c.db, session_id, list(uids))
            lines = [message_line(m) for m in fresh]
            if flagged:
                lines.append(flags_line(flagged, None, True, reason, now()))
            if not lines:
                return 0

            def tx(db: apsw.Connection) -> None:
                q.insert_messages(db, fresh)
                if flagged:
                    q.apply_flags(db, flagged, None, True)

            c.journaled({session_id: lines}, tx)
            return len(flagged)

        return await self._call(job, then=lambda _: self._forget_history(session_id), soft_first=False)

    async def history(self, session_id: str, *, include_inactive: bool = False) -> list[StoredMessage]:
        """Messages of a session in conversation order; only active, uncompacted ones by default.

        Conversation order is insertion order, except that a compression summary (meta
        `after_uid`) follows the message it names, so history reads [head, summary, tail].
        Served from memory for a live session; the messages are shared, do not mutate them."""
        if not include_inactive:
            live = self._live.get(session_id)
            if live is not None and live.history is not None and self._db is not None:
                self._live.move_to_end(session_id)
                return list(live.history)

        def job(c: _Call) -> list[StoredMessage]:
            return conversation_order(
                [row_msg(r) for r in q.session_messages(c.db, session_id, include_inactive=include_inactive)]
            )

        def then(msgs: list[StoredMessage]) -> None:
            if not include_inactive and (session_id in self._live or session_id in self._routes.values()):
                self._remember(session_id).history = list(msgs)

        return await self._call(job, then=then)

    @staticmethod
    def _load_history(db: apsw.Connection, sid: str) -> list[StoredMessage]:
        return conversation_order([row_msg(r) for r in q.session_messages(db, sid, include_inactive=False)])

    @staticmethod
    def _load_state(db: apsw.Connection, sid: str) -> dict[str, Any]:
        text = q.get_compression_state(db, sid)
        if text is None:
            return {}
        try:
            data = json.loads(text)
        except (TypeError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    async def set_flags(
        self, uids: list[str], *, active: bool | None = None, compacted: bool | None = None, reason: str
    ) -> int:
        """Flip `active`/`compacted` on messages (journaled as a flags event). Returns how many matched."""
        if active is None and compacted is None:
            raise ValueError("set_flags needs active and/or compacted")
        return await self._call(
            lambda c: self._set_flags(c, list(uids), active, compacted, reason),
            then=lambda _: self._forget_history(),
            soft_first=False,
        )

    async def undo_last_turn(self, session_id: str) -> int:
        """Deactivate the last visible user message and everything active after it; returns the count.

        Repeated calls walk back one turn each.
        """
        check_session_id(session_id)

        def job(c: _Call) -> int:
            last = c.db.execute(
                "SELECT id FROM messages WHERE session_id=? AND role='user' AND active=1 AND compacted=0 "
                f"AND NOT {q.IS_SUMMARY_SQL} ORDER BY id DESC LIMIT 1",
                (session_id,),
            ).fetchone()
            if last is None:
                return 0
            rows: list[q.Row] = c.db.execute(
                f"SELECT uid FROM messages WHERE session_id=? AND id>=? AND active=1 AND NOT {q.IS_SUMMARY_SQL} "
                "ORDER BY id",
                (session_id, last[0]),
            ).fetchall()
            return self._set_flags(c, [r[0] for r in rows], False, None, "undo")

        return await self._call(job, then=lambda _: self._forget_history(), soft_first=False)

    @staticmethod
    def _set_flags(c: _Call, uids: list[str], active: bool | None, compacted: bool | None, reason: str) -> int:
        by_session = q.uids_by_session(c.db, uids)
        if not by_session:
            return 0
        ts = now()
        lines = {sid: [flags_line(us, active, compacted, reason, ts)] for sid, us in by_session.items()}
        count = 0

        def tx(db: apsw.Connection) -> None:
            nonlocal count
            count = q.apply_flags(db, [u for us in by_session.values() for u in us], active, compacted)

        c.journaled(lines, tx)
        return count

    async def search(self, query: str, limit: int = 10, *, session_key: str | None = None) -> list[dict[str, Any]]:
        """FTS5 search over this profile's messages (see agent/sessions/search.py); with
        `session_key`, only over the sessions of that one lane. `limit` is capped."""
        if not isinstance(query, str) or not query.strip():
            return []
        n = clamp_limit(limit)
        return await self._call(lambda c: search(c.db, query, n, session_key))

    # ------------------------------------------------------------------ counters and info

    async def transact(self, fn: Callable[[apsw.Connection], T]) -> T:
        """Run `fn` in one transaction of state.db, on the store's pool and under its lock
        and write guard (the budget ledger's tables, agent/ledger.py)."""

        def job(c: _Call) -> T:
            with q.Transaction(c.db):
                return fn(c.db)

        return await self._call(job)

    def transact_later(self, fn: Callable[[apsw.Connection], None]) -> None:
        """Queue `fn` for the store's next transaction (normally the turn's answer), like the
        usage counters: a crash before it loses only what `fn` would write (the ledger's
        settle, which replaces an estimate already counted)."""
        self._require_db()
        self._soft.later.append(fn)

    async def add_usage(self, session_id: str, input_tokens: int, output_tokens: int) -> None:
        """Add token usage to a session's counters (SQLite only). For a live session it is
        written with the next transaction (normally the turn's answer), not on its own."""
        i, o = int(input_tokens), int(output_tokens)
        if session_id in self._live and self._db is not None:
            cur = self._soft.usage.setdefault(session_id, [0, 0])
            cur[0] += i
            cur[1] += o
            return
        await self._update_session(
            session_id,
            "input_tokens = COALESCE(input_tokens,0) + ?, output_tokens = COALESCE(output_tokens,0) + ?",
            (i, o),
        )

    async def increment_compressions(self, session_id: str, by: int = 1) -> None:
        """Count `by` more compressions of this session (SQLite only)."""
        await self._update_session(session_id, "compressions = COALESCE(compressions,0) + ?", (int(by),))

    async def compression_state(self, session_id: str) -> dict[str, Any]:
        """The session's persisted compression state (streaks, cooldowns...; {} if none)."""
        live = self._live.get(session_id)
        if live is not None and live.compression is not None and self._db is not None:
            return json.loads(dumps(live.compression))

        def then(state: dict[str, Any]) -> None:
            if session_id in self._live:
                self._live[session_id].compression = state

        state = await self._call(lambda c: self._load_state(c.db, session_id), then=then)
        return json.loads(dumps(state))

    async def set_compression_state(self, session_id: str, state: dict[str, Any]) -> None:
        """Replace the session's compression state (SQLite only; soft state). For a live
        session it is written with the next transaction (normally the turn's answer)."""
        text = dumps(clean(state))
        live = self._live.get(session_id)
        if live is not None and self._db is not None:
            live.compression = json.loads(text)
            self._soft.states[session_id] = text
            return
        await self._call(lambda c: q.put_compression_state(c.db, session_id, text, now()))

    async def set_summary(self, session_id: str, text: str) -> None:
        """Store the session's latest summary text (SQLite only)."""
        await self._update_session(session_id, "summary = ?", (clean_str(text),))

    async def _update_session(self, session_id: str, assignments: str, params: tuple[Any, ...]) -> None:
        def job(c: _Call) -> None:
            c.db.execute(f"UPDATE sessions SET {assignments} WHERE id=?", (*params, session_id))
            if c.db.changes() == 0:
                raise UnknownSessionError(session_id)

        await self._call(job)

    async def session_info(self, session_id: str) -> dict[str, Any] | None:
        """The sessions row as a dict, or None."""

        def job(c: _Call) -> dict[str, Any] | None:
            row = c.db.execute(f"SELECT {q.SESSION_COLS} FROM sessions WHERE id=?", (session_id,)).fetchone()
            return None if row is None else q.session_dict(row)

        return await self._call(job)

    async def list_sessions(self) -> list[dict[str, Any]]:
        """Every sessions row, oldest first."""
        return await self._call(
            lambda c: [
                q.session_dict(r)
                for r in c.db.execute(f"SELECT {q.SESSION_COLS} FROM sessions ORDER BY started_at, id")
            ]
        )

    async def stats(self) -> dict[str, Any]:
        """Counts of sessions and messages, and the latest message/session timestamp."""

        def job(c: _Call) -> dict[str, Any]:
            row = q.aggregate(
                c.db,
                "SELECT (SELECT count(*) FROM sessions) AS sessions, (SELECT count(*) FROM messages) AS messages, "
                "max(COALESCE((SELECT max(timestamp) FROM messages), 0), "
                "    COALESCE((SELECT max(max(COALESCE(started_at,0), COALESCE(ended_at,0))) FROM sessions), 0)) "
                "AS last",
            )
            return {"sessions": row[0], "messages": row[1], "last_activity": row[2] or None}

        return await self._call(job)

    async def export(self) -> dict[str, Any]:
        """Every session with all its messages (inactive and compacted too), JSON-serialisable."""

        def job(c: _Call) -> dict[str, Any]:
            sessions = [
                q.session_dict(r)
                for r in c.db.execute(f"SELECT {q.SESSION_COLS} FROM sessions ORDER BY started_at, id")
            ]
            by_id: dict[str, list[dict[str, Any]]] = {s["id"]: [] for s in sessions}
            for r in c.db.execute(f"SELECT {q.MSG_COLS} FROM messages ORDER BY id"):
                m = row_msg(r)
                by_id.setdefault(m.session_id, []).append(m.to_json())
            for s in sessions:
                s["messages"] = by_id.get(s["id"], [])
            return {"schema_version": q.SCHEMA_VERSION, "exported_at": now(), "sessions": sessions}

        return await self._call(job)

    async def backup_to(self, dest_path: Path) -> None:
        """Copy state.db to `dest_path` with SQLite's online backup API (a self-contained
        file with a rollback journal, which the stdlib `sqlite3` reads); an encrypted one
        is copied plain (docs/privacy.md#exports-and-the-hermes-cli)."""
        dest_path = Path(dest_path)
        key = self.key

        def job(c: _Call) -> None:
            private_mkdir(dest_path.parent)
            private_file(dest_path)
            if key is not None:
                q.plain_copy(c.db, dest_path, key)
            else:
                q.backup_file(c.db, dest_path)

        await self._call(job)
