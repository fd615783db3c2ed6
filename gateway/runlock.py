"""The run lock: `<data_dir>/gateway.lock`, an flock held by a running gateway and by the
operator commands that change data (docs/operator-guide.md#managing-tenants).

A single-node gateway holds it exclusively; cluster nodes, several of which share one data
directory, hold it shared, which still keeps a single-node gateway and the changing
commands out. Reads (`profiles list|show|export`, `backup`) never take it.
`AdminError` is the one-sentence refusal every operator command reports (exit status 1).
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from agent.fileio import private_mkdir

LOCK_NAME = "gateway.lock"


class AdminError(Exception):
    """A refusal or failure to report to the operator (exit status 1)."""


class RunLock:
    """`<data_dir>/gateway.lock`, held (flock) by a running gateway and by admin commands
    that change data. Released when the holder exits, however it exits."""

    def __init__(self, data_dir: Path) -> None:
        self.path = Path(data_dir) / LOCK_NAME
        self._fd: int | None = None

    def acquire(self, what: str = "the gateway", *, shared: bool = False) -> RunLock:
        """Exclusive: one gateway (or admin command) per data dir. `shared`: cluster nodes,
        several of which run on one data dir; they still keep out a single-node gateway and
        the admin commands that change data (on this host: flock is per host on NFS)."""
        private_mkdir(self.path.parent)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise AdminError(
                f"{self.path.parent} is in use: a hermes-gateway `run`, `chat` or admin command holds "
                f"{self.path}. Stop the gateway first (systemctl stop hermes-gateway, or docker compose stop) "
                f"or quit that chat, then run {what} again. Exports and backups work while it runs."
            ) from None
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> RunLock:
        return self.acquire() if self._fd is None else self

    def __exit__(self, *exc: object) -> None:
        self.release()


def gateway_running(data_dir: Path) -> bool:
    """True while some process (this one included) holds the run lock."""
    path = Path(data_dir) / LOCK_NAME
    if not path.exists():
        return False
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)
    return False
