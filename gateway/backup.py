"""`backup` and `restore` of the whole data directory (docs/operator-guide.md#backups).

A backup works while the gateway runs: every state.db and gateway.db goes through SQLite's
online backup, then journals, memories, provider files and links.json (gateway/archive.py),
into one timestamped archive. A damaged profile is copied as it is found, for
`profiles repair` to rebuild. A restore needs the gateway stopped and an empty data
directory; it holds the run lock while it works and checks every database first.

An encrypted data directory's backup keeps every state.db encrypted (online backup keyed
alike) and never holds `keyring/`, which is backed up on its own with the master key. A
restore opens each profile with the live keyring: a tenant whose slot is gone (deleted since
the backup) is not restored, and its traces in gateway.db and links.json go with it
(docs/privacy.md#backups-and-restore).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from agent.fileio import private_file, private_mkdir, tighten_tree, write_private
from agent.vault import KEY_FILE, KEYRING_DIR, DataKey, Keyring, VaultError, key_of
from gateway.archive import copy_profile_files, fsync_tree, integrity_check, safe_extract, sqlite_backup, write_tar
from gateway.runlock import LOCK_NAME, AdminError, RunLock
from gateway.tenants import TenantInfo, scan_profiles, scrub_gateway_db, tenant_info
from tenancy.identity import IdentityLinks
from tenancy.profiles import profile_problem

BACKUP_FORMAT = "hermes-gateway-backup"
BACKUP_GLOB = "hermes-backup-*.tar.gz"


def _backup_name(directory: Path) -> Path:
    """`hermes-backup-<UTC date>-<time>-<microseconds>.tar.gz`, not yet taken in `directory`.
    Fixed width, so names sort in time order (what `keep` relies on)."""
    now = time.time()
    while True:
        stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(now)) + f"-{int(now * 1e6) % 1_000_000:06d}"
        path = directory / f"hermes-backup-{stamp}.tar.gz"
        if not path.exists():
            return path
        now += 1e-6


def backup_data_dir(data_dir: Path, dest: Path, *, keep: int | None = None, keyring: Keyring | None = None) -> Path:
    """A consistent copy of the data directory while the gateway runs: every state.db and
    gateway.db through SQLite's online backup, then journals, memories, provider files and
    links.json. Always one archive (mode 0600) with a timestamped name inside the directory
    `dest` (created if missing); `keep` then deletes all but the newest `keep` archives.
    Encrypted profiles stay encrypted (their keys from `keyring`); `keyring/` is never in it."""
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise AdminError(f"{data_dir}: no such data directory")
    if keep is not None and keep < 1:
        raise AdminError(f"--keep must be at least 1 (got {keep})")
    directory = Path(dest)
    if directory.name.endswith((".tar.gz", ".tgz")) and not directory.is_dir():
        raise AdminError(
            f"backup writes a timestamped archive inside a directory; give the directory "
            f"(e.g. {directory.parent}), not an archive name"
        )
    if directory.exists() and not directory.is_dir():
        raise AdminError(f"{directory} is a file; backup needs a directory to put the archive in")
    private_mkdir(directory)
    dest = _backup_name(directory)
    with tempfile.TemporaryDirectory(prefix=".hermes-backup-", dir=dest.parent) as tmp:
        stage = Path(tmp) / "data"
        stage.mkdir(mode=0o700)
        report: dict[str, Any] = {
            "format": BACKUP_FORMAT,
            "version": 1,
            "created_at": time.time(),
            "source": str(data_dir),
            "profiles": 0,
            "databases": [],
            "encrypted": keyring is not None,  # its profiles need the live keyring to restore
        }
        for entry in sorted(data_dir.iterdir()):  # gateway.db, links.json, anything a future version adds
            name = entry.name
            if (
                name.startswith(".")
                or name == LOCK_NAME
                or name == KEYRING_DIR  # the keyring is backed up apart from the data, with the master key
                or not entry.is_file()
                or entry.is_symlink()
                or name.endswith(("-wal", "-shm", "-journal", ".tmp"))
            ):
                continue
            if name.endswith(".db"):
                sqlite_backup(entry, stage / name)
                report["databases"].append(name)
            else:
                shutil.copyfile(entry, private_file(stage / name))
        for info in scan_profiles(data_dir):
            target = private_mkdir(stage / "profiles" / info.dir_name)
            problem = profile_problem(info.path)
            if problem is not None:  # kept as it is, journals and all: `profiles repair` rebuilds it
                report.setdefault("damaged", {})[info.dir_name] = problem
                if (info.path / "state.db").is_file():
                    shutil.copyfile(info.path / "state.db", private_file(target / "state.db"))
            elif (info.path / "state.db").exists():
                key = key_of(keyring, info.tenant_id, info.path)  # encrypted: copied keyed alike
                sqlite_backup(info.path / "state.db", target / "state.db", key)  # database first, journals after
                report["databases"].append(f"profiles/{info.dir_name}/state.db")
            copy_profile_files(info.path, target)
            report["profiles"] += 1
        write_private(stage / "BACKUP.json", json.dumps(report, indent=1))
        write_tar(stage, dest)
    if keep:
        for path in sorted(directory.glob(BACKUP_GLOB))[:-keep]:
            path.unlink()
    return dest


def restore_data_dir(src: Path, data_dir: Path, master: bytes | None = None) -> dict[str, Any]:
    """Restore a `backup` (directory or archive) into an empty data directory, or one that
    holds only the live keyring (`master` opens it). A profile whose tenant has no slot in
    it is left out and named in the report's `not_restored`."""
    src, data_dir = Path(src), Path(data_dir)
    if data_dir.exists() and any(p.name not in (LOCK_NAME, KEYRING_DIR) for p in data_dir.iterdir()):
        raise AdminError(
            f"{data_dir} is not empty; restore goes into an empty data directory, or one holding only "
            f"its keyring/ (move the old one aside first)"
        )
    private_mkdir(data_dir)
    with (
        RunLock(data_dir).acquire("`restore`"),
        tempfile.TemporaryDirectory(prefix=".hermes-restore-", dir=data_dir) as tmp,
    ):
        if src.is_dir():
            stage = Path(tmp) / "data"
            shutil.copytree(src, stage, symlinks=False)
            tighten_tree(stage)
        elif src.is_file():
            safe_extract(src, Path(tmp))
            stage = Path(tmp)
        else:
            raise AdminError(f"{src}: no such backup")
        try:
            report = json.loads((stage / "BACKUP.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            raise AdminError(f"{src}: not a hermes-gateway backup (no BACKUP.json)") from None
        if report.get("format") != BACKUP_FORMAT:
            raise AdminError(f"{src}: not a hermes-gateway backup")
        keys, gone = _keys_of(stage, data_dir, master, src)
        for db in report.get("databases", []):
            parts = Path(db).parts
            if len(parts) == 3 and parts[1] in gone:
                continue
            key = keys.get(parts[1]) if len(parts) == 3 else None
            if (stage / db).exists() and integrity_check(stage / db, key) != "ok":
                raise AdminError(f"{src}: {db} fails PRAGMA integrity_check")
        report["not_restored"] = {info.tenant_id: why for info, why in gone.values()}
        for info, _why in gone.values():  # its key is gone: so is all of it, its traces too
            shutil.rmtree(info.path)
        fsync_tree(stage)
        for entry in stage.iterdir():
            if entry.name in ("BACKUP.json", LOCK_NAME, KEYRING_DIR) or entry.name.startswith(".hermes-restore-"):
                continue
            os.replace(entry, data_dir / entry.name)
        for info, _why in gone.values():
            _forget_traces(data_dir, info.tenant_id, set(info.principals))
    return report


def _keys_of(
    stage: Path, data_dir: Path, master: bytes | None, src: Path
) -> tuple[dict[str, DataKey], dict[str, tuple[TenantInfo, str]]]:
    """Each encrypted profile's key from the live keyring, by directory name, and the
    profiles that cannot be restored (their slot is gone) with why."""
    infos = [tenant_info(p) for p in sorted((stage / "profiles").glob("*")) if (p / KEY_FILE).exists()]
    if not infos:
        return {}, {}
    if master is None:
        raise AdminError(
            f"{src} holds encrypted profiles, but storage.encryption is off: set it to per_tenant with the master key"
        )
    if not (data_dir / KEYRING_DIR).is_dir():
        raise AdminError(
            f"{src} holds encrypted profiles and {data_dir} has no keyring/: put the keyring (backed up "
            f"apart, with the master key) there first"
        )
    try:
        ring = Keyring.open(data_dir, master, create=False)
    except VaultError as err:
        raise AdminError(str(err)) from None
    keys: dict[str, DataKey] = {}
    gone: dict[str, tuple[TenantInfo, str]] = {}
    for info in infos:
        if not ring.has_slot(info.path):
            gone[info.dir_name] = (info, "its key was destroyed (deleted after this backup)")
            continue
        try:
            keys[info.dir_name] = ring.key_for(info.tenant_id, info.path)
        except VaultError as err:
            gone[info.dir_name] = (info, str(err))
    return keys, gone


def _forget_traces(data_dir: Path, tenant_id: str, principals: set[str]) -> None:
    """What the restored gateway.db and links.json still say of a tenant not restored."""
    links_file = data_dir / "links.json"
    if links_file.exists():
        links = IdentityLinks.load(links_file)
        left = {p for p in principals if links.name_for(p) is not None}
        for p in left:
            links.unlink(p)
        if left:
            links.save(links_file)
    scrub_gateway_db(data_dir, principals, set(), tenant_id)
