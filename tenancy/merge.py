"""The file-level merge of profiles when accounts are linked (docs/operator-guide.md#linking-your-accounts).

Runs in a thread, on closed profiles: the linking flow (gateway/linking.py) closes every
profile involved, merges into a staging copy of the target, checks it opens and swaps it
in. Journals are copied byte for byte, state.db rows (sessions, messages with FTS, routes,
journal offsets) with SQLite ATTACH, MEMORY.md and USER.md entry by entry (deduplicated; what
does not fit is set aside in `merged-overflow.md`), visibility marks on the safe side, and
every other file copied (`*.jsonl` appended). Nothing here knows about chats or the gateway.

Encrypted profiles (docs/privacy.md#encryption-at-rest): every record of a source is opened
with the source's key and sealed again with the target's (a record is bound to its tenant),
and the source's state.db is attached with its own key.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import time
from collections.abc import Callable, Sequence, Set
from dataclasses import dataclass, field
from pathlib import Path

import apsw

from agent.fileio import atomic_write, fsync_dir, open_private, private_mkdir, write_private
from agent.memory import ENTRY_DELIMITER, parse_entries
from agent.memory_files import BASELINE_FILE, Baselines, digest
from agent.model_choice import FILE as MODEL_FILE
from agent.model_choice import read_model, write_model
from agent.persona import FILE as PERSONA_FILE
from agent.persona import read_choice, write_choice
from agent.profile import write_manifest
from agent.reminders import FILE as REMINDERS_FILE
from agent.reminders import merge_files as merge_reminders
from agent.sessions.journal import decode_line, encode_lines, place_of
from agent.vault import KEY_FILE, DataKey, ProfileFiles, is_sealed, shred_slot
from agent.visibility import VISIBILITY_FILE, Marks, entry_key
from tenancy.profiles import SCHEMA_VERSION

log = logging.getLogger("hermes.linking")

RETIRED_MARKER = "merged-into.json"  # in a merged-away profile until it is removed (`profiles list` shows it)
PENDING_MARKER = "link-pending.json"  # in a swapped-in merged profile until its link is recorded
OVERFLOW_FILE = "merged-overflow.md"
_MEMORY_FILES = {"memory": "MEMORY.md", "user": "USER.md"}


def init_profile(path: Path, tenant_id: str) -> None:
    for sub in ("memories", "sessions", "provider"):
        private_mkdir(path / sub)
    write_manifest(
        path,
        {
            "tenant_id": tenant_id,
            "kind": "person",
            "principals": [],
            "created_at": time.time(),
            "schema_version": SCHEMA_VERSION,
        },
    )


class Swap:
    """Staging put in place of a target profile: the old one is kept aside (`.link-old-`)
    until the link is recorded, so a failure can put it back."""

    def __init__(self, target: Path, old: Path | None) -> None:
        self.target, self.old = target, old

    @classmethod
    def apply(cls, staging: Path, target: Path) -> Swap:
        old = None
        if target.exists():
            old = target.parent / f".link-old-{target.name}"
            shutil.rmtree(old, ignore_errors=True)
            os.replace(target, old)
        os.replace(staging, target)
        fsync_dir(target.parent)
        return cls(target, old)

    def __call__(self) -> None:
        """Undo: the profile from before goes back in place."""
        shutil.rmtree(self.target, ignore_errors=True)
        if self.old is not None:
            os.replace(self.old, self.target)
        fsync_dir(self.target.parent)

    def forget(self) -> None:
        """The link is recorded: the merged profile stays, the one from before goes."""
        (self.target / PENDING_MARKER).unlink(missing_ok=True)
        if self.old is not None:
            shutil.rmtree(self.old, ignore_errors=True)


def clean_staging(profiles: Path, older_than_s: float = 3600.0, keep: Set[str] = frozenset()) -> None:
    """Remove staging directories a crash mid-merge left behind; a profile set aside by a
    swap that a crash interrupted goes back in place (not those of merges in `keep`)."""
    if not profiles.is_dir():
        return
    for old in profiles.glob(".link-old-*"):
        target = profiles / old.name[len(".link-old-") :]
        if target.name in keep:
            continue
        if target.exists():
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(old, target)
    now = time.time()
    for path in profiles.glob(".link-*"):
        try:
            if now - path.stat().st_mtime > older_than_s:
                shutil.rmtree(path, ignore_errors=True)
        except OSError:
            pass


def retire(path: Path, into: str) -> None:
    """Remove a personal profile merged into `into` (marker first, so a crash midway leaves
    a profile `profiles list` shows as merged and `profiles delete` of the link removes);
    its keyring slot goes before its files, as in a delete."""
    if not path.exists():
        return
    marker = {"tenant": into, "at": time.time()}
    write_private(path / RETIRED_MARKER, json.dumps(marker))
    shred_slot(path.parent.parent, path)
    shutil.rmtree(path)


class _Flock:
    def __init__(self, path: Path) -> None:
        private_mkdir(path.parent)
        self.path = path
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)

    def __enter__(self) -> _Flock:
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(self.fd)
            raise RuntimeError(f"{self.path.parent.parent} is open elsewhere") from None
        return self

    def __exit__(self, *exc: object) -> None:
        os.close(self.fd)


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass(frozen=True)
class MergeKeys:
    """The data keys of a merge: the target's (its records are sealed again with it) and
    each source's by path; None for a plain profile."""

    target: DataKey | None = None
    sources: dict[Path, DataKey | None] = field(default_factory=dict)


