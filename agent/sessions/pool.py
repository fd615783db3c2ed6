"""The threads that do storage I/O for every profile: a small pool plus one group syncer.

A store call runs one blocking function on the pool with the profile's own objects passed
in (connection, journal); no thread keeps anything of a tenant between calls. The group
syncer fsyncs the dirty journals of all profiles (`storage.fsync: batch`) in one pass at
most every `BATCH_FSYNC_INTERVAL` seconds.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from agent.sessions.journal import Journal

log = logging.getLogger("agent.sessions")

BATCH_FSYNC_INTERVAL = 0.05  # seconds: the most a `batch` journal line stays un-fsynced
DEFAULT_IO_THREADS = 4
MAX_IO_THREADS = 8

T = TypeVar("T")


class GroupSyncer:
    """One thread that fsyncs every dirty journal (of any profile) in one pass."""

    def __init__(self, interval: float = BATCH_FSYNC_INTERVAL) -> None:
        self.interval = interval
        self._dirty: set[Journal] = set()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False

    def wake(self, journal: Journal) -> None:
        """Called (from any thread) after `journal` was written without fsync."""
        with self._cond:
            self._dirty.add(journal)
            if self._thread is None and not self._stopping:
                self._thread = threading.Thread(target=self._run, name="hermes-fsync", daemon=True)
                self._thread.start()
            if len(self._dirty) == 1:
                self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._dirty and not self._stopping:
                    self._cond.wait()
                if self._stopping and not self._dirty:
                    return
            self._sleep()
            with self._cond:
                batch, self._dirty = self._dirty, set()
            for journal in batch:
                try:
                    journal.fsync_dirty()
                except OSError as e:
                    log.error("batch fsync of %s failed: %s", journal.sessions_dir, e)

    def _sleep(self) -> None:
        """Let writes gather for one interval (wake-ups for new writes do not cut it short)."""
        deadline = time.monotonic() + self.interval
        with self._cond:
            while not self._stopping:
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                self._cond.wait(left)

    def stop(self) -> None:
        """Sync what is pending and end the thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join()
        with self._cond:  # a later wake() starts a fresh thread
            self._stopping = False
            self._thread = None


class StoragePool:
    """A bounded thread pool shared by all profiles' session stores, and their group syncer."""

    def __init__(self, threads: int = DEFAULT_IO_THREADS) -> None:
        if not 1 <= threads <= MAX_IO_THREADS:
            raise ValueError(f"storage io threads must be 1..{MAX_IO_THREADS}, not {threads}")
        self.threads = threads
        self._executor: ThreadPoolExecutor | None = None  # threads start on first use
        self.syncer = GroupSyncer()
        self.calls = 0  # storage round trips so far (for benchmarks and tests)
        self.cpu_s = 0.0  # CPU time the pool threads spent in those calls
        self._cpu_lock = threading.Lock()

    async def run(self, fn: Callable[[], T]) -> T:
        """Run `fn` on a pool thread (one round trip)."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="hermes-storage")
        self.calls += 1
        return await asyncio.get_running_loop().run_in_executor(self._executor, self._timed, fn)

    def _timed(self, fn: Callable[[], T]) -> T:
        t0 = time.thread_time()
        try:
            return fn()
        finally:
            dt = time.thread_time() - t0
            with self._cpu_lock:
                self.cpu_s += dt

    def shutdown(self) -> None:
        """Finish the pending batch fsyncs and end the threads (a later call starts new ones).
        Blocking: call it once every store using the pool is closed."""
        self.syncer.stop()
        executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)


_default: StoragePool | None = None
_default_lock = threading.Lock()


def default_pool() -> StoragePool:
    """The process's shared pool for stores built without one (tools, tests). It holds no
    tenant state: only threads, and the journals waiting for the next batch fsync."""
    global _default
    with _default_lock:
        if _default is None:
            _default = StoragePool()
        return _default
