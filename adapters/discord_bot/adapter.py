"""Discord adapter (discord.py 2.x): guild channels, threads and DMs as InboundMessage,
replies as plain channel messages (or interaction followups for slash commands).

What this adapter decides (and nothing more):
- which Discord messages are for the bot: bots and webhooks are ignored; in guild
  channels with `require_mention_in_guilds` only a mention of the bot, a reply to one of
  its messages, a message in a `free_response_channels` channel (or a thread under one),
  or a text starting with `/` gets through; guilds outside `allowed_guilds` are dropped.
- where a message belongs: DM -> `dm` (chat id = DM channel), guild channel -> `group`
  (chat id = channel), thread -> `thread` (chat id = parent channel, thread id = thread;
  `private_thread` for a private thread, which is its own chat tenant). A group DM, or any
  non-DM context of a user-installed app, is a `group`, never a `dm`.
- delivery details: the first chunk references the person's message, every send carries
  `allowed_mentions = {"parse": []}` so model output can never ping anyone, and 429s are
  retried by discord.py itself (each POST carries a nonce with `enforce_nonce`, so a
  retried request can never create a second message; the gateway's outbox passes the
  chunk's own nonce, so its resends after a crash are deduplicated the same way). There
  is no retry loop here: a 5xx after discord.py's own retries, or a network error, raises
  `DeliveryDeferred` and the outbox retries later.

Everything else (auth, dedupe of replayed events, lanes, splitting, typing cadence)
is the gateway's job.

Endpoints: `api_base` / `gateway_url` point discord.py at a proxy or a test server.
discord.py keeps both as class attributes (`discord.http.Route.BASE`,
`DiscordWebSocket.DEFAULT_GATEWAY`), so setting them is process-wide: one Discord bot
per process (which is how hermes-gateway runs).

`DiscordAdapter` is the lifecycle (construction, start, stop); the rest are its parts:
`receive.py` (gateway connection, shards, event guard, button presses), `commands.py`
(slash commands), `normalise.py` (message -> InboundMessage), `send.py` (send, edit,
typing, download, confirmation questions), over the state in `state.py` and the shared
pieces in `client.py`.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import discord
import yarl
from discord.gateway import DiscordWebSocket
from discord.http import Route

from adapters.discord_bot.client import (
    _ORIGINAL_DEFAULT_GATEWAY,
    _ORIGINAL_ROUTE_BASE,
    _install_redactor,
    log,
    resolve_api_base,
)
from adapters.discord_bot.receive import Receiving
from adapters.discord_bot.send import Sending
from adapters.discord_bot.state import _LRU
from core.messages import InboundSink
from core.settings import ConfigError, DiscordConfig


class DiscordAdapter(Receiving, Sending):
    """A Discord bot connection implementing `core.protocols.Adapter`.

    Sharded (`shard_count` > 1, or `elected=True` in a cluster): the adapter's client only
    logs in (REST: replies, edits, lookups) and each gateway shard is a connection of its
    own, started and stopped with `start_shard(n)` / `stop_shard(n)`. A single node starts
    every shard itself; in a cluster the ingress election starts the shards this node holds,
    and replies go out through REST from whichever node ran the turn."""

    platform = "discord"
    max_message_length = 2000
    can_edit = True

    def __init__(
        self,
        cfg: DiscordConfig,
        token: str,
        *,
        ready_timeout: float = 60.0,
        guild_ready_timeout: float = 2.0,
        elected: bool = False,
    ) -> None:
        if not token or not token.strip():
            raise ConfigError(f"platforms.discord: the bot token (${cfg.token_env}) is empty")
        # declared, with what each one means, in state.py
        self.cfg = cfg
        self._token = token.strip()
        self._ready_timeout = ready_timeout
        self._guild_ready_timeout = guild_ready_timeout
        self._free = set(cfg.free_response_channels)
        self._allowed_guilds = set(cfg.allowed_guilds)
        self._status = "stopped"
        self._down_since = None
        self.skipped_events = 0
        self._client = None
        self._tree = None
        self._sink = None
        self.overheard = None
        self.answerer = None
        self._inbound = asyncio.Queue()
        self._ready = asyncio.Event()
        self._tasks = []
        self._runner = None
        self._stopping = False
        self._api_base = resolve_api_base(cfg.api_base)
        self._gateway_url = cfg.gateway_url
        self._own_messages = _LRU(5000)
        self._thread_parents = {}
        self._private_kinds = _LRU(4096)
        self._interactions = {}
        self._open_interaction = {}
        self._followup_messages = _LRU(2000)
        self._warned_channels = set()
        self.commands_synced = False
        self._elected = elected
        self._sharded = elected or cfg.shard_count > 1
        self._shard_clients = {}
        self._shard_tasks = {}
        self.last_error = None

    # ------------------------------------------------------------------ construction
    @property
    def elected(self) -> bool:
        """Cluster mode: receiving is started and stopped by the node's ingress election."""
        return self._elected

    @classmethod
    def from_config(cls, cfg: DiscordConfig, **kw: Any) -> DiscordAdapter:
        token = os.environ.get(cfg.token_env, "").strip()
        if not token:
            raise ConfigError(
                f"platforms.discord is enabled but the environment variable {cfg.token_env} "
                "(platforms.discord.token_env) is not set: put the bot token there"
            )
        return cls(cfg, token, **kw)

    def measure(self, text: str) -> int:
        return len(text)

    @property
    def status(self) -> str:
        """`stopped`, `connecting`, `connected`, or `failed: <reason>`."""
        return self._status

    @property
    def down_since(self) -> float | None:
        """`time.monotonic()` since which the adapter has not been connected; None while it is."""
        return self._down_since

    @property
    def bot_user_id(self) -> str | None:
        user = self._client.user if self._client else None
        return str(user.id) if user else None

    @property
    def client(self) -> discord.Client | None:
        return self._client

    # ------------------------------------------------------------------ lifecycle
    async def start(self, sink: InboundSink) -> None:
        """Log in, connect in the background and return once READY (or after
        `ready_timeout`). Never raises for Discord-side problems, so other platforms keep
        running: a rejected token or a refused intent sets `status` to `failed: <what to
        do>` (also logged); an unreachable API or gateway is retried in the background
        with backoff while `status` stays `connecting` (`last_error` says why)."""
        if self._runner is not None:
            raise RuntimeError("DiscordAdapter.start() called twice")
        self._sink = sink
        self._stopping = False
        self._ready = asyncio.Event()
        self._set_status("connecting")
        self.last_error = None
        _install_redactor(self._token)
        Route.BASE = self._api_base  # process-wide, see module docstring
        if self._gateway_url:
            DiscordWebSocket.DEFAULT_GATEWAY = yarl.URL(self._gateway_url)
        else:
            DiscordWebSocket.DEFAULT_GATEWAY = _ORIGINAL_DEFAULT_GATEWAY

        self._tasks.append(asyncio.create_task(self._consume(), name="discord-inbound"))
        self._tasks.append(asyncio.create_task(self._sweep_interactions(), name="discord-interactions"))
        self._runner = asyncio.create_task(self._run(), name="discord-gateway")

        ready = asyncio.create_task(self._ready.wait())
        done, _ = await asyncio.wait(
            {ready, self._runner}, timeout=self._ready_timeout, return_when=asyncio.FIRST_COMPLETED
        )
        if ready not in done:
            ready.cancel()
        if not self._ready.is_set() and not self._status.startswith("failed"):
            log.error(
                "discord: not connected after %.0fs (%s); still trying in the background",
                self._ready_timeout,
                self.last_error or "no READY from the gateway yet",
            )

    async def stop(self) -> None:
        self._stopping = True
        for shard_id in list(self._shard_tasks):
            await self.stop_shard(shard_id)
        runner, self._runner = self._runner, None
        if runner is not None and not runner.done():
            runner.cancel()
            await asyncio.gather(runner, return_exceptions=True)
        await self._close_client()
        # hand what Discord already delivered to the gateway (it records it for the next
        # start); Discord would not deliver it again
        deadline = time.monotonic() + 5
        while not self._inbound.empty() and time.monotonic() < deadline and self._sink is not None:  # noqa: ASYNC110
            await asyncio.sleep(0.01)  # a bounded poll: the queue has no "drained" event to wait on
        for t in self._tasks:
            if not t.done():
                t.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        self._client = None
        if not self._status.startswith("failed"):
            self._set_status("stopped")
        Route.BASE = _ORIGINAL_ROUTE_BASE
        DiscordWebSocket.DEFAULT_GATEWAY = _ORIGINAL_DEFAULT_GATEWAY
