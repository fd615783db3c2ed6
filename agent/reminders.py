"""Reminders of one tenant: `reminders.json` in the profile, and the `reminders` tool.

Each reminder remembers the lane it was set in (platform, chat, thread, session key): it is
listed, cancelled and delivered only there (a private chat sees all of its tenant's). Its
due time is a UTC timestamp; times the person gives are read in their IANA time zone
(zoneinfo) or at the offset they carry, and repeating reminders keep their wall-clock time
across DST changes. The file is replaced
atomically under an exclusive lock, so the tool and the gateway's scheduler never lose
each other's writes. Delivery itself is the gateway's job (gateway/reminders.py).
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import re
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass
from datetime import datetime, timedelta, timezone, tzinfo
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from agent.vault import ProfileFiles, VaultError, as_files

FILE = "reminders.json"
MAX_TEXT = 500
REPEATS = ("hourly", "daily", "weekly")

# the gateway's index of next-due times: (next due or None, lower_only). lower_only: called
# before a write, so a crash between the index and the file can only wake the scheduler early
IndexHook = Callable[[float | None, bool], Awaitable[None]]

REMINDERS_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "reminders",
        "description": (
            "Reminders delivered into this chat at a set time. create: give `text` and either `at` "
            "(local date and time 'YYYY-MM-DD HH:MM' in the person's time zone, with `timezone`, or an "
            "ISO time with an explicit offset) or "
            "`in_minutes`; `repeat` optional. The person's time zone is an IANA name such as "
            "Europe/Berlin: take it from what you know about the person; if you don't know it, ask "
            "them once and save it to the user profile with the memory tool (e.g. 'Time zone: "
            "Europe/Berlin'). list: the reminders set here. cancel: by `id`."
        ),
        "parameters": {
            "type": "object",
            "properties": {
                "action": {"type": "string", "enum": ["create", "list", "cancel"]},
                "text": {"type": "string", "description": "What to remind them of (create)."},
                "at": {
                    "type": "string",
                    "description": "Local 'YYYY-MM-DD HH:MM', or ISO with offset (create).",
                },
                "in_minutes": {"type": "number", "description": "Delay from now in minutes (create)."},
                "timezone": {"type": "string", "description": "IANA time zone of the person, e.g. Europe/Berlin."},
                "repeat": {"type": "string", "enum": ["none", *REPEATS]},
                "id": {"type": "integer", "description": "The reminder to cancel (cancel)."},
            },
            "required": ["action"],
        },
    },
}


class ReminderError(Exception):
    """A reminder that cannot be set; the message says why (shown to the model or person)."""


@dataclass(frozen=True)
class ReminderChat:
    """Where a reminder was set, and so where it is delivered (the same lane)."""

    platform: str
    chat_id: str
    chat_type: str
    thread_id: str | None
    user_id: str
    user_name: str = ""
    # a Discord private thread is its own shared chat: its occurrence must resolve there
    private_thread: bool = False
    lane: str = ""  # session key of the lane it was set in ("" in files from before it was kept)

    def in_lane(self, platform: str, chat_id: str, thread_id: str | None, lane: str) -> bool:
        """Set in this lane: same chat and thread, and the same session key when it is known."""
        here = (self.platform, self.chat_id, self.thread_id) == (platform, chat_id, thread_id)
        return here and (not self.lane or self.lane == lane)

    def of_account(self, principal: str) -> bool:
        """Set by the account `principal` (`<platform>:<user_id>`)."""
        return f"{self.platform}:{self.user_id}" == principal


@dataclass
class Reminder:
    id: int
    text: str
    due: float  # UTC timestamp of the next delivery
    chat: ReminderChat
    tz: str | None = None
    repeat: str | None = None
    created_at: float = 0.0

    def local(self, when: float | None = None) -> str:
        """The due time as the person reads it."""
        stamp = datetime.fromtimestamp(self.due if when is None else when, _tzinfo(self.tz))
        return stamp.strftime("%a %d %b %Y %H:%M") + f" ({self.tz or 'UTC'})"

    def describe(self) -> str:
        every = {"hourly": ", every hour", "daily": ", every day", "weekly": ", every week"}.get(self.repeat or "", "")
        return f"#{self.id} {self.local()}{every}: {self.text}"


def zone(name: str) -> ZoneInfo:
    try:
        return ZoneInfo(name.strip())
    except (ZoneInfoNotFoundError, ValueError, TypeError):
        raise ReminderError(f"unknown time zone {name!r}; use an IANA name such as Europe/Berlin") from None


_OFFSET_RE = re.compile(r"UTC([+-])(\d\d):(\d\d)")


def offset_name(offset: timedelta) -> str:
    """A fixed UTC offset as a reminder's zone name (`UTC`, `UTC+05:30`)."""
    if not offset:
        return "UTC"
    sign, rest = ("-", -offset) if offset < timedelta(0) else ("+", offset)
    minutes = int(rest.total_seconds() // 60)
    return f"UTC{sign}{minutes // 60:02d}:{minutes % 60:02d}"


def _tzinfo(name: str | None) -> tzinfo:
    """The zone of a stored reminder: an IANA name, or a fixed offset from `offset_name`."""
    if not name:
        return ZoneInfo("UTC")
    fixed = _OFFSET_RE.fullmatch(name)
    if fixed is None:
        return zone(name)
    sign = -1 if fixed.group(1) == "-" else 1
    return timezone(sign * timedelta(hours=int(fixed.group(2)), minutes=int(fixed.group(3))))


def next_occurrence(due: float, tz: str | None, repeat: str, after: float) -> float:
    """The first occurrence of a repeating reminder later than `after` (missed ones are
    skipped); days and weeks keep the local wall-clock time."""
    if repeat == "hourly":
        steps = int((after - due) // 3600) + 1 if after >= due else 1
        return due + steps * 3600
    days = 1 if repeat == "daily" else 7
    local = datetime.fromtimestamp(due, _tzinfo(tz))
    while True:
        local = (local.replace(tzinfo=None) + timedelta(days=days)).replace(tzinfo=local.tzinfo)
        if local.timestamp() > after:
            return local.timestamp()


class ReminderStore:
    """`reminders.json` of one profile; every change is a locked, atomic read-modify-write."""

    def __init__(self, profile: ProfileFiles | Path, guard: Callable[[], None] | None = None) -> None:
        """`profile`: the profile's files (sealed when encrypted); a bare path is a plain profile.
        `guard` is called right before the file is replaced and raises to refuse it (cluster
        mode: the tenant's lease)."""
        self.files = as_files(profile)
        self.path = self.files.path(FILE)
        self._lock_path = self.files.path(f".{FILE}.lock")
        self.guard = guard

    def _read(self) -> dict[str, Any]:
        try:
            data = json.loads(self.files.read_text(FILE))
        except FileNotFoundError:
            return {"next_id": 1, "reminders": []}
        return data if isinstance(data, dict) else {"next_id": 1, "reminders": []}

    @staticmethod
    def _parse(raw: dict[str, Any]) -> Reminder:
        return Reminder(**{**raw, "chat": ReminderChat(**raw["chat"])})

    def _change(self, fn: Callable[[dict[str, Any]], Any]) -> Any:
        self._lock_path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            data = self._read()
            result = fn(data)
            if self.guard is not None:
                self.guard()
            self.files.write_text(FILE, json.dumps(data, ensure_ascii=False, indent=1))
            return result
        finally:
            os.close(fd)

    def zone_now(self) -> tzinfo:
        """The person's time zone as their reminders know it: that of the latest reminder
        set with one, else UTC (budget days roll over at its midnight, agent/metering.py)."""
        try:
            raws = [r for r in self._read().get("reminders", []) if isinstance(r, dict) and r.get("tz")]
            latest = max(raws, key=lambda r: float(r.get("created_at") or 0), default=None)
            return _tzinfo(str(latest["tz"])) if latest is not None else ZoneInfo("UTC")
        except (OSError, ValueError, ReminderError, VaultError):
            return ZoneInfo("UTC")

    async def all(self) -> list[Reminder]:
        data = await asyncio.to_thread(self._read)
        return sorted((self._parse(r) for r in data.get("reminders", [])), key=lambda r: r.due)

    async def next_due(self) -> float | None:
        items = await self.all()
        return items[0].due if items else None

    async def add(
        self,
        text: str,
        due: float,
        chat: ReminderChat,
        *,
        tz: str | None,
        repeat: str | None,
        cap: int,
        now: float,
        private: bool = True,
    ) -> Reminder:
        """Add one; over `cap` it is refused (`private`: the lane may see every reminder, so
        the refusal may say how many there are; elsewhere it names no count)."""

        def op(data: dict[str, Any]) -> Reminder:
            if len(data["reminders"]) >= cap:
                raise ReminderError(
                    f"this person already has {cap} reminders, the most allowed; cancel one first (list shows them)"
                    if private
                    else "no more reminders can be set for this person right now; they can cancel some "
                    "in a private chat with me (/reminders there lists them)"
                )
            reminder = Reminder(
                id=int(data.get("next_id", 1)), text=text, due=due, chat=chat, tz=tz, repeat=repeat, created_at=now
            )
            data["next_id"] = reminder.id + 1
            data["reminders"].append(asdict(reminder))
            return reminder

        return await asyncio.to_thread(self._change, op)

    async def cancel(self, reminder_id: int, *, where: Callable[[Reminder], bool] | None = None) -> Reminder | None:
        """Remove one (only if `where` accepts it, when given); the removed reminder or None."""

        def op(data: dict[str, Any]) -> Reminder | None:
            for i, raw in enumerate(data["reminders"]):
                if raw.get("id") == reminder_id and (where is None or where(self._parse(raw))):
                    return self._parse(data["reminders"].pop(i))
            return None

        return await asyncio.to_thread(self._change, op)

    async def remove_where(self, where: Callable[[Reminder], bool]) -> list[Reminder]:
        """Remove every reminder `where` accepts; the removed ones, by due time."""
        return await asyncio.to_thread(self.remove_where_now, where)

    def remove_where_now(self, where: Callable[[Reminder], bool]) -> list[Reminder]:
        """`remove_where` for a caller that is not in the event loop (the admin tools)."""
        if not self.path.exists():
            return []

        def op(data: dict[str, Any]) -> list[Reminder]:
            keep: list[dict[str, Any]] = []
            gone: list[dict[str, Any]] = []
            for raw in data["reminders"]:
                (gone if where(self._parse(raw)) else keep).append(raw)
            data["reminders"] = keep
            return sorted((self._parse(r) for r in gone), key=lambda r: r.due)

        removed: list[Reminder] = self._change(op)
        return removed

    def next_due_now(self) -> float | None:
        """`next_due` outside the event loop."""
        dues = [float(r["due"]) for r in self._read().get("reminders", []) if isinstance(r, dict) and "due" in r]
        return min(dues) if dues else None

    async def advance(self, reminder_id: int, delivered_due: float, now: float) -> None:
        """The occurrence due at `delivered_due` was handed over for delivery: schedule the
        next one of a repeating reminder, remove a one-off."""

        def op(data: dict[str, Any]) -> None:
            for i, raw in enumerate(data["reminders"]):
                if raw.get("id") != reminder_id or raw.get("due") != delivered_due:
                    continue
                if raw.get("repeat"):
                    raw["due"] = next_occurrence(delivered_due, raw.get("tz"), raw["repeat"], now)
                else:
                    data["reminders"].pop(i)
                return

        await asyncio.to_thread(self._change, op)


@dataclass
class ReminderTool:
    """The `reminders` tool of one turn: bound to the tenant's store and the chat it runs in."""

    store: ReminderStore
    chat: ReminderChat
    cap: int
    index: IndexHook
    group: bool  # list and cancel only what was set in this lane (others can read it)
    clock: Callable[[], float] = time.time

    def _here(self, reminder: Reminder) -> bool:
        """May this lane see `reminder`: a private chat sees all of its tenant's, any other
        lane only those set in it."""
        c = self.chat
        return not self.group or reminder.chat.in_lane(c.platform, c.chat_id, c.thread_id, c.lane)

    async def handle(self, args: dict[str, Any]) -> str:
        action = args.get("action")
        try:
            if action == "create":
                return await self._create(args)
            if action == "list":
                mine = [r for r in await self.store.all() if self._here(r)]
                return _ok(count=len(mine), reminders=[r.describe() for r in mine])
            if action == "cancel":
                rid = args.get("id")
                if not isinstance(rid, int) or isinstance(rid, bool):
                    raise ReminderError("cancel needs the reminder's numeric id (see list)")
                removed = await self.store.cancel(rid, where=self._here)
                if removed is None:
                    raise ReminderError(f"there is no reminder #{rid} here")
                await self.index(await self.store.next_due(), False)
                return _ok(cancelled=removed.describe())
            raise ReminderError("action must be create, list or cancel")
        except ReminderError as err:
            return json.dumps({"success": False, "error": str(err)}, ensure_ascii=False)

    async def _create(self, args: dict[str, Any]) -> str:
        text = args.get("text")
        if not isinstance(text, str) or not text.strip():
            raise ReminderError("text must say what to remind them of")
        if len(text) > MAX_TEXT:
            raise ReminderError(f"text is too long (at most {MAX_TEXT} characters)")
        repeat = args.get("repeat") or None
        if repeat == "none":
            repeat = None
        if repeat is not None and repeat not in REPEATS:
            raise ReminderError(f"repeat must be one of none, {', '.join(REPEATS)}")
        tz = args.get("timezone") or None
        if tz is not None:
            tz = zone(str(tz)).key
        now = self.clock()
        if args.get("at"):
            instant = _instant(str(args["at"]))
            if instant is not None:  # an explicit offset names one instant: no zone needed
                due = instant.timestamp()
                offset = instant.utcoffset()
                tz = tz or offset_name(offset if offset is not None else timedelta(0))
            elif tz is None:
                raise ReminderError(
                    "a time of day needs the person's time zone: ask them once, save it to "
                    "the user profile with the memory tool, and pass it as timezone"
                )
            else:
                try:
                    # a wall-clock time in `tz`, given its zone on the next line
                    local = datetime.strptime(str(args["at"]).strip().replace("T", " ")[:16], "%Y-%m-%d %H:%M")  # noqa: DTZ007
                except ValueError:
                    raise ReminderError("at must be 'YYYY-MM-DD HH:MM' (local time)") from None
                due = local.replace(tzinfo=zone(tz)).timestamp()
        elif isinstance(args.get("in_minutes"), (int, float)) and not isinstance(args.get("in_minutes"), bool):
            if args["in_minutes"] <= 0 or args["in_minutes"] > 366 * 24 * 60:
                raise ReminderError("in_minutes must be between 0 and a year")
            due = now + float(args["in_minutes"]) * 60
        else:
            raise ReminderError("create needs `at` (with timezone) or `in_minutes`")
        if due <= now:
            raise ReminderError("that time has already passed")
        await self.index(due, True)  # first: a crash before the file is written only wakes the scheduler
        reminder = await self.store.add(
            text.strip(), due, self.chat, tz=tz, repeat=repeat, cap=self.cap, now=now, private=not self.group
        )
        await self.index(await self.store.next_due(), False)
        return _ok(created=reminder.describe())


def _instant(text: str) -> datetime | None:
    """An ISO 8601 time with an explicit UTC offset (`...+00:00`, `...Z`), else None."""
    try:
        parsed = datetime.fromisoformat(text.strip())
    except ValueError:
        return None
    return parsed if parsed.tzinfo is not None else None


def merge_files(target: ProfileFiles | Path, sources: Sequence[ProfileFiles | Path]) -> None:
    """Carry the reminders of closed profiles `sources` into the closed profile `target`
    (a /link merge): each keeps its lane and time under a new id; one already carried
    (same text, time, lane and creation) is not added twice."""
    store = ReminderStore(target)
    incoming = []
    for src in sources:
        raw = ReminderStore(src)._read().get("reminders", [])
        incoming += [r for r in raw if isinstance(r, dict)]
    if not incoming:
        return

    def op(data: dict[str, Any]) -> None:
        def same(r: dict[str, Any]) -> tuple:
            return (r.get("text"), r.get("due"), json.dumps(r.get("chat"), sort_keys=True), r.get("created_at"))

        have = {same(r) for r in data["reminders"]}
        next_id = max([int(data.get("next_id", 1)), *(int(r.get("id", 0)) + 1 for r in data["reminders"])])
        for raw in incoming:
            if same(raw) in have:
                continue
            data["reminders"].append({**raw, "id": next_id})
            have.add(same(raw))
            next_id += 1
        data["next_id"] = next_id

    store._change(op)


def _ok(**fields: Any) -> str:
    return json.dumps({"success": True, **fields}, ensure_ascii=False)
