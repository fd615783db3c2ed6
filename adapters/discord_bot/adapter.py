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
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import discord
import yarl
from discord import app_commands
from discord.gateway import DiscordWebSocket
from discord.http import Route

from core.commands import COMMAND_SPECS, CommandSpec, find_command
from core.messages import (
    Attachment,
    DeliveryDeferred,
    DownloadError,
    InboundMessage,
    InboundSink,
    OutboundMessage,
    OverheardHook,
    SentMessage,
)
from core.redact import RedactingFilter, Redactor
from core.settings import ConfigError, DiscordConfig

# the name the adapter has always logged as (logging settings and the redactor name it)
log = logging.getLogger("adapters.discord_bot")

DISCORD_API = "https://discord.com/api/v10"
DISCORD_GATEWAY = "wss://gateway.discord.gg/"
_ORIGINAL_ROUTE_BASE = Route.BASE
_ORIGINAL_DEFAULT_GATEWAY = DiscordWebSocket.DEFAULT_GATEWAY

PORTAL_URL = "https://discord.com/developers/applications"
INTENT_HINT = (
    "Discord refused the Message Content intent: open "
    f"{PORTAL_URL} → your app → Bot → Privileged Gateway Intents "
    "and turn on MESSAGE CONTENT INTENT"
)

# Application flags (GET /oauth2/applications/@me `flags`)
APP_FLAG_GATEWAY_MESSAGE_CONTENT = 1 << 18
APP_FLAG_GATEWAY_MESSAGE_CONTENT_LIMITED = 1 << 19

# Invite permissions: View Channels, Send Messages, Read Message History, Send Messages in Threads
INVITE_PERMISSIONS = (1 << 10) | (1 << 11) | (1 << 16) | (1 << 38)
INVITE_SCOPES = "bot+applications.commands"

NO_PINGS = discord.AllowedMentions.none()

# Slash commands whose answer is about the person asking: in a server only they see it
# (an ephemeral response); in a DM it is private anyway.
EPHEMERAL_IN_SERVERS = frozenset(spec.name for spec in COMMAND_SPECS if spec.ephemeral)
# Admin commands are registered with these default member permissions, so Discord shows them
# only to server members who have them (server admins can widen that in the integration settings).
ADMIN_DEFAULT_PERMISSIONS = discord.Permissions(administrator=True)

# An interaction token lives 15 minutes; followups after that fail.
_INTERACTION_TTL_S = 15 * 60
# A deferred ("thinking...") slash command nobody answered is cleaned up after this.
_INTERACTION_ABANDON_S = 13 * 60


def invite_url(application_id: int | str) -> str:
    return (
        f"https://discord.com/oauth2/authorize?client_id={application_id}"
        f"&scope={INVITE_SCOPES}&permissions={INVITE_PERMISSIONS}"
    )


def resolve_api_base(api_base: str | None) -> str:
    """`api_base` as a full REST root: `http://host:port` -> `http://host:port/api/v10`,
    `.../api` -> `.../api/v10`, `.../api/v9` kept as is; None -> Discord's."""
    if not api_base:
        return DISCORD_API
    base = api_base.rstrip("/")
    if re.search(r"/api/v\d+$", base):
        return base
    if base.endswith("/api"):
        return base + "/v10"
    return base + "/api/v10"


def _redact_url_tokens(text: str) -> str:
    text = re.sub(r"(/(?:webhooks|interactions)/\d+/)[^/\s?'\"]+", r"\1<redacted>", text)
    # interaction tokens inside logged gateway payloads ({'token': '...'})
    return re.sub(r"""(['"]token['"]\s*:\s*['"])[^'"]+""", r"\1<redacted>", text)


# the bot token, and interaction/webhook tokens in URLs and logged gateway payloads
_REDACTOR = RedactingFilter(
    "hermes-discord-redact", Redactor(mark="<redacted>", patterns=False, min_len=1), extra=_redact_url_tokens
)


def _install_redactor(token: str) -> None:
    """Attach the redacting filter to every discord.py logger and ours (logger filters
    are not inherited, so each existing logger gets it)."""
    _REDACTOR.redactor.add(token)
    names = [n for n in logging.root.manager.loggerDict if n == "discord" or n.startswith("discord.")]
    _REDACTOR.attach([*names, "discord", log.name])


def _attachment_kind(content_type: str | None) -> str:
    major = (content_type or "").split("/", 1)[0]
    return major if major in ("image", "audio", "video") else "file"


@dataclass
class _PendingInteraction:
    interaction: discord.Interaction
    chat_key: tuple[str, str | None]
    created: float = field(default_factory=time.monotonic)
    answered: bool = False
    ephemeral: bool = False  # only the asker sees the answer; never falls back to the channel

    def usable(self) -> bool:
        return time.monotonic() - self.created < _INTERACTION_TTL_S - 30


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


