"""What went into an answer, and `/why` (docs/concepts.md#why-an-answer-said-what-it-said).

`record` builds an answer's provenance from what the turn already holds in memory (the
session's system prompt and its `sources`, the messages answered, the tools run), so it
rides in the answer's own write (meta `provenance`): no extra storage call, and no prompt
text, only references: memory entry keys (a prefix of `visibility.entry_key`), skill
names, the uid and date of each `session_search` hit, file names and kinds, tool names and
outcomes. `explain` resolves those references against the stores as they are now, for the
person asking and the place they ask in: an entry since forgotten is only "an entry since
forgotten", and what the place may not show is counted, never named or quoted.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from agent.memory import TARGETS, MemorySnapshot, MemoryStore
from agent.messages import StoredMessage
from agent.sessions import SessionStore
from agent.skills import SkillStore
from agent.vault import ProfileFiles, as_files
from agent.visibility import GROUP_LANE, GROUP_TENANT, PRIVATE_CHAT, Scope, entry_key

VERSION = 1
KEY_CHARS = 12  # of an entry key: unique among one profile's entries, a third of the bytes
MAX_FILES = 10  # earlier files named per answer (the newest); the rest are counted
MAX_HITS = 20  # session_search hits kept per answer
_QUOTE = 60

#: where `/why` is asked: a private chat, a person's own lane in a group, a shared lane
Place = Literal["private", "member", "shared"]


# ----- recording ------------------------------------------------------------------------


def prompt_sources(
    snapshot: MemorySnapshot | None, skills: Iterable[str], persona: tuple[str, str] | None, own_persona: bool
) -> dict[str, Any]:
    """What a system prompt holds besides its fixed text, as references (kept in the system
    message's meta `sources`; every answer of the session copies them into its record)."""
    out: dict[str, Any] = {}
    if snapshot is not None:
        if snapshot.memory_keys:
            out["memory"] = [k[:KEY_CHARS] for k in snapshot.memory_keys]
        if snapshot.user_keys:
            out["user"] = [k[:KEY_CHARS] for k in snapshot.user_keys]
    names = list(skills)
    if names:
        out["skills"] = names
    if persona is not None:
        out["persona"] = "own" if own_persona else "operator"
    return out


def answered(history: list[StoredMessage]) -> list[StoredMessage]:
    """The user messages the answer being written replies to: those after the last answer
    (or summary, or the system prompt), in order."""
    out: list[StoredMessage] = []
    for m in reversed(history):
        if m.role == "system" or m.meta.get("compressed_summary"):
            break
        if m.role == "user":
            out.append(m)
        elif m.role == "assistant" and not m.tool_calls and m.content:
            break
    return out[::-1]


def _files_of(m: StoredMessage, now: bool, shared_lane: bool) -> list[dict[str, Any]]:
    items = [(f.get("name"), f.get("kind")) for f in m.meta.get("files") or [] if isinstance(f, dict)]
    items += [(f.get("name"), "image") for f in m.meta.get("images") or [] if isinstance(f, dict)]
    out = []
    for name, kind in items:
        item: dict[str, Any] = {"name": str(name or kind or "file"), "kind": str(kind or "other"), "msg": m.uid}
        if now:
            item["now"] = True
        if kind == "audio" and m.meta.get("transcribed"):
            item["transcribed"] = True
        if shared_lane and m.meta.get("user"):
            item["from"] = m.meta["user"]  # a shared lane: /why names only the asker's own
        out.append(item)
    return out


def _hits(result: str) -> list[dict[str, Any]]:
    """The messages a `session_search` result returned, without their text."""
    try:
        data = json.loads(result)
    except (TypeError, ValueError):
        return []
    rows = data.get("results") if isinstance(data, dict) else None
    return [
        {"session": r.get("session_id"), "uid": r.get("uid"), "at": r.get("timestamp"), "role": r.get("role")}
        for r in rows or []
        if isinstance(r, dict)
    ]


def tool_run(name: str, outcome: str, result: str) -> dict[str, Any]:
    """One tool call of a turn as its answer's provenance keeps it."""
    run: dict[str, Any] = {"name": name, "outcome": outcome}
    if name == "session_search" and outcome == "ok":
        run["hits"] = _hits(result)
    return run


def record(history: list[StoredMessage], runs: list[dict[str, Any]], *, scope: Scope, recalled: bool) -> dict[str, Any]:
    """The provenance of the answer about to be stored after `history`: the prompt's
    sources, the files in the conversation (those of the messages answered marked `now`),
    the tools the turn ran and what `session_search` returned."""
    system = next((m for m in history if m.role == "system"), None)
    sources = system.meta.get("sources") if system is not None else None
    rec: dict[str, Any] = {"v": VERSION, "scope": scope.name}
    if isinstance(sources, dict):
        rec.update(sources)
    elif system is not None:  # a prompt from before sources were kept: its entries, store unknown
        stamp = system.meta.get("memory_stamp") or {}
        keys = [str(k)[:KEY_CHARS] for k in stamp.get("keys") or []]
        if keys:
            rec["entries"] = keys
    shared_lane = scope is GROUP_TENANT
    now = {m.uid for m in answered(history)}
    files: list[dict[str, Any]] = []
    for m in history:
        if m.role == "user" and (m.meta.get("files") or m.meta.get("images")):
            files += _files_of(m, m.uid in now, shared_lane)
    current = [f for f in files if f.get("now")]
    earlier = [f for f in files if not f.get("now")]
    if earlier[:-MAX_FILES]:
        rec["earlier_files"] = len(earlier) - MAX_FILES
    if current or earlier:
        rec["files"] = earlier[-MAX_FILES:] + current
    tools = [{"name": r["name"], "outcome": r["outcome"]} for r in runs]
    if tools:
        rec["tools"] = tools
    hits: dict[str, dict[str, Any]] = {}
    for r in runs:
        for hit in r.get("hits") or []:
            hits.setdefault(str(hit.get("uid")), hit)
    if hits:
        rec["search"] = list(hits.values())[:MAX_HITS]
    if recalled:
        rec["recall"] = True
    return rec


def reminder_record(reminder_id: int, due: float) -> dict[str, Any]:
    """The provenance of a delivered reminder: which one, due when (nothing else goes in)."""
    return {"v": VERSION, "reminder": {"id": reminder_id, "due": due}}


# ----- explaining -----------------------------------------------------------------------


@dataclass(frozen=True)
class Asker:
    """Who asks `/why` and where: the place decides what may be shown (a group reads it)."""

    principal: str
    place: Place
    session_key: str


def replies(history: list[StoredMessage]) -> list[StoredMessage]:
    """The lane's replies in its live conversation, newest first (`/why N` counts them)."""
    return [
        m
        for m in reversed(history)
        if m.role == "assistant" and m.content and not m.tool_calls and not m.meta.get("compressed_summary")
    ]


def _when(ts: object) -> str:
    try:
        return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(float(ts)))  # type: ignore[arg-type]
    except (TypeError, ValueError, OverflowError):
        return "an unknown time"


