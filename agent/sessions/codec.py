"""How messages and events look on disk: journal lines, SQLite rows, and the conversation order."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Sequence
from typing import Any

from agent.messages import StoredMessage

_SESSION_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
_LINE_BREAKERS = str.maketrans({"\u2028": "\\u2028", "\u2029": "\\u2029", "\x85": "\\u0085"})


def now() -> float:
    return time.time()


def dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def journal_line(obj: dict[str, Any]) -> str:
    """One JSONL line. Unicode line separators are escaped so no reader can split a record."""
    return dumps(obj).translate(_LINE_BREAKERS) + "\n"


def clean_str(s: str) -> str:
    """Replace lone surrogates (unencodable in UTF-8) with U+FFFD; pairs are joined."""
    try:
        s.encode("utf-8")
        return s
    except UnicodeEncodeError:
        return s.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


def clean(obj: Any) -> Any:
    if isinstance(obj, str):
        return clean_str(obj)
    if isinstance(obj, dict):
        return {clean(k): clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [clean(v) for v in obj]
    return obj


def check_session_id(session_id: str) -> str:
    """Session ids become file names: refuse anything that could leave sessions/."""
    if not isinstance(session_id, str) or not _SESSION_ID_RE.match(session_id) or ".." in session_id:
        raise ValueError(f"invalid session id: {session_id!r}")
    return session_id


def message_line(m: StoredMessage) -> dict[str, Any]:
    return {"type": "message", **m.to_json()}


def start_line(
    sid: str,
    session_key: str | None,
    *,
    parent: str | None,
    route: bool,
    ts: float,
    source: str = "",
    user_id: str = "",
    model: str = "",
) -> dict[str, Any]:
    return {
        "type": "event",
        "event": "session_start",
        "session_id": sid,
        "session_key": session_key,
        "parent_session_id": parent,
        "source": source,
        "user_id": user_id,
        "model": model,
        "route": route,
        "ts": ts,
    }


def end_line(sid: str, reason: str | None, ts: float) -> dict[str, Any]:
    return {"type": "event", "event": "session_end", "session_id": sid, "reason": reason, "ts": ts}


def flags_line(uids: list[str], active: bool | None, compacted: bool | None, reason: str, ts: float) -> dict[str, Any]:
    return {
        "type": "event",
        "event": "flags",
        "uids": uids,
        "active": active,
        "compacted": compacted,
        "reason": reason,
        "ts": ts,
    }


def prepare_messages(msgs: list[StoredMessage], check_session: bool = True) -> list[StoredMessage]:
    """Validate messages for storage; lone surrogates are replaced with U+FFFD."""
    cleaned: list[StoredMessage] = []
    for m in msgs:
        if check_session:
            check_session_id(m.session_id)
        if not isinstance(m.uid, str) or not m.uid:
            raise ValueError("message uid must be a non-empty string")
        if not isinstance(m.role, str) or not (m.content is None or isinstance(m.content, str)):
            raise TypeError(f"message {m.uid}: role must be str and content str or None")
        if not (m.tool_calls is None or isinstance(m.tool_calls, list)) or not isinstance(m.meta, dict):
            raise TypeError(f"message {m.uid}: tool_calls must be a list or None and meta a dict")
        data = message_line(m)
        try:
            dumps(data).encode("utf-8")
        except UnicodeEncodeError:
            data = clean(data)
            m = StoredMessage.from_json(data)
        except (TypeError, ValueError) as e:
            raise ValueError(f"message {m.uid} is not JSON-serialisable: {e}") from e
        cleaned.append(m)
    return cleaned


def msg_row(m: StoredMessage) -> tuple[Any, ...]:
    return (
        m.uid,
        m.session_id,
        m.role,
        m.content,
        m.tool_call_id,
        None if m.tool_calls is None else dumps(m.tool_calls),
        m.tool_name,
        m.timestamp,
        m.token_count,
        m.finish_reason,
        1 if m.active else 0,
        1 if m.compacted else 0,
        dumps(m.meta or {}),
    )


def row_msg(r: Sequence[Any]) -> StoredMessage:
    """A message from a `SELECT {db.MSG_COLS}` row (positional: the column list's order)."""
    uid, sid, role, content, tool_call_id, tool_calls, tool_name, ts, tokens, finish, active, compacted, meta = r
    return StoredMessage(
        session_id=sid,
        role=role,
        content=content,
        uid=uid,
        tool_call_id=tool_call_id,
        tool_calls=None if tool_calls is None else json.loads(tool_calls),
        tool_name=tool_name,
        timestamp=ts,
        token_count=tokens,
        finish_reason=finish,
        active=bool(active),
        compacted=bool(compacted),
        meta=json.loads(meta) if meta else {},
    )


def conversation_order(msgs: list[StoredMessage]) -> list[StoredMessage]:
    """Insertion order, except that a message whose meta names `after_uid` (a compression
    summary) follows that message when it is present. Originals are never re-inserted, so a
    summary written after the tail it precedes still reads [head..., summary, tail...].

    System prompts lead: a rebuilt one (meta `replaces`, appended later) stands first, and
    an anchor naming the prompt it replaced names the new one."""
    if any(m.role == "system" for m in msgs[1:]):
        msgs = [m for m in msgs if m.role == "system"] + [m for m in msgs if m.role != "system"]
    alias = {
        m.meta["replaces"]: m.uid
        for m in msgs
        if m.role == "system" and isinstance(m.meta, dict) and isinstance(m.meta.get("replaces"), str)
    }
    present = {m.uid for m in msgs}
    moved: dict[str, list[StoredMessage]] = {}
    for m in msgs:
        anchor = m.meta.get("after_uid") if isinstance(m.meta, dict) else None
        for _ in range(len(alias)):
            if anchor not in alias or anchor in present:
                break
            anchor = alias[anchor]
        if isinstance(anchor, str) and anchor != m.uid and anchor in present:
            moved.setdefault(anchor, []).append(m)
    if not moved:
        return msgs
    moved_ids = {id(m) for ms in moved.values() for m in ms}
    out: list[StoredMessage] = []
    emitted: set[int] = set()
    for root in msgs:
        if id(root) in moved_ids:
            continue
        stack = [root]
        while stack:
            m = stack.pop()
            if id(m) in emitted:
                continue
            emitted.add(id(m))
            out.append(m)
            stack.extend(reversed(moved.pop(m.uid, [])))
    out.extend(m for m in msgs if id(m) not in emitted)  # anchor cycles: keep insertion order
    return out
