"""Built-in file memory of one tenant profile (Hermes `memory` tool semantics).

Two stores under `<profile_dir>/memories/`: MEMORY.md (the agent's notes) and USER.md
(who the user is), entries separated by ENTRY_DELIMITER. The system prompt gets a
frozen `MemorySnapshot` taken at session start; tool writes go to disk at once.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import logging
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from agent import visibility
from agent.memory_approval import PendingWrites
from agent.memory_files import Baselines, UndecodableFile, backup, decode, digest, read_file
from agent.threats import first_threat
from agent.vault import ProfileFiles
from agent.visibility import PRIVATE_CHAT, Scope

log = logging.getLogger(__name__)

ENTRY_DELIMITER = "\n§\n"
MEMORY_BLOCK_HEADERS = {
    "memory": "MEMORY (your personal notes)",
    "user": "USER PROFILE (who the user is)",
}
TARGETS: tuple[str, ...] = ("memory", "user")
ACTIONS: tuple[str, ...] = ("add", "replace", "remove")
_FILES = MappingProxyType({"memory": "MEMORY.md", "user": "USER.md"})
_SEPARATOR = "═" * 46
_PREVIEW = 80

Result = dict[str, Any]
# Write approval (`memory.write_approval: stage`): takes a validated tool write instead of
# the store: (action, target, content, old_text) -> the tool result.
Stage = Callable[[str, str, "str | None", "str | None"], Awaitable[dict[str, Any]]]
# A mutation gets the fresh entries (read under the lock) and returns the new list
# (None = do not write) together with the result for the caller.
_Mutation = Callable[[list[str]], tuple[list[str] | None, Result]]


def _joined_len(entries: list[str] | tuple[str, ...]) -> int:
    return len(ENTRY_DELIMITER.join(entries))


def _pct(current: int, limit: int) -> int:
    return min(100, current * 100 // limit) if limit > 0 else 0


def _preview(entry: str) -> str:
    flat = " ".join(entry.split())
    return flat[:_PREVIEW] + ("..." if len(flat) > _PREVIEW else "")


def _withheld(entry: str) -> str:
    """The entry, or a placeholder when it fails the threat scan."""
    reason = first_threat(entry)
    return entry if reason is None else f"[entry withheld: {reason}]"


def parse_entries(raw: str) -> list[str]:
    """Split file text into stripped entries, dropping empties and exact duplicates."""
    raw = raw.replace("\r\n", "\n")
    return list(dict.fromkeys(e.strip() for e in raw.split(ENTRY_DELIMITER) if e.strip()))


def _only_lines_added(raw: bytes | None, base: str, max_lines: int = 120) -> bool:
    """The file differs from what the store last wrote (digest `base`) only by lines typed
    into it without an entry delimiter: dropping one run of such lines gives back `base`."""
    lines = decode(raw, strict=False).replace("\r\n", "\n").split("\n")
    if len(lines) > max_lines:
        return False
    bare = ENTRY_DELIMITER.strip()
    for start in range(len(lines)):
        for end in range(start + 1, len(lines) + 1):
            if lines[end - 1].strip() == bare:
                break  # a run never holds a delimiter line
            rest = "\n".join(lines[:start] + lines[end:])
            if digest(ENTRY_DELIMITER.join(parse_entries(rest)).encode("utf-8")) == base:
                return True
    return False


def _fail(error: str, **extra: Any) -> Result:
    return {"success": False, "error": error, **extra}


@dataclass(frozen=True)
class MemorySnapshot:
    """Both stores as they were at session start (threat-scanned)."""

    memory: tuple[str, ...] = ()
    user: tuple[str, ...] = ()
    keys: frozenset[str] = frozenset()  # visibility.entry_key of every entry included
    # the same keys per store, in file order (an answer's provenance names entries by them)
    memory_keys: tuple[str, ...] = ()
    user_keys: tuple[str, ...] = ()

    @property
    def is_empty(self) -> bool:
        return not self.memory and not self.user

    def render(self, memory_char_limit: int = 2200, user_char_limit: int = 1375) -> str:
        """The memory block for the system prompt; '' when both stores are empty."""
        blocks = [
            _render_block(target, entries, limit)
            for target, entries, limit in (
                ("memory", self.memory, memory_char_limit),
                ("user", self.user, user_char_limit),
            )
            if entries
        ]
        return "\n\n".join(blocks)


def _render_block(target: str, entries: tuple[str, ...], limit: int) -> str:
    content = ENTRY_DELIMITER.join(entries)
    current = len(content)
    cap = max(limit * 2, 4000)  # a hand-edited, oversized file must not flood the prompt
    if current > cap:
        head, tail = int(cap * 0.7), int(cap * 0.2)
        content = (
            f"{content[:head]}\n\n[... {current - head - tail:,} chars truncated: memory over "
            f"budget; consolidate with memory(action=replace/remove) ...]\n\n{content[-tail:]}"
        )
    over = " ⚠ OVER BUDGET" if current > limit else ""
    header = f"{MEMORY_BLOCK_HEADERS[target]} [{_pct(current, limit)}% — {current:,}/{limit:,} chars{over}]"
    return f"{_SEPARATOR}\n{header}\n{_SEPARATOR}\n{content}"


class MemoryStore:
    """MEMORY.md / USER.md of one profile, safe across tasks and processes."""

    def __init__(
        self,
        profile_dir: Path,
        memory_char_limit: int = 2200,
        user_char_limit: int = 1375,
        *,
        read_only: bool = False,
        scope: Scope = PRIVATE_CHAT,
        guard: Callable[[], None] | None = None,
        files: ProfileFiles | None = None,
    ) -> None:
        """`guard` is called before a file is written and may raise to refuse it (cluster
        mode: this node no longer holds the tenant's lease). `files`: the profile's files,
        sealed with the tenant's key when it is encrypted (docs/privacy.md#encryption-at-rest)."""
        self.profile_dir = Path(profile_dir)
        self.files = files if files is not None else ProfileFiles(self.profile_dir)
        self.guard = guard
        self.memory_dir = self.profile_dir / "memories"
        self.memory_char_limit = memory_char_limit
        self.user_char_limit = user_char_limit
        self.read_only = read_only
        self.scope = scope  # which entries this view sees and how its writes are marked
        self._lock = asyncio.Lock()

    # -- paths and limits ------------------------------------------------------

    def path_for(self, target: str) -> Path:
        return self.memory_dir / _FILES[self._check_target(target)]

    def _place(self, target: str) -> str:
        return f"{self.memory_dir.name}/{_FILES[self._check_target(target)]}"

    def marks(self) -> visibility.Marks:
        """The visibility marks of this profile's entries."""
        return visibility.Marks(self.memory_dir, self.files)

    def pending_writes(self) -> PendingWrites:
        """The queue of writes waiting for the person's approval."""
        return PendingWrites(self.memory_dir, self.files)

    @property
    def lock_path(self) -> Path:
        return self.memory_dir / ".lock"

    def char_limit(self, target: str) -> int:
        return self.memory_char_limit if self._check_target(target) == "memory" else self.user_char_limit

    @staticmethod
    def _check_target(target: object) -> str:
        if target not in TARGETS:
            raise ValueError(f"Unknown target {target!r}. Use 'memory' or 'user'.")
        return str(target)

    def _usage(self, target: str, entries: list[str]) -> str:
        return f"{_joined_len(entries)}/{self.char_limit(target)}"

    # -- reads -------------------------------------------------------------------

    async def load_snapshot(self) -> MemorySnapshot:
        """Frozen, threat-scanned copy of both stores (the entries this scope sees)."""
        mem, user = await asyncio.to_thread(lambda: (self._visible("memory"), self._visible("user")))
        memory_keys = tuple(visibility.entry_key("memory", e) for e in mem)
        user_keys = tuple(visibility.entry_key("user", e) for e in user)
        return MemorySnapshot(
            memory=tuple(_withheld(e) for e in mem),
            user=tuple(_withheld(e) for e in user),
            keys=frozenset(memory_keys + user_keys),
            memory_keys=memory_keys,
            user_keys=user_keys,
        )

    async def entries(self, target: str) -> list[str]:
        """Live entries of `target` this scope sees, read from disk (unscanned)."""
        self._check_target(target)
        return await asyncio.to_thread(self._visible, target)

    async def set_visibility(self, target: str, entry: str, value: visibility.Visibility) -> bool:
        """Mark one entry private or shared (/memory share|unshare); False when it is gone."""
        self._check_target(target)
        async with self._lock:
            return await asyncio.to_thread(
                visibility.set_mark, self.memory_dir, target, entry, value, self._read_entries, self.files
            )

    async def forget_entry(self, target: str, entry: str) -> bool:
        """Remove the entry exactly equal to `entry` (/forget N); False when it is gone."""
        if self.read_only:
            return False
        result = await self._write(
            self._check_target(target),
            lambda entries: (
                ([e for e in entries if e != entry], {"success": True})
                if entry in entries
                else (None, {"success": False})
            ),
            force=True,
        )  # an explicit erase by the person
        return bool(result.get("success"))

    def _visible(self, target: str) -> list[str]:
        entries = self._read_entries(target)
        if self.scope.sees_private:
            return entries
        return visibility.visible(self.scope, target, entries, self.marks().load())

    def _dir_ok(self) -> bool:
        """False when the memories dir is a symlink (it could point outside the profile)."""
        if self.memory_dir.is_symlink():
            log.warning("memory dir %s is a symlink; ignoring it", self.memory_dir)
            return False
        return True

    def _read_entries(self, target: str) -> list[str]:
        if not self._dir_ok():
            return []
        return parse_entries(decode(read_file(self.files, self._place(target)), strict=False))

    # -- writes ------------------------------------------------------------------

    async def add(self, target: str, content: str) -> Result:
        """Append one entry (refused when duplicate, unsafe or over the limit)."""
        if (err := self._precheck(target, content=content)) is not None:
            return err
        content = content.strip()

        def mutate(entries: list[str]) -> tuple[list[str] | None, Result]:
            if content in entries:
                return None, _fail(
                    f"An identical entry already exists in {target}; nothing was added.",
                    usage=self._usage(target, entries),
                )
            new = [*entries, content]
            limit, current, after = self.char_limit(target), _joined_len(entries), _joined_len(new)
            if after > limit:
                return None, self._over_limit(
                    target,
                    entries,
                    f"{target} memory is at {current:,}/{limit:,} chars; adding this entry "
                    f"({len(content):,} chars) would make it {after:,}, over the limit. "
                    "Consolidate first: 'replace' related entries with one shorter entry or "
                    "'remove' stale ones, then retry the add.",
                )
            return new, self._ok(target, new, f"Entry added to {target}.")

        # an add rewrites no entry, so a hand edit is kept alongside it (as upstream Hermes does)
        return await self._write(target, mutate, keep_edits=True)

    async def replace(self, target: str, old_text: str, content: str) -> Result:
        """Replace the single entry containing `old_text` with `content`."""
        if (err := self._precheck(target, content=content, old_text=old_text)) is not None:
            return err
        content, old_text = content.strip(), old_text.strip()

        def mutate(entries: list[str]) -> tuple[list[str] | None, Result]:
            idx, err = self._match(target, entries, old_text)
            if err is not None:
                return None, err
            if entries[idx] == content:
                return None, self._ok(target, entries, f"Entry in {target} already has this content; nothing changed.")
            if content in entries:
                return None, _fail(
                    f"An identical entry already exists in {target}; remove the old one instead.",
                    usage=self._usage(target, entries),
                )
            new = [*entries[:idx], content, *entries[idx + 1 :]]
            limit, current, after = self.char_limit(target), _joined_len(entries), _joined_len(new)
            if after > limit and after > current:
                return None, self._over_limit(
                    target,
                    entries,
                    f"Replacing would put {target} memory at {after:,}/{limit:,} chars "
                    f"(now {current:,}/{limit:,}), over the limit. Shorten the new content or "
                    "consolidate: 'remove' stale entries or merge related ones first, then retry.",
                )
            return new, self._ok(target, new, f"Entry replaced in {target}.")

        return await self._write(target, mutate)

    async def remove(self, target: str, old_text: str) -> Result:
        """Remove the single entry containing `old_text`."""
        if (err := self._precheck(target, old_text=old_text)) is not None:
            return err
        old_text = old_text.strip()

        def mutate(entries: list[str]) -> tuple[list[str] | None, Result]:
            idx, err = self._match(target, entries, old_text)
            if err is not None:
                return None, err
            new = entries[:idx] + entries[idx + 1 :]
            return new, self._ok(target, new, f"Entry removed from {target}.")

        return await self._write(target, mutate)

    async def clear(self, target: str | None = None) -> Result:
        """Erase one store, or both when `target` is None (the /forget command)."""
        if self.read_only:
            return _fail("Memory is read-only here; nothing was changed.")
        targets = TARGETS if target is None else (self._check_target(target),)
        for t in targets:
            await self._write(t, lambda entries: ([], {}), force=True)
        names = " and ".join(targets)
        return {"success": True, "message": f"Cleared {names}."}

    async def handle_tool_call(self, args: dict[str, Any], *, stage: Stage | None = None) -> str:
        """Run one `memory` tool call; always returns a JSON result, never raises. With
        `stage`, a valid write is handed to it instead of being written."""
        try:
            result = await self._dispatch(args, stage)
        except Exception as exc:  # a tool call must never crash the turn
            log.exception("memory tool call failed")
            result = _fail(f"Memory operation failed: {type(exc).__name__}: {exc}")
        return json.dumps(result, ensure_ascii=False)

    async def _dispatch(self, args: object, stage: Stage | None = None) -> Result:
        if not isinstance(args, dict):
            return _fail("Arguments must be a JSON object with 'action' and 'target'.")
        action, target = args.get("action"), args.get("target") or "memory"
        content, old_text = args.get("content"), args.get("old_text")
        if action not in ACTIONS:
            return _fail(f"Unknown action {action!r}. Use 'add', 'replace' or 'remove'.")
        if target not in TARGETS:
            return _fail(f"Unknown target {target!r}. Use 'memory' or 'user'.")
        for name, value in (("content", content), ("old_text", old_text)):
            if value is not None and not isinstance(value, str):
                return _fail(f"'{name}' must be a string.")
        if action in ("add", "replace") and not content:
            return _fail(f"'content' is required for '{action}'.")
        if action in ("replace", "remove") and not old_text:
            entries = await self.entries(target)
            return _fail(
                f"'old_text' is required for '{action}': a short substring unique to the entry. "
                f"The entries of {target} are listed below.",
                entries=[_preview(_withheld(e)) for e in entries],
                usage=self._usage(target, entries),
            )
        if stage is not None:
            return await self._stage(stage, action, target, content, old_text)
        if action == "add":
            return await self.add(target, content)  # type: ignore[arg-type]
        if action == "replace":
            return await self.replace(target, old_text, content)  # type: ignore[arg-type]
        return await self.remove(target, old_text)  # type: ignore[arg-type]

    async def _stage(self, stage: Stage, action: str, target: str, content: str | None, old_text: str | None) -> Result:
        """Check a write as if it were made now, then hand it to `stage`."""
        checks: dict[str, Any] = {}
        if action != "remove":
            checks["content"] = content
        if action != "add":
            checks["old_text"] = old_text
        if (err := self._precheck(target, **checks)) is not None:
            return err
        if old_text is not None and action != "add":
            entries = await self.entries(target)
            _, err = self._match(target, entries, old_text.strip())
            if err is not None:
                return err
        return await stage(action, target, content.strip() if content else None, old_text.strip() if old_text else None)

    # -- helpers -----------------------------------------------------------------

    def _precheck(self, target: object, *, content: object = ..., old_text: object = ...) -> Result | None:
        """Argument checks done before taking any lock."""
        if self.read_only:
            return _fail("Memory is read-only here; nothing was saved.")
        if target not in TARGETS:
            return _fail(f"Unknown target {target!r}. Use 'memory' or 'user'.")
        if old_text is not ...:
            if not isinstance(old_text, str):
                return _fail("'old_text' must be a string.")
            if not old_text.strip():
                return _fail("'old_text' cannot be empty: give a short substring unique to the entry.")
        if content is not ...:
            if not isinstance(content, str):
                return _fail("'content' must be a string.")
            text = content.strip()
            if not text:
                return _fail("Content cannot be empty.")
            if "§" in text.split("\n"):
                return _fail("Content cannot contain a line made only of '§' (the entry separator).")
            if (reason := first_threat(text)) is not None:
                return _fail(
                    f"Refused: {reason}. Memory goes into the system prompt and must not "
                    "contain injection or exfiltration payloads."
                )
        return None

    def _match(self, target: str, entries: list[str], old_text: str) -> tuple[int, Result | None]:
        """The entry equal to `old_text` (an exact whole-entry match wins), else the one
        entry containing it."""
        if old_text in entries:
            return entries.index(old_text), None
        hits = [i for i, e in enumerate(entries) if old_text in e]
        if not hits:
            return -1, _fail(
                f"No entry matched '{_preview(old_text)}' in {target}. Use an exact substring "
                "of one of the entries below.",
                entries=[_preview(_withheld(e)) for e in entries],
            )
        if len(hits) > 1:
            return -1, _fail(
                f"'{_preview(old_text)}' matches {len(hits)} entries in {target}. Use a longer "
                "substring that is unique to one entry.",
                matches=[_preview(_withheld(entries[i])) for i in hits],
            )
        return hits[0], None

    def _ok(self, target: str, entries: list[str], message: str) -> Result:
        return {"success": True, "message": message, "usage": self._usage(target, entries)}

    def _over_limit(self, target: str, entries: list[str], error: str) -> Result:
        return _fail(
            error,
            usage=self._usage(target, entries),
            entries=[_preview(_withheld(e)) for e in entries],
        )

    async def _write(self, target: str, mutate: _Mutation, *, force: bool = False, keep_edits: bool = False) -> Result:
        async with self._lock:
            return await asyncio.to_thread(self._locked_write, target, mutate, force, keep_edits)

    def _locked_write(self, target: str, mutate: _Mutation, force: bool = False, keep_edits: bool = False) -> Result:
        """Read-modify-write under an exclusive cross-process lock (runs in a thread).

        The file must be what this store last wrote: one changed outside the tool (drift)
        is backed up and becomes the base for the next write; the write is refused unless
        `force` (an explicit erase by the person) or `keep_edits` (an add, which changes no
        entry: the edited text stays as it is, the new entry goes after it)."""
        self.memory_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        if not self._dir_ok():
            return _fail("Memory directory is not usable (symlink); nothing was saved.")
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            os.fchmod(fd, 0o600)  # a lock file left by something else may be looser
            fcntl.flock(fd, fcntl.LOCK_EX)
            return self._checked_write(target, mutate, force, keep_edits)
        finally:
            os.close(fd)  # closing releases the flock

    def _checked_write(self, target: str, mutate: _Mutation, force: bool, keep_edits: bool = False) -> Result:
        path, name, place = self.path_for(target), _FILES[target], self._place(target)
        raw = read_file(self.files, place)
        try:
            entries = parse_entries(decode(raw, strict=True))
        except UndecodableFile as exc:
            return _fail(
                f"{name} holds bytes that are not valid UTF-8 ({exc}); it was left untouched "
                "and nothing was saved. Ask the person to re-save it as UTF-8."
            )
        # compared as parsed entries: cosmetic edits (line endings, blank lines around the
        # separator, a BOM) are not drift, any change of an entry is
        # a group lane sees (and may change) only the entries its audience may read
        view = visibility.WriteView.open(self.memory_dir, target, entries, self.scope, self.files)
        baselines, seen = Baselines(self.memory_dir, self.files), digest(ENTRY_DELIMITER.join(entries).encode("utf-8"))
        base = baselines.get(name)
        if base is not None and base != seen:
            kept = backup(path, raw, self.files)
            baselines.set(name, seen)  # what is really there is the base from now on
            log.warning("%s changed outside the memory tool; kept a backup at %s", path, kept)
            if not force and not (keep_edits and _only_lines_added(raw, base)):
                return _fail(
                    f"{name} was changed outside the memory tool since my last write (edited by "
                    f"hand?). Nothing was saved and the file was left exactly as it is"
                    f"{f' (backup: {kept.name})' if kept else ''}. Its current entries are listed "
                    "below: apply your change again against them.",
                    entries=[_preview(_withheld(e)) for e in view.visible],
                    usage=self._usage(target, view.visible),
                )
        new, result = mutate(view.visible)
        if new is not None:
            if self.guard is not None:
                self.guard()
            new = view.merge(new)
            data = ENTRY_DELIMITER.join(new).encode("utf-8")
            self.files.write_bytes(place, data)
            baselines.set(name, digest(data))
            view.commit(new)
        elif base is None:
            baselines.set(name, seen)
        return result


__all__ = [
    "ACTIONS",
    "ENTRY_DELIMITER",
    "MEMORY_BLOCK_HEADERS",
    "TARGETS",
    "MemorySnapshot",
    "MemoryStore",
    "parse_entries",
]
