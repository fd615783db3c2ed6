"""The JSONL journals of one profile (`sessions/<session_id>.jsonl`): append, withdraw,
fsync, and read back for reconciliation.

With the tenant's data key (storage.encryption per_tenant) every line is one sealed record,
base64 on its own line, bound to its file (`sessions/<file name>`), so torn tails and
reconciliation by uid work the same on sealed lines (docs/privacy.md#encryption-at-rest).

Blocking code, run on a storage pool thread by the store (one call at a time per profile).
The group syncer may fsync this profile's dirty journals from its own thread at the same
time, so the descriptor table is guarded by a lock and the syncer fsyncs duplicates.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os
import secrets
import threading
from collections import OrderedDict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

from agent.sessions.codec import check_session_id, journal_line
from agent.vault import DataKey, VaultError, is_sealed_line

log = logging.getLogger("agent.sessions")

MAX_OPEN_JOURNALS = 8  # per profile: descriptors of its most recently written journals


class Syncer(Protocol):
    def wake(self, journal: Journal) -> None: ...


@dataclasses.dataclass
class Record:
    """One parsed journal line and where it starts in the file."""

    start: int
    data: dict[str, Any]


def place_of(path: Path) -> str:
    """A journal's place, the associated data its sealed lines are bound to."""
    return f"sessions/{path.name}"


def encode_lines(lines: list[dict[str, Any]], key: DataKey | None, place: str) -> bytes:
    """JSONL bytes of `lines`: plain, or each line sealed with `key` for `place`."""
    if key is None:
        return "".join(journal_line(d) for d in lines).encode("utf-8")
    return "".join(key.seal_line(journal_line(d)[:-1], place) + "\n" for d in lines).encode("ascii")


def decode_line(raw: bytes, key: DataKey | None, place: str) -> Any:
    """One journal line's JSON value. ValueError when it is garbled (torn, damaged); VaultError
    when it is sealed and there is no key, or plain in a sealed journal: never cut as garbage."""
    if key is None:
        if is_sealed_line(raw):
            raise VaultError(f"{place} is encrypted, but this profile was opened without its key")
        return json.loads(raw.decode("utf-8"))
    if raw.lstrip().startswith(b"{"):
        raise VaultError(f"{place} holds plain lines, but its profile is encrypted")
    try:
        return json.loads(key.open_line(raw.decode("ascii"), place))
    except (VaultError, UnicodeDecodeError) as err:
        raise ValueError(str(err)) from None


