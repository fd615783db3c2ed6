"""Tenant operations: find a tenant by id, directory or principal; read a profile's
figures; export one profile and restore it; delete everything a tenant owns; repair a
damaged profile from its journals (docs/operator-guide.md#managing-tenants).

Consistency rules:
- Reads (`scan_profiles`, `find_tenant`, `profile_stats`, `export_profile`) work while
  the gateway runs; copies go through gateway/archive.py (database first, journals after).
- Changes (`delete_tenant`, `restore_profile`) need the gateway stopped: the running
  gateway holds the run lock (gateway/runlock.py), keeps links.json and gateway.db in
  memory, and may have the profile open. They refuse with a clear message while the lock is
  held, and hold it themselves while they work, so a gateway cannot start halfway through.
- `repair_profile` works while the gateway runs: it takes the profile's own lock (which a
  profile the gateway could not open is free of), sets the damaged files aside, and the
  gateway's next retry opens the repaired profile and answers its held messages.

What the cluster's nodes share lives in PostgreSQL, which this module never touches: in
cluster mode the caller hands `delete_tenant` the eraser of those rows
(gateway/cluster/erase.py).
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import logging
import os
import shutil
import sqlite3
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from contextlib import closing
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import apsw

from agent.fileio import open_private, private_file, private_mkdir, write_private
from agent.profile import write_manifest
from agent.reminders import ReminderStore
from agent.sessions import SessionStore
from agent.sessions.db import open_reader
from agent.vault import DataKey, Keyring, ProfileFiles, TenantKeys, VaultError, key_of, open_keyring, shred_slot
from core.settings import Config
from gateway.archive import (
    STATE_FILES,
    copy_profile_files,
    fsync_tree,
    integrity_check,
    plain_profile_files,
    safe_extract,
    sqlite_backup,
    write_tar,
)
from gateway.outbox import reseal_rows
from gateway.runlock import AdminError, RunLock
from tenancy.identity import IdentityLinks
from tenancy.keys import link_tenant_id, person_tenant_id, tenant_dir, tenant_dir_name
from tenancy.merge import RETIRED_MARKER
from tenancy.profiles import SCHEMA_VERSION, journal_records, manifest_problem, profile_problem, tenant_id_of_dir

EXPORT_FORMAT = "hermes-gateway-profile-export"
# kv keys of gateway.db that name a principal after the prefix
_PRINCIPAL_KEYS = ("paired:", "pairing-of:", "link-code-of:", "link-issued:", "link-fail:", "link-request:")

EraseShared = Callable[[str, set[str], set[tuple[str, str]]], int]
"""Cluster mode: remove a tenant's rows from what the nodes share, given its tenant id, its
principals and its private chats; how many rows (gateway/cluster/erase.py)."""

log = logging.getLogger("hermes.gateway")


# ----- finding tenants ----------------------------------------------------------------------


@dataclass
class TenantInfo:
    tenant_id: str
    dir_name: str
    path: Path
    kind: str = "person"
    principals: list[str] = field(default_factory=list)
    created_at: float | None = None
    merged_into: str | None = None  # a profile merged away by /link and not yet removed


def read_manifest(path: Path) -> dict[str, Any]:
    try:
        data = json.loads((path / "tenant.json").read_text(encoding="utf-8"))
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def tenant_info(path: Path) -> TenantInfo:
    manifest = read_manifest(path)
    merged = None
    try:
        merged = json.loads((path / RETIRED_MARKER).read_text(encoding="utf-8")).get("tenant")
    except (OSError, ValueError, AttributeError):
        pass
    raw_tid = manifest.get("tenant_id")
    tid = raw_tid if isinstance(raw_tid, str) else tenant_id_of_dir(path.name) or path.name
    return TenantInfo(
        tenant_id=tid,
        dir_name=path.name,
        path=path,
        kind=str(manifest.get("kind", "person")),
        principals=[p for p in manifest.get("principals", []) if isinstance(p, str)]
        if isinstance(manifest.get("principals"), list)
        else [],
        created_at=manifest.get("created_at"),
        merged_into=merged,
    )


def scan_profiles(data_dir: Path) -> list[TenantInfo]:
    root = Path(data_dir) / "profiles"
    if not root.is_dir():
        return []
    return [
        tenant_info(p)
        for p in sorted(root.iterdir())
        if p.is_dir() and not p.is_symlink() and not p.name.startswith(".")
    ]


def load_links(cfg: Config) -> IdentityLinks:
    return IdentityLinks.load(cfg.data_dir / "links.json", cfg.tenancy)


def link_names_of(links: IdentityLinks, tenant_id: str) -> list[str]:
    """The link name(s) whose tenant is `tenant_id` (at most one in practice)."""
    if not tenant_id.startswith("link-"):
        return []
    return [n for n in links.names() if link_tenant_id(n) == tenant_id]


def live_principals(links: IdentityLinks, info: TenantInfo) -> list[str]:
    """The principals whose lanes belong to this tenant today: a link tenant's live
    members; otherwise the tenant.json principals no link has taken (a stale entry left by
    an older version's /unlink never counts)."""
    names = link_names_of(links, info.tenant_id)
    if names:
        return sorted({p for n in names for p in links.principals_of(n)})
    if info.merged_into is not None:
        return []
    return sorted(p for p in info.principals if links.name_for(p) is None)


def find_tenant(cfg: Config, ref: str, links: IdentityLinks | None = None) -> TenantInfo:
    """A tenant by id (`telegram-111`, `link-alice`), directory name, or principal
    (`telegram:111`, following live identity links only: `links`, else links.json)."""
    profiles = scan_profiles(cfg.data_dir)
    for info in profiles:
        if ref in (info.tenant_id, info.dir_name):
            return info
    links = links if links is not None else load_links(cfg)
    if ":" in ref:
        linked = links.tenant_for(ref)
        if linked is not None:
            for info in profiles:
                if info.tenant_id == linked:
                    return info
            raise AdminError(f"{ref} is linked to {linked}, which has no profile yet")
        platform, _, uid = ref.partition(":")
        for info in profiles:
            if info.tenant_id == person_tenant_id(platform, uid) and info.merged_into is None:
                return info
    owners = [i for i in profiles if ref in live_principals(links, i)]
    if len(owners) == 1:
        return owners[0]
    if len(owners) > 1:
        raise AdminError(
            f"{ref} appears in several profiles: {', '.join(i.tenant_id for i in owners)}; name the tenant id instead"
        )
    try:
        path = tenant_dir(cfg.data_dir, ref)
    except (TypeError, ValueError):
        path = None
    if path is not None and path.is_dir():
        return tenant_info(path)
    raise AdminError(
        f"no profile found for {ref!r} under {cfg.data_dir / 'profiles'} (see `hermes-gateway profiles list`)"
    )


# ----- reading a profile --------------------------------------------------------------------


def _connect_ro(db: Path) -> sqlite3.Connection:
    """gateway.db, read beside a running gateway (the stdlib, as the gateway opens it)."""
    try:
        conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10)
        conn.execute("SELECT 1 FROM sqlite_master LIMIT 1")
        return conn
    except sqlite3.Error:
        return sqlite3.connect(db, timeout=10)


