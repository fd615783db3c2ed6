"""A tenant's model: one of the operator's `llm.models` offers, kept in its profile
(`model.json`) so it follows the tenant across restarts and a `/link` (docs/concepts.md#models)."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from agent.fileio import read_choice_file
from agent.vault import ProfileFiles, as_files

FILE = "model.json"
log = logging.getLogger("hermes.agent")


@dataclass(frozen=True)
class ModelChoice:
    """The offer's name; None: the `llm` section's model (the default)."""

    name: str | None = None


DEFAULT = ModelChoice()


def read_model(profile: ProfileFiles | Path) -> ModelChoice:
    """The profile's choice; the default when it has none, or when the file is damaged (logged)."""
    files = as_files(profile)
    data = read_choice_file(
        lambda: files.read_bytes(FILE), files.path(FILE), log, "the default model until one is chosen again"
    )
    name = data.get("name")
    return ModelChoice(name if isinstance(name, str) and name else None)


def write_model(profile: ProfileFiles | Path, choice: ModelChoice) -> None:
    """Write the choice atomically, sealed in an encrypted profile (the default removes the file)."""
    files = as_files(profile)
    if choice.name is None:
        files.path(FILE).unlink(missing_ok=True)
        return
    files.write_text(FILE, json.dumps({"name": choice.name}))
