"""Profile directories (one HERMES_HOME per tenant) and their open/close lifecycle.

`ProfileManager` opens a profile lazily on first use, keeps at most `max_open` open (what
the memory budget and the descriptor limit allow, docs/concepts.md#open-profiles) and closes
the least recently used idle one when it needs room. Everything is per instance.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from datetime import tzinfo
from pathlib import Path
from typing import Protocol

import apsw

from agent.fileio import FileMemo, private_mkdir
from agent.memory import MemoryStore
from agent.model_choice import ModelChoice, read_model
from agent.persona import PersonaChoice, read_choice
from agent.profile import Profile, budget_memo, write_manifest, zone_memo
from agent.providers import make_provider
from agent.sessions import FsyncPolicy, SessionStore, StoragePool
from agent.sessions.db import JournalMode
from agent.sessions.errors import damaged_sqlite
from agent.sessions.journal import decode_line, place_of
from agent.vault import KEY_FILE, DataKey, ProfileFiles, TenantKeys, VaultError
from core.settings import DEFAULT_MEMORY_BUDGET_MIB
from tenancy.keys import tenant_dir, tenant_dir_name

SCHEMA_VERSION = 1
SQLITE_HEADER = b"SQLite format 3\0"
# What one open profile costs, measured (stdlib sqlite3, SQLite 3.40): its connection takes
# ~190 KiB once open (parsed schema with FTS5, lookaside, the WAL index mapping) and ~250 KiB
# after a few turns (prepared statements, cached pages: the page cache is capped at
# agent.sessions.db.PAGE_CACHE_KIB); in the gateway, live sessions and the rest included,
# 1,000 open profiles took 272 MiB (bench/gateway_bench.py, 1,000 x 5). And 5 descriptors
# (state.db, -wal, -shm, the journal, the profile lock).
PROFILE_COST_KIB = 272
# what SQLite3 Multiple Ciphers adds to an open encrypted profile (its cipher context and
# page buffers), measured: 302 vs 234 KiB per open store (docs/privacy.md#what-it-costs)
ENCRYPTED_EXTRA_KIB = 72
PROFILE_FDS = 5
FD_RESERVE = 256  # descriptors kept for everything else (sockets, gateway.db, logs): at most half the limit

log = logging.getLogger("hermes.profiles")


class ProfileDamaged(Exception):
    """A profile whose files cannot be opened as they are (`problem` says which and why);
    its lanes are held until `hermes-gateway profiles repair` (or the operator) fixes it."""

    def __init__(self, tenant_id: str, problem: str) -> None:
        super().__init__(f"profile {tenant_id} is damaged: {problem}")
        self.tenant_id, self.problem = tenant_id, problem


def manifest_problem(path: Path) -> str | None:
    """Why `path`/tenant.json cannot be used (None when it is absent or a JSON object
    whose principals are a list of strings)."""
    file = path / "tenant.json"
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except IsADirectoryError:
        return "tenant.json is a directory"
    except UnicodeDecodeError:
        return "tenant.json is not UTF-8 text"
    except json.JSONDecodeError as err:
        return f"tenant.json is not valid JSON ({err.msg} at line {err.lineno})"
    if not isinstance(data, dict):
        return f"tenant.json holds a JSON {type(data).__name__}, not an object"
    principals = data.get("principals", [])
    if not isinstance(principals, list) or not all(isinstance(p, str) for p in principals):
        return "tenant.json: principals is not a list of strings"
    return None


def profile_problem(path: Path, *, deep: bool = False, key: DataKey | None = None) -> str | None:
    """What is wrong with the profile directory `path`, or None. Cheap checks of the
    layout, tenant.json and state.db's header; `deep` adds SQLite's integrity_check
    (blocking: run it off the event loop). An encrypted profile's header is ciphertext:
    only `deep` with its `key` checks its state.db (docs/privacy.md#encryption-at-rest)."""
    if not path.exists():
        return None
    if not path.is_dir():
        return f"{path.name} is not a directory"
    for sub in ("memories", "sessions", "provider"):
        if (path / sub).exists() and not (path / sub).is_dir():
            return f"{sub}/ is not a directory"
    problem = manifest_problem(path)
    if problem is not None:
        return problem
    db = path / "state.db"
    if not db.exists():
        return None
    if not db.is_file():
        return "state.db is not a regular file"
    encrypted = (path / KEY_FILE).exists()
    with db.open("rb") as fh:
        header = fh.read(len(SQLITE_HEADER))
    if header and header != SQLITE_HEADER and not encrypted:
        return "state.db is not a SQLite database (damaged header)"
    if deep and header and (key is not None or not encrypted):
        try:
            # APSW, as the store: in the gateway this runs right before the store opens the
            # file, and one process keeps to one SQLite library per file (docs/concepts.md#session-storage)
            conn = apsw.Connection(str(db), flags=apsw.SQLITE_OPEN_READONLY)
            try:
                if key is not None:
                    conn.execute(key.db_pragma(), can_cache=False).fetchall()
                conn.set_busy_timeout(10000)
                verdict = str(conn.execute("PRAGMA integrity_check").fetchone()[0])  # type: ignore[index]
            finally:
                conn.close()
        except apsw.Error as err:
            return f"state.db cannot be read ({err})"
        if verdict != "ok":
            return f"state.db fails integrity_check ({verdict.splitlines()[0]})"
    return None


def tenant_id_of_dir(name: str) -> str | None:
    """The tenant id a profile directory name encodes (`tenancy.keys.tenant_dir_name`
    reversed), or None for a hashed name, which only its tenant.json can tell."""
    if not name.startswith("x-"):
        return None if name.startswith("h-") else name
    body, out, i = name[2:], bytearray(), 0
    while i < len(body):
        if body.startswith("__", i):
            out += b"_"
            i += 2
        elif body[i] == "_":
            try:
                out.append(int(body[i + 1 : i + 3], 16))
            except ValueError:
                return None
            i += 3
        else:
            out += body[i].encode()
            i += 1
    try:
        return out.decode("utf-8", "surrogatepass")
    except UnicodeDecodeError:
        return None


def journal_records(path: Path, key: DataKey | None = None) -> list[dict]:
    """Every whole JSON object line of the profile's journals, opened with `key` when
    sealed (blocking; for repairs and reports of a profile whose state.db cannot be read).
    VaultError, one sentence, for sealed lines without the key."""
    out: list[dict] = []
    sessions = path / "sessions"
    if not sessions.is_dir():
        return out
    for journal in sorted(sessions.glob("*.jsonl")):
        place = place_of(journal)
        with journal.open("rb") as fh:
            for line in fh:
                if not line.strip():
                    continue
                try:
                    data = decode_line(line.rstrip(b"\r\n"), key, place)
                except ValueError:
                    continue  # a torn or damaged line; reconciliation cuts it
                if isinstance(data, dict):
                    out.append(data)
    return out


def _damage_of(exc: BaseException) -> str | None:
    """The damage an open failure shows (SQLite finding a file that is not a sound
    database, a layout entry of the wrong type), or None for anything that may pass."""
    if isinstance(exc, VaultError):  # a destroyed, missing or wrong key: one sentence already
        return str(exc)
    if damaged_sqlite(exc):  # "file is not a database", "disk image is malformed"
        return f"state.db cannot be read ({exc})"
    if isinstance(exc, (NotADirectoryError, FileExistsError, IsADirectoryError)):
        return f"{Path(exc.filename).name if exc.filename else 'a file'} has the wrong type ({exc.strerror})"
    return None


def remove_principal(path: Path, principal: str) -> None:
    """Drop `principal` from the tenant.json at `path` (no-op if absent)."""
    try:
        manifest = json.loads((path / "tenant.json").read_text(encoding="utf-8"))
    except (FileNotFoundError, json.JSONDecodeError):
        return
    principals = manifest.get("principals", [])
    if principal in principals:
        manifest["principals"] = [p for p in principals if p != principal]
        write_manifest(path, manifest)


def ensure_profile_dir(data_dir: Path, tenant_id: str, kind: str) -> tuple[Path, set[str]]:
    """Create the profile layout for `tenant_id` if missing; returns its directory and the
    principals its tenant.json lists (blocking: run it off the event loop)."""
    path = tenant_dir(data_dir, tenant_id)
    for sub in ("memories", "sessions", "provider"):
        private_mkdir(path / sub)
    try:
        manifest = json.loads((path / "tenant.json").read_text(encoding="utf-8"))
    except FileNotFoundError:
        manifest = {
            "tenant_id": tenant_id,
            "kind": kind,
            "principals": [],
            "created_at": time.time(),
            "schema_version": SCHEMA_VERSION,
        }
        write_manifest(path, manifest)
    except json.JSONDecodeError:
        manifest = {}  # left for an operator to inspect, never overwritten here
    return path, set(manifest.get("principals", []))


def open_limit(
    max_open: int | None, memory_budget_mib: int, nofile: int | None = None, *, cost_kib: int = PROFILE_COST_KIB
) -> int:
    """How many profiles may stay open: as many as `memory_budget_mib` holds at
    `cost_kib` each (PROFILE_COST_KIB), within the descriptor limit `nofile` (RLIMIT_NOFILE's soft limit
    when None) and never more than `max_open` (an optional hard cap); at least 1."""
    if nofile is None:
        nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    limits = [memory_budget_mib * 1024 // cost_kib]
    if nofile != resource.RLIM_INFINITY:
        limits.append((nofile - min(FD_RESERVE, nofile // 2)) // PROFILE_FDS)
    if max_open is not None:
        limits.append(max_open)
    return max(1, min(limits))


class _Found(Exception):
    """Raised on the pool thread when the checks before an open find the directory damaged."""

    def __init__(self, problem: str) -> None:
        super().__init__(problem)
        self.problem = problem


def _writable(profile: Profile) -> bool:
    if profile.guard is None:
        return True
    try:
        profile.guard()
    except Exception:
        return False
    return True


class ProfileGate(Protocol):
    """Who may open a profile (cluster mode: the node holding the tenant's lease).

    `opening` is awaited before a profile is opened and returns the write guard its stores
    call before every write (raising to refuse); it raises itself to refuse the open.
    `closed` is awaited once the profile's stores are closed."""

    async def opening(self, tenant_id: str) -> Callable[[], None]: ...

    async def closed(self, tenant_id: str) -> None: ...


class ProfileManager:
    """Opens tenants' profiles on demand and closes idle ones beyond `max_open`."""

    def __init__(
        self,
        data_dir: Path,
        *,
        max_open: int | None = None,
        memory_budget_mib: int = DEFAULT_MEMORY_BUDGET_MIB,
        fsync: FsyncPolicy = "batch",
        memory_char_limit: int = 2200,
        user_char_limit: int = 1375,
        provider_kind: str = "",
        pool: StoragePool | None = None,
        gate: ProfileGate | None = None,
        journal_mode: JournalMode = "wal",
        keys: TenantKeys | None = None,
    ) -> None:
        """`max_open` caps the open profiles below what `memory_budget_mib` and the
        descriptor limit allow (`open_limit`). `gate` guards every open and write (cluster
        mode); `journal_mode` "delete" opens SQLite with a rollback journal, safe on a
        network filesystem (one host at a time). `keys` (storage.encryption per_tenant) keys
        every profile with its tenant's data key, the same cache the ingress seals messages
        with (docs/privacy.md#encryption-at-rest)."""
        self.data_dir = data_dir
        self.keys = keys if keys is not None else TenantKeys(None)
        self.keyring = self.keys.keyring
        self.gate = gate
        self.journal_mode: JournalMode = journal_mode
        self.pool = pool  # storage threads shared by every profile's SessionStore
        cost = PROFILE_COST_KIB + (ENCRYPTED_EXTRA_KIB if self.keys.on else 0)
        self.max_open = open_limit(max_open, memory_budget_mib, cost_kib=cost)
        by_budget = open_limit(max_open, memory_budget_mib, resource.RLIM_INFINITY, cost_kib=cost)
        if self.max_open < by_budget:
            log.warning(
                "the descriptor limit (RLIMIT_NOFILE %d) keeps at most %d profiles open, not the %d "
                "the memory budget allows: raise it (LimitNOFILE=) to serve more people without reopening",
                resource.getrlimit(resource.RLIMIT_NOFILE)[0],
                self.max_open,
                by_budget,
                extra={"event": "profiles_fd_limited"},
            )
        self._fsync = fsync
        self._memory_limits = (memory_char_limit, user_char_limit)
        self._provider_kind = provider_kind
        make_provider(provider_kind)  # fail at start-up, not at the first turn
        self._open: OrderedDict[str, Profile] = OrderedDict()
        self._opening: dict[str, asyncio.Lock] = {}
        self._closing: dict[str, asyncio.Task] = {}
        self._lock = asyncio.Lock()
        self.quarantined: dict[str, str] = {}  # tenant id -> what is damaged; its lanes wait
        # tenant id -> principals of a profile whose directory was checked and laid out in this
        # process: reopening it skips those checks. Single node only (cluster nodes share
        # data_dir: another node may have changed it meanwhile); evict() forgets it.
        self._known: dict[str, set[str]] = {}

    @property
    def open_count(self) -> int:
        return len(self._open)

    def _quarantine(self, tenant_id: str, problem: str) -> ProfileDamaged:
        """Note a damaged profile (said once, with the fix) and the error that holds its lanes."""
        if self.quarantined.get(tenant_id) != problem:
            log.error(
                "profile %s is damaged (%s): its messages stay pending and everyone else is served; "
                "repair it with `hermes-gateway profiles repair %s`",
                tenant_id,
                problem,
                tenant_id,
                extra={"event": "profile_quarantined", "tenant": tenant_id},
            )
        self.quarantined[tenant_id] = problem
        self._known.pop(tenant_id, None)  # checked again (deep) before it opens
        return ProfileDamaged(tenant_id, problem)

    async def quarantine_open(self, tenant_id: str, problem: str) -> None:
        """A turn found the open profile damaged: quarantine it and close it once idle, so
        the next turn reopens it through the checks (integrity_check included)."""
        self._quarantine(tenant_id, problem)
        async with self._lock:
            profile = self._open.get(tenant_id)
            if profile is None or profile.users:
                return
            del self._open[tenant_id]
        self._close_soon(profile)

    async def shed_idle(self) -> int:
        """Close every open profile nobody is using (a descriptor or memory limit was hit);
        how many."""
        async with self._lock:
            idle = [t for t, p in self._open.items() if p.users == 0]
            victims = [self._open.pop(t) for t in idle]
        for victim in victims:
            self._close_soon(victim)
        return len(victims)

    @asynccontextmanager
    async def use(self, tenant_id: str, *, kind: str = "person") -> AsyncIterator[Profile]:
        """Hold `tenant_id`'s profile open for the duration of the block."""
        profile = await self._acquire(tenant_id, kind)
        try:
            yield profile
        finally:
            profile.users -= 1
            profile.last_used = time.monotonic()

    def _reuse(self, tenant_id: str) -> Profile | None:
        """The open profile, marked in use and most recently used (call under `_lock`). One
        its gate no longer lets write (a lost lease) is closed instead, and opened afresh."""
        profile = self._open.get(tenant_id)
        if profile is not None and not _writable(profile):
            del self._open[tenant_id]
            self._close_soon(profile)
            return None
        if profile is not None:
            profile.users += 1
            self._open.move_to_end(tenant_id)
        return profile

    async def _acquire(self, tenant_id: str, kind: str) -> Profile:
        async with self._lock:
            profile = self._reuse(tenant_id)
            if profile is not None:
                return profile
            opening = self._opening.setdefault(tenant_id, asyncio.Lock())
        async with opening:
            async with self._lock:
                profile = self._reuse(tenant_id)  # opened by a concurrent caller meanwhile?
                if profile is not None:
                    return profile
                closing = self._closing.get(tenant_id)
            if closing is not None:  # an eviction of this very profile is finishing
                await asyncio.wait([closing])
            profile = await self._open_profile(tenant_id, kind)
            async with self._lock:
                profile.users += 1
                self._open[tenant_id] = profile
                self._opening.pop(tenant_id, None)
                for victim in self._pick_victims():
                    self._close_soon(victim)
            return profile

    def _pick_victims(self) -> list[Profile]:
        """Idle profiles beyond `max_open`, least recently used first (call under `_lock`)."""
        victims = []
        for tid in list(self._open):
            if len(self._open) <= self.max_open:
                break
            if self._open[tid].users == 0:
                victims.append(self._open.pop(tid))
        return victims

    def _close_soon(self, profile: Profile) -> None:
        """Close an evicted profile in the background; reopening it waits for this."""
        task = asyncio.create_task(self._close(profile))
        self._closing[profile.tenant_id] = task

    async def _close(self, profile: Profile) -> None:
        try:
            await profile.close()
        except Exception:
            log.exception("closing a profile failed")
        finally:
            if self._closing.get(profile.tenant_id) is asyncio.current_task():
                del self._closing[profile.tenant_id]

    async def _open_profile(self, tenant_id: str, kind: str) -> Profile:
        gate = self.gate
        guard = await gate.opening(tenant_id) if gate is not None else None
        try:
            if guard is not None:
                guard()
            known = self._known.get(tenant_id)
            # tenant_dir's check (it resolves the path) runs on the pool thread, in `_checks`
            path = self.data_dir / "profiles" / tenant_dir_name(tenant_id)
            found: list[set[str]] = []
            persona: list[PersonaChoice] = []
            model: list[ModelChoice] = []
            checks = None if known is not None else self._checks(tenant_id, kind, path, found)
            opened: list[ProfileFiles] = []

            def before() -> DataKey | None:  # on the pool thread, in the open's own job (no hop of its own)
                if checks is not None:
                    checks()
                # an interrupted rekey finished first, while nothing has the profile open
                # (docs/privacy.md#delete-is-crypto-shredding)
                self.keys.rekey(tenant_id, path)
                # the key first: every file below is read through it (docs/privacy.md#encryption-at-rest)
                files = self.keys.files(tenant_id, path)
                opened.append(files)
                persona.append(read_choice(files))
                model.append(read_model(files))
                memos.append((zone_memo(files), budget_memo(files)))
                memos[0][1].load()
                if kind == "person":  # a chat's budget days are UTC's
                    memos[0][0].load()
                return files.key

            memos: list[tuple[FileMemo[tzinfo], FileMemo[dict[str, float | None]]]] = []
            sessions = SessionStore(
                path,
                fsync=self._fsync,
                pool=self.pool,
                guard=guard,
                journal_mode=self.journal_mode,
                profile_lock=gate is None,  # under a gate its lease is the one-writer rule
            )
            try:
                await sessions.open(before=before)
            except _Found as damaged:
                raise self._quarantine(tenant_id, damaged.problem) from None
            except Exception as exc:
                damage = _damage_of(exc)
                if damage is None:
                    raise
                raise self._quarantine(tenant_id, damage) from exc
        except BaseException:
            if gate is not None:
                await gate.closed(tenant_id)
            raise
        principals = known if known is not None else found[0]
        if gate is None:
            self._known[tenant_id] = principals
        mem_limit, user_limit = self._memory_limits
        files = opened[0] if opened else ProfileFiles(path, self.keys.cached(tenant_id))
        memory = MemoryStore(path, mem_limit, user_limit, guard=guard, files=files)
        provider = make_provider(self._provider_kind)
        on_close = (lambda: gate.closed(tenant_id)) if gate is not None else None
        profile = Profile(
            tenant_id=tenant_id,
            path=path,
            sessions=sessions,
            memory=memory,
            provider=provider,
            guard=guard,
            on_close=on_close,
            persona_choice=persona[0] if persona else None,
            model_choice=model[0] if model else None,
            zone_file=memos[0][0] if memos else None,
            budget_file=memos[0][1] if memos else None,
            files=files,
        )
        if provider is not None:
            try:
                await provider.initialize(tenant_id, path, files=files)
            except BaseException:
                await profile.close()
                raise
        if self.quarantined.pop(tenant_id, None) is not None:
            log.info(
                "profile %s opens again; its held messages are answered now",
                tenant_id,
                extra={"event": "profile_released", "tenant": tenant_id},
            )
        profile.principals = principals  # the same set as in _known: add_principal updates both
        return profile

    def _checks(self, tenant_id: str, kind: str, path: Path, found: list[set[str]]) -> Callable[[], None]:
        """The checks of a profile directory not yet known in this process, run on the pool
        thread right before its store opens (no hop of their own): the path stays in
        `profiles/`, the cheap damage checks (integrity_check too for a quarantined profile),
        the layout and tenant.json created if missing. Its principals go into `found`; a
        damaged directory raises `_Found`. Only the caller's objects are touched."""
        deep = tenant_id in self.quarantined  # it opens again only once integrity_check passes too

        def checks() -> None:
            tenant_dir(self.data_dir, tenant_id)  # raises if the directory leads out of profiles/
            key = self.keys.key_for(tenant_id, path) if deep else None  # an encrypted state.db's check needs it
            problem = profile_problem(path, deep=deep, key=key)
            if problem is not None:
                raise _Found(problem)
            found.append(ensure_profile_dir(self.data_dir, tenant_id, kind)[1])

        return checks

    def idle(self, for_s: float) -> list[str]:
        """Open profiles nobody used for `for_s` seconds (cluster mode closes them to free
        their tenant leases for other nodes)."""
        cutoff = time.monotonic() - for_s
        return [t for t, p in self._open.items() if p.users == 0 and p.last_used < cutoff]

    async def evict(self, tenant_id: str) -> bool:
        """Close a profile now (e.g. before deleting it); False if it is in use. Its
        directory is checked again when it next opens."""
        self._known.pop(tenant_id, None)
        self.keys.forget(tenant_id)
        async with self._lock:
            profile = self._open.get(tenant_id)
            closing = self._closing.get(tenant_id)
        if profile is None:
            if closing is not None:
                await asyncio.wait([closing])
            return True
        async with self._lock:
            profile = self._open.get(tenant_id)
            if profile is None:
                return True
            if profile.users:
                return False
            del self._open[tenant_id]
        await profile.close()
        return True

    async def discard_principal(self, tenant_id: str, principal: str) -> None:
        """Remove `principal` from a tenant's tenant.json (and from its open profile), e.g.
        after /unlink, so tools never resolve the principal to this tenant again."""
        async with self._lock:
            profile = self._open.get(tenant_id)
            if profile is not None:
                profile.principals.discard(principal)
            self._known.get(tenant_id, set()).discard(principal)
        path = tenant_dir(self.data_dir, tenant_id)
        await asyncio.to_thread(remove_principal, path, principal)

    async def close_all(self) -> None:
        async with self._lock:
            profiles = list(self._open.values())
            self._open.clear()
            closing = list(self._closing.values())
        if closing:
            await asyncio.wait(closing)
        for profile in profiles:
            await profile.close()