def _quote(text: str) -> str:
    flat = " ".join(text.split())
    return f'"{flat}"' if len(flat) <= _QUOTE else f'"{flat[:_QUOTE]}..."'


def _ordinal(n: int) -> str:
    return "my last reply" if n == 1 else "my reply before last" if n == 2 else f"my reply {n} back"


_STORE_WORDS = {"memory": "note", "user": "profile entry"}
_SCOPE_OF = {"private": PRIVATE_CHAT.name, "member": GROUP_LANE.name, "shared": GROUP_TENANT.name}


def _entry_words(target: str, vis: str, asker: Asker) -> str:
    """Whose entry it is and who may see it, in words (docs/concepts.md#memory-visibility)."""
    if asker.place == "shared":
        return "this group's shared memory" + (" (about this group)" if target == "user" else "")
    what = _STORE_WORDS[target]
    if vis == "private":
        return f"your private {what}"
    return f"your shared {what}" + (" (groups may see it)" if asker.place == "private" else "")


async def _entries(files: ProfileFiles) -> dict[str, tuple[str, str, str]]:
    """Every entry of the profile now, by key prefix: (target, text, visibility)."""
    store = MemoryStore(files.root, read_only=True, scope=PRIVATE_CHAT, files=files)  # all of them; the caller filters
    out: dict[str, tuple[str, str, str]] = {}
    for target in TARGETS:
        entries = await store.entries(target)
        marks = await asyncio.to_thread(store.marks().of, target, entries)
        for text, vis in zip(entries, marks, strict=True):
            out[entry_key(target, text)[:KEY_CHARS]] = (target, text, vis)
    return out


