"""Durable, owner-only file writes shared by every store: one way to replace a file
atomically, and helpers that create files 0600 and directories 0700 whatever the umask."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any, Generic, TypeVar

T = TypeVar("T")


def fsync_dir(path: Path) -> None:
    """Make a rename or create in directory `path` durable (best effort where unsupported)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes | str, *, mode: int = 0o600) -> None:
    """Replace `path` with `data` so a crash leaves either the old or the new file:
    a temp file in the same directory, flushed and fsynced, renamed over `path`, then
    the directory fsynced. The temp file never outlives a failure."""
    path = Path(path)
    if isinstance(data, str):
        data = data.encode("utf-8")
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    fsync_dir(path.parent)


# Owner-only files: everything under data_dir is created 0600 (files) / 0700 (dirs) with
# explicit modes, whatever the process umask (which only ever removes bits).
PRIVATE_FILE = 0o600
PRIVATE_DIR = 0o700


def private_mkdir(path: Path) -> Path:
    """`mkdir -p` where every directory this call creates is 0700."""
    path = Path(path)
    missing = []
    p = path
    while not p.exists():
        missing.append(p)
        if p.parent == p:
            break
        p = p.parent
    for d in reversed(missing):
        try:
            d.mkdir(mode=PRIVATE_DIR)
        except FileExistsError:
            continue
        os.chmod(d, PRIVATE_DIR)
    return path


def private_file(path: Path) -> Path:
    """Create `path` empty and 0600 if it does not exist (e.g. before SQLite opens it, so
    the database and its -wal/-shm files, which copy its mode, are owner-only)."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, PRIVATE_FILE)
    except FileExistsError:
        return path
    try:
        os.fchmod(fd, PRIVATE_FILE)
    finally:
        os.close(fd)
    return path


def open_private(path: Path, mode: str = "a", encoding: str | None = "utf-8") -> IO[Any]:
    """`open(path, mode)` ("w", "a", "wb", "ab") creating a missing file as 0600."""
    flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if "a" in mode else os.O_TRUNC)
    fd = os.open(path, flags, PRIVATE_FILE)
    return os.fdopen(fd, mode, encoding=None if "b" in mode else encoding)


def write_private(path: Path, data: bytes | str) -> None:
    """Write a whole (new or replaced) file, 0600."""
    with open_private(path, "wb") as fh:
        fh.write(data.encode("utf-8") if isinstance(data, str) else data)
    os.chmod(path, PRIVATE_FILE)


def tighten_tree(root: Path) -> None:
    """Make every directory under `root` (itself included) 0700 and every file 0600, e.g.
    after copying or unpacking files whose modes came from elsewhere. Symlinks untouched."""
    root = Path(root)
    if root.is_symlink():
        return
    if root.is_file():
        os.chmod(root, PRIVATE_FILE)
        return
    os.chmod(root, PRIVATE_DIR)
    for base, dirs, files in os.walk(root):
        for d in dirs:
            full = os.path.join(base, d)
            if not os.path.islink(full):
                os.chmod(full, PRIVATE_DIR)
        for f in files:
            full = os.path.join(base, f)
            if not os.path.islink(full):
                os.chmod(full, PRIVATE_FILE)


def read_choice_file(read: Callable[[], bytes], where: Path, log: logging.Logger, otherwise: str) -> dict[str, Any]:
    """A small JSON object a profile keeps (a persona or model choice), its bytes from
    `read` (a profile's files, plain or sealed): {} when the file is absent, and {} with a
    warning naming what applies `otherwise` when it is damaged or does not open."""
    try:
        data = json.loads(read().decode("utf-8"))
    except FileNotFoundError:
        return {}
    except Exception as err:  # damaged, unreadable, or sealed for another key (agent/vault.py)
        log.warning("%s cannot be read (%s): %s", where, err, otherwise)
        return {}
    if not isinstance(data, dict):
        log.warning("%s is not a JSON object: %s", where, otherwise)
        return {}
    return data


class FileMemo(Generic[T]):
    """A small file's parsed value, parsed again only when the file changed (its inode,
    size or mtime): a stat per use on the event loop, no thread hop, so a file another
    process may replace (`budget set`) takes effect from the next use."""

    __slots__ = ("_key", "_parse", "_path", "_value")

    def __init__(self, path: Path, parse: Callable[[], T]) -> None:
        self._path = path
        self._parse = parse
        self._key: tuple[int, int, int] | bool | None = False  # False: never parsed
        self._value: T | None = None

    def _stat(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self._path)
        except OSError:
            return None
        return (st.st_ino, st.st_size, st.st_mtime_ns)

    def load(self) -> T:
        """Parse now, where blocking is fine (an open's pool job)."""
        key = self._stat()
        self._value, self._key = self._parse(), key
        return self._value

    async def get(self) -> T:
        """The value, re-parsed (in a thread) only when the file changed since the last parse."""
        key = self._stat()
        if key != self._key:
            value = await asyncio.to_thread(self._parse)
            self._value, self._key = value, key
        return self._value  # type: ignore[return-value]