def disk_usage(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total


def profile_key(keyring: Keyring | None, info: TenantInfo) -> DataKey | None:
    """The tenant's data key for reading its profile here (None: a plain profile);
    VaultError, one sentence, when it is encrypted and cannot be opened."""
    return key_of(keyring, info.tenant_id, info.path)


def profile_stats(path: Path, key: DataKey | None = None) -> dict[str, Any]:
    """Sessions, messages, last activity and disk use; a damaged profile (`damaged` says
    what) is counted from its journals, which hold every message. `key` opens an
    encrypted one (docs/privacy.md#encryption-at-rest)."""
    stats: dict[str, Any] = {"sessions": 0, "messages": 0, "last_activity": None, "disk_bytes": disk_usage(path)}
    problem = profile_problem(path)
    db = path / "state.db"
    if problem is None and db.exists():
        try:
            with closing(open_reader(db, key)) as conn:
                row = conn.execute(
                    "SELECT (SELECT count(*) FROM sessions), (SELECT count(*) FROM messages), "
                    "max(COALESCE((SELECT max(timestamp) FROM messages), 0), "
                    "COALESCE((SELECT max(max(COALESCE(started_at,0), COALESCE(ended_at,0))) FROM sessions), 0))"
                ).fetchone()
            assert row is not None
            stats.update(sessions=row[0], messages=row[1], last_activity=row[2] or None)
        except (apsw.BusyError, apsw.LockedError, apsw.SQLError) as err:  # busy, or an older schema
            stats["error"] = f"state.db unreadable: {err}"
        except apsw.Error as err:
            problem = f"state.db cannot be read ({err})"
    if problem is not None:
        records = journal_records(path, key)
        stamps = [r["ts"] for r in records if isinstance(r.get("ts"), (int, float))]
        stamps += [r["timestamp"] for r in records if isinstance(r.get("timestamp"), (int, float))]
        stats.update(
            damaged=problem,
            sessions=len({r["session_id"] for r in records if isinstance(r.get("session_id"), str)}),
            messages=len({r["uid"] for r in records if r.get("type") == "message" and isinstance(r.get("uid"), str)}),
            last_activity=max(stamps, default=None),
        )
    return stats


def session_rows(path: Path, key: DataKey | None = None) -> list[dict[str, Any]]:
    db = path / "state.db"
    if not db.exists():
        return []
    cols = (
        "id, session_key, started_at, ended_at, end_reason, parent_session_id, message_count, "
        "input_tokens, output_tokens, compressions"
    )
    names = [c.strip() for c in cols.split(",")]
    try:
        with closing(open_reader(db, key)) as conn:
            rows = conn.execute(f"SELECT {cols} FROM sessions ORDER BY started_at, id").fetchall()
    except apsw.Error:  # damaged: profile_stats says so
        return []
    return [dict(zip(names, r, strict=True)) for r in rows]


# ----- gateway.db traces ------------------------------------------------------------------------


def kv_principals(key: str, value: str) -> set[str]:
    """Every principal a gateway.db kv row is about (a link request names two)."""
    found = {_kv_principal(key, value)} - {None}
    if key.startswith("link-request:"):
        try:
            data = json.loads(value)
        except ValueError:
            data = None
        if isinstance(data, dict) and isinstance(data.get("joiner"), str):
            found.add(data["joiner"])
    return found  # type: ignore[return-value]


def _kv_principal(key: str, value: str) -> str | None:
    for prefix in _PRINCIPAL_KEYS:
        if key.startswith(prefix):
            return key[len(prefix) :]
    if key.startswith(("pairing:", "link-code:")):
        try:
            data = json.loads(value)
        except ValueError:
            return None
        return data.get("principal") if isinstance(data, dict) else None
    return None


def dm_chats(path: Path, key: DataKey | None = None) -> set[tuple[str, str]]:
    """(platform, chat_id) of every DM lane in a profile, from its sessions' keys."""
    out = set()
    for row in session_rows(path, key):
        parts = (row.get("session_key") or "").split(":")
        if len(parts) == 5 and parts[:2] == ["agent", "main"] and parts[3] == "dm":
            out.add((unquote(parts[2]), unquote(parts[4])))
    return out


def paired_principals(data_dir: Path, principals: Iterable[str]) -> list[str]:
    db = Path(data_dir) / "gateway.db"
    if not db.exists():
        return []
    conn = _connect_ro(db)
    try:
        return [p for p in principals if conn.execute("SELECT 1 FROM kv WHERE key=?", (f"paired:{p}",)).fetchone()]
    except sqlite3.Error:
        return []
    finally:
        conn.close()


def scrub_gateway_db(
    data_dir: Path,
    principals: set[str],
    chats: set[tuple[str, str]],
    tenant_id: str | None = None,
    dues: dict[str, float | None] | None = None,
) -> int:
    """Remove a tenant's traces from gateway.db: kv rows naming its principals, inbox and
    outbox rows of its DM chats (or pending rows from its principals), then VACUUM so no freed page
    keeps them; `dues` re-indexes other profiles whose reminders changed. The gateway must be stopped."""
    db = Path(data_dir) / "gateway.db"
    if not db.exists():
        return 0
    for platform, user in (p.split(":", 1) for p in principals if ":" in p):
        chats = chats | {(platform, user)}  # Telegram: a DM chat id is the user id
    conn = sqlite3.connect(db, timeout=30)
    removed = 0
    try:
        conn.execute("PRAGMA secure_delete=ON")
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        with conn:
            if "kv" in tables:
                for key, value in conn.execute("SELECT key, value FROM kv").fetchall():
                    if kv_principals(key, value) & principals:
                        conn.execute("DELETE FROM kv WHERE key=?", (key,))
                        removed += 1
            if "reminder_due" in tables and tenant_id is not None:  # the reminder index (gateway/reminders.py)
                removed += conn.execute("DELETE FROM reminder_due WHERE tenant_id=?", (tenant_id,)).rowcount
            for other, due in (dues or {}).items() if "reminder_due" in tables else ():
                if due is None:
                    conn.execute("DELETE FROM reminder_due WHERE tenant_id=?", (other,))
                else:
                    conn.execute("UPDATE reminder_due SET due_at=? WHERE tenant_id=?", (due, other))
            if "inbound" in tables:
                for platform, chat in chats:
                    removed += conn.execute(
                        "DELETE FROM inbound WHERE platform=? AND chat_id=?", (platform, chat)
                    ).rowcount
                for platform, chat, mid, payload in conn.execute(
                    "SELECT platform, chat_id, message_id, payload FROM inbound WHERE payload IS NOT NULL"
                ).fetchall():
                    try:
                        data = json.loads(payload)
                        who = f"{data.get('platform')}:{data.get('user_id')}"
                    except (ValueError, AttributeError):
                        continue
                    if who in principals:
                        conn.execute(
                            "DELETE FROM inbound WHERE platform=? AND chat_id=? AND message_id=?", (platform, chat, mid)
                        )
                        removed += 1
            if "outbox" in tables:  # the chunks addressed to its chats (sent or not)
                for platform, chat in chats:
                    removed += conn.execute(
                        "DELETE FROM outbox WHERE platform=? AND chat_id=?", (platform, chat)
                    ).rowcount
        conn.execute("VACUUM")
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    finally:
        conn.close()
    return removed


def _kv_put(data_dir: Path, items: dict[str, str]) -> None:
    db = Path(data_dir) / "gateway.db"
    conn = sqlite3.connect(private_file(db), timeout=30)
    try:
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("CREATE TABLE IF NOT EXISTS kv (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
        with conn:
            conn.executemany("INSERT OR REPLACE INTO kv(key, value) VALUES (?, ?)", list(items.items()))
    finally:
        conn.close()


# ----- export / restore of one profile --------------------------------------------------------


def export_profile(
    cfg: Config,
    info: TenantInfo,
    out: Path | None = None,
    links: IdentityLinks | None = None,
    key: DataKey | None = None,
) -> Path:
    """One .tar.gz with everything the tenant owns: EXPORT.json, profile/tenant.json,
    profile/memories/, profile/sessions/*.jsonl, profile/provider/, profile/state.db (online
    backup) and profile/state.sql (a text dump of it). Mode 0600. An encrypted profile
    (`key`) is exported plain, as the Hermes CLI reads it (docs/privacy.md#exports-and-the-hermes-cli)."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    out = Path(out) if out else Path.cwd() / f"hermes-export-{info.dir_name}-{stamp}.tar.gz"
    if out.is_dir():
        out = out / f"hermes-export-{info.dir_name}-{stamp}.tar.gz"
    private_mkdir(out.parent)
    links = links if links is not None else load_links(cfg)
    link_name = next(iter(link_names_of(links, info.tenant_id)), None)
    principals = live_principals(links, info)
    with tempfile.TemporaryDirectory(prefix=".hermes-export-", dir=out.parent) as tmp:
        stage = private_mkdir(Path(tmp) / "profile")
        files = write_plain_profile(info.path, stage, key)
        if (stage / "state.db").exists():
            conn = sqlite3.connect(stage / "state.db")  # the staged copy: nothing else has it open
            try:
                with open_private(stage / "state.sql", "w") as fh:
                    for line in conn.iterdump():
                        fh.write(line + "\n")
            finally:
                conn.close()
        manifest = {
            "format": EXPORT_FORMAT,
            "version": 1,
            "exported_at": time.time(),
            "tenant_id": info.tenant_id,
            "dir_name": info.dir_name,
            "kind": info.kind,
            "principals": principals,
            "link": {"name": link_name, "principals": links.principals_of(link_name)} if link_name else None,
            "paired": paired_principals(cfg.data_dir, principals),
            "files": sorted(files + (["state.sql"] if (stage / "state.db").exists() else [])),
        }
        write_private(Path(tmp) / "EXPORT.json", json.dumps(manifest, indent=1, ensure_ascii=False))
        write_tar(Path(tmp), out)
    return out


def write_plain_profile(src: Path, dst: Path, key: DataKey | None) -> list[str]:
    """A profile's copy in `dst` as Hermes reads it: state.db first (plain: the key
    removed), then every other file, sealed records opened; its relative paths
    (`profiles export`, `profiles decrypt`)."""
    files = []
    if (src / "state.db").exists():
        sqlite_backup(src / "state.db", dst / "state.db", key, plain=True)  # database first, journals after
        files.append("state.db")
    files += copy_profile_files(src, dst) if key is None else plain_profile_files(src, dst, key)
    return files


def decrypt_profile(info: TenantInfo, key: DataKey | None, out: Path) -> list[str]:
    """`profiles decrypt`: the profile, plain, into the new or empty directory `out`."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise AdminError(f"{out} is not an empty directory; decrypt writes a whole profile into a new one")
    private_mkdir(out)
    return write_plain_profile(info.path, out, key)


def archive_problems(
    cfg: Config,
    manifest: dict[str, Any],
    tenant_json: dict[str, Any],
    target: Path,
    links: IdentityLinks | None = None,
) -> list[str]:
    """Why an export archive must not be restored as it is: it may only link and pair
    principals its own tenant.json lists, that belong to its tenant, and that no other
    tenant owns (an edited archive must not join someone else's account to it)."""
    tid = manifest.get("tenant_id")
    problems = []
    if tenant_json.get("tenant_id") not in (None, tid):
        problems.append(f"its tenant.json is for {tenant_json.get('tenant_id')!r}, not {tid!r}")
    listed = {p for p in tenant_json.get("principals", []) if isinstance(p, str)}
    link = manifest.get("link") or {}
    name = link.get("name")
    if name is not None and link_tenant_id(str(name)) != tid:
        problems.append(f"its link {name!r} is not tenant {tid!r}")
    wanted = {p for p in link.get("principals", []) if isinstance(p, str)} if name else set()
    wanted |= {p for p in manifest.get("paired") or [] if isinstance(p, str)}
    links = links if links is not None else load_links(cfg)
    others = [i for i in scan_profiles(cfg.data_dir) if i.path != target]
    for p in sorted(wanted):
        if p not in listed:
            problems.append(f"{p} is not one of the principals its tenant.json lists")
            continue
        platform, _, uid = p.partition(":")
        if not name and person_tenant_id(platform, uid) != tid:
            problems.append(f"{p} is not the account of tenant {tid!r}")
        current = links.name_for(p)
        if current is not None and current != name:
            problems.append(f"{p} belongs to the identity link {current!r}")
            continue
        owner = next((i.tenant_id for i in others if p in live_principals(links, i)), None)
        if owner is not None:
            problems.append(f"{p} belongs to tenant {owner}")
    return problems


def restore_profile(
    cfg: Config, archive: Path, *, force: bool = False, links: IdentityLinks | None = None
) -> TenantInfo:
    """Put an exported profile back (gateway stopped): its directory, its identity link and
    its pairing approval."""
    archive = Path(archive)
    if not archive.is_file():
        raise AdminError(f"{archive}: no such archive")
    with RunLock(cfg.data_dir).acquire("`profiles restore`"):
        profiles_root = cfg.data_dir / "profiles"
        private_mkdir(profiles_root)
        with tempfile.TemporaryDirectory(prefix=".restore-", dir=profiles_root) as tmp:
            safe_extract(archive, Path(tmp))
            try:
                manifest = json.loads((Path(tmp) / "EXPORT.json").read_text(encoding="utf-8"))
            except (OSError, ValueError):
                raise AdminError(f"{archive}: not a hermes-gateway profile export (no EXPORT.json)") from None
            if manifest.get("format") != EXPORT_FORMAT:
                raise AdminError(f"{archive}: not a hermes-gateway profile export")
            tid = manifest["tenant_id"]
            target = tenant_dir(cfg.data_dir, tid)
            if manifest.get("dir_name") not in (None, target.name):
                raise AdminError(
                    f"{archive}: tenant {tid!r} belongs in {target.name}, the archive says {manifest.get('dir_name')}"
                )
            stage = Path(tmp) / "profile"
            if cfg.storage.encryption != "off":
                raise AdminError(
                    f"{archive}: this gateway encrypts profiles (storage.encryption: per_tenant), and an export "
                    "is plain; restoring one into an encrypted data directory is not supported yet"
                )
            problems = archive_problems(cfg, manifest, read_manifest(stage), target)
            if problems and not force:
                raise AdminError(
                    f"{archive}: refusing to restore: " + "; ".join(problems) + ". Use --force to restore anyway."
                )
            if target.exists() and any(target.iterdir()):
                if not force:
                    raise AdminError(f"{tid} already has a profile at {target}; use --force to replace it")
                shutil.rmtree(target)
            (stage / "state.sql").unlink(missing_ok=True)  # the dump is for people; state.db is the copy
            if (stage / "state.db").exists() and integrity_check(stage / "state.db") != "ok":
                raise AdminError(f"{archive}: state.db fails PRAGMA integrity_check")
            for sub in ("memories", "sessions", "provider"):
                private_mkdir(stage / sub)
            fsync_tree(stage)
            os.replace(stage, target)
        link = manifest.get("link") or None
        if link and link.get("name"):
            links = links if links is not None else load_links(cfg)
            for p in link.get("principals", []):
                current = links.name_for(p)
                if current is None:
                    links.link(link["name"], p)
                elif current != link["name"]:
                    print(
                        f"warning: {p} is now linked to {current!r}; not re-linked to {link['name']!r}", file=sys.stderr
                    )
            links.save()
        paired = manifest.get("paired") or []
        if paired:
            _kv_put(cfg.data_dir, {f"paired:{p}": str(time.time()) for p in paired})
    return tenant_info(target)


# ----- delete -----------------------------------------------------------------------------------


@dataclass
class DeleteReport:
    tenant_id: str
    removed_dirs: list[str]
    principals: list[str]
    links_removed: list[str]
    gateway_rows: int
    pinned: list[str]
    shared_rows: int = 0  # cluster mode: rows removed from PostgreSQL


def delete_tenant(
    cfg: Config,
    info: TenantInfo,
    *,
    erase_shared: EraseShared | None = None,
    links: IdentityLinks | None = None,
    keyring: Keyring | None = None,
) -> DeleteReport:
    """Remove everything a tenant owns (the gateway must be stopped): its profile directory
    (memory, journals, state.db, provider namespace, exports), profiles merged into it and
    left behind, its identity link, and its rows in gateway.db; then, through
    `erase_shared`, its rows in what cluster nodes share (required in cluster mode: a
    delete that left them would not be one). The keyring slot of every directory goes
    first, before any file: every copy of an encrypted profile, backups included, is
    unreadable from then on (docs/privacy.md#delete-is-crypto-shredding)."""
    if cfg.cluster.enabled and erase_shared is None:
        raise ValueError("cluster mode: delete_tenant needs erase_shared (gateway.cluster.erase)")
    data_dir = cfg.data_dir
    with RunLock(data_dir).acquire("`profiles delete`"):
        lock_fd = _lock_profile(info.path)
        try:
            links = links if links is not None else load_links(cfg)
            principals = set(live_principals(links, info))  # never an account that left the link
            link_names = set(link_names_of(links, info.tenant_id))
            chats = dm_chats(info.path, _readable_key(keyring, info))
            dirs = [info.path]
            for other in scan_profiles(data_dir):
                if other.path != info.path and other.merged_into == info.tenant_id:
                    dirs.append(other.path)  # a profile /link merged into this one, not yet removed
            if link_names:
                for p in principals:  # personal profiles of linked principals are never used again
                    platform, _, uid = p.partition(":")
                    try:
                        stale = tenant_dir(data_dir, person_tenant_id(platform, uid))
                    except (TypeError, ValueError):
                        continue
                    if stale.is_dir() and stale != info.path and stale not in dirs:
                        dirs.append(stale)
            for extra in dirs[1:]:
                chats |= dm_chats(extra, _readable_key(keyring, tenant_info(extra)))
            for other in scan_profiles(data_dir):  # a DM chat that lives on elsewhere keeps its rows
                if other.path not in dirs:
                    chats -= dm_chats(other.path, _readable_key(keyring, other))
            for path in dirs:  # the keys first: a crash right after leaves files nobody can read
                shred_slot(data_dir, path)
            for path in dirs:
                shutil.rmtree(path)
            # the person owns the reminders they set, even in a shared chat's profile
            dues = _drop_reminders_of(data_dir, principals, tenant_keys(cfg))
        finally:
            os.close(lock_fd)
        removed_links, pinned = [], []
        for p in sorted(principals):
            if links.name_for(p) is None:
                continue
            if links.is_pinned(p):
                pinned.append(p)
                continue
            links.unlink(p)
            removed_links.append(p)
        if removed_links or (data_dir / "links.json").exists():
            links.save()
        rows = scrub_gateway_db(data_dir, principals, chats, info.tenant_id, dues)
        shared = erase_shared(info.tenant_id, principals, chats) if erase_shared is not None else 0
    return DeleteReport(info.tenant_id, [str(d) for d in dirs], sorted(principals), removed_links, rows, pinned, shared)


def _readable_key(keyring: Keyring | None, info: TenantInfo) -> DataKey | None:
    """The key to read a profile a delete looks into; None when it cannot be had (its DM
    chats are then not known from it: a delete never stops for a key)."""
    try:
        return profile_key(keyring, info)
    except VaultError:
        return None


def _drop_reminders_of(data_dir: Path, principals: set[str], keys: TenantKeys) -> dict[str, float | None]:
    """Remove the reminders `principals` set in any other profile (a shared chat's); the
    next due time of each profile changed, for the scheduler's index."""
    dues: dict[str, float | None] = {}
    for other in scan_profiles(data_dir):
        try:
            store = ReminderStore(keys.files(other.tenant_id, other.path))
            if store.remove_where_now(lambda r: any(r.chat.of_account(p) for p in principals)):
                dues[other.tenant_id] = store.next_due_now()
        except VaultError as err:  # its key is gone or damaged: its reminders cannot be read, nor kept
            log.warning("reminders of %s left as they are: %s", other.tenant_id, err)
    return dues


def tenant_keys(cfg: Config) -> TenantKeys:
    """Tenants' data keys as the gateway has them (none when storage.encryption is off);
    AdminError, one sentence, when the master key is missing or wrong."""
    storage = cfg.storage
    try:
        return TenantKeys(
            open_keyring(cfg.data_dir, storage.encryption, storage.master_key_env, storage.master_key_file),
            rows=partial(reseal_rows, cfg.data_dir / "gateway.db"),  # an interrupted rekey finishes alike
        )
    except VaultError as err:
        raise AdminError(str(err)) from None


def profile_files(cfg: Config, info: TenantInfo) -> ProfileFiles:
    """A tenant's files as the gateway reads them (sealed under storage.encryption per_tenant)."""
    try:
        return tenant_keys(cfg).files(info.tenant_id, info.path)
    except VaultError as err:
        raise AdminError(str(err)) from None


def _lock_profile(path: Path) -> int:
    """Take the profile's SessionStore lock so nothing has it open while it is removed."""
    lock = path / "sessions" / ".lock"
    private_mkdir(lock.parent)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise AdminError(f"{path} is open in another process; stop the gateway first") from None
    return fd


# ----- repairing a damaged profile ------------------------------------------------------------


@dataclass
class RepairReport:
    tenant_id: str
    path: Path
    set_aside: list[str] = field(default_factory=list)  # damaged files kept beside their replacements
    rebuilt: list[str] = field(default_factory=list)  # what was written afresh
    messages: int = 0  # in the repaired state.db


def _set_aside(path: Path, stamp: str) -> str:
    """Rename a damaged file (or directory) to `<name>.damaged-<stamp>`; its new name."""
    target = path.with_name(f"{path.name}.damaged-{stamp}")
    os.replace(path, target)
    return target.name


def _known_manifest(path: Path, tenant_id: str, key: DataKey | None) -> dict[str, Any]:
    """tenant.json as far as the profile tells: its id, kind, and the principals and
    earliest time its journals name."""
    records = journal_records(path, key)
    kind = "chat" if "-chat-" in tenant_id else "person"
    principals: list[str] = []
    if kind == "person":
        for r in records:
            user = r.get("meta", {}).get("user") if isinstance(r.get("meta"), dict) else None
            if r.get("role") == "user" and isinstance(user, str) and user not in principals:
                principals.append(user)
    stamps = [r["ts"] for r in records if isinstance(r.get("ts"), (int, float))]
    return {
        "tenant_id": tenant_id,
        "kind": kind,
        "principals": principals,
        "created_at": min(stamps, default=time.time()),
        "schema_version": SCHEMA_VERSION,
        "repaired_at": time.time(),
    }


def _repair_tenant_id(info: TenantInfo, ref: str) -> str:
    if manifest_problem(info.path) is None and read_manifest(info.path).get("tenant_id"):
        return info.tenant_id
    for candidate in (ref, tenant_id_of_dir(info.dir_name)):
        if candidate and tenant_dir_name(candidate) == info.dir_name:
            return candidate
    raise AdminError(
        f"{info.path.name} is a hashed directory name and its tenant.json is damaged; "
        f"run `profiles repair` with the tenant id itself (e.g. telegram-111)"
    )


def repair_profile(cfg: Config, info: TenantInfo, ref: str, keyring: Keyring | None = None) -> RepairReport:
    """Set a damaged profile's unusable files aside and rebuild them: the layout's
    directories, tenant.json from what the profile tells, state.db from the journals (the
    same reconciliation by uid that every open runs). Safe while the gateway runs. An
    encrypted profile is repaired with its key, and refused in one sentence without it."""
    path = info.path
    tenant_id = _repair_tenant_id(info, ref)
    key = key_of(keyring, tenant_id, path)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    report = RepairReport(tenant_id, path)
    sessions = path / "sessions"
    if sessions.exists() and not sessions.is_dir():  # the profile lock lives in there
        report.set_aside.append(_set_aside(sessions, stamp))
    lock_fd = _lock_profile(path)
    try:
        for sub in ("memories", "provider"):
            if (path / sub).exists() and not (path / sub).is_dir():
                report.set_aside.append(_set_aside(path / sub, stamp))
            private_mkdir(path / sub)
        problem = manifest_problem(path)
        if problem is not None:
            manifest = path / "tenant.json"
            aside = manifest.with_name(f"tenant.json.damaged-{stamp}")
            if manifest.is_dir():
                os.replace(manifest, aside)
            else:  # copied, so tenant.json is never absent while the gateway may look
                shutil.copyfile(manifest, aside)
            private_file(aside)
            report.set_aside.append(aside.name)
            write_manifest(path, _known_manifest(path, tenant_id, key))
            report.rebuilt.append(f"tenant.json ({problem})")
        db = path / "state.db"
        problem = profile_problem(path, deep=True, key=key)
        if problem is not None and problem.startswith("state.db"):
            for name in sorted(STATE_FILES):
                if (path / name).exists():
                    report.set_aside.append(_set_aside(path / name, stamp))
            report.rebuilt.append(f"state.db from the journals ({problem})")
        store = SessionStore(path, fsync="always", profile_lock=False, key=key)  # the lock is held here

        async def reopen() -> None:
            await store.open()
            await store.close()

        asyncio.run(reopen())
        with closing(open_reader(db, key)) as conn:
            report.messages = int(conn.execute("SELECT count(*) FROM messages").fetchall()[0][0] or 0)
    finally:
        os.close(lock_fd)
    left = profile_problem(path, deep=True, key=key)
    if left is not None:
        raise AdminError(f"{tenant_id} is still damaged after the repair: {left}")
    return report


def check_profiles(cfg: Config, *, deep: bool = False, keyring: Keyring | None = None) -> tuple[bool, str]:
    """Doctor's check of every profile's files (cheap by default; `deep` adds
    integrity_check, with each encrypted profile's key): ok, or which are damaged and how
    to repair them."""
    profiles = scan_profiles(cfg.data_dir)
    damaged = [(i.tenant_id, p) for i in profiles if (p := _problem(i, deep, keyring)) is not None]
    how = "integrity_check included" if deep else "cheap checks; --deep runs integrity_check"
    if not damaged:
        return True, f"{count(len(profiles), 'profile', 'profiles')}, none damaged ({how})"
    shown = "; ".join(f"{t} ({p})" for t, p in damaged[:5]) + ("; ..." if len(damaged) > 5 else "")
    return False, (
        f"{len(damaged)} of {count(len(profiles), 'profile', 'profiles')} damaged: {shown}; their messages wait. "
        f"Repair each with `hermes-gateway profiles repair TENANT` (works while the gateway runs)"
    )


def _problem(info: TenantInfo, deep: bool, keyring: Keyring | None) -> str | None:
    try:
        key = profile_key(keyring, info) if deep else None
    except VaultError as err:
        return str(err)
    return profile_problem(info.path, deep=deep, key=key)


def scan_damaged(cfg: Config) -> list[str]:
    """The tenant ids whose profiles fail the cheap checks."""
    return [i.tenant_id for i in scan_profiles(cfg.data_dir) if profile_problem(i.path) is not None]


def count(n: int, one: str, many: str) -> str:
    """`1 profile`, `2 profiles`."""
    return f"{n} {one if n == 1 else many}"
