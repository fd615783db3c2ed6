"""Memory writes waiting for the person's approval (`memory.write_approval: stage`, seed 2.9).

A staged write is kept in `<profile>/memories/pending.json` with a number that stays
stable until it is approved or rejected (`/memory pending`, `/memory approve N`,
`/memory reject N`). Approving applies it through the memory store's normal write path.
`origin` records whether the write came from a private chat or a group lane.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from agent.memory_files import decode, read_file
from agent.vault import ProfileFiles

PENDING_FILE = "pending.json"
MAX_PENDING = 50


@dataclass(frozen=True)
class PendingWrite:
    id: int
    action: str  # add | replace | remove
    target: str  # memory | user
    content: str | None
    old_text: str | None
    origin: str  # private | shared
    created_at: float

    def describe(self) -> str:
        where = " (from a group chat)" if self.origin == "shared" else ""
        if self.action == "add":
            return f"#{self.id} add to {self.target}: {self.content}{where}"
        if self.action == "replace":
            return f"#{self.id} replace in {self.target} '{self.old_text}' with: {self.content}{where}"
        return f"#{self.id} remove from {self.target}: '{self.old_text}'{where}"


class PendingWrites:
    """The approval queue of one profile (a short JSON file; one writer at a time)."""

    def __init__(self, memory_dir: Path, files: ProfileFiles | None = None) -> None:
        """`files`: the profile's files (the queue holds memory text: sealed when encrypted)."""
        self.path = Path(memory_dir) / PENDING_FILE
        self.files = files if files is not None else ProfileFiles(Path(memory_dir).parent)
        self.place = f"{Path(memory_dir).name}/{PENDING_FILE}"
        self._lock = asyncio.Lock()

    def _load(self) -> dict[str, Any]:
        try:
            data = json.loads(decode(read_file(self.files, self.place), strict=False) or "{}")
        except ValueError:
            data = {}
        if not isinstance(data, dict):
            data = {}
        items = []
        for raw in data.get("items", []):
            try:
                items.append(PendingWrite(**raw))
            except TypeError:
                continue
        return {"next_id": int(data.get("next_id", 1) or 1), "items": items}

    def _save(self, state: dict[str, Any]) -> None:
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.files.write_text(
            self.place,
            json.dumps(
                {"next_id": state["next_id"], "items": [asdict(i) for i in state["items"]]},
                ensure_ascii=False,
                indent=1,
            ),
        )

    async def list(self) -> list[PendingWrite]:
        return (await asyncio.to_thread(self._load))["items"]

    async def stage(
        self, action: str, target: str, content: str | None, old_text: str | None, *, origin: str
    ) -> dict[str, Any]:
        """Queue one write; the tool result the model gets."""

        def add() -> dict[str, Any]:
            state = self._load()
            if len(state["items"]) >= MAX_PENDING:
                return {
                    "success": False,
                    "error": f"{MAX_PENDING} memory writes are already waiting for the "
                    "person's approval; nothing more is queued until they approve or reject some.",
                }
            item = PendingWrite(state["next_id"], action, target, content, old_text, origin, time.time())
            state["items"].append(item)
            state["next_id"] += 1
            self._save(state)
            return {
                "success": True,
                "staged": True,
                "pending_id": item.id,
                "message": "Queued for the person's approval (they see it with /memory pending); it is "
                "not in memory until they approve it. Don't queue it again.",
            }

        async with self._lock:
            return await asyncio.to_thread(add)

    async def take(self, item_id: int) -> PendingWrite | None:
        """Remove and return pending write `item_id` (None when there is no such write)."""

        def pop() -> PendingWrite | None:
            state = self._load()
            found = next((i for i in state["items"] if i.id == item_id), None)
            if found is not None:
                state["items"] = [i for i in state["items"] if i.id != item_id]
                self._save(state)
            return found

        async with self._lock:
            return await asyncio.to_thread(pop)


__all__ = ["MAX_PENDING", "PENDING_FILE", "PendingWrite", "PendingWrites"]
