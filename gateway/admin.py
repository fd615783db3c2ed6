"""Operator commands: `profiles list|show|export|delete|restore|repair`, `backup`, `restore`, `health`.

Consistency rules:
- Reads (`list`, `show`, `export`, `backup`) work while the gateway runs. SQLite files are
  copied with SQLite's online backup API (a consistent snapshot, writers not blocked), the
  database first and the journals after, so a copy's journals are never older than its
  database; opening the copy reconciles the two (a torn last journal line is cut).
- Changes (`profiles delete`, `profiles restore`, `restore`) need the gateway stopped: the
  running gateway holds `<data_dir>/gateway.lock` (an flock), keeps links.json and
  gateway.db in memory, and may have the profile open. They refuse with a clear message
  while the lock is held, and hold it themselves while they work, so a gateway cannot
  start halfway through.
- `profiles repair` works while the gateway runs: it takes the profile's own lock (which a
  profile the gateway could not open is free of), sets the damaged files aside, and the
  gateway's next retry opens the repaired profile and answers its held messages.
"""

from __future__ import annotations

import argparse
import asyncio
import fcntl
import json
import os
import shutil
import sqlite3
import sys
import tarfile
import tempfile
import time
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote

from agent.fileio import open_private, private_file, private_mkdir, tighten_tree, write_private
from agent.profile import write_manifest
from agent.reminders import ReminderStore
from agent.sessions import SessionStore
from core.settings import Config
from tenancy.identity import IdentityLinks
from tenancy.keys import link_tenant_id, person_tenant_id, tenant_dir, tenant_dir_name
from tenancy.profiles import SCHEMA_VERSION, journal_records, manifest_problem, profile_problem, tenant_id_of_dir

LOCK_NAME = "gateway.lock"
CONFIG_HELP = "config file (default: hermes-gateway.yaml, or $HERMES_GATEWAY_CONFIG)"
RETIRED_MARKER = "merged-into.json"  # written by gateway/linking.py into a merged-away profile
EXPORT_FORMAT = "hermes-gateway-profile-export"
BACKUP_FORMAT = "hermes-gateway-backup"
_STATE_FILES = {"state.db", "state.db-wal", "state.db-shm", "state.db-journal"}
# kv keys of gateway.db that name a principal after the prefix
_PRINCIPAL_KEYS = ("paired:", "pairing-of:", "link-code-of:", "link-issued:", "link-fail:", "link-request:")


class AdminError(Exception):
    """A refusal or failure to report to the operator (exit status 1)."""


# ----- the run lock -----------------------------------------------------------------------


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


def find_tenant(cfg: Config, ref: str) -> TenantInfo:
    """A tenant by id (`telegram-111`, `link-alice`), directory name, or principal
    (`telegram:111`, following live identity links only)."""
    profiles = scan_profiles(cfg.data_dir)
    for info in profiles:
        if ref in (info.tenant_id, info.dir_name):
            return info
    links = load_links(cfg)
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


def profile_stats(path: Path) -> dict[str, Any]:
    """Sessions, messages, last activity and disk use; a damaged profile (`damaged` says
    what) is counted from its journals, which hold every message."""
    stats: dict[str, Any] = {"sessions": 0, "messages": 0, "last_activity": None, "disk_bytes": disk_usage(path)}
    problem = profile_problem(path)
    db = path / "state.db"
    if problem is None and db.exists():
        conn = _connect_ro(db)
        try:
            row = conn.execute(
                "SELECT (SELECT count(*) FROM sessions), (SELECT count(*) FROM messages), "
                "max(COALESCE((SELECT max(timestamp) FROM messages), 0), "
                "COALESCE((SELECT max(max(COALESCE(started_at,0), COALESCE(ended_at,0))) FROM sessions), 0))"
            ).fetchone()
            stats.update(sessions=row[0], messages=row[1], last_activity=row[2] or None)
        except sqlite3.OperationalError as err:
            stats["error"] = f"state.db unreadable: {err}"
        except sqlite3.DatabaseError as err:
            problem = f"state.db cannot be read ({err})"
        finally:
            conn.close()
    if problem is not None:
        records = journal_records(path)
        stamps = [r["ts"] for r in records if isinstance(r.get("ts"), (int, float))]
        stamps += [r["timestamp"] for r in records if isinstance(r.get("timestamp"), (int, float))]
        stats.update(
            damaged=problem,
            sessions=len({r["session_id"] for r in records if isinstance(r.get("session_id"), str)}),
            messages=len({r["uid"] for r in records if r.get("type") == "message" and isinstance(r.get("uid"), str)}),
            last_activity=max(stamps, default=None),
        )
    return stats


