"""`profiles list|show|path|export|decrypt|delete|restore|repair`, `backup` and `restore`: the
operator's tenant and backup commands (docs/operator-guide.md#managing-tenants,
docs/operator-guide.md#backups). The work is in gateway/tenants.py and gateway/backup.py;
this module parses, asks, prints, and picks the cluster's eraser in cluster mode.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from agent.fileio import private_mkdir
from agent.vault import Keyring, VaultError
from core.settings import Config
from gateway.backup import backup_data_dir, restore_data_dir
from gateway.cli.common import CONFIG_HELP, admin_keyring, admin_links, admin_master_key, guard
from gateway.runlock import AdminError, RunLock, gateway_running
from gateway.tenants import (
    TenantInfo,
    count,
    decrypt_profile,
    delete_tenant,
    disk_usage,
    export_profile,
    find_tenant,
    live_principals,
    profile_key,
    profile_stats,
    repair_profile,
    restore_profile,
    scan_damaged,
    scan_profiles,
    session_rows,
)
from tenancy.keys import person_tenant_id, tenant_dir
from tenancy.profiles import profile_problem


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


def _print_json(data: Any) -> None:
    print(json.dumps(data, indent=1, ensure_ascii=False, default=str))


def _human_bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


def _when(ts: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.gmtime(ts)) if ts else "-"


def _stats(keyring: Keyring | None, info: TenantInfo) -> dict[str, Any]:
    """profile_stats with the tenant's key; a profile that cannot be opened says why."""
    try:
        key = profile_key(keyring, info)
    except VaultError as err:
        return {
            "sessions": 0,
            "messages": 0,
            "last_activity": None,
            "disk_bytes": disk_usage(info.path),
            "damaged": str(err),
        }
    return profile_stats(info.path, key)


def cmd_profiles_list(cfg: Config, args: argparse.Namespace) -> int:
    _check_owner(cfg)
    rows = []
    links = admin_links(cfg)
    keyring = admin_keyring(cfg)
    for info in scan_profiles(cfg.data_dir):
        stats = _stats(keyring, info)
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
            f"{count(len(damaged), 'profile is', 'profiles are')} damaged (counted from the journals); "
            f"repair with `hermes-gateway profiles repair TENANT`"
        )
    return 0


def cmd_profiles_show(cfg: Config, args: argparse.Namespace) -> int:
    _check_owner(cfg)
    links = admin_links(cfg)
    info = find_tenant(cfg, args.tenant, links)
    key = profile_key(admin_keyring(cfg), info)
    stats = profile_stats(info.path, key)
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
        "sessions_detail": session_rows(info.path, key),
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
    print(f"provider:      {count(len(provider_files), 'file', 'files')}")
    print(f"sessions:      {stats['sessions']} ({stats['messages']} messages)")
    for s in data["sessions_detail"]:
        state = f"ended {_when(s['ended_at'])} ({s['end_reason']})" if s["ended_at"] else "live"
        print(f"  {s['id']}  {s['session_key']}  {s['message_count']} msgs  started {_when(s['started_at'])}  {state}")
    return 0


def cmd_profiles_path(cfg: Config, args: argparse.Namespace) -> int:
    """Print the profile directory (the HERMES_HOME) of a principal or tenant, e.g. for
    `HERMES_HOME=$(hermes-gateway profiles path telegram:111) hermes`."""
    links = admin_links(cfg)
    try:
        path = find_tenant(cfg, args.principal, links).path
    except AdminError:
        platform, sep, user = args.principal.partition(":")
        if not sep or not platform or not user:
            raise
        tenant = links.tenant_for(args.principal) or person_tenant_id(platform, user)
        path = tenant_dir(cfg.data_dir, tenant)
        print(
            f"note: {args.principal} has no profile yet; it will be created there on their first message",
            file=sys.stderr,
        )
    print(path.resolve())
    return 0


def cmd_profiles_export(cfg: Config, args: argparse.Namespace) -> int:
    _check_owner(cfg)
    links = admin_links(cfg)
    info = find_tenant(cfg, args.tenant, links)
    problem = profile_problem(info.path)
    if problem is not None:
        raise AdminError(
            f"{info.tenant_id} is damaged ({problem}); repair it first with "
            f"`hermes-gateway profiles repair {info.tenant_id}` (the damaged files are kept beside it)"
        )
    key = profile_key(admin_keyring(cfg), info)
    output = Path(args.output) if args.output else None
    if output is not None and args.output.endswith(("/", os.sep)):  # `-o new/dir/`: a directory to create
        private_mkdir(output)
    out = export_profile(cfg, info, output, links, key)
    print(f"exported {info.tenant_id} to {out}" + (" (decrypted: plain, as the Hermes CLI reads it)" if key else ""))
    return 0


