"""What one turn works on (`TurnContext`), apart from the code that runs turns (agent/turn.py),
so the modules a turn passes it to (agent/compression.py) can name its type without
importing the turn runner."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from agent.providers import NO_ACCESS, ProviderAccess

if TYPE_CHECKING:
    from agent.compression import CompressionState
    from agent.memory import MemoryStore
    from agent.metering import Payer, Reservation
    from agent.profile import Profile
    from agent.prompt import ChatPlace
    from agent.reminders import ReminderChat
    from agent.toolkit import ConfirmGate, Speaker
    from core.lanes import Lane

# (kind, text): kind is "progress" / "progress_done" (routine: shown only with
# compression.progress_notices; the second edits the first in place where possible),
# "warning" or "error" (always shown)
Notify = Callable[[str, str], Awaitable[None]]

# called with the text of the model's answer so far while it streams
OnText = Callable[[str], None]


@dataclass
class TurnContext:
    """Everything one turn works on; passed explicitly, never stored globally."""

    profile: Profile
    lane: Lane
    place: ChatPlace
    session_id: str  # the live session; compression with in_place: false moves it to a child
    memory: MemoryStore | None
    notify: Notify
    compression_state: CompressionState | None = None  # the session's, loaded once per turn
    compressions: int = 0  # automatic compressions run in this turn (<= compression.max_attempts)
    tool_iterations: int = 0
    provider_access: ProviderAccess = NO_ACCESS  # what this lane may do with the memory provider
    recall: str = ""  # the provider's prefetch for this turn: sent with the request, never stored
    stop: asyncio.Event | None = None  # set by /stop: the model call is cancelled, the turn ends
    on_text: OnText | None = None  # given: the model streams, each delta is reported
    partial: str = ""  # text of the current model answer so far (streaming only)
    chat: ReminderChat | None = None  # where the turn runs: reminders set in it are delivered there
    interrupted: bool = False
    payer: Payer | None = None  # whose budget the turn's model calls count to (agent/metering.py)
    reserved: Reservation | None = None  # the next call's reservation, made in the turn's first write
    speaker: Speaker | None = None  # who the tools serve (agent/toolkit.py); None: from the place
    confirm: ConfirmGate | None = None  # asks the person to allow a `confirm` tool's call
    # the tool calls run since the last answer was stored (agent/provenance.py `tool_run`)
    runs: list[dict[str, Any]] = field(default_factory=list)


__all__ = ["Notify", "OnText", "TurnContext"]