def merge_profiles(
    target: Path,
    sources: list[Path],
    limits: dict[str, int],
    principals: list[str],
    keys: MergeKeys | None = None,
) -> None:
    """Merge closed profiles `sources` into the closed profile `target` (idempotent)."""
    keys = keys or MergeKeys()
    with _Flock(target / "sessions" / ".lock"):
        for src in sources:
            src_key = keys.sources.get(src)
            with _Flock(src / "sessions" / ".lock"):
                _merge_journals(src, target, src_key, keys.target)
                _merge_db(src, target, src_key, keys.target)
                _merge_files(src, target, src_key, keys.target)
        # the stores' own files, opened with each profile's key and sealed again with the target's
        into = ProfileFiles(target, keys.target)
        froms = [ProfileFiles(src, keys.sources.get(src)) for src in sources]
        merge_memory(into, froms, limits)
        merge_reminders(into, froms)
        merge_personas(into, froms)
        merge_models(into, froms)
        manifest = json.loads((target / "tenant.json").read_text(encoding="utf-8"))
        have = manifest.setdefault("principals", [])
        for src in sources:
            try:
                theirs = json.loads((src / "tenant.json").read_text(encoding="utf-8")).get("principals", [])
            except (OSError, ValueError):
                theirs = []
            for p in [*theirs, *principals]:
                if p not in have:
                    have.append(p)
        write_manifest(target, manifest)


def _lines(data: bytes, key: DataKey | None, place: str) -> list[dict]:
    """A journal's whole lines (a torn or damaged one left out, as reconciliation cuts it)."""
    out = []
    for raw in data.split(b"\n")[:-1]:
        if raw.strip():
            try:
                obj = decode_line(raw, key, place)
            except ValueError:
                continue
            if isinstance(obj, dict):
                out.append(obj)
    return out


def _merge_journals(src: Path, target: Path, src_key: DataKey | None = None, key: DataKey | None = None) -> None:
    out_dir = target / "sessions"
    for journal in sorted((src / "sessions").glob("*.jsonl")):
        dest = out_dir / journal.name
        if src_key is not None or key is not None:  # compared line by line, sealed again for the target
            _merge_sealed_journal(journal, dest, src_key, key)
            continue
        data = journal.read_bytes()
        if dest.exists():
            have = dest.read_bytes()
            if have == data or not data.startswith(have):
                if have != data:
                    log.warning("link: journal %s differs in both profiles; keeping the target's", journal.name)
                continue
        atomic_write(dest, data)


def _merge_sealed_journal(journal: Path, dest: Path, src_key: DataKey | None, key: DataKey | None) -> None:
    place = place_of(journal)
    lines = _lines(journal.read_bytes(), src_key, place)
    if dest.exists():
        have = _lines(dest.read_bytes(), key, place)
        if have == lines or lines[: len(have)] != have:
            if have != lines:
                log.warning("link: journal %s differs in both profiles; keeping the target's", journal.name)
            return
    atomic_write(dest, encode_lines(lines, key, place))


def _columns(conn: apsw.Connection, schema: str, table: str) -> list[str]:
    return [str(r[1]) for r in conn.execute(f"PRAGMA {schema}.table_info({table})")]


