"""One tenant's open profile: its directory and the stores that live in it.

The agent works on a `Profile` it is handed; opening, closing and quarantining profiles is
`tenancy.profiles.ProfileManager`'s job (docs/concepts.md#how-people-map-to-profiles).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import tzinfo
from pathlib import Path

from agent import reminders
from agent.fileio import FileMemo, atomic_write
from agent.ledger import OVERRIDE_FILE, read_override
from agent.memory import MemoryStore
from agent.model_choice import ModelChoice, read_model, write_model
from agent.persona import PersonaChoice, read_choice, write_choice
from agent.providers import MemoryProvider
from agent.sessions import SessionStore
from agent.vault import ProfileFiles


def zone_memo(files: ProfileFiles) -> FileMemo[tzinfo]:
    """The person's time zone as their reminders know it (budget days roll over at its midnight)."""
    return FileMemo(files.path(reminders.FILE), lambda: reminders.ReminderStore(files).zone_now())


def budget_memo(files: ProfileFiles) -> FileMemo[dict[str, float | None]]:
    """The operator's per-tenant caps (`budget set`, agent/ledger.py)."""
    return FileMemo(files.path(OVERRIDE_FILE), lambda: read_override(files))


@dataclass
class Profile:
    """One tenant's open profile: its directory and the stores that live in it."""

    tenant_id: str
    path: Path
    sessions: SessionStore
    memory: MemoryStore
    provider: MemoryProvider | None = None
    principals: set[str] = field(default_factory=set)
    users: int = 0  # turns currently using it; never closed while > 0
    last_used: float = field(default_factory=time.monotonic)
    guard: Callable[[], None] | None = None  # raises when writing is no longer allowed (ProfileGate)
    on_close: Callable[[], Awaitable[None]] | None = None  # after the stores are closed
    #: what the payer of a call reads (agent/metering.py): parsed at open, again when changed
    zone_file: FileMemo[tzinfo] | None = None
    budget_file: FileMemo[dict[str, float | None]] | None = None
    #: persona.json as the open read it (in its pool job); None: read on first use
    persona_choice: PersonaChoice | None = None
    #: its files, sealed with the tenant's key when storage.encryption is per_tenant
    files: ProfileFiles | None = None

    def __post_init__(self) -> None:
        if self.files is None:
            self.files = ProfileFiles(self.path)
        if self.zone_file is None:
            self.zone_file = zone_memo(self.files)
        if self.budget_file is None:
            self.budget_file = budget_memo(self.files)

    @property
    def store_files(self) -> ProfileFiles:
        """Its files (set in __post_init__; typed without the None)."""
        assert self.files is not None
        return self.files

    async def time_zone(self) -> tzinfo:
        """The person's time zone (from their reminders; UTC when none says)."""
        assert self.zone_file is not None  # set in __post_init__
        return await self.zone_file.get()

    async def budget_override(self) -> dict[str, float | None]:
        """The operator's caps for this tenant ({}: the config's apply)."""
        assert self.budget_file is not None  # set in __post_init__
        return await self.budget_file.get()

    async def persona(self) -> PersonaChoice:
        """The tenant's persona choice (its file is read once per open)."""
        if self.persona_choice is None:
            self.persona_choice = await asyncio.to_thread(read_choice, self.store_files)
        return self.persona_choice

    #: model.json as the open read it; None: read on first use
    model_choice: ModelChoice | None = None

    async def model(self) -> ModelChoice:
        """The tenant's model choice (its file is read once per open)."""
        if self.model_choice is None:
            self.model_choice = await asyncio.to_thread(read_model, self.store_files)
        return self.model_choice

    async def set_model(self, choice: ModelChoice) -> None:
        if self.guard is not None:
            self.guard()
        await asyncio.to_thread(write_model, self.store_files, choice)
        self.model_choice = choice

    async def set_persona(self, choice: PersonaChoice) -> None:
        if self.guard is not None:
            self.guard()
        await asyncio.to_thread(write_choice, self.store_files, choice)
        self.persona_choice = choice

    async def close(self) -> None:
        try:
            await self.sessions.close()
            if self.provider is not None:
                await self.provider.shutdown()
        finally:
            if self.on_close is not None:
                on_close, self.on_close = self.on_close, None
                await on_close()

    def read_manifest(self) -> dict:
        try:
            return json.loads((self.path / "tenant.json").read_text(encoding="utf-8"))
        except (FileNotFoundError, json.JSONDecodeError):
            return {}

    def add_principal(self, principal: str) -> None:
        """Record in tenant.json that `principal` lives in this profile."""
        manifest = self.read_manifest()
        principals = manifest.setdefault("principals", [])
        if principal not in principals:
            if self.guard is not None:
                self.guard()
            principals.append(principal)
            write_manifest(self.path, manifest)
        self.principals.add(principal)


def write_manifest(path: Path, manifest: dict) -> None:
    """Write tenant.json atomically."""
    atomic_write(path / "tenant.json", json.dumps(manifest, ensure_ascii=False, indent=2))