class _Lines:
    """The lines of one explanation, and what is counted instead of shown."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.hidden: Counter[str] = Counter()

    def add(self, line: str) -> None:
        self.lines.append(f"- {line}")

    def hide(self, kind: str, n: int = 1) -> None:
        self.hidden[kind] += n


def _lane_words(session_key: str | None, asker: Asker) -> str:
    """Where a search hit was said, from the asker's standpoint."""
    if session_key is None:
        return "an earlier conversation"
    if session_key == asker.session_key:
        return "this chat"
    parts = session_key.split(":")
    platform, kind = (parts[2], parts[3]) if len(parts) > 3 else ("", "")
    if kind == "dm":
        return f"our private chat on {platform}"
    chat = parts[4] if len(parts) > 4 else "?"
    return f"your conversation in a group on {platform} (chat {chat})"


async def _memory(rec: dict[str, Any], asker: Asker, files: ProfileFiles, out: _Lines) -> None:
    refs: list[tuple[str | None, Any]] = [(t, k) for t in ("user", "memory") for k in rec.get(t) or []]
    refs += [(None, k) for k in rec.get("entries") or []]
    if not refs:
        return
    live = await _entries(files)
    # a group lane's prompt only held shared entries; one private now is counted there
    audience_sees_private = asker.place != "member"
    for target, key in refs:
        found = live.get(str(key))
        if found is None:
            store = f" ({'about you' if target == 'user' else 'a note'})" if target and asker.place != "shared" else ""
            out.add(f"an entry since forgotten{store}")
        elif found[2] == "private" and not audience_sees_private:
            out.hide("entry")
        else:
            out.add(f"{_entry_words(found[0], found[2], asker)}: {_quote(found[1])}")


async def _skills(rec: dict[str, Any], asker: Asker, files: ProfileFiles, out: _Lines) -> None:
    names = [str(n) for n in rec.get("skills") or []]
    if not names:
        return
    group = asker.place == "member"
    visible = {s.name for s in await SkillStore(files.root, read_only=True, files=files).index(shared_only=group)}
    shown = [n for n in names if n in visible]
    if shown:
        out.add("the skill index, listing " + ", ".join(shown))
    gone = len(names) - len(shown)
    if gone and group:
        out.hide("skill", gone)  # deleted or private now: a group is not told which
    elif gone:
        out.add(f"{gone} skill{'s' if gone > 1 else ''} since deleted")


def _persona(rec: dict[str, Any], asker: Asker, out: _Lines) -> None:
    persona = rec.get("persona")
    if persona == "own" and asker.place == "private":
        out.add("your own instructions (/persona)")
    elif persona == "own":
        out.hide("setting")
    elif persona == "operator":
        out.add("the persona chosen here (/persona)")


_KIND_WORDS = {"pdf": "a PDF", "text": "a text file", "image": "an image", "audio": "an audio file"}


def _files(rec: dict[str, Any], asker: Asker, out: _Lines) -> None:
    for f in rec.get("files") or []:
        if asker.place == "shared" and f.get("from") != asker.principal:
            out.hide("file from another member")
            continue
        kind = "a voice note" if f.get("kind") == "audio" and f.get("transcribed") else None
        kind = kind or _KIND_WORDS.get(str(f.get("kind")), "a file")
        how = ", transcribed" if f.get("transcribed") else ""
        when = "with the message I answered" if f.get("now") else "earlier in this conversation"
        out.add(f"{f.get('name')} ({kind} you sent {when}{how})")
    if rec.get("earlier_files"):
        out.add(f"{rec['earlier_files']} more file(s) sent earlier in this conversation")


