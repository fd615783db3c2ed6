"""Skills of one tenant profile: reusable procedures the agent wrote for itself (seed 2.5).

Each skill is `<profile>/skills/<name>/SKILL.md`: a small front matter (`name`,
`description`, `visibility`) and the procedure. A skill written in a private chat is
`private`; one written in a group lane is `shared`, and a group lane only ever sees shared
skills (index, view, update, delete), so a private chat's procedures never reach a group.
An update takes the visibility of where it was written: a shared skill updated in a private
chat becomes private (it may now hold private details), as a replaced memory entry does.
Every write is threat-scanned and size-limited like memory; the `skill_manage` tool returns
a short JSON result.

A group lane must not learn a private skill's name: creating a skill there under a name a
private skill has succeeds like any free name, and is kept in `skills/<name>.shared/` (a
folder name no skill name can have). A private chat sees both (its own first); a group
lane sees only the shared one. Counts in a group lane count only shared skills.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.memory_files import decode, read_file
from agent.threats import first_threat
from agent.vault import ProfileFiles

log = logging.getLogger(__name__)

SKILL_FILE = "SKILL.md"
MAX_SKILL_CHARS = 8000
MAX_DESCRIPTION_CHARS = 200
MAX_SKILLS = 50
SKILL_ACTIONS = ("list", "view", "create", "update", "delete")
TWIN_SUFFIX = ".shared"  # the folder of a shared skill whose name a private skill holds
VISIBILITIES = ("private", "shared")
_NAME_RE = re.compile(r"[a-z0-9][a-z0-9_-]{0,47}")

Result = dict[str, Any]


def _fail(error: str, **extra: Any) -> Result:
    return {"success": False, "error": error, **extra}


@dataclass(frozen=True)
class SkillInfo:
    name: str
    description: str
    visibility: str


def _shown(body: str) -> str:
    """A procedure as the model or an export may read it."""
    if (reason := first_threat(body)) is not None:  # edited by hand into something unsafe
        return f"[skill withheld: {reason}]"
    return body


def _render(info: SkillInfo, body: str) -> str:
    return (
        f"---\nname: {info.name}\ndescription: {info.description}\nvisibility: {info.visibility}\n---\n{body.strip()}\n"
    )


def _parse(name: str, text: str) -> tuple[SkillInfo, str]:
    """Front matter and body; a file without front matter is a private skill. `name` ""
    takes the front matter's (an encrypted profile's folders do not say it)."""
    meta: dict[str, str] = {}
    body = text
    if text.startswith("---\n"):
        head, sep, rest = text[4:].partition("\n---\n")
        if sep:
            for line in head.splitlines():
                key, colon, value = line.partition(":")
                if colon:
                    meta[key.strip().lower()] = value.strip()
            body = rest
    visibility = meta.get("visibility", "private")
    return SkillInfo(
        name or meta.get("name", ""),
        meta.get("description", ""),
        visibility if visibility in VISIBILITIES else "private",
    ), body.strip()


class SkillStore:
    """The skills directory of one profile."""

    def __init__(
        self,
        profile_dir: Path,
        *,
        read_only: bool = False,
        guard: Callable[[], None] | None = None,
        files: ProfileFiles | None = None,
    ) -> None:
        """`guard` is called right before a file is written and may raise to refuse it
        (cluster mode: the tenant lease is no longer held). `files`: the profile's files,
        each SKILL.md sealed when it is encrypted (docs/privacy.md#encryption-at-rest)."""
        self.skills_dir = Path(profile_dir) / "skills"
        self.files = files if files is not None else ProfileFiles(Path(profile_dir))
        self.read_only = read_only
        self.guard = guard
        self._lock = asyncio.Lock()

    # -- reads ---------------------------------------------------------------------------
    def _place(self, folder: Path) -> str:
        """The place of a skill folder's SKILL.md in the profile (what its seal is bound to)."""
        return f"{self.skills_dir.name}/{folder.name}/{SKILL_FILE}"

    def _folder(self, name: str, twin: bool = False) -> Path:
        """The folder of skill `name` (or of its shared twin): named after it in a plain
        profile, after an HMAC of it in an encrypted one (docs/privacy.md#encryption-at-rest)."""
        return self.skills_dir / self.files.hidden_name(f"{name}{TWIN_SUFFIX}" if twin else name)

    def _name_inside(self, folder: Path) -> str | None:
        """An encrypted profile's skill name, from its sealed front matter."""
        raw = read_file(self.files, self._place(folder))
        if raw is None:
            return None
        info, _ = _parse("", decode(raw, strict=False))
        return info.name or None

    def _dir_ok(self, path: Path) -> bool:
        return not path.is_symlink()

    def _load(self, name: str) -> tuple[SkillInfo, str] | None:
        if not _NAME_RE.fullmatch(name):
            return None
        folder = self._folder(name)
        if not self._dir_ok(self.skills_dir) or not self._dir_ok(folder):
            return None
        raw = read_file(self.files, self._place(folder))
        return None if raw is None else _parse(name, decode(raw, strict=False))

    def _load_twin(self, name: str) -> tuple[SkillInfo, str] | None:
        """The shared twin of `name` (only ever a shared skill)."""
        if not _NAME_RE.fullmatch(name):
            return None
        folder = self._folder(name, twin=True)
        if not self._dir_ok(self.skills_dir) or not self._dir_ok(folder):
            return None
        raw = read_file(self.files, self._place(folder))
        loaded = None if raw is None else _parse(name, decode(raw, strict=False))
        return loaded if loaded is not None and loaded[0].visibility == "shared" else None

    def _all(self) -> list[tuple[SkillInfo, str]]:
        if not self.skills_dir.is_dir() or not self._dir_ok(self.skills_dir):
            return []
        out = []
        for folder in sorted(self.skills_dir.iterdir()):
            if not folder.is_dir():
                continue
            if self.files.sealed:
                name = self._name_inside(folder)
                loaded = None
                if name is not None and folder == self._folder(name, twin=True):
                    loaded = self._load_twin(name)
                elif name is not None and folder == self._folder(name):
                    loaded = self._load(name)
            elif folder.name.endswith(TWIN_SUFFIX):
                loaded = self._load_twin(folder.name[: -len(TWIN_SUFFIX)])
            else:
                loaded = self._load(folder.name)
            if loaded is not None:
                out.append(loaded)
        return out

    def _count(self, shared_only: bool) -> int:
        return sum(1 for info, _ in self._all() if not shared_only or info.visibility == "shared")

    async def index(self, *, shared_only: bool) -> list[SkillInfo]:
        """The skills a lane may see (only shared ones in a group lane)."""
        skills = await asyncio.to_thread(self._all)
        return [info for info, _ in skills if not shared_only or info.visibility == "shared"]

    async def bodies(self) -> list[tuple[SkillInfo, str]]:
        """Every skill with its procedure as `view` shows it, twins included (a private
        chat's export)."""
        return [(info, _shown(body)) for info, body in await asyncio.to_thread(self._all)]

    def _find(self, name: str, shared_only: bool) -> tuple[Path, SkillInfo, str] | None:
        """The folder and skill `name` resolves to in a lane: the skill itself when the lane
        may see it, else its shared twin (a group lane); None when the lane sees neither."""
        loaded = self._load(name)
        if loaded is not None and (not shared_only or loaded[0].visibility == "shared"):
            return self._folder(name), *loaded
        twin = self._load_twin(name)
        return (self._folder(name, twin=True), *twin) if twin is not None else None

    def _visible(self, name: str, shared_only: bool) -> tuple[SkillInfo, str] | None:
        found = self._find(name, shared_only)
        return None if found is None else (found[1], found[2])

    async def view(self, name: str, *, shared_only: bool) -> Result:
        loaded = await asyncio.to_thread(self._visible, name, shared_only)
        if loaded is None:
            return _fail(f"No skill named {name!r}. Use action 'list' to see the skills.")
        info, body = loaded
        return {"success": True, "name": info.name, "description": info.description, "content": _shown(body)}

    # -- writes --------------------------------------------------------------------------
    def _allow_write(self) -> None:
        if self.guard is not None:
            self.guard()

    def _check(self, name: object, description: object = None, content: object = None) -> Result | None:
        if self.read_only:
            return _fail("Skills are read-only here; nothing was saved.")
        if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
            return _fail("'name' must be 1-48 characters: lower-case letters, digits, '-' or '_'.")
        for key, value, limit in (
            ("description", description, MAX_DESCRIPTION_CHARS),
            ("content", content, MAX_SKILL_CHARS),
        ):
            if value is None:
                continue
            if not isinstance(value, str) or not value.strip():
                return _fail(f"'{key}' must be non-empty text.")
            if len(value) > limit:
                return _fail(f"'{key}' is {len(value):,} characters; the limit is {limit:,}. Make it shorter.")
            if (reason := first_threat(value)) is not None:
                return _fail(
                    f"Refused: {reason}. Skills go into the system prompt and must not contain "
                    "injection or exfiltration payloads, or secrets."
                )
        if isinstance(description, str) and "\n" in description.strip():
            return _fail("'description' must be one line.")
        return None

    async def create(self, name: str, description: str, content: str, *, visibility: str) -> Result:
        if (err := self._check(name, description, content)) is not None:
            return err
        info = SkillInfo(name, description.strip(), visibility)

        shared_only = visibility == "shared"

        def write() -> Result:
            folder = self._folder(name)
            if self._find(name, shared_only) is not None:
                return _fail(f"A skill named {name!r} already exists; use 'update' to refine it.")
            if folder.exists():  # a private skill (unseen here) or a stray folder: use the twin
                folder = self._folder(name, twin=True)
                if not shared_only or folder.exists():
                    return _fail(f"A skill named {name!r} already exists; use 'update' to refine it.")
            if self._count(shared_only) >= MAX_SKILLS:
                return _fail(f"There are already {MAX_SKILLS} skills; delete or merge some first.")
            if not self._dir_ok(self.skills_dir):
                return _fail("The skills directory is not usable (symlink); nothing was saved.")
            self._allow_write()
            folder.mkdir(mode=0o700, parents=True)
            self.files.write_text(self._place(folder), _render(info, content))
            return {"success": True, "message": f"Skill {name!r} created."}

        async with self._lock:
            return await asyncio.to_thread(write)

    async def update(self, name: str, *, description: str | None, content: str | None, shared_only: bool) -> Result:
        if (err := self._check(name, description, content)) is not None:
            return err
        if description is None and content is None:
            return _fail("Give 'content' and/or 'description' to update.")

        def write() -> Result:
            found = self._find(name, shared_only)
            if found is None:
                return _fail(f"No skill named {name!r}. Use action 'list' to see the skills.")
            folder, info, body = found
            # the text written takes the visibility of the place it was written in (as memory
            # does): a shared skill updated in a private chat may now hold private details
            visibility = "shared" if shared_only else "private"
            new = SkillInfo(name, description.strip() if description else info.description, visibility)
            self._allow_write()
            if not shared_only and folder != self._folder(name):  # a twin turning private takes the name's folder
                os.replace(folder, self._folder(name))
                folder = self._folder(name)
            self.files.write_text(self._place(folder), _render(new, content if content else body))
            return {"success": True, "message": f"Skill {name!r} updated."}

        async with self._lock:
            return await asyncio.to_thread(write)

    async def delete(self, name: str, *, shared_only: bool) -> Result:
        if (err := self._check(name)) is not None:
            return err

        def remove() -> Result:
            found = self._find(name, shared_only)
            if found is None:
                return _fail(f"No skill named {name!r}.")
            self._allow_write()
            shutil.rmtree(found[0])
            return {"success": True, "message": f"Skill {name!r} deleted."}

        async with self._lock:
            return await asyncio.to_thread(remove)

    # -- the tool ------------------------------------------------------------------------
    async def handle_tool_call(self, args: dict[str, Any], *, shared: bool) -> str:
        """One `skill_manage` call from a lane (`shared`: a group lane); never raises."""
        try:
            result = await self._dispatch(args, shared)
        except Exception as exc:
            log.exception("skill_manage call failed")
            result = _fail(f"Skill operation failed: {type(exc).__name__}")
        return json.dumps(result, ensure_ascii=False)

    async def _dispatch(self, args: dict[str, Any], shared: bool) -> Result:
        action, name = args.get("action"), args.get("name")
        if action not in SKILL_ACTIONS:
            return _fail(f"Unknown action {action!r}. Use one of: {', '.join(SKILL_ACTIONS)}.")
        if action == "list":
            skills = await self.index(shared_only=shared)
            return {"success": True, "skills": [{"name": s.name, "description": s.description} for s in skills]}
        if not isinstance(name, str):
            return _fail("'name' is required.")
        if action == "view":
            return await self.view(name, shared_only=shared)
        if action == "create":
            description, content = args.get("description"), args.get("content")
            if not isinstance(description, str) or not isinstance(content, str):
                return _fail("'description' and 'content' are required to create a skill.")
            return await self.create(name, description, content, visibility="shared" if shared else "private")
        if action == "update":
            return await self.update(
                name, description=args.get("description"), content=args.get("content"), shared_only=shared
            )
        return await self.delete(name, shared_only=shared)


def render_skill_index(skills: list[SkillInfo]) -> str:
    """The skills block of the system prompt ('' when there are none)."""
    if not skills:
        return ""
    lines = [
        f"- {s.name}: {s.description if first_threat(s.description) is None else '[description withheld]'}"
        for s in skills
    ]
    return (
        "SKILLS (procedures you saved earlier; view one with skill_manage(action='view', name=...) "
        "before following it):\n" + "\n".join(lines)
    )


__all__ = ["MAX_SKILLS", "MAX_SKILL_CHARS", "SKILL_ACTIONS", "SkillInfo", "SkillStore", "render_skill_index"]
