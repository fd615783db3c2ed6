"""Slash commands: the command table registered with Discord (admin commands only shown to
members with the permission; synced only when it changed), each interaction deferred and
handed on as an `InboundMessage` ("interaction-<id>"), ephemeral in servers for commands
about the asker, and the "thinking..." placeholder of an unanswered one removed in time.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

import discord
from discord import app_commands
from pydantic import SecretStr

from adapters.discord_bot.client import log
from adapters.discord_bot.normalise import Normalising
from adapters.discord_bot.state import _INTERACTION_TTL_S, _PendingInteraction
from core.commands import COMMAND_SPECS, CommandSpec, find_command
from core.messages import InboundMessage, ReplyHandle

# Slash commands whose answer is about the person asking: in a server only they see it
# (an ephemeral response); in a DM it is private anyway.
EPHEMERAL_IN_SERVERS = frozenset(spec.name for spec in COMMAND_SPECS if spec.ephemeral)
# Admin commands are registered with these default member permissions, so Discord shows them
# only to server members who have them (server admins can widen that in the integration settings).
ADMIN_DEFAULT_PERMISSIONS = discord.Permissions(administrator=True)

# A deferred ("thinking...") slash command nobody answered is cleaned up after this.
_INTERACTION_ABANDON_S = 13 * 60


class SlashCommands(Normalising):
    """The command tree and interactions (part of `DiscordAdapter`)."""

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
            if not self._elected:
                # in a cluster the node that runs the turn answers it, whichever it is: the
                # handle goes with the message and that node adopts it (see `adopt`)
                pend = _PendingInteraction(interaction.followup, (chat_id, thread_id), ephemeral=ephemeral)
                self._interactions[message_id] = pend
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
                reply_handle=ReplyHandle(
                    application_id=str(interaction.application_id),
                    token=SecretStr(interaction.token),
                    ephemeral=ephemeral,
                    created_at=interaction.created_at.timestamp(),
                ),
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
                    await self._withdraw(pend)

    async def _withdraw(self, pend: _PendingInteraction) -> None:
        """Remove the placeholder of an interaction nothing answered (once)."""
        pend.answered = True
        try:
            await pend.withdraw()
        except Exception as exc:
            log.debug("discord: could not remove an unanswered interaction (%s)", type(exc).__name__)

    # ------------------------------------------------------------------ other nodes' interactions
    def adopt(self, msg: InboundMessage) -> None:
        """Cluster mode: answer `msg`, a slash command another node (or this one) received
        and deferred, through its follow-up webhook (`AdoptsReplies`, core/protocols.py)."""
        handle = msg.reply_handle
        if handle is None or msg.message_id in self._interactions:
            return
        client, token = self._client, handle.token.get_secret_value()
        webhook = None  # an expired or spent handle: kept so that a private answer stays private
        if client is not None and token and handle.application_id.isdigit():
            # what `Interaction.followup` builds: the application's webhook for this token
            webhook = discord.Webhook.from_state(
                {"id": int(handle.application_id), "type": 3, "token": token}, client._connection
            )
        age = max(time.time() - handle.created_at, 0.0)
        self._interactions[msg.message_id] = _PendingInteraction(
            webhook, (msg.chat_id, msg.thread_id), created=time.monotonic() - age, ephemeral=handle.ephemeral
        )

    async def release(self, message_ids: Sequence[str], done: bool) -> None:
        """The lane's claim ended: forget the adopted interactions of `message_ids`; with
        `done`, one still unanswered never will be, so its placeholder goes now (not after
        13 minutes, when another node may have answered it in the meantime)."""
        for message_id in message_ids:
            pend = self._interactions.pop(message_id, None)
            if pend is None:
                continue
            if self._open_interaction.get(pend.chat_key) is pend:
                self._open_interaction.pop(pend.chat_key, None)
            if done and not pend.answered and pend.usable():
                await self._withdraw(pend)