async def _search(rec: dict[str, Any], asker: Asker, sessions: SessionStore, out: _Lines) -> None:
    hits = [h for h in rec.get("search") or [] if isinstance(h, dict)]
    if not hits:
        return
    keys: dict[str, str | None] = {}
    if asker.place == "private":  # a private chat's search spans every conversation: say which
        keys = {s["id"]: s.get("session_key") for s in await sessions.list_sessions()}
    said = []
    for h in hits:
        # elsewhere the search only ever covered this lane's own conversations
        lane = keys.get(str(h.get("session"))) if asker.place == "private" else asker.session_key
        who = {"user": "a message", "assistant": "my reply", "tool": "a tool result"}.get(
            str(h.get("role")), "a message"
        )
        said.append(f"{who} in {_lane_words(lane, asker)} of {_when(h.get('at'))}")
    if said:
        out.add(f"a search of earlier conversations, which found {len(said)}: " + "; ".join(said))


_OUTCOME_WORDS = {"ok": "worked", "error": "failed", "refused": "was refused", "denied": "was not allowed"}


def _tools(rec: dict[str, Any], out: _Lines) -> None:
    runs = Counter((str(t.get("name")), str(t.get("outcome"))) for t in rec.get("tools") or [] if isinstance(t, dict))
    if not runs:
        return
    said = []
    for (name, outcome), n in runs.items():
        times = f" ×{n}" if n > 1 else ""
        said.append(f"{name}{times} ({_OUTCOME_WORDS.get(outcome, outcome)})")
    out.add("tools: " + ", ".join(said))


def _hidden(counts: Counter[str]) -> str:
    parts = []
    for kind, n in counts.items():
        if kind == "entry":
            parts.append(f"{n} entr{'ies' if n > 1 else 'y'}")
        elif kind == "file from another member":
            parts.append(f"{n} file{'s' if n > 1 else ''} from another member")
        else:
            parts.append(f"{n} {kind}{'s' if n > 1 else ''}")
    return "And " + " and ".join(parts) + " you cannot see here."


async def explain(
    history: list[StoredMessage], n: int, asker: Asker, profile: ProfileFiles | Path, sessions: SessionStore
) -> str:
    """`/why N`: what went into the lane's Nth-last reply, as far as `asker` may see it here
    (`profile`: its files, read with the tenant's key when encrypted)."""
    files = as_files(profile)
    found = replies(history)
    if not found:
        return "I haven't replied in this conversation yet, so there is nothing to explain."
    if n > len(found):
        return f"This conversation has {len(found)} repl{'ies' if len(found) > 1 else 'y'} of mine; /why {len(found)} is the oldest."
    reply = found[n - 1]
    head = f"{_ordinal(n).capitalize()} ({_when(reply.timestamp)}, {_quote(reply.content or '')})"
    rec = reply.meta.get("provenance")
    if not isinstance(rec, dict):
        return f"{head}: I kept no record of what went into it (it was written before I kept them)."
    if rec.get("scope", _SCOPE_OF[asker.place]) != _SCOPE_OF[asker.place] and asker.place != "private":
        # written for another audience than this place's (never expected): nothing is shown
        return f"{head}: what went into it can't be shown here."
    reminder = rec.get("reminder")
    if isinstance(reminder, dict):
        return (
            f"{head} was reminder #{reminder.get('id')}, due {_when(reminder.get('due'))}, delivered as it was set; "
            "nothing else went into it."
        )
    out = _Lines()
    await _memory(rec, asker, files, out)
    await _skills(rec, asker, files, out)
    _persona(rec, asker, out)
    if rec.get("recall"):
        out.add("what my memory service recalled for the message (never kept, so I can't list it)")
    _files(rec, asker, out)
    await _search(rec, asker, sessions, out)
    _tools(rec, out)
    if not out.lines and not out.hidden:
        return f"{head}: nothing stored went into it (no memory, skills, searches, files or tools); it came from this conversation alone."
    lines = [f"{head} drew on:", *out.lines] if out.lines else [f"{head}: nothing I can show here went into it."]
    if out.hidden:
        lines.append(_hidden(out.hidden))
    lines.append("Besides these, it saw this conversation so far.")
    return "\n".join(lines)


__all__ = [
    "Asker",
    "Place",
    "answered",
    "explain",
    "prompt_sources",
    "record",
    "reminder_record",
    "replies",
    "tool_run",
]