class Journal:
    """Append-only journal files of one profile, with a small descriptor cache."""

    def __init__(
        self, sessions_dir: Path, fsync: str, syncer: Syncer | None = None, key: DataKey | None = None
    ) -> None:
        self.sessions_dir = sessions_dir
        self.fsync = fsync
        self._syncer = syncer
        #: the tenant's data key: lines are sealed with it (set by the store's open job, before any write)
        self.key = key
        self._fds: OrderedDict[str, int] = OrderedDict()
        self._dirty: set[str] = set()  # journals written since their last fsync
        self._dir_dirty = False
        self._suspect: set[str] = set()  # journals a failed write may have left unterminated
        self._lock = threading.Lock()  # guards _fds/_dirty against the group syncer
        self._sync_lock = threading.Lock()  # one fsync pass at a time (syncer or close)

    def path(self, sid: str) -> Path:
        return self.sessions_dir / f"{sid}.jsonl"

    def new_session_id(self) -> str:
        while True:
            sid = f"{datetime.now(UTC).strftime('%Y%m%d_%H%M%S')}_{secrets.token_hex(4)}"
            if not self.path(sid).exists():
                return sid

    # ------------------------------------------------------------------ writing

    def _fd(self, sid: str) -> int:
        """A cached O_APPEND descriptor of a session journal."""
        fd = self._fds.get(sid)
        if fd is not None:
            self._fds.move_to_end(sid)
            return fd
        path = self.path(sid)
        created = not path.exists()
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        if created:
            if self.fsync == "always":
                self._fsync_dir()
            else:
                self._dir_dirty = True
        with self._lock:
            self._fds[sid] = fd
            evicted = []
            while len(self._fds) > MAX_OPEN_JOURNALS:
                old_sid, old_fd = self._fds.popitem(last=False)
                evicted.append((old_sid, old_fd, old_sid in self._dirty))
                self._dirty.discard(old_sid)
        for _sid, old_fd, dirty in evicted:
            try:
                if dirty:  # close()/sync() could not reach it once closed
                    os.fsync(old_fd)
            finally:
                os.close(old_fd)
        return fd

    def _fsync_dir(self) -> None:
        self._dir_dirty = False
        dfd = os.open(self.sessions_dir, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)

    def encode(self, sid: str, lines: list[dict[str, Any]]) -> bytes:
        """One session's lines as the bytes its journal gets (sealed when keyed)."""
        return encode_lines(lines, self.key, place_of(self.path(sid)))

    def write(self, payload: dict[str, bytes]) -> dict[str, tuple[int, int]]:
        """Append each session's bytes; on failure undo what was written. Returns (start, end) spans."""
        spans: dict[str, tuple[int, int]] = {}
        try:
            for sid, data in payload.items():
                fd = self._fd(sid)
                start = os.fstat(fd).st_size
                if sid in self._suspect:
                    start, data = self._repair_tail(sid, start, data)
                spans[sid] = (start, start)
                view = memoryview(data)
                while view:
                    n = self._write_fd(fd, view)
                    if n <= 0:
                        raise OSError(errno.EIO, "short write")
                    view = view[n:]
                spans[sid] = (start, start + len(data))
                if self.fsync == "always":
                    os.fsync(fd)
                else:
                    with self._lock:
                        self._dirty.add(sid)
        except OSError:
            self.withdraw(spans)
            raise
        if self.fsync == "batch" and self._syncer is not None:
            self._syncer.wake(self)
        return spans

    def _write_fd(self, fd: int, data: memoryview) -> int:
        """One write(2); a seam for tests that simulate a full disk."""
        return os.write(fd, data)

    def _repair_tail(self, sid: str, size: int, data: bytes) -> tuple[int, bytes]:
        """After an unrepaired failed write, make sure new lines start on a fresh line."""
        if size > 0:
            with open(self.path(sid), "rb") as f:
                f.seek(size - 1)
                if f.read(1) != b"\n":
                    data = b"\n" + data
        self._suspect.discard(sid)
        return size, data

    def withdraw(self, spans: dict[str, tuple[int, int]]) -> None:
        """Truncate journals back to where this write started (best effort)."""
        for sid, (start, _) in spans.items():
            fd = self._fds.get(sid)
            try:
                if fd is None:
                    os.truncate(self.path(sid), start)
                else:
                    os.ftruncate(fd, start)
            except OSError as e:
                self._suspect.add(sid)
                log.error("could not withdraw journal bytes of %s: %s (reconciled on next open)", sid, e)

    # ------------------------------------------------------------------ durability

    @property
    def dirty(self) -> bool:
        return bool(self._dirty) or self._dir_dirty

    def fsync_dirty(self, everything: bool = False) -> None:
        """Fsync dirty journals (and the directory). `everything` also covers fsync=never.

        Safe from any thread: descriptors are duplicated under the lock, so a concurrent
        eviction cannot close one under the fsync."""
        if self.fsync == "never" and not everything:
            return
        with self._sync_lock:
            with self._lock:
                dups = [os.dup(self._fds[sid]) for sid in self._dirty if sid in self._fds]
                self._dirty.clear()
                dir_dirty, self._dir_dirty = self._dir_dirty, False
            try:
                for fd in dups:
                    os.fsync(fd)
            finally:
                for fd in dups:
                    os.close(fd)
            if dir_dirty:
                self._fsync_dir()

    def close(self) -> None:
        """Fsync what was written and close every descriptor."""
        try:
            self.fsync_dirty(True)
        finally:
            with self._lock:
                fds = list(self._fds.values())
                self._fds.clear()
                self._dirty.clear()
            for fd in fds:
                try:
                    os.close(fd)
                except OSError:
                    pass

    @property
    def open_fds(self) -> int:
        return len(self._fds)

    # ------------------------------------------------------------------ reading

    @staticmethod
    def read(path: Path, start: int, key: DataKey | None = None) -> tuple[list[Record], int]:
        """Parse journal lines from `start` (opened with `key` when sealed); cut a torn or
        garbled tail. Returns (records, end).

        Garbled lines followed by good ones are skipped (logged), never cut. Lines of the
        other kind (sealed without a key, plain with one) raise VaultError, cutting nothing.
        """
        place = place_of(path)
        with open(path, "r+b") as f:
            f.seek(start)
            data = f.read()
            raws = data.split(b"\n")
            tail = raws.pop()  # bytes after the last newline: a torn write when non-empty
            records: list[Record] = []
            pos = start
            bad_from: int | None = None  # start of trailing garbled lines
            for raw in raws:
                line_start, pos = pos, pos + len(raw) + 1
                if not raw.strip():
                    continue
                try:
                    obj = decode_line(raw, key, place)
                    if not isinstance(obj, dict):
                        raise ValueError("not a JSON object")
                except ValueError:  # includes UnicodeDecodeError and JSONDecodeError
                    log.warning("garbled journal line in %s at byte %d", path, line_start)
                    if bad_from is None:
                        bad_from = line_start
                    continue
                bad_from = None
                records.append(Record(line_start, obj))
            end = pos if bad_from is None else bad_from
            if tail or bad_from is not None:
                log.warning("truncating torn journal tail of %s at byte %d", path, end)
                f.truncate(end)
                f.flush()
                os.fsync(f.fileno())
        return records, end

    def sizes(self) -> dict[str, int]:
        """Every journal's size by session id (invalid file names are skipped, logged)."""
        out: dict[str, int] = {}
        with os.scandir(self.sessions_dir) as it:
            for entry in it:
                if not entry.name.endswith(".jsonl"):
                    continue
                try:
                    sid = check_session_id(entry.name[: -len(".jsonl")])
                except ValueError:
                    log.warning("ignoring journal with an invalid session id: %s", entry.path)
                    continue
                out[sid] = entry.stat().st_size
        return out

    def scan(self, offsets: dict[str, int], suspects: set[str]) -> tuple[set[str], list[tuple[str, Path, int, bool]]]:
        """All journal session ids, and (id, path, start, full) for each journal needing work.

        An offset is trusted when the file is at least that long and a line ends right
        before it; otherwise the journal lost data state.db has, and gets a full scan.
        """
        out: list[tuple[str, Path, int, bool]] = []
        sizes = self.sizes()
        for sid in sorted(sizes):
            path, size = self.path(sid), sizes[sid]
            offset = offsets.get(sid, 0)
            ok = offset == 0
            if 0 < offset <= size:
                with open(path, "rb") as f:
                    f.seek(offset - 1)
                    ok = f.read(1) == b"\n"
            if not ok:
                log.warning("journal %s lost data state.db has; full reconcile", path)
            full = sid in suspects or not ok
            if full or size > offset:
                out.append((sid, path, 0 if full else offset, full))
        return set(sizes), out
