"""Consistent copies of a data directory's files, for `profiles export` and `backup`
(docs/operator-guide.md#backups).

SQLite files are copied with SQLite's online backup API (a consistent snapshot, writers
not blocked), the database first and the journals after, so a copy's journals are never
older than its database; opening the copy reconciles the two (a torn last journal line is
cut). An encrypted profile's state.db is copied keyed alike and its other files as they
are (sealed); a plain copy for its owner opens every sealed record instead
(docs/privacy.md#exports-and-the-hermes-cli). Archives are .tar.gz with owner-only members, written to a temporary name, fsynced
and renamed; unpacking refuses anything but plain files and directories inside the target.
"""

from __future__ import annotations

import os
import shutil
import sqlite3
import tarfile
import zlib
from contextlib import closing
from pathlib import Path

import apsw

from agent.fileio import private_file, private_mkdir, tighten_tree, write_private
from agent.sessions.codec import journal_line
from agent.sessions.db import backup_file, open_reader, plain_copy
from agent.sessions.journal import decode_line
from agent.vault import KEY_FILE, DataKey, is_sealed
from gateway.runlock import AdminError

STATE_FILES = {"state.db", "state.db-wal", "state.db-shm", "state.db-journal"}


def _skip(rel: Path) -> bool:
    name = rel.name
    return (
        name == ".lock"
        or name.endswith(".tmp")
        or (len(rel.parts) == 1 and name in STATE_FILES)
        or name.startswith(".tenant.json.")
    )


def copy_profile_files(src: Path, dst: Path) -> list[str]:
    """Copy every regular file of a profile except state.db* and lock/temp files (symlinks
    are never followed). Returns the relative paths copied."""
    copied = []
    for root, dirs, files in os.walk(src):
        dirs[:] = [d for d in dirs if not os.path.islink(os.path.join(root, d))]
        for name in sorted(files):
            full = Path(root) / name
            rel = full.relative_to(src)
            if _skip(rel) or full.is_symlink() or not full.is_file():
                continue
            target = dst / rel
            private_mkdir(target.parent)
            try:
                shutil.copyfile(full, private_file(target))
            except FileNotFoundError:  # removed meanwhile (e.g. a temp file renamed)
                continue
            copied.append(str(rel))
    return copied


def plain_profile_files(src: Path, dst: Path, key: DataKey) -> list[str]:
    """Copy a profile's files like `copy_profile_files`, every sealed record opened with
    `key` (`place` = its path in the profile) and journal lines written as plain JSON;
    key.json stays behind. Returns the relative paths written."""
    written = []
    for rel in copy_profile_files(src, dst):
        target = dst / rel
        if rel == KEY_FILE:
            target.unlink()
            continue
        data = target.read_bytes()
        if Path(rel).parts[0] == "sessions" and rel.endswith(".jsonl"):
            data = plain_journal(data, key, rel)
        elif is_sealed(data):
            data = key.open(data, rel)
        write_private(target, data)
        written.append(rel)
    return written


def plain_journal(data: bytes, key: DataKey, place: str) -> bytes:
    """A sealed journal's lines as plain JSONL (a torn or damaged line is left out, as
    reconciliation would cut it)."""
    out = []
    for raw in data.split(b"\n")[:-1]:
        if not raw.strip():
            continue
        try:
            obj = decode_line(raw, key, place)
        except ValueError:
            continue
        out.append(journal_line(obj))
    return "".join(out).encode("utf-8")


def sqlite_backup(src: Path, dst: Path, key: DataKey | None = None, *, plain: bool = False) -> None:
    """Online backup of `src` to `dst` (a consistent snapshot; writers are not blocked).

    A profile's state.db through APSW, as its store opens it, keyed with `key` when
    encrypted: the copy is encrypted alike, or plain with `plain` (VACUUM INTO, then the
    key removed); gateway.db and the other files of the data directory through the stdlib,
    as the gateway does: one SQLite library per file in a process
    (docs/concepts.md#one-sqlite-library-per-file)."""
    private_mkdir(dst.parent)
    if dst.exists():
        dst.unlink()
    private_file(dst)
    if src.name == "state.db":
        with closing(open_reader(src, key)) as source:
            if plain and key is not None:
                dst.unlink()  # VACUUM INTO wants to make the file itself
                plain_copy(source, dst, key)
                private_file(dst)
            else:
                backup_file(source, dst, key)
    else:
        with (
            closing(sqlite3.connect(f"file:{src}?mode=ro", uri=True, timeout=30)) as ro,
            closing(sqlite3.connect(dst)) as target,
        ):
            ro.backup(target)
            target.execute("PRAGMA journal_mode=DELETE")  # a self-contained file, no -wal
    for suffix in ("-wal", "-shm"):
        Path(f"{dst}{suffix}").unlink(missing_ok=True)


def integrity_check(db: Path, key: DataKey | None = None) -> str:
    """PRAGMA integrity_check of a copy (staged by a backup or restore: no other connection
    has it open); an encrypted copy through APSW with its `key`, SQLite's answer or why it
    does not open."""
    if key is not None:
        try:
            with closing(open_reader(db, key)) as enc:
                return str(enc.execute("PRAGMA integrity_check").fetchall()[0][0])
        except apsw.Error as err:
            return f"it does not open with its key ({err})"
    with closing(sqlite3.connect(db)) as conn:
        return str(conn.execute("PRAGMA integrity_check").fetchone()[0])


def fsync_tree(path: Path) -> None:
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                fd = os.open(os.path.join(root, name), os.O_RDONLY)
            except OSError:
                continue
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fd = os.open(root, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def safe_extract(archive: Path, dest: Path) -> None:
    """Unpack a .tar.gz of ours; anything that is not a readable tar archive is one sentence."""
    try:
        with tarfile.open(archive, "r:*") as tar:
            for member in tar.getmembers():
                parts = Path(member.name).parts
                if member.name.startswith("/") or ".." in parts or not (member.isfile() or member.isdir()):
                    raise AdminError(f"{archive}: refusing unsafe archive member {member.name!r}")
            tar.extractall(dest, filter="data")
    except (tarfile.TarError, EOFError, zlib.error) as exc:
        raise AdminError(
            f"{archive}: not a readable archive ({type(exc).__name__}); give the .tar.gz that "
            "`profiles export` or `backup` wrote"
        ) from None
    tighten_tree(dest)  # whatever modes the archive recorded, restored files are owner-only


def _owner_only(info: tarfile.TarInfo) -> tarfile.TarInfo:
    """Archive members are recorded 0600 (files) / 0700 (directories)."""
    info.mode = 0o700 if info.isdir() else 0o600
    return info


def write_tar(src_dir: Path, out: Path) -> None:
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as raw, tarfile.open(fileobj=raw, mode="w:gz") as tar:
        for entry in sorted(src_dir.iterdir()):
            tar.add(entry, arcname=entry.name, filter=_owner_only)
    with open(tmp, "rb") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, out)