def _merge_db(src: Path, target: Path, src_key: DataKey | None = None, key: DataKey | None = None) -> None:
    if not (src / "state.db").exists():
        return
    # APSW, as the store: the merge runs inside the gateway, which keeps to one SQLite
    # library per state.db (docs/concepts.md#session-storage)
    conn = apsw.Connection(str(target / "state.db"))
    try:
        if key is not None:
            conn.execute(key.db_pragma()).fetchall()
        conn.set_busy_timeout(30000)
        # an attached file without KEY would take the main file's key: a plain one says ''
        attach_key = src_key.db_key() if src_key is not None else ""
        conn.execute("ATTACH DATABASE ? AS src KEY ?", (str(src / "state.db"), attach_key)).fetchall()
        conn.execute("BEGIN IMMEDIATE")
        try:
            for table, conflict in (("sessions", "REPLACE"), ("routes", "IGNORE"), ("journal_offsets", "REPLACE")):
                cols = [c for c in _columns(conn, "main", table) if c in _columns(conn, "src", table)]
                names = ", ".join(f'"{c}"' for c in cols)
                conn.execute(f"INSERT OR {conflict} INTO main.{table}({names}) SELECT {names} FROM src.{table}")
            cols = [
                c for c in _columns(conn, "main", "messages") if c != "id" and c in _columns(conn, "src", "messages")
            ]
            names = ", ".join(f'"{c}"' for c in cols)
            conn.execute(
                f"INSERT INTO main.messages({names}) SELECT {names} FROM src.messages WHERE true ORDER BY id "
                "ON CONFLICT(uid) DO UPDATE SET active=excluded.active, compacted=excluded.compacted"
            )
            missing = conn.execute(
                "SELECT count(*) FROM src.messages WHERE uid NOT IN (SELECT uid FROM main.messages)"
            ).fetchone()[0]  # type: ignore[index]
            if missing:
                raise RuntimeError(f"{missing} message(s) did not copy")
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("DETACH DATABASE src")
    finally:
        conn.close()


def _merge_files(src: Path, target: Path, src_key: DataKey | None = None, key: DataKey | None = None) -> None:
    """Provider files, exports and anything else: copy what's missing, append *.jsonl, keep
    both when two different files have one name. Sealed files are compared and written as
    their plaintext, sealed again with the target's key."""

    def plain(data: bytes, k: DataKey | None, place: str) -> bytes:
        return k.open(data, place) if k is not None and is_sealed(data) else data

    def sealed(data: bytes, place: str) -> bytes:
        return key.seal(data, place) if key is not None else data

    skip_top = {
        "tenant.json",
        KEY_FILE,  # the target keeps its own key
        "state.db",
        "state.db-wal",
        "state.db-shm",
        "state.db-journal",
        RETIRED_MARKER,
        PENDING_MARKER,
        REMINDERS_FILE,  # merged entry by entry (agent/reminders.py)
        PERSONA_FILE,  # one choice wins (merge_personas)
        MODEL_FILE,  # one choice wins (merge_models)
        f".{REMINDERS_FILE}.lock",
    }
    for root, dirs, files in os.walk(src):
        dirs[:] = [d for d in dirs if not os.path.islink(os.path.join(root, d))]
        for name in files:
            full = Path(root) / name
            rel = full.relative_to(src)
            if (
                (len(rel.parts) == 1 and name in skip_top)
                or name == ".lock"
                or name.endswith(".tmp")
                or full.is_symlink()
                or rel.parts[0] == "sessions"
                or (rel.parts[0] == "memories" and name in (*_MEMORY_FILES.values(), VISIBILITY_FILE, BASELINE_FILE))
            ):
                continue
            dest = target / rel
            private_mkdir(dest.parent)
            place = str(rel)
            data = full.read_bytes()
            if src_key is not None or key is not None:
                data = plain(data, src_key, place)
            if not dest.exists():
                write_private(dest, sealed(data, place) if src_key is not None or key is not None else data)
            elif src_key is not None or key is not None:
                _merge_sealed_file(target, rel, data, plain(dest.read_bytes(), key, place), sealed, f".from-{src.name}")
            elif name.endswith(".jsonl"):
                have = dest.read_bytes()
                if data and data not in have:
                    with open_private(dest, "ab") as fh:
                        if have and not have.endswith(b"\n"):
                            fh.write(b"\n")
                        fh.write(data)
            elif dest.read_bytes() != data:
                alt = dest.with_name(f"{dest.stem}.from-{src.name}{dest.suffix}")
                if not alt.exists():
                    write_private(alt, data)
            _fsync_file(dest)


def _merge_sealed_file(
    target: Path, rel: Path, data: bytes, have: bytes, seal: Callable[[bytes, str], bytes], tag: str
) -> None:
    """`_merge_files` on plaintexts: *.jsonl appended, another file kept beside (`tag`)."""
    dest = target / rel
    if dest.name.endswith(".jsonl"):
        if data and data not in have:
            joined = have + (b"\n" if have and not have.endswith(b"\n") else b"") + data
            atomic_write(dest, seal(joined, str(rel)))
    elif have != data:
        alt = rel.with_name(f"{rel.stem}{tag}{rel.suffix}")
        if not (target / alt).exists():
            write_private(target / alt, seal(data, str(alt)))


