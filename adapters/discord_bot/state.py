"""What the parts of the Discord adapter share: the attributes receive, slash commands,
normalise and send read and write (declared here once, set in `DiscordAdapter.__init__`),
the small caches they keep, and the connection status bookkeeping.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import discord
from discord import app_commands

from adapters.discord_bot.client import log
from core.messages import ConfirmAnswerer, InboundSink, OverheardHook
from core.settings import DiscordConfig

if TYPE_CHECKING:
    from adapters.discord_bot.receive import _Client, _ShardClient

# An interaction token lives 15 minutes; followups after that fail.
_INTERACTION_TTL_S = 15 * 60


@dataclass
class _PendingInteraction:
    """A deferred slash command this adapter answers: through its follow-up webhook (the
    interaction's token is inside it, so it is never logged), here since `created`."""

    followup: discord.Webhook | None  # None: adopted while the client was down (never usable)
    chat_key: tuple[str, str | None]
    created: float = field(default_factory=time.monotonic)
    answered: bool = False
    ephemeral: bool = False  # only the asker sees the answer; never falls back to the channel

    def usable(self) -> bool:
        return self.followup is not None and time.monotonic() - self.created < _INTERACTION_TTL_S - 30

    async def withdraw(self) -> None:
        """Delete the "thinking..." placeholder (DELETE .../messages/@original, what
        `Interaction.delete_original_response` sends)."""
        if self.followup is not None:
            await self.followup.delete_message("@original")  # type: ignore[arg-type]  # the route takes the alias


class _LRU:
    def __init__(self, size: int) -> None:
        self.size = size
        self._d: OrderedDict[str, Any] = OrderedDict()

    def add(self, key: str, value: Any = True) -> None:
        self._d[key] = value
        self._d.move_to_end(key)
        while len(self._d) > self.size:
            self._d.popitem(last=False)

    def get(self, key: str) -> Any:
        return self._d.get(key)

    def __contains__(self, key: object) -> bool:
        return key in self._d


class DiscordState:
    """The state of one `DiscordAdapter`; the parts (`Normalising`, `SlashCommands`,
    `Receiving`, `Sending`) are mixins over it."""

    cfg: DiscordConfig
    max_message_length: int
    _token: str
    _ready_timeout: float
    _guild_ready_timeout: float
    _free: set[str]
    _allowed_guilds: set[str]
    _status: str
    _down_since: float | None  # monotonic time it stopped being connected
    #: gateway events discord.py could not parse, skipped (the connection goes on)
    skipped_events: int
    _client: _Client | None
    _tree: app_commands.CommandTree | None
    _sink: InboundSink | None
    overheard: OverheardHook | None  # guild text dropped unanswered (link-code screen)
    answerer: ConfirmAnswerer | None  # a press of a confirmation button (set before start)
    _inbound: asyncio.Queue[Any]
    _ready: asyncio.Event
    _tasks: list[asyncio.Task[Any]]
    _runner: asyncio.Task[None] | None
    _stopping: bool
    _api_base: str
    _gateway_url: str | None
    _own_messages: _LRU  # ids of messages the bot sent (reply detection)
    _thread_parents: dict[str, tuple[str, bool]]  # thread id -> (parent channel id, private)
    _private_kinds: _LRU  # guildless channel id -> "dm" | "group" (learnt by fetching it)
    _interactions: dict[str, _PendingInteraction]  # "interaction-<id>" -> pending
    _open_interaction: dict[tuple[str, str | None], _PendingInteraction]
    _followup_messages: _LRU  # message id -> pending interaction (for edits)
    _warned_channels: set[str]
    commands_synced: bool
    _elected: bool
    _sharded: bool
    _shard_clients: dict[int, _ShardClient]
    _shard_tasks: dict[int, asyncio.Task[None]]
    #: why the adapter is still `connecting` (e.g. the API is unreachable), if known
    last_error: str | None

    def _set_status(self, status: str) -> None:
        if status == "connected":
            self._down_since = None
        elif self._down_since is None:
            self._down_since = time.monotonic()
        self._status = status

    def _fail(self, reason: str) -> None:
        self._set_status(f"failed: {reason}")
        log.error("discord: %s", reason)
