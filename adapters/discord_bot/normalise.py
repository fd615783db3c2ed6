"""Discord messages -> `InboundMessage` (which messages are for the bot and where they
belong: the rules are in adapter.py's docstring): the bot's mention cut out and other
mentions made readable, a thread or a one-to-one DM told apart by fetching a channel
discord.py does not know, attachments and the quoted text of a reply.
"""

from __future__ import annotations

import re
from typing import Any

import aiohttp
import discord

from adapters.discord_bot.client import log
from adapters.discord_bot.state import DiscordState
from core.messages import Attachment, InboundMessage


def _attachment_kind(content_type: str | None) -> str:
    major = (content_type or "").split("/", 1)[0]
    return major if major in ("image", "audio", "video") else "file"


class Normalising(DiscordState):
    """Turns discord.py messages into `InboundMessage`s (part of `DiscordAdapter`)."""

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
