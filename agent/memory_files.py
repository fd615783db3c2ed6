"""The raw files under a profile's `memories/`: safe reads, drift baselines and backups.

A memory file may be edited by hand. `read_text` decodes it strictly (a UTF-8 BOM is
dropped; undecodable bytes raise instead of being replaced, so they are never written
back). `Baselines` remembers, per file, a digest of the entries the store last wrote (kept
in `memories/.written.json`, so it survives restarts); a file whose entries differ has
drifted, and `backup` keeps a timestamped copy before anything else happens to it.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import time
from pathlib import Path

from agent.fileio import atomic_write
from agent.vault import ProfileFiles

log = logging.getLogger(__name__)

BOM = "\ufeff"
BASELINE_FILE = ".written.json"
KEEP_BACKUPS = 10  # per memory file; older drift backups are pruned


class UndecodableFile(Exception):
    """The file holds bytes that are not UTF-8; it must not be rewritten."""


def read_bytes(path: Path) -> bytes | None:
    """The file's bytes, None when it is missing or a symlink (never followed)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            log.warning("memory file %s is a symlink; ignoring it", path)
            return None
        raise
    with os.fdopen(fd, "rb") as fh:
        return fh.read()


def read_file(files: ProfileFiles, place: str) -> bytes | None:
    """`read_bytes` of the profile's file at `place`, opened with the tenant's key when it
    is sealed (VaultError when it does not open)."""
    raw = read_bytes(files.path(place))
    return None if raw is None else files.unseal(raw, place)


def decode(raw: bytes | None, *, strict: bool) -> str:
    """UTF-8 text without a leading BOM; `strict` raises UndecodableFile on bad bytes,
    otherwise they become U+FFFD (for display only)."""
    if raw is None:
        return ""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        if strict:
            raise UndecodableFile(f"byte {exc.start} is not valid UTF-8") from None
        text = raw.decode("utf-8", errors="replace")
    return text[1:] if text.startswith(BOM) else text


def digest(raw: bytes | None) -> str:
    return hashlib.sha256(raw or b"").hexdigest()


class Baselines:
    """Digests of what the store last wrote, one per memory file (call under the file lock)."""

    def __init__(self, memory_dir: Path, files: ProfileFiles | None = None) -> None:
        self.path = memory_dir / BASELINE_FILE
        # the digests say whether a guessed text is an entry: sealed like the entries
        self.files = files if files is not None else ProfileFiles(memory_dir.parent)
        self.place = f"{memory_dir.name}/{BASELINE_FILE}"

    def _load(self) -> dict[str, str]:
        raw = read_file(self.files, self.place)
        try:
            data = json.loads(raw) if raw else {}
        except ValueError:
            return {}
        return {str(k): str(v) for k, v in data.items()} if isinstance(data, dict) else {}

    def get(self, name: str) -> str | None:
        return self._load().get(name)

    def set(self, name: str, value: str) -> None:
        data = self._load()
        if data.get(name) != value:
            data[name] = value
            self.files.write_text(self.place, json.dumps(data, sort_keys=True))


def backup(path: Path, raw: bytes | None, files: ProfileFiles | None = None) -> Path | None:
    """Keep `raw` (the drifted file) as `<name>.<UTC time>.bak` beside it, sealed when the
    profile is (`files`); prune old ones."""
    if raw is None:
        return None
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    target = path.with_name(f"{path.name}.{stamp}.bak")
    n = 1
    while target.exists():
        n += 1
        target = path.with_name(f"{path.name}.{stamp}-{n}.bak")
    if files is None:
        atomic_write(target, raw)
    else:
        files.write_bytes(f"{path.parent.name}/{target.name}", raw)
    old = sorted(path.parent.glob(f"{path.name}.*.bak"))
    for stale in old[:-KEEP_BACKUPS]:
        try:
            stale.unlink()
        except OSError:
            pass
    return target


__all__ = ["BASELINE_FILE", "Baselines", "UndecodableFile", "backup", "decode", "digest", "read_bytes", "read_file"]
