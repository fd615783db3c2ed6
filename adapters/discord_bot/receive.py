"""Receiving from Discord: the gateway connection (log in with backoff, discord.py's own
resume, reconnect with backoff after anything else, final only for a rejected token or a
refused intent), gateway shards in sharded or cluster mode, the guard that skips an event
discord.py cannot parse instead of losing the connection, the queue that hands
messages to the gateway in order, and presses of confirmation buttons (handed to the
gateway's `answerer`, never to the sink).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import aiohttp
import discord
import yarl
from discord.gateway import DiscordWebSocket

from adapters.discord_bot.client import (
    DISCORD_GATEWAY,
    INTENT_HINT,
    NO_PINGS,
    PORTAL_URL,
    log,
)
from adapters.discord_bot.commands import SlashCommands
from core.backoff import Backoff
from core.messages import CONFIRM_REFUSALS, ConfirmVerdict, InboundMessage, parse_confirm_payload, press_verdict

# How long a press waits for the gateway's verdict (the press is acknowledged first, so
# Discord's 3 s limit does not apply; a followup is possible for 15 minutes).
_PRESS_ANSWER_TIMEOUT_S = 30.0


class _Client(discord.Client):
    def __init__(self, adapter: Receiving, **options: Any) -> None:
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

    async def on_interaction(self, interaction: discord.Interaction) -> None:
        await self._adapter._on_press(interaction)

    async def on_error(self, event_method: str, /, *args: Any, **kwargs: Any) -> None:
        log.exception("discord: error in %s", event_method)


class _ShardClient(discord.Client):
    """One gateway shard's connection (sharded mode): hands messages to the adapter; the
    adapter's own client, logged in but not connected, does every REST call."""

    def __init__(self, adapter: Receiving, shard_id: int, **options: Any) -> None:
        super().__init__(shard_id=shard_id, shard_count=adapter.cfg.shard_count, **options)
        self._adapter = adapter
        adapter._guard_parsers(self)

    async def on_connect(self) -> None:
        self._adapter._point_at_gateway(self)

    async def on_ready(self) -> None:
        log.info("discord: shard %s of %s connected", self.shard_id, self.shard_count)

    async def on_message(self, message: discord.Message) -> None:
        self._adapter._inbound.put_nowait(message)

    async def on_interaction(self, interaction: discord.Interaction) -> None:
        await self._adapter._on_press(interaction)

    async def on_error(self, event_method: str, /, *args: Any, **kwargs: Any) -> None:
        log.exception("discord: error in %s (shard %s)", event_method, self.shard_id)


class Receiving(SlashCommands):
    """The gateway connection and shards (part of `DiscordAdapter`)."""

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
        wait = Backoff(2.0, 60.0)
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
                delay = wait.next()
                log.warning("discord: shard %s: %r; retrying in %.0fs", client.shard_id, exc, delay)
                await asyncio.sleep(delay)

    def _point_at_gateway(self, client: discord.Client) -> None:
        # With an explicit gateway_url (a proxy), RESUME goes there too, not to the
        # `resume_gateway_url` Discord hands out in READY.
        if self._gateway_url and client.ws is not None:
            client.ws.gateway = yarl.URL(self._gateway_url)

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
        wait = Backoff(2.0, 60.0)
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
                delay = wait.next()
                log.warning("discord: %s; retrying in %.0fs", self.last_error, delay)
                await asyncio.sleep(delay)

    async def _run(self) -> None:
        """Log in and hold the gateway connection for as long as the adapter runs: discord.py
        reconnects by itself after network drops; anything else that ends the connection is
        reconnected here with backoff. Only a rejected token or a refused intent is final."""
        wait = Backoff(2.0, 60.0)
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
                    wait.reset()
                self._set_status("connecting")
                self.last_error = why
                delay = wait.next()
                log.warning("discord: %s; reconnecting in %.0fs", why, delay)
                await self._close_client()
                await asyncio.sleep(delay)
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

    # ------------------------------------------------------------------ button presses
    async def _on_press(self, interaction: discord.Interaction) -> None:
        """A press of a message button, dispatched on its custom_id (so it works for
        questions posted before a restart; the adapter keeps no views). One of ours
        (`hgc:<token>:a|d`) is acknowledged at once (a deferred update: `settle` edits the
        question), then handed to `answerer`; a refusal is an ephemeral followup only the
        presser sees. Other interactions are left alone. Never raises."""
        if interaction.type is not discord.InteractionType.component:
            return
        data: Any = interaction.data or {}
        parsed = parse_confirm_payload(data.get("custom_id"))
        if parsed is None:
            return
        token, allow = parsed
        try:
            await interaction.response.defer()  # type 6: within Discord's 3 s, whatever the verdict takes
            acknowledged = True
        except (TimeoutError, discord.HTTPException, aiohttp.ClientError, OSError) as exc:
            # too late or already answered: the press is still a press, only no reply can follow
            log.warning("discord: could not acknowledge a button press (%s)", type(exc).__name__)
            acknowledged = False
        verdict = await self._verdict(token, str(interaction.user.id), allow)
        if verdict is None or verdict == "ok" or not acknowledged:
            return
        try:
            await interaction.followup.send(CONFIRM_REFUSALS[verdict], ephemeral=True, allowed_mentions=NO_PINGS)
        except (TimeoutError, discord.HTTPException, aiohttp.ClientError, OSError) as exc:
            log.warning("discord: could not tell a presser why a press was refused (%s)", type(exc).__name__)

    async def _verdict(self, token: str, user_id: str, allow: bool) -> ConfirmVerdict | None:
        return await press_verdict(self.answerer, token, user_id, allow, timeout_s=_PRESS_ANSWER_TIMEOUT_S, log=log)