def cmd_profiles_decrypt(cfg: Config, args: argparse.Namespace) -> int:
    """A plain copy of a profile in a new directory, for `HERMES_HOME=DIR hermes`
    (docs/privacy.md#exports-and-the-hermes-cli)."""
    _check_owner(cfg)
    info = find_tenant(cfg, args.tenant, admin_links(cfg))
    problem = profile_problem(info.path)
    if problem is not None:
        raise AdminError(f"{info.tenant_id} is damaged ({problem}); repair it first")
    key = profile_key(admin_keyring(cfg), info)
    files = decrypt_profile(info, key, Path(args.dir))
    print(
        f"wrote {info.tenant_id}'s profile, plain, to {args.dir}: {count(len(files), 'file', 'files')}"
        + ("" if key else " (it was not encrypted)")
        + "; it holds their messages and memory unencrypted: remove it when done"
    )
    return 0


def cmd_profiles_delete(cfg: Config, args: argparse.Namespace) -> int:
    _check_owner(cfg)
    links = admin_links(cfg)
    info = find_tenant(cfg, args.tenant, links)
    if gateway_running(cfg.data_dir):
        RunLock(cfg.data_dir).acquire("`profiles delete`")  # raises the explanation
    keyring = admin_keyring(cfg)
    stats = _stats(keyring, info)
    members = live_principals(links, info)
    print(
        f"This permanently deletes {info.tenant_id} ({', '.join(members) or 'no principals'}): "
        f"{count(stats['sessions'], 'session', 'sessions')}, {count(stats['messages'], 'message', 'messages')}, "
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
    if cfg.cluster.enabled:  # what the nodes share lives in PostgreSQL
        from gateway.cluster.erase import delete_tenant_everywhere

        report = delete_tenant_everywhere(cfg, info)
    else:
        report = delete_tenant(cfg, info, keyring=keyring)
    print(
        f"deleted {report.tenant_id}: {count(len(report.removed_dirs), 'profile directory', 'profile directories')}, "
        f"{count(len(report.links_removed), 'link entry', 'link entries')}, "
        f"{count(report.gateway_rows, 'gateway.db row', 'gateway.db rows')}"
        + (f", {count(report.shared_rows, 'PostgreSQL row', 'PostgreSQL rows')}" if cfg.cluster.enabled else "")
        + ("; its key was destroyed first, so its copies in backups cannot be read either" if keyring else "")
    )
    if report.pinned:
        print(
            f"note: {', '.join(report.pinned)} are linked in the config file (tenancy.identity_links); "
            "remove them there too."
        )
    return 0


def cmd_profiles_restore(cfg: Config, args: argparse.Namespace) -> int:
    _check_owner(cfg)
    info = restore_profile(cfg, Path(args.archive), force=args.force, links=admin_links(cfg))
    stats = profile_stats(info.path)  # an export is plain (restore refuses one into an encrypted data dir)
    print(
        f"restored {info.tenant_id} to {info.path}: {count(stats['sessions'], 'session', 'sessions')}, "
        f"{count(stats['messages'], 'message', 'messages')}"
    )
    return 0


def cmd_profiles_repair(cfg: Config, args: argparse.Namespace) -> int:
    _check_owner(cfg)
    info = find_tenant(cfg, args.tenant, admin_links(cfg))
    keyring = admin_keyring(cfg)
    try:
        healthy = profile_problem(info.path, deep=True, key=profile_key(keyring, info)) is None
    except VaultError:
        healthy = False  # the repair says why in one sentence (a missing or destroyed key is not mended)
    if healthy:
        print(f"{info.tenant_id} is not damaged; nothing to repair")
        return 0
    report = repair_profile(cfg, info, args.tenant, keyring)
    print(f"repaired {report.tenant_id} in {report.path}: {'; '.join(report.rebuilt) or 'layout'}")
    if report.set_aside:
        print(f"  damaged files kept beside it: {', '.join(report.set_aside)}")
    print(
        f"  state.db holds {count(report.messages, 'message', 'messages')}; "
        f"a running gateway answers the held messages at its next retry"
    )
    return 0


def cmd_backup(cfg: Config, args: argparse.Namespace) -> int:
    _check_owner(cfg)
    keyring = admin_keyring(cfg)
    dest = backup_data_dir(cfg.data_dir, Path(args.dest), keep=args.keep, keyring=keyring)
    print(f"backup written to {dest}")
    if keyring is not None:
        print(
            f"note: its profiles are encrypted; it holds no keyring: back up {keyring.directory} and the "
            "master key apart (docs/privacy.md#backups-and-restore)"
        )
    damaged = scan_damaged(cfg)
    if damaged:
        print(
            f"note: {', '.join(damaged)} {'is' if len(damaged) == 1 else 'are'} damaged and copied as found; "
            "repair with `hermes-gateway profiles repair TENANT`"
        )
    return 0


def cmd_restore(cfg: Config, args: argparse.Namespace) -> int:
    _check_owner(cfg)
    report = restore_data_dir(Path(args.src), cfg.data_dir, admin_master_key(cfg))
    left_out = report.get("not_restored", {})
    print(
        f"restored {count(report.get('profiles', 0) - len(left_out), 'profile', 'profiles')} into {cfg.data_dir} "
        f"(backup of {_when(report.get('created_at'))} UTC)"
    )
    for tenant, why in sorted(left_out.items()):
        print(f"not restored: {tenant}: {why}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add `profiles ...`, `backup` and `restore` to the command line."""
    tenant_help = "tenant id (telegram-111), principal (telegram:111) or profile directory name"
    json_help = "print JSON instead of a table"
    profiles = sub.add_parser("profiles", help="list, show, export, delete or restore tenant profiles")
    psub = profiles.add_subparsers(dest="profiles_command", required=True)
    p = psub.add_parser("list", help="every tenant: principals, sessions, messages, disk use, last activity")
    p.add_argument("--json", action="store_true", help=json_help)
    p.set_defaults(handler=guard(cmd_profiles_list))
    p = psub.add_parser("show", help="one tenant in detail (id, principal like telegram:111, or directory)")
    p.add_argument("tenant", help=tenant_help)
    p.add_argument("--json", action="store_true", help=json_help)
    p.set_defaults(handler=guard(cmd_profiles_show))
    p = psub.add_parser("path", help="print a tenant's profile directory, for HERMES_HOME=$(...)")
    p.add_argument("principal", help=tenant_help)
    p.set_defaults(handler=guard(cmd_profiles_path))
    p = psub.add_parser("export", help="one .tar.gz of everything a tenant owns (works while running)")
    p.add_argument("tenant", help=tenant_help)
    p.add_argument("-o", "--output", default=None, help="archive path or directory (default: current directory)")
    p.set_defaults(handler=guard(cmd_profiles_export))
    p = psub.add_parser("decrypt", help="a plain copy of a tenant's profile in a new directory (for the Hermes CLI)")
    p.add_argument("tenant", help=tenant_help)
    p.add_argument("dir", help="a new or empty directory to write the plain profile into")
    p.set_defaults(handler=guard(cmd_profiles_decrypt))
    p = psub.add_parser("delete", help="delete everything a tenant owns (gateway stopped; asks to confirm)")
    p.add_argument("tenant", help=tenant_help)
    p.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    p.set_defaults(handler=guard(cmd_profiles_delete))
    p = psub.add_parser("restore", help="put back a profile from a `profiles export` archive (gateway stopped)")
    p.add_argument("archive", help="a .tar.gz written by `profiles export`")
    p.add_argument(
        "--force",
        action="store_true",
        help="replace an existing profile of the same tenant, and restore links and pairings the "
        "archive's own tenant.json does not vouch for",
    )
    p.set_defaults(handler=guard(cmd_profiles_restore))
    p = psub.add_parser("repair", help="rebuild a damaged profile from its journals (works while running)")
    p.add_argument("tenant", help=tenant_help)
    p.set_defaults(handler=guard(cmd_profiles_repair))
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
    p.set_defaults(handler=guard(cmd_backup))
    p = sub.add_parser("restore", help="restore a `backup` into an empty data directory (gateway stopped)")
    p.add_argument("src", help="backup archive (or a backup directory of an older version)")
    p.set_defaults(handler=guard(cmd_restore))
