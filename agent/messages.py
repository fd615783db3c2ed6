"""The message record every part of the agent shares: what is journaled, stored and sent."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any


def new_uid() -> str:
    """A stable, globally unique message id (sortable by creation time)."""
    return f"{time.time_ns():x}-{uuid.uuid4().hex[:12]}"


@dataclass
class StoredMessage:
    """One message of a session, as journaled to JSONL and stored in state.db.

    `active` is false once a message was undone or reset away; `compacted` once a
    compression replaced it with a summary. Neither ever deletes the original.
    """

    session_id: str
    role: str  # system | user | assistant | tool
    content: str | None
    uid: str = field(default_factory=new_uid)
    tool_call_id: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_name: str | None = None
    timestamp: float = field(default_factory=time.time)
    token_count: int | None = None
    finish_reason: str | None = None
    active: bool = True
    compacted: bool = False
    meta: dict[str, Any] = field(default_factory=dict)

    def to_openai(self) -> dict[str, Any]:
        """The wire form for an OpenAI-compatible chat request (no private fields)."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = self.tool_calls
        if self.role == "tool":
            out["tool_call_id"] = self.tool_call_id
            if self.tool_name:
                out["name"] = self.tool_name
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "uid": self.uid,
            "session_id": self.session_id,
            "role": self.role,
            "content": self.content,
            "tool_call_id": self.tool_call_id,
            "tool_calls": self.tool_calls,
            "tool_name": self.tool_name,
            "timestamp": self.timestamp,
            "token_count": self.token_count,
            "finish_reason": self.finish_reason,
            "active": self.active,
            "compacted": self.compacted,
            "meta": self.meta,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> StoredMessage:
        known = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
        return cls(**known)

    def dumps(self) -> str:
        return json.dumps(self.to_json(), ensure_ascii=False, separators=(",", ":"))