def session_rows(path: Path) -> list[dict[str, Any]]:
    db = path / "state.db"
    if not db.exists():
        return []
    try:
        conn = _connect_ro(db)
    except sqlite3.Error:
        return []
    conn.row_factory = sqlite3.Row
    try:
        return [
            dict(r)
            for r in conn.execute(
                "SELECT id, session_key, started_at, ended_at, end_reason, parent_session_id, message_count, "
                "input_tokens, output_tokens, compressions FROM sessions ORDER BY started_at, id"
            )
        ]
    except sqlite3.Error:  # damaged: profile_stats says so
        return []
    finally:
        conn.close()


def _human_bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


def _when(ts: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.gmtime(ts)) if ts else "-"


# ----- copying --------------------------------------------------------------------------------


def _skip(rel: Path) -> bool:
    name = rel.name
    return (
        name == ".lock"
        or name.endswith(".tmp")
        or (len(rel.parts) == 1 and name in _STATE_FILES)
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


def sqlite_backup(src: Path, dst: Path) -> None:
    """Online backup of `src` to `dst` (a consistent snapshot; writers are not blocked)."""
    private_mkdir(dst.parent)
    if dst.exists():
        dst.unlink()
    private_file(dst)
    source = sqlite3.connect(f"file:{src}?mode=ro", uri=True, timeout=30)
    try:
        target = sqlite3.connect(dst)
        try:
            source.backup(target)
            target.execute("PRAGMA journal_mode=DELETE")  # a self-contained file, no -wal
        finally:
            target.close()
    finally:
        source.close()
    for suffix in ("-wal", "-shm"):
        Path(f"{dst}{suffix}").unlink(missing_ok=True)


def integrity_check(db: Path) -> str:
    conn = sqlite3.connect(db)
    try:
        return conn.execute("PRAGMA integrity_check").fetchone()[0]
    finally:
        conn.close()


def _fsync_tree(path: Path) -> None:
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


def _safe_extract(archive: Path, dest: Path) -> None:
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


def _write_tar(src_dir: Path, out: Path) -> None:
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as raw, tarfile.open(fileobj=raw, mode="w:gz") as tar:
        for entry in sorted(src_dir.iterdir()):
            tar.add(entry, arcname=entry.name, filter=_owner_only)
    with open(tmp, "rb") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, out)


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


def dm_chats(path: Path) -> set[tuple[str, str]]:
    """(platform, chat_id) of every DM lane in a profile, from its sessions' keys."""
    out = set()
    for row in session_rows(path):
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