def merge_personas(target: ProfileFiles | Path, sources: Sequence[ProfileFiles | Path]) -> ProfileFiles | Path | None:
    """One persona choice for the merged profile: the last source's that has one (the account
    that joins last, the one linking), else the target's own. Returns the source that won."""
    for src in reversed(sources):
        choice = read_choice(src)
        if not choice.empty:
            write_choice(target, choice)
            return src
    return None


def merge_models(target: ProfileFiles | Path, sources: Sequence[ProfileFiles | Path]) -> ProfileFiles | Path | None:
    """One model for the merged profile: the last source's choice (the account that joins
    last, the one that entered the code), else the target's own. Returns the source that won."""
    for src in reversed(sources):
        choice = read_model(src)
        if choice.name is not None:
            write_model(target, choice)
            return src
    return None


def combine_entries(lists: list[list[str]], limit: int, note_date: str) -> tuple[list[str], list[str]]:
    """Merge entry lists (deduplicated, in order); when over `limit`, set aside the oldest
    entries of whichever side is larger and put one note entry first. Returns (kept, dropped)."""
    seen: set[str] = set()
    items: list[tuple[int, str]] = []
    for i, entries in enumerate(lists):
        for e in entries:
            if e not in seen:
                seen.add(e)
                items.append((i, e))

    def size(entries: list[str]) -> int:
        return len(ENTRY_DELIMITER.join(entries))

    dropped: list[str] = []

    def note() -> str:
        n = len(dropped)
        return (
            f"(Accounts linked {note_date}: {n} older entr{'y' if n == 1 else 'ies'} did not fit and were set aside.)"
        )

    while items and size(([note()] if dropped else []) + [e for _, e in items]) > limit:
        sides: dict[int, int] = {}
        for i, e in items:
            sides[i] = sides.get(i, 0) + len(e)
        side = max(sides, key=lambda k: (sides[k], -k))
        idx = next(j for j, (i, _) in enumerate(items) if i == side)
        dropped.append(items.pop(idx)[1])
    kept = [e for _, e in items]
    if dropped and size([note(), *kept]) <= limit:
        kept = [note(), *kept]
    return kept, dropped


def merge_memory(target: ProfileFiles, sources: Sequence[ProfileFiles], limits: dict[str, int]) -> None:
    """Memory and user-profile entries of every source into the target's, within its limits;
    what does not fit is set aside in memories/merged-overflow.md (sealed like the rest)."""
    mem_dir = target.path("memories")
    private_mkdir(mem_dir)
    today = time.strftime("%Y-%m-%d", time.gmtime())
    fd = os.open(mem_dir / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        source_marks = [Marks(f.path("memories"), f).load() for f in (target, *sources)]
        marks = dict(source_marks[0])
        for target_name, fname in _MEMORY_FILES.items():
            lists = []
            for f in (target, *sources):
                try:
                    lists.append(parse_entries(f.read_text(f"memories/{fname}")))
                except FileNotFoundError:
                    lists.append([])
            if not any(lists[1:]):
                continue
            kept, dropped = combine_entries(lists, limits[target_name], today)
            data = ENTRY_DELIMITER.join(kept).encode("utf-8")
            target.write_bytes(f"memories/{fname}", data)
            Baselines(mem_dir, target).set(fname, digest(data))  # the merge is the store's own write, not drift
            marks[target_name] = combine_marks(target_name, kept, lists, source_marks)
            if dropped:
                place = f"memories/{OVERFLOW_FILE}"
                try:
                    before = target.read_text(place)
                except FileNotFoundError:
                    before = ""
                section = f"## {fname}, set aside when accounts were linked on {today}\n\n"
                target.write_text(place, before + section + ENTRY_DELIMITER.join(dropped) + "\n\n")
        Marks(mem_dir, target).save(marks)  # after the memory files: a crash in between leaves entries private
    finally:
        os.close(fd)


def combine_marks(
    target: str, kept: list[str], lists: list[list[str]], marks: list[dict[str, dict[str, str]]]
) -> dict[str, str]:
    """The visibility marks of merged entries: an entry stays shared when every profile that
    held it had it shared (one private copy keeps it private: the safe side)."""
    out: dict[str, str] = {}
    for entry in kept:
        key = entry_key(target, entry)
        holders = [m.get(target, {}) for m, entries in zip(marks, lists, strict=False) if entry in entries]
        if holders and all(h.get(key) == "shared" for h in holders):
            out[key] = "shared"
    return out
