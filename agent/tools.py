"""The tools the model sees (Hermes-compatible names and arguments) and their dispatch.

Every tool result is a short JSON string saying what happened or why it was refused.
A `ToolBox` is built per turn from that turn's own stores, so a tool can only ever
reach the current tenant's profile.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any, Literal

from agent.memory import MemoryStore
from agent.reminders import REMINDERS_TOOL, ReminderTool
from agent.sessions import SessionStore
from agent.skills import SKILL_ACTIONS, SkillStore
from agent.toolkit import DEFAULT_SERVICES, ConfirmGate, Speaker, ToolServices, failed, permits, question, refusal

log = logging.getLogger("hermes.agent")

#: what became of one tool call: it worked, it failed, it was refused (not allowed here,
#: unknown, bad arguments) or the person did not allow it
Outcome = Literal["ok", "error", "refused", "denied"]

MEMORY_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "memory",
        "description": (
            "Save durable facts to your persistent memory, which you will see at the start of "
            "every future conversation with this person. target 'user' is what you know about "
            "the person (preferences, name, facts they shared); target 'memory' is your own notes. "
            "Keep entries short; replace or remove stale ones."
        ),
        "parameters": {
            "type": "object",
            "properties": {
                "action": {"type": "string", "enum": ["add", "replace", "remove"]},
                "target": {"type": "string", "enum": ["memory", "user"]},
                "content": {"type": "string", "description": "The entry text (add, replace)."},
                "old_text": {
                    "type": "string",
                    "description": "A unique substring of the entry to replace or remove.",
                },
            },
            "required": ["action", "target"],
        },
    },
}

SESSION_SEARCH_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "session_search",
        "description": (
            "Full-text search over your past conversations with this person (or this group), "
            "including older sessions. Use it when they refer to something discussed before."
        ),
        "parameters": {
            "type": "object",
            "properties": {
                "query": {"type": "string"},
                "limit": {"type": "integer", "minimum": 1, "maximum": 20},
            },
            "required": ["query"],
        },
    },
}


SKILL_MANAGE_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "skill_manage",
        "description": (
            "Your skills: short reusable procedures (how to do a kind of task well) that you see "
            "listed at the start of every conversation here. list / view them; create one when you "
            "worked out a non-trivial approach worth reusing; update it when you learn better. A skill "
            "holds steps, never personal facts, names or secrets (those belong in memory)."
        ),
        "parameters": {
            "type": "object",
            "properties": {
                "action": {"type": "string", "enum": list(SKILL_ACTIONS)},
                "name": {"type": "string", "description": "lower-case-with-dashes (view, create, update, delete)"},
                "description": {"type": "string", "description": "One line: when to use it (create, update)."},
                "content": {"type": "string", "description": "The procedure, in Markdown (create, update)."},
            },
            "required": ["action"],
        },
    },
}


def _refused(error: str) -> str:
    return json.dumps({"success": False, "error": error}, ensure_ascii=False)


@dataclass
class ToolBox:
    """The tools of one turn, bound to that turn's tenant stores and speaker."""

    sessions: SessionStore
    memory: MemoryStore | None  # None: memory is off in this lane
    # set in lanes others can read (groups): search only this lane's own conversations,
    # so a person's private chats never surface in a group reply
    search_lane: str | None = None
    skills: SkillStore | None = None  # None: skills are off in this lane
    shared: bool = False  # a lane others can read: only shared skills, new skills are shared
    only: frozenset[str] | None = None  # restrict to these tools (the background review)
    write_approval: str = "allow"  # memory.write_approval: allow | stage | block
    reminders: ReminderTool | None = None  # None: no reminders in this turn (e.g. a review)
    # who may use what (docs/concepts.md#who-may-use-a-tool) and the shared web and MCP clients
    services: ToolServices = DEFAULT_SERVICES
    speaker: Speaker = field(default_factory=lambda: Speaker(dm=False))
    tenant: str = ""
    confirm: ConfirmGate | None = None  # None: nobody to ask (a review): confirm tools are denied
    agent_name: str = "Hermes"
    _mcp: dict[str, Any] | None = field(default=None, init=False, repr=False)  # qualified -> McpTool, once per turn

    def _builtin_schemas(self) -> list[dict[str, Any]]:
        tools = []
        if self.memory is not None:
            tools.append(MEMORY_TOOL)
        if self.skills is not None:
            tools.append(SKILL_MANAGE_TOOL)
        tools.append(SESSION_SEARCH_TOOL)
        if self.reminders is not None:
            tools.append(REMINDERS_TOOL)
        tools.extend(t.schema for t in self.services.web.values())
        return tools

    async def _mcp_tools(self) -> dict[str, Any]:
        if self._mcp is None:
            found: dict[str, Any] = {}
            hub = self.services.mcp
            servers = self.services.mcp_servers_for(self.speaker)  # the others are not even started
            if hub is not None and self.only is None and servers:
                try:
                    found = {t.qualified: t for t in await hub.tools(self.tenant, servers)}
                except Exception:  # a tool server must never break a turn
                    log.exception("listing MCP tools failed")
            self._mcp = found
        return self._mcp

    def rule_of(self, name: str) -> tuple[Any, bool]:
        """(allow, confirm) of a tool this box lists."""
        return self._rule(name)

    def has_dm_only(self) -> bool:
        """Whether a tool is left out here that a direct message would offer."""
        dm = Speaker(dm=True, operator=self.speaker.operator, chat_admin=self.speaker.chat_admin)
        names = [t["function"]["name"] for t in self._builtin_schemas()] + list(self._mcp or {})
        return any(permits(self._rule(n)[0], dm) and not permits(self._rule(n)[0], self.speaker) for n in names)

    def _rule(self, name: str) -> tuple[Any, bool]:
        tool = (self._mcp or {}).get(name)
        if tool is not None:
            return self.services.rule(name, tool.server, tool.name)
        return self.services.rule(name)

    async def schemas(self) -> list[dict[str, Any]]:
        """The tools this lane's speaker may use (a group never sees a `dm` tool)."""
        tools = [t for t in self._builtin_schemas() if permits(self._rule(t["function"]["name"])[0], self.speaker)]
        for qualified, tool in (await self._mcp_tools()).items():
            if permits(self._rule(qualified)[0], self.speaker):
                tools.append(tool.openai_tool())
        return [t for t in tools if self.only is None or t["function"]["name"] in self.only]

    async def call(self, name: str, arguments: str | dict | None) -> str:
        """Run one tool call; never raises, always returns the JSON result string."""
        return (await self.run(name, arguments))[0]

    async def run(self, name: str, arguments: str | dict | None) -> tuple[str, Outcome]:
        """Run one tool call: (the JSON result string, its outcome), the outcome as /metrics
        counts it; never raises."""
        try:
            args = json.loads(arguments) if isinstance(arguments, str) and arguments.strip() else (arguments or {})
        except json.JSONDecodeError:
            return _refused("arguments were not valid JSON"), "refused"
        if not isinstance(args, dict):
            return _refused("arguments must be a JSON object"), "refused"
        if self.only is not None and name not in self.only:
            return _refused(f"only {', '.join(sorted(self.only))} can be used here"), "refused"
        mcp = await self._mcp_tools()
        known = name in mcp or name in self.services.web or name in ("skill_manage", "memory", "session_search")
        known = known or (name == "reminders" and self.reminders is not None)
        if not known:
            return _refused(f"unknown tool {name!r}"), "refused"
        allow, confirm = self._rule(name)
        if not permits(allow, self.speaker):  # offered only where allowed; a call made anyway is refused
            self.services.count(name, "refused")
            return _refused(refusal(name, allow)), "refused"
        if confirm:
            why = "nobody can be asked to allow it here" if self.confirm is None else None
            if self.confirm is not None:
                why = await self.confirm(name, question(self.agent_name, name, args))
            if why is not None:
                self.services.count(name, "denied")
                return _refused(f"the person did not allow this call ({why}); do not retry it unasked"), "denied"
        if name in mcp:
            out = await self.services.mcp.call(self.tenant, name, args)  # type: ignore[union-attr]
        elif name in self.services.web:
            out = await self.services.web[name].call(args)
        else:
            out = await self._builtin(name, args)
        outcome: Outcome = "error" if failed(out) else "ok"
        self.services.count(name, outcome)
        return out, outcome

    async def _builtin(self, name: str, args: dict[str, Any]) -> str:
        if name == "skill_manage":
            if self.skills is None:
                return _refused("skills are turned off in this chat")
            return await self.skills.handle_tool_call(args, shared=self.shared)
        if name == "memory":
            if self.memory is None:
                return _refused("memory is turned off in this chat")
            if self.write_approval == "block" and args.get("action") in ("add", "replace", "remove"):
                return _refused(
                    "the operator turned memory writes off (memory.write_approval: block); "
                    "nothing was saved and retrying won't help. Use what you know from the "
                    "conversation instead."
                )
            stage = self._stage if self.write_approval == "stage" else None
            return await self.memory.handle_tool_call(args, stage=stage)
        if name == "session_search":
            return await self._session_search(args)
        if name == "reminders" and self.reminders is not None:
            return await self.reminders.handle(args)
        return _refused(f"unknown tool {name!r}")

    async def _stage(self, action: str, target: str, content: str | None, old_text: str | None) -> dict[str, Any]:
        assert self.memory is not None
        return await self.memory.pending_writes().stage(
            action, target, content, old_text, origin="shared" if self.shared else "private"
        )

    async def _session_search(self, args: dict[str, Any]) -> str:
        query = args.get("query")
        if not isinstance(query, str) or not query.strip():
            return _refused("query must be a non-empty string")
        limit = args.get("limit", 5)
        if not isinstance(limit, int) or isinstance(limit, bool):
            limit = 5
        limit = max(1, min(limit, 20))
        hits = await self.sessions.search(query, limit=limit, session_key=self.search_lane)
        return json.dumps({"success": True, "count": len(hits), "results": hits}, ensure_ascii=False, default=str)
