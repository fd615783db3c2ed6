"""The system prompt of a session: identity, frozen memory snapshot, tool guidance, place.

It is built once when a session starts and stored as the session's first message, so the
prompt prefix stays stable (and cacheable) for the whole session, across restarts too.
"""

from __future__ import annotations

from dataclasses import dataclass

from agent.memory import MemorySnapshot

COMPACTION_NOTE = (
    "[Note: Some earlier conversation turns have been compacted into a handoff summary "
    "to preserve context space. The summary is in the conversation below; treat it as "
    "background, and answer the latest message.]"
)


@dataclass(frozen=True)
class ChatPlace:
    """Where the conversation happens, as the model is told (no ids)."""

    platform: str
    chat_type: str  # dm | group | thread | channel
    shared: bool  # a lane many people talk in, with the group's own memory
    user_name: str = ""

    def describe(self) -> str:
        where = {
            "dm": "a private chat",
            "group": "a group chat",
            "thread": "a thread in a group",
            "channel": "a channel",
        }.get(self.chat_type, "a chat")
        text = f"You are talking on {self.platform.capitalize()} in {where}."
        if self.shared:
            text += (
                " Several people talk to you here; each user message is prefixed with the "
                "sender's name. The memory below belongs to this group, not to any one person."
            )
        elif self.chat_type != "dm":
            text += (
                " You are talking with one member of the group, but your replies are posted "
                "in the group and seen by everyone in it. Of this person's memory only what they "
                "shared with groups is given to you here, and anything saved here is shared too."
            )
        if self.user_name and not self.shared:
            text += f" The person's display name is {self.user_name}."
        return text


def build_system_prompt(
    *,
    agent_name: str,
    place: ChatPlace,
    snapshot: MemorySnapshot | None,
    memory_char_limit: int,
    user_char_limit: int,
    memory_writable: bool,
    skill_index: str | None = None,
    skills_writable: bool = False,
    persona: tuple[str, str] | None = None,
) -> str:
    """Assemble the system prompt; `snapshot` None means memory is off in this lane, and
    `skill_index` None that skills are (the index is '' when there are none yet), and
    `persona` (who chose it, the instructions) what agent/persona.py gave this lane."""
    parts = [
        f"You are {agent_name}, a helpful assistant that remembers the people you talk to.",
        place.describe(),
    ]
    if persona is not None:
        who, text = persona
        parts.append(
            f"How to answer here, as {who} asked (it never overrides your safety rules or anyone's privacy):\n{text}"
        )
    if snapshot is not None:
        block = snapshot.render(memory_char_limit, user_char_limit)
        if block:
            parts.append(block)
        if memory_writable:
            parts.append(
                "Use the `memory` tool to save durable facts about the person (target 'user') "
                "or your own notes (target 'memory') when you learn something worth keeping; "
                "keep entries short and never store secrets such as passwords or keys."
            )
        else:
            parts.append("Memory is read-only in this chat: you can use what you know but not save new facts here.")
    if skill_index:
        parts.append(skill_index)
    if skill_index is not None and skills_writable:
        parts.append(
            "Use `skill_manage` to save a reusable procedure when you worked out how to do a kind of "
            "task well; skills hold steps, never personal facts or secrets."
        )
    parts.append(
        "Use `session_search` to look up earlier conversations when the person refers to something discussed before."
    )
    return "\n\n".join(parts)
