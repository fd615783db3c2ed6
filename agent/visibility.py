"""Memory visibility: which MEMORY.md/USER.md entries a lane may see, and how writes are marked.

Every entry is `private` or `shared`. An entry written in a private chat (DM, console) is
private; one written in a group lane is shared. A private chat sees both, a per-member group
lane only shared ones (anything in a group lane's prompt can reach the whole group). A shared
lane's tenant *is* the group, so it sees all of its own entries and marks writes shared.

The memory files keep the exact Hermes format; the marks live beside them in
`memories/visibility.json` as {target: {entry key: "shared"|"private"}}, keyed by a hash of
the entry text. An entry without a mark (hand-edited, written before marks existed, merged
from a link) is private. Marks are written under the memory lock, after the memory file, so
a crash in between leaves a new entry unmarked, i.e. private: the safe side.

Rule for writes: the text written takes the visibility of the place it was written in.
`add` and `replace` from a private chat give a private entry (a replace may fold private
facts into the entry, so a shared entry replaced in private becomes private until shared
again with `/memory share`); from a group lane a shared one. `remove` drops the mark.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from agent.vault import ProfileFiles, VaultError

log = logging.getLogger(__name__)

Visibility = Literal["private", "shared"]
VISIBILITY_FILE = "visibility.json"
RULES_VERSION = 1  # bump when the rule of what a lane sees changes: old prompts are rebuilt


def entry_key(target: str, text: str) -> str:
    """A stable key of one entry's text (its mark and prompt fingerprints use it)."""
    return hashlib.sha256(f"{target}\0{text.strip()}".encode("utf-8", "surrogatepass")).hexdigest()[:32]


@dataclass(frozen=True)
class Scope:
    """What one lane may see of its tenant's memory, and the mark its writes get."""

    name: str
    sees_private: bool
    writes: Visibility


PRIVATE_CHAT = Scope("private-chat", sees_private=True, writes="private")
GROUP_LANE = Scope("group-lane", sees_private=False, writes="shared")  # a person's lane in a group
GROUP_TENANT = Scope("group-tenant", sees_private=True, writes="shared")  # a shared lane: the group's own memory


def lane_scope(kind: str, private: bool) -> Scope:
    """The scope of a lane: a shared lane (`kind` "chat") is the group's own memory, a
    person's private chat sees everything, any other lane of a person is in a group."""
    if kind == "chat":
        return GROUP_TENANT
    return PRIVATE_CHAT if private else GROUP_LANE


class Marks:
    """The visibility marks of one memories directory (read without the lock: files are
    replaced atomically; write only under the memory lock)."""

    def __init__(self, memory_dir: Path, files: ProfileFiles | None = None) -> None:
        """`files`: the profile's files (the marks are sealed when it is encrypted)."""
        self.path = Path(memory_dir) / VISIBILITY_FILE
        self.files = files if files is not None else ProfileFiles(Path(memory_dir).parent)
        self.place = f"{Path(memory_dir).name}/{VISIBILITY_FILE}"

    def load(self) -> dict[str, dict[str, str]]:
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            return {}
        except OSError:
            log.warning("visibility marks %s unreadable; every entry counts as private", self.path)
            return {}
        try:
            with os.fdopen(fd, "rb") as fh:
                data = json.loads(self.files.unseal(fh.read(), self.place).decode("utf-8"))
        except (ValueError, UnicodeDecodeError, VaultError):
            log.warning("visibility marks %s corrupt; every entry counts as private", self.path)
            return {}
        if not isinstance(data, dict):
            return {}
        return {
            t: {k: v for k, v in m.items() if v in ("private", "shared")}
            for t, m in data.get("entries", {}).items()
            if isinstance(m, dict)
        }

    def save(self, marks: dict[str, dict[str, str]]) -> None:
        body = {"version": 1, "entries": {t: dict(sorted(m.items())) for t, m in sorted(marks.items()) if m}}
        self.files.write_text(self.place, json.dumps(body, indent=1))

    def of(self, target: str, entries: Iterable[str]) -> list[Visibility]:
        """The visibility of each entry, in order (unmarked = private)."""
        marks = self.load().get(target, {})
        return ["shared" if marks.get(entry_key(target, e)) == "shared" else "private" for e in entries]


def visible(scope: Scope, target: str, entries: list[str], marks: dict[str, dict[str, str]]) -> list[str]:
    """The entries `scope` may see, in file order."""
    if scope.sees_private:
        return list(entries)
    m = marks.get(target, {})
    return [e for e in entries if m.get(entry_key(target, e)) == "shared"]


@dataclass
class WriteView:
    """One memory write seen through a scope: the mutation works on the visible entries
    only, hidden entries stay where they are, and new text gets the scope's mark."""

    memory_dir: Path
    target: str
    scope: Scope
    full: list[str]
    marks: dict[str, dict[str, str]]
    files: ProfileFiles | None = None

    @classmethod
    def open(
        cls, memory_dir: Path, target: str, full: list[str], scope: Scope, files: ProfileFiles | None = None
    ) -> WriteView:
        return cls(Path(memory_dir), target, scope, list(full), Marks(memory_dir, files).load(), files)

    @property
    def visible(self) -> list[str]:
        return visible(self.scope, self.target, self.full, self.marks)

    def merge(self, new_visible: list[str]) -> list[str]:
        """The whole file after the mutation: a replaced entry keeps its place, removed ones
        go, added ones are appended, hidden ones are untouched."""
        before = set(self.visible)
        keep = set(new_visible)
        fresh = [e for e in new_visible if e not in before]
        pending = list(fresh)
        out: list[str] = []
        for e in self.full:
            if e not in before or e in keep:
                out.append(e)
            elif pending and len(new_visible) == len(before):  # a replace: same place
                out.append(pending.pop(0))
        out.extend(pending)
        return list(dict.fromkeys(out))

    def commit(self, merged: list[str]) -> None:
        """Mark newly written text with the scope's visibility and drop marks of entries
        that are gone (call after the memory file is written, still under the lock)."""
        before = set(self.full)
        old = self.marks.get(self.target, {})
        marks: dict[str, str] = {}
        for e in merged:
            key = entry_key(self.target, e)
            vis = self.scope.writes if e not in before else old.get(key, "private")
            if vis == "shared":
                marks[key] = "shared"
        if marks != {k: v for k, v in old.items() if v == "shared"}:
            self.marks[self.target] = marks
            Marks(self.memory_dir, self.files).save(self.marks)


@contextmanager
def memory_lock(memory_dir: Path) -> Iterator[None]:
    """The same exclusive cross-process lock the memory store writes under."""
    Path(memory_dir).mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(Path(memory_dir) / ".lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def set_mark(
    memory_dir: Path,
    target: str,
    entry: str,
    value: Visibility,
    read_entries: Callable[[str], list[str]],
    files: ProfileFiles | None = None,
) -> bool:
    """Mark one entry (`/memory share|unshare`); False when the entry is gone meanwhile."""
    with memory_lock(memory_dir):
        if entry not in read_entries(target):
            return False
        store = Marks(memory_dir, files)
        marks = store.load()
        target_marks = marks.setdefault(target, {})
        key = entry_key(target, entry)
        if value == "shared":
            target_marks[key] = "shared"
        else:
            target_marks.pop(key, None)
        store.save(marks)
        return True


__all__ = [
    "GROUP_LANE",
    "GROUP_TENANT",
    "PRIVATE_CHAT",
    "RULES_VERSION",
    "Marks",
    "Scope",
    "Visibility",
    "WriteView",
    "entry_key",
    "lane_scope",
    "set_mark",
    "visible",
]
