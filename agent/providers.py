"""External memory providers: one optional kind per deployment, one instance per tenant.

A provider lives beside the built-in MEMORY.md/USER.md files. Its namespace is the tenant
id and its files go under the tenant's `provider/` directory, so an instance never serves
two tenants. `memory.provider` names the kind; "" turns providers off.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Callable

from agent.fileio import open_private, private_mkdir


class MemoryProvider:
    """The interface (all hooks are optional no-ops); subclasses override what they use."""

    name = "base"

    async def initialize(self, namespace: str, profile_dir: Path) -> None:
        self.namespace = namespace
        self.profile_dir = profile_dir

    async def prefetch(self, query: str) -> str:
        """Text to add to the turn's context for `query` ("" for nothing)."""
        return ""

    async def sync_turn(self, user: str, assistant: str) -> None: ...

    async def on_pre_compress(self, messages: list[dict[str, Any]]) -> None:
        """Called with the messages about to be summarised away, so nothing learned is lost."""

    async def on_memory_write(self, action: str, target: str, content: str) -> None: ...

    async def shutdown(self) -> None: ...


class LocalNotesProvider(MemoryProvider):
    """A small file-backed provider: keeps each turn and pre-compression message in
    `provider/notes.jsonl` and recalls lines sharing words with the query."""

    name = "local"

    def _file(self) -> Path:
        return self.profile_dir / "provider" / "notes.jsonl"

    def _append(self, record: dict[str, Any]) -> None:
        path = self._file()
        private_mkdir(path.parent)
        with open_private(path, "a") as fh:
            fh.write(json.dumps(record, ensure_ascii=False) + "\n")
            fh.flush()
            os.fsync(fh.fileno())

    async def sync_turn(self, user: str, assistant: str) -> None:
        self._append({"kind": "turn", "user": user, "assistant": assistant})

    async def on_pre_compress(self, messages: list[dict[str, Any]]) -> None:
        for m in messages:
            if m.get("role") in ("user", "assistant") and m.get("content"):
                self._append({"kind": "pre_compress", "role": m["role"], "content": m["content"]})

    async def on_memory_write(self, action: str, target: str, content: str) -> None:
        self._append({"kind": "memory_write", "action": action, "target": target, "content": content})

    async def prefetch(self, query: str) -> str:
        path = self._file()
        words = {w for w in re.findall(r"\w{4,}", query.lower())}
        if not words or not path.exists():
            return ""
        hits: list[str] = []
        for line in path.read_text(encoding="utf-8").splitlines()[-500:]:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            text = rec.get("user") or rec.get("content") or ""
            if words & set(re.findall(r"\w{4,}", text.lower())):
                hits.append(text[:200])
        return "\n".join(hits[-3:])


PROVIDERS: dict[str, Callable[[], MemoryProvider]] = {"local": LocalNotesProvider}


def make_provider(kind: str) -> MemoryProvider | None:
    """A fresh, uninitialised provider of `kind`, or None when providers are off."""
    if not kind:
        return None
    try:
        return PROVIDERS[kind]()
    except KeyError:
        raise ValueError(f"memory.provider: unknown provider {kind!r} (known: {', '.join(PROVIDERS)})") from None
