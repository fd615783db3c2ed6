"""A process for crash tests of the group commit: appends messages through a SessionStore
(`storage.fsync: batch`) and prints `STORED <uid>` after each append returns. Every fsync
the group syncer makes prints `FSYNC` and then stalls, so a test can SIGKILL the process
while a group commit is in progress and writes go on around it.

    python -m tests.fakes.store_writer PROFILE_DIR
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time
from pathlib import Path

from agent.messages import StoredMessage
from agent.sessions import SessionStore, StoragePool

_real_fsync = os.fsync
_out = threading.Lock()


def say(line: str) -> None:
    """One whole line on stdout: `print` writes the text and the newline apart, so lines from
    the syncer thread and the loop could run into each other (`...uidFSYNC`)."""
    with _out:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


def stalling_fsync(fd: int) -> None:
    if threading.current_thread().name == "hermes-fsync":
        say("FSYNC")
        time.sleep(0.3)
    _real_fsync(fd)


async def main(profile: str) -> None:
    os.fsync = stalling_fsync  # type: ignore[assignment]
    pool = StoragePool(4)
    async with SessionStore(Path(profile), fsync="batch", pool=pool) as store:
        lanes = [(await store.get_or_start(f"lane-{i}"))[0] for i in range(3)]
        i = 0
        while True:
            sid = lanes[i % len(lanes)]
            batch = [StoredMessage(sid, "user", f"q{i}"), StoredMessage(sid, "assistant", f"a{i}")]
            await asyncio.gather(store.append(batch[0]), store.add_usage(sid, 3, 1))
            await store.append(batch[1])
            say(f"STORED {batch[0].uid} {batch[1].uid}")
            i += 1


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
