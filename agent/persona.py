"""A tenant's persona: an operator persona by name, or a person's own instructions.

Kept in the tenant's profile (`persona.json`), like its memory: a person's choice follows
them across their lanes and a `/link`; a shared lane's is the chat's. Which text a lane's
prompt gets is decided here, and only here (docs/concepts.md#personas): a person's own
instructions are private data, used in that person's DMs alone, never in a group lane,
where only the operator's personas apply.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from agent.fileio import read_choice_file
from agent.threats import first_threat
from agent.vault import ProfileFiles, as_files

FILE = "persona.json"
#: the most a person's own instructions may hold (they ride in every prompt of their DMs)
CUSTOM_MAX_CHARS = 2000
log = logging.getLogger("hermes.agent")
#: who chose the persona a prompt gets (the first item of `lane_persona`)
BY_PERSON = "the person you are talking with"
BY_OPERATOR = "the operator"


@dataclass(frozen=True)
class PersonaChoice:
    """What a tenant chose: an operator persona's name, or their own text (at most one)."""

    name: str | None = None
    custom: str | None = None

    @property
    def empty(self) -> bool:
        return self.name is None and self.custom is None


NONE = PersonaChoice()


def read_choice(profile: ProfileFiles | Path) -> PersonaChoice:
    """The profile's choice; none when it has none, or when the file is damaged (said in the log)."""
    files = as_files(profile)
    data = read_choice_file(lambda: files.read_bytes(FILE), files.path(FILE), log, "no persona until it is set again")
    name, custom = data.get("name"), data.get("custom")
    return PersonaChoice(
        name=name if isinstance(name, str) and name else None,
        custom=custom if isinstance(custom, str) and custom and not first_threat(custom) else None,
    )


def write_choice(profile: ProfileFiles | Path, choice: PersonaChoice) -> None:
    """Write the choice atomically, sealed in an encrypted profile (an empty one removes the file)."""
    files = as_files(profile)
    if choice.empty:
        files.path(FILE).unlink(missing_ok=True)
        return
    files.write_text(FILE, json.dumps({"name": choice.name, "custom": choice.custom}, ensure_ascii=False))


def custom_problem(text: str) -> str | None:
    """Why `text` cannot be a person's own instructions (None when it can): the memory threat
    scan, since it enters their prompt as memory does."""
    if not text.strip():
        return "the instructions are empty"
    if len(text) > CUSTOM_MAX_CHARS:
        return f"the instructions are {len(text):,} characters; at most {CUSTOM_MAX_CHARS:,} fit"
    threat = first_threat(text)
    return f"they look unsafe to put in my instructions ({threat})" if threat else None


def lane_persona(choice: PersonaChoice, offered: Mapping[str, str], *, private: bool) -> tuple[str, str] | None:
    """(who chose it, the instructions) a lane's prompt gets, or None.

    `private` is true only in a person's own DM: their own text is used there and nowhere
    else; elsewhere only an operator persona the config still offers applies."""
    if private and choice.custom is not None:
        return (BY_PERSON, choice.custom)
    if choice.name is not None and choice.name in offered:
        return (BY_OPERATOR, offered[choice.name])
    return None