class _Client(discord.Client):
    def __init__(self, adapter: DiscordAdapter, **options: Any) -> None:
        super().__init__(**options)
        self._adapter = adapter
        adapter._guard_parsers(self)

    async def on_connect(self) -> None:
        self._adapter._on_connect()

    async def on_ready(self) -> None:
        self._adapter._on_ready()

    async def on_resumed(self) -> None:
        self._adapter._on_resumed()

    async def on_disconnect(self) -> None:
        self._adapter._on_disconnect()

    async def on_message(self, message: discord.Message) -> None:
        # Runs first thing in its task, so messages are queued in gateway order.
        self._adapter._inbound.put_nowait(message)

    async def on_error(self, event_method: str, /, *args: Any, **kwargs: Any) -> None:
        log.exception("discord: error in %s", event_method)


class _ShardClient(discord.Client):
    """One gateway shard's connection (sharded mode): hands messages to the adapter; the
    adapter's own client, logged in but not connected, does every REST call."""

    def __init__(self, adapter: DiscordAdapter, shard_id: int, **options: Any) -> None:
        super().__init__(shard_id=shard_id, shard_count=adapter.cfg.shard_count, **options)
        self._adapter = adapter
        adapter._guard_parsers(self)

    async def on_connect(self) -> None:
        self._adapter._point_at_gateway(self)

    async def on_ready(self) -> None:
        log.info("discord: shard %s of %s connected", self.shard_id, self.shard_count)

    async def on_message(self, message: discord.Message) -> None:
        self._adapter._inbound.put_nowait(message)

    async def on_error(self, event_method: str, /, *args: Any, **kwargs: Any) -> None:
        log.exception("discord: error in %s (shard %s)", event_method, self.shard_id)


