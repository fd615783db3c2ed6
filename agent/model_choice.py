"""A tenant's model: one of the operator's `llm.models` offers, kept in its profile
(`model.json`) so it follows the tenant across restarts and a `/link` (docs/concepts.md#models)."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from agent.fileio import atomic_write, read_choice_file

FILE = "model.json"
log = logging.getLogger("hermes.agent")


@dataclass(frozen=True)
class ModelChoice:
    """The offer's name; None: the `llm` section's model (the default)."""

    name: str | None = None


DEFAULT = ModelChoice()


def read_model(profile_dir: Path) -> ModelChoice:
    """The profile's choice; the default when it has none, or when the file is damaged (logged)."""
    data = read_choice_file(Path(profile_dir) / FILE, log, "the default model until one is chosen again")
    name = data.get("name")
    return ModelChoice(name if isinstance(name, str) and name else None)


def write_model(profile_dir: Path, choice: ModelChoice) -> None:
    """Write the choice atomically (the default removes the file)."""
    path = Path(profile_dir) / FILE
    if choice.name is None:
        path.unlink(missing_ok=True)
        return
    atomic_write(path, json.dumps({"name": choice.name}))
