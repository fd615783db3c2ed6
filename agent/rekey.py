"""Re-keying a tenant: a new data key and slot for everything kept, the old slot shredded
(docs/privacy.md#delete-is-crypto-shredding). `/forget all` uses it so that older copies
of what was forgotten, backups included, no longer open.

Crash-safe in steps, each of which a later `finish_rekey` recognises and completes:
1. a new slot (`keyring/<dir>.slot-next`) and `rekey.json`, the new data key wrapped by it;
2. every sealed file, journal line and `state.db` re-sealed under the new key, one file at a
   time with an atomic replace (a file already under the new key is left as it is);
3. `key.json` replaced by the new wrapped key; 4. the old slot shredded; 5. the new slot
renamed into place and `rekey.json` removed. Until step 4 the old key still opens whatever
step 2 has not reached. Blocking file I/O: run it off the event loop, the profile closed.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import apsw

from agent.fileio import atomic_write, fsync_dir, private_mkdir
from agent.vault import KEY_FILE, DataKey, Keyring, VaultError, is_sealed, is_sealed_line, shred_file

REKEY_FILE = "rekey.json"  # in the profile while a rekey is under way: the new wrapped key
_DB_FILES = ("state.db", "state.db-wal", "state.db-shm", "state.db-journal")

#: called with the old and the new key before the old one is destroyed (gateway.db's rows)
Resealer = Callable[[DataKey, DataKey], object]
#: a test seam: called after each file re-sealed, with how many so far
Progress = Callable[[int], None]


def _next_slot(ring: Keyring, dir_name: str) -> Path:
    return ring.directory / f"{dir_name}.slot-next"


def rekeying(profile: Path) -> bool:
    """Whether a rekey of the profile began and has not finished."""
    return (Path(profile) / REKEY_FILE).exists()


def committed(profile: Path) -> bool:
    """Whether a rekey under way has re-sealed everything (step 3 done: `key.json` is the new key)."""
    profile = Path(profile)
    try:
        return json.loads((profile / KEY_FILE).read_text(encoding="utf-8")) == json.loads(
            (profile / REKEY_FILE).read_text(encoding="utf-8")
        )
    except FileNotFoundError:
        return False


def begin_rekey(ring: Keyring, tenant_id: str, profile: Path) -> None:
    """Step 1: a new slot and the new data key wrapped by it; nothing re-sealed yet. A
    rekey already under way is left to `finish_rekey`."""
    profile = Path(profile)
    if rekeying(profile):
        return
    ring.key_for(tenant_id, profile)  # the old key must open: VaultError otherwise
    nxt = _next_slot(ring, profile.name)
    shred_file(nxt)  # a leftover of a begin that died before its rekey.json: never used
    slot = os.urandom(32)
    private_mkdir(ring.directory)
    atomic_write(nxt, ring.seal_slot(slot, tenant_id))
    atomic_write(profile / REKEY_FILE, ring._wrap(os.urandom(32), slot, tenant_id))


def finish_rekey(
    ring: Keyring, tenant_id: str, profile: Path, *, rows: Resealer | None = None, progress: Progress | None = None
) -> DataKey | None:
    """Steps 2-5 of a begun rekey, from wherever it stopped; the new key (None when none
    was under way)."""
    profile = Path(profile)
    marker = profile / REKEY_FILE
    try:
        wrapped_text = marker.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    wrapped = json.loads(wrapped_text)
    name = profile.name
    nxt_path, cur_path = _next_slot(ring, name), ring._slot_path(name)
    nxt = ring.read_slot_file(nxt_path, tenant_id)
    cur = ring.read_slot_file(cur_path, tenant_id)
    if nxt is None:
        if cur is None:
            raise VaultError(f"{tenant_id}'s key was destroyed (the profile was deleted); its data cannot be read")
        new = DataKey(tenant_id, ring._unwrap(wrapped, cur, tenant_id))  # step 5 had renamed it
    else:
        new = DataKey(tenant_id, ring._unwrap(wrapped, nxt, tenant_id))
        if cur is not None:
            kept = json.loads((profile / KEY_FILE).read_text(encoding="utf-8"))
            if kept != wrapped:  # step 3 not done: the old key still opens what step 2 missed
                old = DataKey(tenant_id, ring._unwrap(kept, cur, tenant_id))
                reseal_profile(profile, old, new, progress)
                if rows is not None:
                    rows(old, new)
                atomic_write(profile / KEY_FILE, wrapped_text)
            shred_file(cur_path)
        os.replace(nxt_path, cur_path)
        fsync_dir(ring.directory)
    marker.unlink()
    fsync_dir(profile)
    return new


def reseal_profile(profile: Path, old: DataKey, new: DataKey, progress: Progress | None = None) -> int:
    """Step 2: state.db rekeyed and every sealed file and line re-sealed; how many files."""
    done = 0
    if (profile / "state.db").exists():
        _rekey_db(profile / "state.db", old, new)
        done += 1
        if progress is not None:
            progress(done)
    for root, dirs, files in os.walk(profile):
        dirs[:] = sorted(d for d in dirs if not os.path.islink(os.path.join(root, d)))
        for fname in sorted(files):
            path = Path(root) / fname
            rel = path.relative_to(profile)
            if (
                path.is_symlink()
                or fname.endswith(".tmp")
                or (len(rel.parts) == 1 and fname in (*_DB_FILES, KEY_FILE, REKEY_FILE))
            ):
                continue
            if _reseal_file(path, rel.as_posix(), old, new):
                done += 1
                if progress is not None:
                    progress(done)
    return done


def _reseal_file(path: Path, place: str, old: DataKey, new: DataKey) -> bool:
    """One file under the new key (a sealed record, or a file of sealed lines); whether it
    was rewritten. Already under the new key, or plain: left as it is."""
    blob = path.read_bytes()
    if is_sealed(blob):
        try:
            new.open(blob, place)
            return False
        except VaultError:
            atomic_write(path, new.seal(old.open(blob, place), place))
            return True
    lines = blob.split(b"\n")
    if not any(is_sealed_line(line) for line in lines):
        return False
    out, changed = [], False
    for line in lines:
        if is_sealed_line(line):
            text = line.decode("ascii", "replace")
            try:
                new.open_line(text, place)
            except VaultError:
                try:
                    line = new.seal_line(old.open_line(text, place), place).encode("ascii")
                    changed = True
                except VaultError:  # a torn last line: reconciliation cuts it; it opens under no key
                    pass
        out.append(line)
    if changed:
        atomic_write(path, b"\n".join(out))
    return changed


def _rekey_db(path: Path, old: DataKey, new: DataKey) -> None:
    """state.db under the new key: PRAGMA rekey needs a rollback journal, so WAL is
    checkpointed away, the file rekeyed in one transaction, and WAL restored."""
    if _opens(path, new):
        return
    db = apsw.Connection(str(path))
    try:
        db.execute(old.db_pragma(), can_cache=False).fetchall()
        db.set_busy_timeout(10000)
        mode = str(db.execute("PRAGMA journal_mode").fetchall()[0][0])
        db.execute("PRAGMA journal_mode=DELETE").fetchall()
        db.execute(f'PRAGMA rekey="{new.db_key()}"', can_cache=False).fetchall()
        db.execute(f"PRAGMA journal_mode={'WAL' if mode.lower() == 'wal' else 'DELETE'}").fetchall()
    finally:
        db.close()
    if not _opens(path, new):
        raise VaultError(f"{path.name} did not take its new key; the old one still opens it")


def _opens(path: Path, key: DataKey) -> bool:
    db = apsw.Connection(str(path), flags=apsw.SQLITE_OPEN_READWRITE)
    try:
        db.execute(key.db_pragma(), can_cache=False).fetchall()
        db.execute("SELECT count(*) FROM sqlite_master").fetchall()
        return True
    except apsw.Error:
        return False
    finally:
        db.close()