class DiscordAdapter:
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
        self.cfg = cfg
        self._token = token.strip()
        self._ready_timeout = ready_timeout
        self._guild_ready_timeout = guild_ready_timeout
        self._free = set(cfg.free_response_channels)
        self._allowed_guilds = set(cfg.allowed_guilds)
        self._status = "stopped"
        self._down_since: float | None = None  # monotonic time it stopped being connected
        #: gateway events discord.py could not parse, skipped (the connection goes on)
        self.skipped_events = 0
        self._client: _Client | None = None
        self._tree: app_commands.CommandTree | None = None
        self._sink: InboundSink | None = None
        self.overheard: OverheardHook | None = None  # guild text dropped unanswered (link-code screen)
        self._inbound: asyncio.Queue[Any] = asyncio.Queue()
        self._ready = asyncio.Event()
        self._tasks: list[asyncio.Task[Any]] = []
        self._runner: asyncio.Task[None] | None = None
        self._stopping = False
        self._api_base = resolve_api_base(cfg.api_base)
        self._gateway_url: str | None = cfg.gateway_url
        self._own_messages = _LRU(5000)  # ids of messages the bot sent (reply detection)
        self._thread_parents: dict[str, tuple[str, bool]] = {}  # thread id -> (parent channel id, private)
        self._private_kinds = _LRU(4096)  # guildless channel id -> "dm" | "group" (learnt by fetching it)
        self._interactions: dict[str, _PendingInteraction] = {}  # "interaction-<id>" -> pending
        self._open_interaction: dict[tuple[str, str | None], _PendingInteraction] = {}
        self._followup_messages = _LRU(2000)  # message id -> pending interaction (for edits)
        self._warned_channels: set[str] = set()
        self.commands_synced = False
        self._elected = elected
        self._sharded = elected or cfg.shard_count > 1
        self._shard_clients: dict[int, _ShardClient] = {}
        self._shard_tasks: dict[int, asyncio.Task[None]] = {}
        #: why the adapter is still `connecting` (e.g. the API is unreachable), if known
        self.last_error: str | None = None

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

    def _set_status(self, status: str) -> None:
        if status == "connected":
            self._down_since = None
        elif self._down_since is None:
            self._down_since = time.monotonic()
        self._status = status

    def _guard_parsers(self, client: discord.Client) -> None:
        """discord.py parses each gateway event inside its read loop, so one payload it cannot
        parse (a partial MESSAGE_UPDATE without `type`, as Discord sends for embed unfurls)
        would end the connection; each parser skips such an event with a warning instead."""
        parsers = client._connection.parsers
        for event, parse in list(parsers.items()):
            parsers[event] = self._skipping(event, parse)

    def _skipping(self, event: str, parse: Callable[[Any], None]) -> Callable[[Any], None]:
        def guarded(data: Any) -> None:
            try:
                parse(data)
            except Exception as exc:  # the payload's fault, not the connection's
                self.skipped_events += 1
                # the type only: an exception's text may quote the payload (message content)
                log.warning("discord: skipped a %s event discord.py could not parse (%s)", event, type(exc).__name__)

        return guarded

    @property
    def bot_user_id(self) -> str | None:
        user = self._client.user if self._client else None
        return str(user.id) if user else None

    @property
    def client(self) -> discord.Client | None:
        return self._client

    @property
    def shards(self) -> list[int]:
        """The gateway shards this adapter runs (sharded mode), connected or connecting."""
        return sorted(self._shard_tasks)

    async def start_shard(self, shard_id: int) -> None:
        """Connect gateway shard `shard_id` (sharded mode); a no-op if it runs already."""
        if not self._sharded:
            raise RuntimeError("start_shard needs platforms.discord.shard_count > 1 or a cluster")
        if not 0 <= shard_id < self.cfg.shard_count:
            raise ValueError(f"shard {shard_id} is outside 0..{self.cfg.shard_count - 1}")
        if shard_id in self._shard_tasks or self._stopping:
            return
        client = _ShardClient(self, shard_id, **self._client_options())
        self._build_tree(client)  # slash command interactions arrive on the shard's connection
        self._shard_clients[shard_id] = client
        self._shard_tasks[shard_id] = asyncio.create_task(self._run_shard(client), name=f"discord-shard-{shard_id}")

    async def stop_shard(self, shard_id: int) -> None:
        """Disconnect gateway shard `shard_id` (what it delivered is already handed on)."""
        task = self._shard_tasks.pop(shard_id, None)
        client = self._shard_clients.pop(shard_id, None)
        if client is not None and not client.is_closed():
            try:
                await client.close()
            except Exception:
                log.debug("discord: error while closing shard %s", shard_id, exc_info=True)
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def _run_shard(self, client: _ShardClient) -> None:
        delay = 2.0
        while not self._stopping:
            try:
                await asyncio.wait_for(client.login(self._token), timeout=30)
                await client.connect(reconnect=True)
                return
            except asyncio.CancelledError:
                raise
            except discord.LoginFailure:
                self._fail(f"the bot token in ${self.cfg.token_env} was rejected (401) on shard {client.shard_id}")
                return
            except discord.ConnectionClosed as exc:
                self._fail(f"the Discord gateway closed shard {client.shard_id} (code {exc.code})")
                return
            except Exception as exc:
                if self._stopping or client.is_closed():
                    return
                log.warning("discord: shard %s: %r; retrying in %.0fs", client.shard_id, exc, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 60.0)

    def _point_at_gateway(self, client: discord.Client) -> None:
        # With an explicit gateway_url (a proxy), RESUME goes there too, not to the
        # `resume_gateway_url` Discord hands out in READY.
        if self._gateway_url and client.ws is not None:
            client.ws.gateway = yarl.URL(self._gateway_url)

    def _fail(self, reason: str) -> None:
        self._set_status(f"failed: {reason}")
        log.error("discord: %s", reason)

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

    def _client_options(self) -> dict[str, Any]:
        intents = discord.Intents.none()
        intents.guilds = True
        intents.guild_messages = True
        intents.dm_messages = True
        intents.message_content = True
        return {
            "intents": intents,
            "allowed_mentions": NO_PINGS,
            "chunk_guilds_at_startup": False,
            "member_cache_flags": discord.MemberCacheFlags.none(),
            "guild_ready_timeout": self._guild_ready_timeout,
            "max_messages": 1000,
        }

    def _new_client(self) -> _Client:
        client = _Client(self, **self._client_options())
        self._tree = self._build_tree(client)
        return client

    async def _login(self) -> _Client | None:
        """Log in (GET /users/@me, /oauth2/applications/@me), retrying network and
        server errors with backoff. None when the token is rejected."""
        delay = 2.0
        while True:
            client = self._new_client()
            self._client = client
            try:
                await asyncio.wait_for(client.login(self._token), timeout=30)
                return client
            except discord.LoginFailure:
                await self._close_client()
                self._fail(
                    f"the bot token in ${self.cfg.token_env} was rejected (401): copy a fresh one from "
                    f"{PORTAL_URL} → your app → Bot → Reset Token"
                )
                return None
            except (TimeoutError, discord.HTTPException, aiohttp.ClientError, OSError, ValueError) as exc:
                await self._close_client()
                self.last_error = f"cannot reach the Discord API at {self._api_base}: {type(exc).__name__}: {exc}"
                log.warning("discord: %s; retrying in %.0fs", self.last_error, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 60.0)

    async def _run(self) -> None:
        """Log in and hold the gateway connection for as long as the adapter runs: discord.py
        reconnects by itself after network drops; anything else that ends the connection is
        reconnected here with backoff. Only a rejected token or a refused intent is final."""
        delay = 2.0
        try:
            while not self._stopping:
                client = await self._login()
                if client is None:
                    return
                flags = getattr(client, "application_flags", None)
                if flags is not None and not (flags.gateway_message_content or flags.gateway_message_content_limited):
                    log.warning("discord: the application's Message Content intent looks off; %s", INTENT_HINT)
                if not self._gateway_url and self.cfg.api_base:
                    # A proxy or test server: ask it where its gateway is.
                    try:
                        _, url, _ = await client.http.get_bot_gateway()
                        DiscordWebSocket.DEFAULT_GATEWAY = yarl.URL(url)
                    except Exception as exc:
                        log.warning(
                            "discord: GET /gateway/bot on %s failed (%r); using %s",
                            self._api_base,
                            exc,
                            DISCORD_GATEWAY,
                        )
                if self._sharded:  # REST only here; the shards connect on their own
                    self._on_ready()
                    if not self._elected:
                        for shard_id in range(self.cfg.shard_count):
                            await self.start_shard(shard_id)
                    await asyncio.Event().wait()  # until stop() cancels this task
                try:
                    await client.connect(reconnect=True)
                    why = "the gateway connection ended"
                except discord.PrivilegedIntentsRequired:
                    self._fail(INTENT_HINT)
                    return
                except discord.ConnectionClosed as exc:
                    # discord.py resumes every close code it can; what reaches here is final
                    if exc.code == 4004:
                        self._fail(f"Discord rejected the bot token in ${self.cfg.token_env} (close code 4004)")
                    else:
                        reason = exc.reason or ""
                        self._fail(f"the Discord gateway closed the connection (code {exc.code}): {reason}".strip())
                    return
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    why = f"the gateway connection failed ({type(exc).__name__})"
                if self._stopping:
                    return
                if self._status == "connected":  # it was up: start the backoff afresh
                    delay = 2.0
                self._set_status("connecting")
                self.last_error = why
                log.warning("discord: %s; reconnecting in %.0fs", why, delay)
                await self._close_client()
                await asyncio.sleep(delay)
                delay = min(delay * 2, 60.0)
        finally:
            if not self._stopping:
                await self._close_client()

    async def _close_client(self) -> None:
        client = self._client
        if client is not None and not client.is_closed():
            try:
                await client.close()
            except Exception:
                log.debug("discord: error while closing the client", exc_info=True)

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

    # ------------------------------------------------------------------ client events
    def _on_connect(self) -> None:
        if self._client is not None:
            self._point_at_gateway(self._client)

    def _on_ready(self) -> None:
        if self._stopping:
            return
        first = not self._ready.is_set()
        self._set_status("connected")
        self._ready.set()
        if first:
            user = self._client.user if self._client else None
            log.info(
                "discord: connected as %s (id %s) in %d guild(s)",
                user,
                getattr(user, "id", "?"),
                len(self._client.guilds) if self._client else 0,
            )
            if self.cfg.sync_slash_commands:
                self._tasks.append(asyncio.create_task(self._sync_commands(), name="discord-sync-commands"))

    def _on_resumed(self) -> None:
        if not self._stopping:
            self._set_status("connected")
            log.info("discord: session resumed")

    def _on_disconnect(self) -> None:
        if not self._stopping and self._status == "connected":
            self._set_status("connecting")
            log.warning("discord: gateway disconnected; reconnecting")

    # ------------------------------------------------------------------ slash commands
    def _build_tree(self, client: discord.Client) -> app_commands.CommandTree:
        tree = app_commands.CommandTree(client)
        for spec in COMMAND_SPECS:
            tree.add_command(self._make_command(spec))

        async def on_error(interaction: discord.Interaction, error: app_commands.AppCommandError) -> None:
            log.warning("discord: slash command failed: %r", error)

        tree.on_error = on_error  # type: ignore[method-assign]
        return tree

    def _make_command(self, spec: CommandSpec) -> app_commands.Command[Any, Any, Any]:
        name = spec.name
        description = spec.description[:100] or name
        if spec.takes_args:

            async def with_args(interaction: discord.Interaction, args: str | None = None) -> None:
                await self._on_interaction(interaction, name, args)

            cmd: app_commands.Command[Any, Any, Any] = app_commands.Command(
                name=name, description=description, callback=with_args
            )
            cmd = app_commands.describe(args="Arguments, as you would type after the command")(cmd)
        else:

            async def no_args(interaction: discord.Interaction) -> None:
                await self._on_interaction(interaction, name, None)

            cmd = app_commands.Command(name=name, description=description, callback=no_args)
        if spec.admin_only:
            cmd.default_permissions = ADMIN_DEFAULT_PERMISSIONS
        return cmd

    async def _sync_commands(self) -> None:
        """Global bulk overwrite (PUT /applications/{id}/commands), skipped when the
        registered set already matches ours."""
        tree, client = self._tree, self._client
        if tree is None or client is None:
            return
        try:
            wanted = {c.name: c.to_dict(tree) for c in tree.get_commands()}
            existing = await tree.fetch_commands()
            have: dict[str, dict[str, Any]] = {c.name: dict(c.to_dict()) for c in existing}
            for c in existing:  # AppCommand.to_dict() leaves the permissions out
                perms = c.default_member_permissions
                have[c.name]["default_member_permissions"] = perms.value if perms is not None else None

            def shape(d: dict[str, Any]) -> tuple[Any, ...]:
                opts = tuple(
                    (o.get("name"), int(o.get("type", 0)), bool(o.get("required", False)))
                    for o in d.get("options", []) or []
                )
                perms = d.get("default_member_permissions")
                return (d.get("description"), opts, int(perms) if perms is not None else None)

            if set(wanted) == set(have) and all(shape(wanted[n]) == shape(have[n]) for n in wanted):
                log.info("discord: %d slash commands already registered", len(wanted))
            else:
                synced = await tree.sync()
                log.info("discord: registered %d slash commands", len(synced))
            self.commands_synced = True
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.warning("discord: could not register slash commands (%r); typed /commands still work", exc)

    async def _on_interaction(self, interaction: discord.Interaction, name: str, args: str | None) -> None:
        try:
            if (
                interaction.guild_id is not None
                and self._allowed_guilds
                and str(interaction.guild_id) not in self._allowed_guilds
            ):
                await interaction.response.send_message("This bot is not enabled in this server.", ephemeral=True)
                return
            if interaction.user.bot:
                return
            context = getattr(interaction, "context", None)
            chat_type, chat_id, thread_id, private = await self._place(
                interaction.channel,
                interaction.channel_id,
                interaction.guild_id,
                private_context=bool(context is not None and context.private_channel),
            )
            spec = find_command(name)
            ephemeral = chat_type != "dm" and spec is not None and spec.ephemeral
            await interaction.response.defer(thinking=True, ephemeral=ephemeral)
            message_id = f"interaction-{interaction.id}"
            self._interactions[message_id] = _PendingInteraction(interaction, (chat_id, thread_id), ephemeral=ephemeral)
            text = f"/{name} {args.strip()}" if args and args.strip() else f"/{name}"
            inbound = InboundMessage(
                platform="discord",
                chat_id=chat_id,
                chat_type=chat_type,
                thread_id=thread_id,
                private_thread=private,
                user_id=str(interaction.user.id),
                user_name=interaction.user.display_name,
                message_id=message_id,
                text=text,
                mentions_bot=True,
                private_reply=ephemeral,
                timestamp=interaction.created_at.timestamp(),
                raw=interaction,
            )
            self._inbound.put_nowait(inbound)
        except discord.HTTPException as exc:
            log.warning("discord: could not acknowledge slash command /%s: %r", name, exc)

    async def _sweep_interactions(self) -> None:
        """Forget expired interactions; remove the "thinking..." placeholder of one
        nobody answered (e.g. the gateway ignored the user) before Discord shows an error."""
        while True:
            await asyncio.sleep(30)
            now = time.monotonic()
            for key, pend in list(self._interactions.items()):
                age = now - pend.created
                if age > _INTERACTION_TTL_S:
                    self._interactions.pop(key, None)
                    if self._open_interaction.get(pend.chat_key) is pend:
                        self._open_interaction.pop(pend.chat_key, None)
                elif age > _INTERACTION_ABANDON_S and not pend.answered:
                    pend.answered = True
                    try:
                        await pend.interaction.delete_original_response()
                    except Exception:
                        log.debug("discord: could not remove an unanswered interaction", exc_info=True)

    # ------------------------------------------------------------------ inbound
    async def _consume(self) -> None:
        while True:
            item = await self._inbound.get()
            try:
                msg = item if isinstance(item, InboundMessage) else await self._normalise(item)
                if msg is not None and self._sink is not None:
                    await self._sink(msg)
                elif msg is None and not isinstance(item, InboundMessage):
                    await self._overhear(item)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("discord: failed to hand an inbound message to the gateway")

    async def _overhear(self, message: Any) -> None:
        """Show the text of a server message dropped unanswered (no mention, another bot's
        post) to `overheard`, so a link code pasted there is still burnt. Never the bot's
        own messages, never a DM."""
        client = self._client
        content = getattr(message, "content", None)
        if self.overheard is None or client is None or client.user is None or not content:
            return
        if getattr(message, "guild", None) is None or message.author.id == client.user.id:
            return
        try:
            await self.overheard("discord", content)
        except Exception:
            log.exception("discord: could not screen an unanswered server message")

    async def _place(
        self, channel: Any, channel_id: int | None, guild_id: int | None, *, private_context: bool = False
    ) -> tuple[str, str, str | None, bool]:
        """(chat_type, chat_id, thread_id, private thread) for a channel. Only a one-to-one
        DM with the bot is `dm`: a group DM (channel type 3) or any other context a
        user-installed app is used in (`private_context`) is a group."""
        cid = str(channel_id if channel_id is not None else channel.id)
        if isinstance(channel, discord.Thread):
            private = channel.type == discord.ChannelType.private_thread
            self._thread_parents[str(channel.id)] = (str(channel.parent_id), private)
            return "thread", str(channel.parent_id), str(channel.id), private
        if private_context or isinstance(channel, discord.GroupChannel):
            return "group", cid, None, False
        if guild_id is None:
            return await self._private_kind(channel, cid), cid, None, False
        if isinstance(channel, discord.PartialMessageable) or channel is None:
            known = self._thread_parents.get(cid)
            if known is None and self._client is not None:
                try:  # an uncached channel: is it a thread, and under which channel?
                    fetched = await self._client.fetch_channel(int(cid))
                except discord.HTTPException:
                    fetched = None
                if isinstance(fetched, discord.Thread):
                    known = (str(fetched.parent_id), fetched.type == discord.ChannelType.private_thread)
                    self._thread_parents[cid] = known
            if known is not None:
                return "thread", known[0], cid, known[1]
        return "group", cid, None, False

    async def _private_kind(self, channel: Any, cid: str) -> str:
        """ "dm" for a one-to-one DM with the bot, "group" for a group DM. discord.py builds
        a DMChannel for every guildless message, so the channel is fetched once to see its
        real type; if that fails the chat counts as a group (never wrongly private)."""
        known = self._private_kinds.get(cid)
        if known is not None:
            return known
        if self._client is None:
            return "group"
        try:
            fetched = await self._client.fetch_channel(int(cid))
        except (TimeoutError, discord.HTTPException, aiohttp.ClientError) as exc:
            log.warning("discord: could not look up private channel %s (%r); treating it as a group", cid, exc)
            return "group"
        kind = "dm" if isinstance(fetched, discord.DMChannel) else "group"
        self._private_kinds.add(cid, kind)
        return kind

    def _guild_allowed(self, guild_id: int | None) -> bool:
        return guild_id is None or not self._allowed_guilds or str(guild_id) in self._allowed_guilds

    async def _normalise(self, message: discord.Message) -> InboundMessage | None:
        client = self._client
        if client is None or client.user is None:
            return None
        author = message.author
        if author.bot or author.system or message.webhook_id is not None or author.id == client.user.id:
            return None
        if message.type not in (discord.MessageType.default, discord.MessageType.reply):
            return None
        guild_id = message.guild.id if message.guild is not None else getattr(message.channel, "guild_id", None)
        if not self._guild_allowed(guild_id):
            log.debug("discord: ignoring a message from guild %s (not in allowed_guilds)", guild_id)
            return None

        bot_id = client.user.id
        content = message.content or ""
        mention_rx = re.compile(rf"<@!?{bot_id}>")
        mentioned = bool(mention_rx.search(content)) or any(u.id == bot_id for u in message.mentions)
        self_role = None
        if message.guild is not None:
            try:
                self_role = message.guild.self_role
            except Exception:
                self_role = None
        role_rx = re.compile(rf"<@&{self_role.id}>") if self_role is not None else None
        if role_rx is not None and role_rx.search(content):
            mentioned = True  # people often pick the bot's role from the @ menu

        replied_to_bot = False
        ref_id: str | None = None
        quoted: dict[str, str] = {}
        if message.reference is not None and message.reference.message_id is not None:
            ref_id = str(message.reference.message_id)
            resolved = message.reference.resolved
            if (isinstance(resolved, discord.Message) and resolved.author.id == bot_id) or ref_id in self._own_messages:
                replied_to_bot = True
            # the quoted text only as Discord sent it with this message (never fetched)
            if isinstance(resolved, discord.Message) and resolved.content:
                quoted = {
                    "reply_to_text": self._readable_mentions(resolved.content, resolved),
                    "reply_to_author": "you" if replied_to_bot else resolved.author.display_name,
                }

        text = re.sub(rf"[ \t]*{mention_rx.pattern}[ \t]*", " ", content)
        if role_rx is not None:
            text = re.sub(rf"[ \t]*{role_rx.pattern}[ \t]*", " ", text)
        text = self._readable_mentions(text, message).strip()

        chat_type, chat_id, thread_id, private = await self._place(message.channel, message.channel.id, guild_id)
        if chat_type != "dm" and self.cfg.require_mention_in_guilds:
            free = chat_id in self._free or (thread_id is not None and thread_id in self._free)
            if not (mentioned or replied_to_bot or free or text.startswith("/")):
                return None

        attachments = tuple(
            Attachment(
                type=_attachment_kind(a.content_type),
                name=a.filename,
                size=a.size,
                url=a.url,
                file_id=str(a.id),
                mime_type=a.content_type or "",
            )
            for a in message.attachments
        )
        if not text and not attachments:
            return None
        return InboundMessage(
            platform="discord",
            chat_id=chat_id,
            chat_type=chat_type,
            thread_id=thread_id,
            private_thread=private,
            user_id=str(author.id),
            user_name=author.display_name,
            message_id=str(message.id),
            text=text,
            attachments=attachments,
            reply_to_message_id=ref_id,
            **quoted,
            mentions_bot=mentioned or replied_to_bot or chat_type == "dm",
            timestamp=message.created_at.timestamp(),
            raw=message,
        )

    async def download(self, attachment: Attachment, max_bytes: int) -> bytes:
        """Fetch one attachment from Discord's CDN through discord.py's HTTP client (what
        `discord.Attachment.read` does). Errors become `DownloadError` with a safe message."""
        if self._client is None and not self._stopping:  # a message replayed before the connection is up
            try:
                await asyncio.wait_for(self._ready.wait(), min(self._ready_timeout, 30.0))
            except TimeoutError:
                pass
        client = self._client
        if client is None or not attachment.url.startswith(("https://", "http://")):
            raise DownloadError("the file is not available")
        if attachment.size and attachment.size > max_bytes:
            raise DownloadError("the file is too large", too_big=True)
        try:
            data = await client.http.get_from_cdn(attachment.url)
        except discord.NotFound:
            raise DownloadError("the file was deleted") from None
        except (TimeoutError, discord.HTTPException, aiohttp.ClientError, OSError) as exc:
            log.warning("discord: downloading an attachment failed (%s)", type(exc).__name__)
            raise DownloadError("the download from Discord failed") from None
        if len(data) > max_bytes:
            raise DownloadError("the file is too large", too_big=True)
        return data

    @staticmethod
    def _readable_mentions(text: str, message: discord.Message) -> str:
        """Other people's, roles' and channels' mentions as @name / #name for the model."""
        for user in message.mentions:
            text = re.sub(rf"<@!?{user.id}>", f"@{user.display_name}", text)
        for role in message.role_mentions:
            text = text.replace(f"<@&{role.id}>", f"@{role.name}")
        for ch in message.channel_mentions:
            text = text.replace(f"<#{ch.id}>", f"#{getattr(ch, 'name', ch.id)}")
        return text

    # ------------------------------------------------------------------ outbound
    def _warn_channel_once(self, channel_id: str, what: str, exc: Exception) -> None:
        if channel_id not in self._warned_channels:
            self._warned_channels.add(channel_id)
            log.warning(
                "discord: cannot %s in channel %s (%s); is the bot still there with Send Messages?",
                what,
                channel_id,
                getattr(exc, "text", "") or type(exc).__name__,
            )

    def _interaction_for(self, message: OutboundMessage) -> _PendingInteraction | None:
        key = (message.chat_id, message.thread_id)
        reply_to = message.reply_to_message_id
        if reply_to is not None and reply_to.startswith("interaction-"):
            pend = self._interactions.get(reply_to)
        elif reply_to is None:
            pend = self._open_interaction.get(key)  # later chunks of a slash command's reply
        else:
            self._open_interaction.pop(key, None)  # a reply to someone's message: a new answer
            pend = None
        if pend is not None and not pend.usable():
            return None
        return pend

    def _private_answer_lost(self, message: OutboundMessage) -> bool:
        """True for an answer to an ephemeral slash command whose token has expired: it
        must not be posted in the channel for everyone instead."""
        reply_to = message.reply_to_message_id
        pend = self._interactions.get(reply_to) if reply_to and reply_to.startswith("interaction-") else None
        return pend is not None and pend.ephemeral and not pend.usable()

    async def send(self, message: OutboundMessage) -> SentMessage | None:
        """Send one chunk. Returns None when the channel is gone or the bot may not post
        there (logged once per channel). Other errors propagate; nothing is retried here
        (discord.py retries 429s and 5xx itself, with a nonce Discord deduplicates)."""
        client = self._client
        if client is None or client.is_closed():
            raise RuntimeError("discord adapter is not running")
        text = message.text
        if not text.strip():
            return None
        if len(text) > self.max_message_length:
            raise ValueError(f"chunk of {len(text)} chars exceeds Discord's {self.max_message_length}")
        channel_id = message.thread_id or message.chat_id

        if self._private_answer_lost(message):
            return None
        pend = self._interaction_for(message)
        if pend is not None:
            try:
                sent = await pend.interaction.followup.send(
                    content=text, wait=True, allowed_mentions=NO_PINGS, ephemeral=pend.ephemeral
                )
            except discord.NotFound:
                if pend.ephemeral:
                    return None  # a private answer is never posted in the channel instead
                pend = None  # the interaction token expired: post in the channel instead
            else:
                pend.answered = True
                # the chunks after the first carry no reply id: they follow the same interaction,
                # so a private answer stays private to its last chunk
                self._open_interaction[pend.chat_key] = pend
                self._own_messages.add(str(sent.id))
                self._followup_messages.add(str(sent.id), pend)
                return SentMessage(chat_id=message.chat_id, thread_id=message.thread_id, message_id=str(sent.id))

        reference = None
        reply_to = message.reply_to_message_id
        if reply_to and reply_to.isdigit():
            reference = discord.MessageReference(
                message_id=int(reply_to), channel_id=int(channel_id), fail_if_not_exists=False
            )
        channel = client.get_partial_messageable(int(channel_id))
        try:
            sent_msg = await channel.send(
                content=text,
                reference=reference,  # type: ignore[arg-type]  # overloads omit None; send() accepts it
                allowed_mentions=NO_PINGS,
                nonce=message.nonce,  # type: ignore[arg-type]  # overloads omit None; send() draws one
            )  # None: discord.py draws one
        except (discord.Forbidden, discord.NotFound) as exc:
            self._warn_channel_once(channel_id, "send", exc)
            return None
        except discord.DiscordServerError as exc:
            raise DeliveryDeferred(f"discord {exc.status}") from None
        except discord.HTTPException as exc:
            log.warning("discord: message refused in channel %s (%s %s)", channel_id, exc.status, exc.code)
            return None
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            raise DeliveryDeferred(type(exc).__name__) from None
        self._own_messages.add(str(sent_msg.id))
        return SentMessage(chat_id=message.chat_id, thread_id=message.thread_id, message_id=str(sent_msg.id))

    async def edit(self, sent: SentMessage, text: str) -> bool:
        client = self._client
        if client is None or client.is_closed() or not text.strip():
            return False
        channel_id = sent.thread_id or sent.chat_id
        try:
            pend = self._followup_messages.get(sent.message_id)
            if pend is not None and pend.usable():
                await pend.interaction.followup.edit_message(
                    int(sent.message_id), content=text, allowed_mentions=NO_PINGS
                )
            else:
                partial = client.get_partial_messageable(int(channel_id)).get_partial_message(int(sent.message_id))
                await partial.edit(content=text, allowed_mentions=NO_PINGS)
            return True
        except (discord.Forbidden, discord.NotFound) as exc:
            self._warn_channel_once(channel_id, "edit a message", exc)
            return False
        except (TimeoutError, discord.HTTPException, aiohttp.ClientError) as exc:
            log.warning("discord: edit failed in channel %s: %r", channel_id, exc)
            return False

    async def is_chat_admin(self, chat_id: str, user_id: str) -> bool:
        """A guild member with Manage Messages in the channel; False when unsure."""
        client = self._client
        if client is None or not chat_id.isdigit() or not user_id.isdigit():
            return False
        try:
            channel = client.get_channel(int(chat_id)) or await client.fetch_channel(int(chat_id))
            guild = getattr(channel, "guild", None)
            if guild is None:
                return False
            member = guild.get_member(int(user_id)) or await guild.fetch_member(int(user_id))
            return channel.permissions_for(member).manage_messages  # type: ignore[union-attr]
        except (TimeoutError, discord.HTTPException, aiohttp.ClientError) as exc:
            log.warning("discord: could not look up a member of channel %s (%r)", chat_id, exc)
            return False

    async def typing(self, chat_id: str, thread_id: str | None) -> None:
        client = self._client
        if client is None or client.is_closed():
            return
        channel_id = thread_id or chat_id
        try:
            await asyncio.wait_for(client.http.send_typing(int(channel_id)), timeout=10)
        except (discord.Forbidden, discord.NotFound) as exc:
            self._warn_channel_once(channel_id, "show typing", exc)
        except Exception:
            log.debug("discord: typing failed in %s", channel_id, exc_info=True)