def export_profile(cfg: Config, info: TenantInfo, out: Path | None = None) -> Path:
    """One .tar.gz with everything the tenant owns: EXPORT.json, profile/tenant.json,
    profile/memories/, profile/sessions/*.jsonl, profile/provider/, profile/state.db (online
    backup) and profile/state.sql (a text dump of it). Mode 0600."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    out = Path(out) if out else Path.cwd() / f"hermes-export-{info.dir_name}-{stamp}.tar.gz"
    if out.is_dir():
        out = out / f"hermes-export-{info.dir_name}-{stamp}.tar.gz"
    private_mkdir(out.parent)
    links = load_links(cfg)
    link_name = next(iter(link_names_of(links, info.tenant_id)), None)
    principals = live_principals(links, info)
    with tempfile.TemporaryDirectory(prefix=".hermes-export-", dir=out.parent) as tmp:
        stage = private_mkdir(Path(tmp) / "profile")
        if (info.path / "state.db").exists():
            sqlite_backup(info.path / "state.db", stage / "state.db")  # database first, journals after
            conn = sqlite3.connect(stage / "state.db")
            try:
                with open_private(stage / "state.sql", "w") as fh:
                    for line in conn.iterdump():
                        fh.write(line + "\n")
            finally:
                conn.close()
        files = copy_profile_files(info.path, stage)
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
            "files": sorted(files + (["state.db", "state.sql"] if (stage / "state.db").exists() else [])),
        }
        write_private(Path(tmp) / "EXPORT.json", json.dumps(manifest, indent=1, ensure_ascii=False))
        _write_tar(Path(tmp), out)
    return out


def archive_problems(cfg: Config, manifest: dict[str, Any], tenant_json: dict[str, Any], target: Path) -> list[str]:
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
    links = load_links(cfg)
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


def restore_profile(cfg: Config, archive: Path, *, force: bool = False) -> TenantInfo:
    """Put an exported profile back (gateway stopped): its directory, its identity link and
    its pairing approval."""
    archive = Path(archive)
    if not archive.is_file():
        raise AdminError(f"{archive}: no such archive")
    with RunLock(cfg.data_dir).acquire("`profiles restore`"):
        profiles_root = cfg.data_dir / "profiles"
        private_mkdir(profiles_root)
        with tempfile.TemporaryDirectory(prefix=".restore-", dir=profiles_root) as tmp:
            _safe_extract(archive, Path(tmp))
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
            _fsync_tree(stage)
            os.replace(stage, target)
        link = manifest.get("link") or None
        if link and link.get("name"):
            links = load_links(cfg)
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


def delete_tenant(cfg: Config, info: TenantInfo) -> DeleteReport:
    """Remove everything a tenant owns (the gateway must be stopped): its profile directory
    (memory, journals, state.db, provider namespace, exports), profiles merged into it and
    left behind, its identity link, and its rows in gateway.db."""
    data_dir = cfg.data_dir
    with RunLock(data_dir).acquire("`profiles delete`"):
        lock_fd = _lock_profile(info.path)
        try:
            links = load_links(cfg)
            principals = set(live_principals(links, info))  # never an account that left the link
            link_names = set(link_names_of(links, info.tenant_id))
            chats = dm_chats(info.path)
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
                chats |= dm_chats(extra)
            for other in scan_profiles(data_dir):  # a DM chat that lives on elsewhere keeps its rows
                if other.path not in dirs:
                    chats -= dm_chats(other.path)
            for path in dirs:
                shutil.rmtree(path)
            # the person owns the reminders they set, even in a shared chat's profile
            dues = _drop_reminders_of(data_dir, principals)
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
        shared = 0
        if cfg.cluster.enabled:  # what the nodes share lives in PostgreSQL
            from gateway.cluster.erase import erase_tenant_now

            shared = erase_tenant_now(cfg, info.tenant_id, principals, chats)
    return DeleteReport(info.tenant_id, [str(d) for d in dirs], sorted(principals), removed_links, rows, pinned, shared)


def _drop_reminders_of(data_dir: Path, principals: set[str]) -> dict[str, float | None]:
    """Remove the reminders `principals` set in any other profile (a shared chat's); the
    next due time of each profile changed, for the scheduler's index."""
    dues: dict[str, float | None] = {}
    for other in scan_profiles(data_dir):
        store = ReminderStore(other.path)
        if store.remove_where_now(lambda r: any(r.chat.of_account(p) for p in principals)):
            dues[other.tenant_id] = store.next_due_now()
    return dues


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


def _known_manifest(path: Path, tenant_id: str) -> dict[str, Any]:
    """tenant.json as far as the profile tells: its id, kind, and the principals and
    earliest time its journals name."""
    records = journal_records(path)
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


def repair_profile(cfg: Config, info: TenantInfo, ref: str) -> RepairReport:
    """Set a damaged profile's unusable files aside and rebuild them: the layout's
    directories, tenant.json from what the profile tells, state.db from the journals (the
    same reconciliation by uid that every open runs). Safe while the gateway runs."""
    path = info.path
    tenant_id = _repair_tenant_id(info, ref)
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
            write_manifest(path, _known_manifest(path, tenant_id))
            report.rebuilt.append(f"tenant.json ({problem})")
        db = path / "state.db"
        problem = profile_problem(path, deep=True)
        if problem is not None and problem.startswith("state.db"):
            for name in sorted(_STATE_FILES):
                if (path / name).exists():
                    report.set_aside.append(_set_aside(path / name, stamp))
            report.rebuilt.append(f"state.db from the journals ({problem})")
        store = SessionStore(path, fsync="always", profile_lock=False)  # the lock is held here

        async def reopen() -> None:
            await store.open()
            await store.close()

        asyncio.run(reopen())
        conn = _connect_ro(db)
        try:
            report.messages = conn.execute("SELECT count(*) FROM messages").fetchone()[0]
        finally:
            conn.close()
    finally:
        os.close(lock_fd)
    left = profile_problem(path, deep=True)
    if left is not None:
        raise AdminError(f"{tenant_id} is still damaged after the repair: {left}")
    return report


def check_profiles(cfg: Config, *, deep: bool = False) -> tuple[bool, str]:
    """Doctor's check of every profile's files (cheap by default; `deep` adds
    integrity_check): ok, or which are damaged and how to repair them."""
    profiles = scan_profiles(cfg.data_dir)
    damaged = [(i.tenant_id, p) for i in profiles if (p := profile_problem(i.path, deep=deep)) is not None]
    how = "integrity_check included" if deep else "cheap checks; --deep runs integrity_check"
    if not damaged:
        return True, f"{_count(len(profiles), 'profile', 'profiles')}, none damaged ({how})"
    shown = "; ".join(f"{t} ({p})" for t, p in damaged[:5]) + ("; ..." if len(damaged) > 5 else "")
    return False, (
        f"{len(damaged)} of {_count(len(profiles), 'profile', 'profiles')} damaged: {shown}; their messages wait. "
        f"Repair each with `hermes-gateway profiles repair TENANT` (works while the gateway runs)"
    )


# ----- backup / restore of the whole data directory ---------------------------------------------

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


def backup_data_dir(data_dir: Path, dest: Path, *, keep: int | None = None) -> Path:
    """A consistent copy of the data directory while the gateway runs: every state.db and
    gateway.db through SQLite's online backup, then journals, memories, provider files and
    links.json. Always one archive (mode 0600) with a timestamped name inside the directory
    `dest` (created if missing); `keep` then deletes all but the newest `keep` archives."""
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
        }
        for entry in sorted(data_dir.iterdir()):  # gateway.db, links.json, anything a future version adds
            name = entry.name
            if (
                name.startswith(".")
                or name == LOCK_NAME
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
                sqlite_backup(info.path / "state.db", target / "state.db")  # database first, journals after
                report["databases"].append(f"profiles/{info.dir_name}/state.db")
            copy_profile_files(info.path, target)
            report["profiles"] += 1
        write_private(stage / "BACKUP.json", json.dumps(report, indent=1))
        _write_tar(stage, dest)
    if keep:
        for path in sorted(directory.glob(BACKUP_GLOB))[:-keep]:
            path.unlink()
    return dest


def restore_data_dir(src: Path, data_dir: Path) -> dict[str, Any]:
    """Restore a `backup` (directory or archive) into an empty data directory."""
    src, data_dir = Path(src), Path(data_dir)
    if data_dir.exists() and any(p.name != LOCK_NAME for p in data_dir.iterdir()):
        raise AdminError(
            f"{data_dir} is not empty; restore goes into an empty data directory (move the old one aside first)"
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
            _safe_extract(src, Path(tmp))
            stage = Path(tmp)
        else:
            raise AdminError(f"{src}: no such backup")
        try:
            report = json.loads((stage / "BACKUP.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            raise AdminError(f"{src}: not a hermes-gateway backup (no BACKUP.json)") from None
        if report.get("format") != BACKUP_FORMAT:
            raise AdminError(f"{src}: not a hermes-gateway backup")
        for db in report.get("databases", []):
            if (stage / db).exists() and integrity_check(stage / db) != "ok":
                raise AdminError(f"{src}: {db} fails PRAGMA integrity_check")
        _fsync_tree(stage)
        for entry in stage.iterdir():
            if entry.name in ("BACKUP.json", LOCK_NAME) or entry.name.startswith(".hermes-restore-"):
                continue
            os.replace(entry, data_dir / entry.name)
    return report


# ----- the command line -----------------------------------------------------------------------


def _check_owner(cfg: Config) -> None:
    """Refuse to run as root on a data directory owned by the service user: files root
    creates (SQLite -shm/-wal, restored profiles) would lock the gateway out."""
    try:
        owner = cfg.data_dir.stat().st_uid
    except FileNotFoundError:
        return
    if os.geteuid() == 0 and owner != 0:
        raise AdminError(
            f"{cfg.data_dir} belongs to uid {owner}; run this as that user "
            f"(e.g. sudo -u hermes-gateway hermes-gateway ...) so new files stay readable by the gateway"
        )


def _count(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"


def _print_json(data: Any) -> None:
    print(json.dumps(data, indent=1, ensure_ascii=False, default=str))


def cmd_profiles_list(cfg: Config, args: argparse.Namespace) -> int:
    _check_owner(cfg)
    rows = []
    links = load_links(cfg)
    for info in scan_profiles(cfg.data_dir):
        stats = profile_stats(info.path)
        principals = live_principals(links, info)
        rows.append(
            {
                "tenant": info.tenant_id,
                "kind": info.kind,
                "principals": principals,
                **stats,
                **({"merged_into": info.merged_into} if info.merged_into else {}),
            }
        )
    if args.json:
        _print_json(rows)
        return 0
    if not rows:
        print(f"no profiles under {cfg.data_dir / 'profiles'}")
        return 0
    header = ("TENANT", "PRINCIPALS", "SESSIONS", "MESSAGES", "DISK", "LAST ACTIVITY (UTC)")
    table = [header] + [
        (
            r["tenant"]
            + (f" (merged into {r['merged_into']})" if r.get("merged_into") else "")
            + (f" (damaged: {r['damaged']})" if r.get("damaged") else ""),
            ",".join(r["principals"]) or "-",
            str(r["sessions"]),
            str(r["messages"]),
            _human_bytes(r["disk_bytes"]),
            _when(r["last_activity"]),
        )
        for r in rows
    ]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for row in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=False)).rstrip())
    damaged = [r["tenant"] for r in rows if r.get("damaged")]
    if damaged:
        print(
            f"{_count(len(damaged), 'profile is', 'profiles are')} damaged (counted from the journals); "
            f"repair with `hermes-gateway profiles repair TENANT`"
        )
    return 0


def cmd_profiles_show(cfg: Config, args: argparse.Namespace) -> int:
    _check_owner(cfg)
    info = find_tenant(cfg, args.tenant)
    links = load_links(cfg)
    stats = profile_stats(info.path)
    memory = {}
    for target, fname in (("memory", "MEMORY.md"), ("user", "USER.md")):
        try:
            text = (info.path / "memories" / fname).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            text = ""
        entries = [e for e in text.split("\n§\n") if e.strip()]
        memory[target] = {"entries": len(entries), "chars": len(text)}
    provider_files = (
        sorted(str(p.relative_to(info.path)) for p in (info.path / "provider").rglob("*") if p.is_file())
        if (info.path / "provider").is_dir()
        else []
    )
    principals = live_principals(links, info)
    linked = sorted({n for p in principals if (n := links.name_for(p)) is not None})
    data = {
        "tenant": info.tenant_id,
        "directory": str(info.path),
        "kind": info.kind,
        "principals": principals,
        "created_at": info.created_at,
        "links": {n: links.principals_of(n) for n in linked},
        **stats,
        "memory": memory,
        "provider_files": provider_files,
        "sessions_detail": session_rows(info.path),
        **({"merged_into": info.merged_into} if info.merged_into else {}),
    }
    if args.json:
        _print_json(data)
        return 0
    print(f"tenant:        {info.tenant_id} ({info.kind})")
    print(f"directory:     {info.path}")
    print(f"principals:    {', '.join(principals) or '-'}")
    if data["links"]:
        print("linked:        " + "; ".join(f"{n}: {', '.join(ps)}" for n, ps in data["links"].items()))
    if info.merged_into:
        print(f"merged into:   {info.merged_into} (left behind by /link; safe to delete)")
    if stats.get("damaged"):
        print(
            f"state:         damaged: {stats['damaged']}; its messages wait; "
            f"repair with `hermes-gateway profiles repair {info.tenant_id}` (counts below are from the journals)"
        )
    print(f"created:       {_when(info.created_at)}")
    print(f"last activity: {_when(stats['last_activity'])}")
    print(f"disk use:      {_human_bytes(stats['disk_bytes'])}")
    print(
        f"memory:        MEMORY.md {memory['memory']['entries']} entries / {memory['memory']['chars']} chars, "
        f"USER.md {memory['user']['entries']} entries / {memory['user']['chars']} chars"
    )
    print(f"provider:      {_count(len(provider_files), 'file', 'files')}")
    print(f"sessions:      {stats['sessions']} ({stats['messages']} messages)")
    for s in data["sessions_detail"]:
        state = f"ended {_when(s['ended_at'])} ({s['end_reason']})" if s["ended_at"] else "live"
        print(f"  {s['id']}  {s['session_key']}  {s['message_count']} msgs  started {_when(s['started_at'])}  {state}")
    return 0


def cmd_profiles_path(cfg: Config, args: argparse.Namespace) -> int:
    """Print the profile directory (the HERMES_HOME) of a principal or tenant, e.g. for
    `HERMES_HOME=$(hermes-gateway profiles path telegram:111) hermes`."""
    try:
        path = find_tenant(cfg, args.principal).path
    except AdminError:
        platform, sep, user = args.principal.partition(":")
        if not sep or not platform or not user:
            raise
        tenant = load_links(cfg).tenant_for(args.principal) or person_tenant_id(platform, user)
        path = tenant_dir(cfg.data_dir, tenant)
        print(
            f"note: {args.principal} has no profile yet; it will be created there on their first message",
            file=sys.stderr,
        )
    print(path.resolve())
    return 0


def cmd_profiles_export(cfg: Config, args: argparse.Namespace) -> int:
    _check_owner(cfg)
    info = find_tenant(cfg, args.tenant)
    problem = profile_problem(info.path)
    if problem is not None:
        raise AdminError(
            f"{info.tenant_id} is damaged ({problem}); repair it first with "
            f"`hermes-gateway profiles repair {info.tenant_id}` (the damaged files are kept beside it)"
        )
    output = Path(args.output) if args.output else None
    if output is not None and args.output.endswith(("/", os.sep)):  # `-o new/dir/`: a directory to create
        private_mkdir(output)
    out = export_profile(cfg, info, output)
    print(f"exported {info.tenant_id} to {out}")
    return 0


def cmd_profiles_delete(cfg: Config, args: argparse.Namespace) -> int:
    _check_owner(cfg)
    info = find_tenant(cfg, args.tenant)
    if gateway_running(cfg.data_dir):
        RunLock(cfg.data_dir).acquire("`profiles delete`")  # raises the explanation
    stats = profile_stats(info.path)
    members = live_principals(load_links(cfg), info)
    print(
        f"This permanently deletes {info.tenant_id} ({', '.join(members) or 'no principals'}): "
        f"{_count(stats['sessions'], 'session', 'sessions')}, {_count(stats['messages'], 'message', 'messages')}, "
        f"memory, provider data, "
        f"{_human_bytes(stats['disk_bytes'])} in {info.path}, plus its identity link and its rows in gateway.db"
        + (" and PostgreSQL." if cfg.cluster.enabled else ".")
    )
    if not args.yes:
        if not sys.stdin.isatty():
            print("Refusing without confirmation: run it in a terminal, or pass --yes.", file=sys.stderr)
            return 1
        answer = input(f"Type the tenant id ({info.tenant_id}) to confirm: ").strip()
        if answer != info.tenant_id:
            print("Not confirmed; nothing was deleted.")
            return 1
    report = delete_tenant(cfg, info)
    print(
        f"deleted {report.tenant_id}: {_count(len(report.removed_dirs), 'profile directory', 'profile directories')}, "
        f"{_count(len(report.links_removed), 'link entry', 'link entries')}, "
        f"{_count(report.gateway_rows, 'gateway.db row', 'gateway.db rows')}"
        + (f", {_count(report.shared_rows, 'PostgreSQL row', 'PostgreSQL rows')}" if cfg.cluster.enabled else "")
    )
    if report.pinned:
        print(
            f"note: {', '.join(report.pinned)} are linked in the config file (tenancy.identity_links); "
            "remove them there too."
        )
    return 0


def cmd_profiles_restore(cfg: Config, args: argparse.Namespace) -> int:
    _check_owner(cfg)
    info = restore_profile(cfg, Path(args.archive), force=args.force)
    stats = profile_stats(info.path)
    print(
        f"restored {info.tenant_id} to {info.path}: {_count(stats['sessions'], 'session', 'sessions')}, "
        f"{_count(stats['messages'], 'message', 'messages')}"
    )
    return 0


def cmd_profiles_repair(cfg: Config, args: argparse.Namespace) -> int:
    _check_owner(cfg)
    info = find_tenant(cfg, args.tenant)
    if profile_problem(info.path, deep=True) is None:
        print(f"{info.tenant_id} is not damaged; nothing to repair")
        return 0
    report = repair_profile(cfg, info, args.tenant)
    print(f"repaired {report.tenant_id} in {report.path}: {'; '.join(report.rebuilt) or 'layout'}")
    if report.set_aside:
        print(f"  damaged files kept beside it: {', '.join(report.set_aside)}")
    print(
        f"  state.db holds {_count(report.messages, 'message', 'messages')}; "
        f"a running gateway answers the held messages at its next retry"
    )
    return 0


def cmd_backup(cfg: Config, args: argparse.Namespace) -> int:
    _check_owner(cfg)
    dest = backup_data_dir(cfg.data_dir, Path(args.dest), keep=args.keep)
    print(f"backup written to {dest}")
    damaged = scan_damaged(cfg)
    if damaged:
        print(
            f"note: {', '.join(damaged)} {'is' if len(damaged) == 1 else 'are'} damaged and copied as found; "
            "repair with `hermes-gateway profiles repair TENANT`"
        )
    return 0


def scan_damaged(cfg: Config) -> list[str]:
    """The tenant ids whose profiles fail the cheap checks."""
    return [i.tenant_id for i in scan_profiles(cfg.data_dir) if profile_problem(i.path) is not None]


def cmd_restore(cfg: Config, args: argparse.Namespace) -> int:
    _check_owner(cfg)
    report = restore_data_dir(Path(args.src), cfg.data_dir)
    print(
        f"restored {_count(report.get('profiles', 0), 'profile', 'profiles')} into {cfg.data_dir} "
        f"(backup of {_when(report.get('created_at'))} UTC)"
    )
    return 0


def cmd_health(cfg: Config, args: argparse.Namespace) -> int:
    from gateway.observability import probe_health

    listen = args.listen or cfg.observability.listen
    if not listen:
        print("observability.listen is not set in the config; there is no health endpoint to ask.", file=sys.stderr)
        return 2
    status, body = probe_health(listen, timeout=args.timeout)
    if not args.quiet:
        print(body.strip())
    return 0 if status == 200 else 1


def _guard(fn: Any) -> Any:
    def run(cfg: Config, args: argparse.Namespace) -> int:
        try:
            return fn(cfg, args)
        except AdminError as err:
            print(f"error: {err}", file=sys.stderr)
            return 1

    return run


def register(sub: Any) -> None:
    """Add the operator subcommands to the CLI (see gateway/cli.py `_EXTRA_COMMANDS`)."""
    tenant_help = "tenant id (telegram-111), principal (telegram:111) or profile directory name"
    json_help = "print JSON instead of a table"
    profiles = sub.add_parser("profiles", help="list, show, export, delete or restore tenant profiles")
    psub = profiles.add_subparsers(dest="profiles_command", required=True)
    p = psub.add_parser("list", help="every tenant: principals, sessions, messages, disk use, last activity")
    p.add_argument("--json", action="store_true", help=json_help)
    p.set_defaults(handler=_guard(cmd_profiles_list))
    p = psub.add_parser("show", help="one tenant in detail (id, principal like telegram:111, or directory)")
    p.add_argument("tenant", help=tenant_help)
    p.add_argument("--json", action="store_true", help=json_help)
    p.set_defaults(handler=_guard(cmd_profiles_show))
    p = psub.add_parser("path", help="print a tenant's profile directory, for HERMES_HOME=$(...)")
    p.add_argument("principal", help=tenant_help)
    p.set_defaults(handler=_guard(cmd_profiles_path))
    p = psub.add_parser("export", help="one .tar.gz of everything a tenant owns (works while running)")
    p.add_argument("tenant", help=tenant_help)
    p.add_argument("-o", "--output", default=None, help="archive path or directory (default: current directory)")
    p.set_defaults(handler=_guard(cmd_profiles_export))
    p = psub.add_parser("delete", help="delete everything a tenant owns (gateway stopped; asks to confirm)")
    p.add_argument("tenant", help=tenant_help)
    p.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    p.set_defaults(handler=_guard(cmd_profiles_delete))
    p = psub.add_parser("restore", help="put back a profile from a `profiles export` archive (gateway stopped)")
    p.add_argument("archive", help="a .tar.gz written by `profiles export`")
    p.add_argument(
        "--force",
        action="store_true",
        help="replace an existing profile of the same tenant, and restore links and pairings the "
        "archive's own tenant.json does not vouch for",
    )
    p.set_defaults(handler=_guard(cmd_profiles_restore))
    p = psub.add_parser("repair", help="rebuild a damaged profile from its journals (works while running)")
    p.add_argument("tenant", help=tenant_help)
    p.set_defaults(handler=_guard(cmd_profiles_repair))
    for p in psub.choices.values():
        p.add_argument("-c", "--config", dest="config", default=argparse.SUPPRESS, help=CONFIG_HELP)

    p = sub.add_parser("backup", help="consistent archive of the whole data directory (works while running)")
    p.add_argument("dest", help="directory for the timestamped archive (created if missing)")
    p.add_argument(
        "--keep",
        type=int,
        default=None,
        metavar="N",
        help="then delete all but the newest N archives in that directory",
    )
    p.set_defaults(handler=_guard(cmd_backup))
    p = sub.add_parser("restore", help="restore a `backup` into an empty data directory (gateway stopped)")
    p.add_argument("src", help="backup archive (or a backup directory of an older version)")
    p.set_defaults(handler=_guard(cmd_restore))
    p = sub.add_parser("health", help="ask the running gateway's /healthz (exit 0 when healthy)")
    p.add_argument("--listen", default=None, help="host:port (default: observability.listen)")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for an answer (default 5)")
    p.add_argument("-q", "--quiet", action="store_true", help="print nothing; only the exit status tells")
    p.set_defaults(handler=_guard(cmd_health))
