"""External memory providers: one optional kind per deployment, one instance per tenant.

A provider lives beside the built-in MEMORY.md/USER.md files. Its namespace is the tenant
id and its files go under the tenant's `provider/` directory, so an instance never serves
two tenants. `memory.provider` names the kind; "" turns providers off.

Visibility (see agent/visibility.py): the hooks are told the visibility of what they store
(`private` from a private chat, `shared` from a group lane) and `prefetch` whether only shared
records may come back; `ProviderAccess` says what a lane may do at all (nothing from a group
lane is stored under `read`/`off`, nothing at all happens under `off`).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.fileio import open_private, private_mkdir
from agent.vault import ProfileFiles, VaultError
from agent.visibility import Scope, Visibility
from core.settings import MEMORY_PROVIDERS


@dataclass(frozen=True)
class ProviderAccess:
    """What one lane may do with its tenant's provider."""

    read: bool  # prefetch
    write: bool  # sync_turn, on_pre_compress, on_memory_write
    shared_only: bool  # prefetch returns only what was stored as shared
    mark: Visibility  # the visibility of what this lane stores


#: on_memory_write actions that change an entry's visibility (`/memory share|unshare`)
VISIBILITY_ACTIONS = ("share", "unshare")

NOTES = "provider/notes.jsonl"  # the local provider's records, in the profile

NO_ACCESS = ProviderAccess(read=False, write=False, shared_only=True, mark="shared")


def provider_access(personal_memory: str, scope: Scope) -> ProviderAccess:
    """A lane's access from its memory mode (`full`/`read`/`off`) and visibility scope."""
    if personal_memory == "off":
        return NO_ACCESS
    return ProviderAccess(
        read=True, write=personal_memory == "full", shared_only=not scope.sees_private, mark=scope.writes
    )


class MemoryProvider:
    """The interface (all hooks are optional no-ops); subclasses override what they use."""

    name = "base"

    async def initialize(self, namespace: str, profile_dir: Path, *, files: ProfileFiles | None = None) -> None:
        """`files`: the profile's files, sealed when it is encrypted (a provider keeps its
        records through them, docs/privacy.md#encryption-at-rest)."""
        self.namespace = namespace
        self.profile_dir = profile_dir
        self.files = files if files is not None else ProfileFiles(profile_dir)

    async def prefetch(self, query: str, *, shared_only: bool = False) -> str:
        """Text to add to the turn's context for `query` ("" for nothing); with
        `shared_only`, nothing that was stored as private may come back."""
        return ""

    async def sync_turn(self, user: str, assistant: str, *, visibility: Visibility = "private") -> None: ...

    async def on_pre_compress(self, messages: list[dict[str, Any]], *, visibility: Visibility = "private") -> None:
        """Called with the messages about to be summarised away, so nothing learned is lost."""

    async def on_memory_write(
        self, action: str, target: str, content: str, *, visibility: Visibility = "private"
    ) -> None:
        """`action` is add|replace|remove from the memory tool, or share|unshare when the
        person changes an entry's visibility (`visibility` is then the entry's new one)."""

    async def shutdown(self) -> None: ...


class LocalNotesProvider(MemoryProvider):
    """A small file-backed provider: keeps each turn and pre-compression message in
    `provider/notes.jsonl` with its visibility and recalls lines sharing words with the
    query (records without a visibility count as private)."""

    name = "local"

    def _file(self) -> Path:
        return self.files.path(NOTES)

    def _append(self, record: dict[str, Any]) -> None:
        path = self._file()
        line = self.files.seal_line(json.dumps(record, ensure_ascii=False), NOTES)  # one sealed record a line
        private_mkdir(path.parent)
        with open_private(path, "a") as fh:
            fh.write(line + "\n")
            fh.flush()
            os.fsync(fh.fileno())

    async def sync_turn(self, user: str, assistant: str, *, visibility: Visibility = "private") -> None:
        self._append({"kind": "turn", "user": user, "assistant": assistant, "visibility": visibility})

    async def on_pre_compress(self, messages: list[dict[str, Any]], *, visibility: Visibility = "private") -> None:
        for m in messages:
            if m.get("role") in ("user", "assistant") and m.get("content"):
                self._append(
                    {"kind": "pre_compress", "role": m["role"], "content": m["content"], "visibility": visibility}
                )

    async def on_memory_write(
        self, action: str, target: str, content: str, *, visibility: Visibility = "private"
    ) -> None:
        self._append(
            {"kind": "memory_write", "action": action, "target": target, "content": content, "visibility": visibility}
        )

    async def prefetch(self, query: str, *, shared_only: bool = False) -> str:
        path = self._file()
        words = set(re.findall(r"\w{4,}", query.lower()))
        if not words or not path.exists():
            return ""
        records = []
        for line in path.read_text(encoding="utf-8").splitlines()[-500:]:
            try:
                rec = json.loads(self.files.open_line(line, NOTES))
            except (json.JSONDecodeError, VaultError):  # a torn or foreign line is skipped
                continue
            if isinstance(rec, dict):
                records.append(rec)
        # a removed (forgotten) entry is never recalled again, nor any record quoting it
        removed = [
            str(r.get("content") or "")
            for r in records
            if r.get("kind") == "memory_write" and r.get("action") == "remove" and r.get("content")
        ]
        # an entry the person unshared (`/memory unshare`) is private again: a group lane
        # recalls no record quoting it, whatever visibility the record was stored with
        marks: dict[str, str] = {}
        for r in records:
            if r.get("kind") == "memory_write" and r.get("action") in VISIBILITY_ACTIONS and r.get("content"):
                marks[str(r["content"])] = str(r["action"])
        unshared = [content for content, action in marks.items() if action == "unshare"]
        hits: list[str] = []
        for rec in records:
            if rec.get("kind") == "memory_write" and rec.get("action") in ("remove", *VISIBILITY_ACTIONS):
                continue
            if shared_only and rec.get("visibility") != "shared":
                continue
            text = str(rec.get("user") or rec.get("content") or "")
            if any(gone in text for gone in removed):
                continue
            if shared_only and any(hidden in text for hidden in unshared):
                continue
            if words & set(re.findall(r"\w{4,}", text.lower())):
                hits.append(text[:200])
        return "\n".join(hits[-3:])


PROVIDERS: dict[str, Callable[[], MemoryProvider]] = {"local": LocalNotesProvider}
assert tuple(PROVIDERS) == MEMORY_PROVIDERS, "core.settings.MEMORY_PROVIDERS names what is built here"


def make_provider(kind: str) -> MemoryProvider | None:
    """A fresh, uninitialised provider of `kind`, or None when providers are off."""
    if not kind:
        return None
    try:
        return PROVIDERS[kind]()
    except KeyError:
        raise ValueError(f"memory.provider: unknown provider {kind!r} (known: {', '.join(PROVIDERS)})") from None