# ---------------------------------------------------------------------- doctor
async def doctor(cfg: DiscordConfig, *, token: str | None = None, timeout: float = 15.0) -> tuple[bool, str]:
    """Check the bot token (GET /users/@me) and the application's Message Content intent
    (GET /oauth2/applications/@me flags). Returns (ok, human-readable report). Never
    includes the token."""
    token = (token if token is not None else os.environ.get(cfg.token_env, "")).strip()
    if not token:
        return False, f"${cfg.token_env} is not set (put the bot token from {PORTAL_URL} → your app → Bot there)"
    api = resolve_api_base(cfg.api_base)
    headers = {"Authorization": f"Bot {token}", "User-Agent": "DiscordBot (hermes-gateway doctor, 1.0)"}
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as http:
            async with http.get(f"{api}/users/@me", headers=headers) as r:
                if r.status == 401:
                    return False, (
                        f"token rejected (401) — the token in ${cfg.token_env} is wrong or was reset; "
                        f"copy a fresh one from {PORTAL_URL} → your app → Bot → Reset Token"
                    )
                if r.status != 200:
                    return False, f"GET /users/@me answered HTTP {r.status}"
                me = await r.json()
            app: dict[str, Any] | None = None
            async with http.get(f"{api}/oauth2/applications/@me", headers=headers) as r:
                if r.status == 200:
                    app = await r.json()
    except (TimeoutError, aiohttp.ClientError, OSError) as exc:
        return False, f"cannot reach {api}: {type(exc).__name__}: {str(exc).replace(token, '<redacted>')}"

    name = me.get("username", "?")
    lines = [f"token OK — bot @{name} (id {me.get('id')})"]
    if app is None:
        lines.append("could not read the application's settings; cannot check the Message Content intent")
        return True, "\n    ".join(lines)
    flags = int(app.get("flags") or 0)
    if flags & (APP_FLAG_GATEWAY_MESSAGE_CONTENT | APP_FLAG_GATEWAY_MESSAGE_CONTENT_LIMITED):
        lines.append("MESSAGE CONTENT INTENT is on")
        ok = True
    else:
        lines.append(
            f"MESSAGE CONTENT INTENT is OFF — open {PORTAL_URL} → your app → Bot → "
            "Privileged Gateway Intents and turn on MESSAGE CONTENT INTENT (Discord will refuse the connection otherwise)"
        )
        ok = False
    if app.get("id"):
        lines.append(f"invite link: {invite_url(app['id'])}")
    return ok, "\n    ".join(lines)
