"""Sending to Discord: channel messages (the first chunk referencing the person's
message) or, for a slash command, interaction followups; edits, typing, chat-admin lookups,
attachment downloads and confirmation questions ("Allow" / "Deny" buttons). No pings, and
no retry loop of our own (discord.py retries with a nonce; the rest raises
`DeliveryDeferred` for the outbox): see the delivery details in adapter.py's docstring.
"""

from __future__ import annotations

import asyncio

import aiohttp
import discord

from adapters.discord_bot.client import CUSTOM_ID_MAX_CHARS, NO_PINGS, log
from adapters.discord_bot.state import DiscordState, _PendingInteraction
from core.messages import (
    Attachment,
    ConfirmRequest,
    DeliveryDeferred,
    DownloadError,
    OutboundMessage,
    SentMessage,
    confirm_payload,
    with_outcome,
)


class Sending(DiscordState):
    """Sends, edits, typing and downloads (part of `DiscordAdapter`)."""

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
        if pend is not None and pend.followup is not None:
            try:
                sent = await pend.followup.send(
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
        return await self._post(client, message, reference=reference)

    async def _post(
        self,
        client: discord.Client,
        message: OutboundMessage,
        *,
        reference: discord.MessageReference | None = None,
        view: discord.ui.View | None = None,
    ) -> SentMessage | None:
        """POST one message into its channel (or thread): None when the channel is gone or
        the bot may not post there, `DeliveryDeferred` when it may work later."""
        channel_id = message.thread_id or message.chat_id
        channel = client.get_partial_messageable(int(channel_id))
        try:
            sent_msg = await channel.send(
                content=message.text,
                reference=reference,  # type: ignore[arg-type]  # overloads omit None; send() accepts it
                allowed_mentions=NO_PINGS,
                nonce=message.nonce,  # type: ignore[arg-type]  # overloads omit None; send() draws one
                view=view,  # type: ignore[arg-type]  # overloads omit None; send() accepts it
            )
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

    # ------------------------------------------------------------------ confirmations
    async def ask(self, request: ConfirmRequest) -> SentMessage | None:
        """Post a confirmation question with "Allow" / "Deny" buttons in its channel (or
        thread): None when the channel is gone or refuses it, `DeliveryDeferred` (or
        RuntimeError while not running) when it may work later. A press is dispatched on
        its custom_id in receive.py, so no view is kept here and none needs restoring
        after a restart."""
        client = self._client
        if client is None or client.is_closed():
            raise RuntimeError("discord adapter is not running")
        allow, deny = confirm_payload(request.token, True), confirm_payload(request.token, False)
        if max(len(allow), len(deny)) > CUSTOM_ID_MAX_CHARS:
            log.error("discord: a confirmation token is too long for a button's custom_id; not asked")
            return None
        view = discord.ui.View(timeout=None)
        view.add_item(discord.ui.Button(label="Allow", style=discord.ButtonStyle.success, custom_id=allow))
        view.add_item(discord.ui.Button(label="Deny", style=discord.ButtonStyle.danger, custom_id=deny))
        # Only its components are sent: a stopped view is not stored by discord.py (an
        # unstopped one with timeout=None would be, for ever, one per question).
        view.stop()
        message = OutboundMessage(chat_id=request.chat_id, thread_id=request.thread_id, text=request.text)
        return await self._post(client, message, view=view)

    async def settle(self, request: ConfirmRequest, sent: SentMessage, outcome: str) -> None:
        """Edit the question to say `outcome`, its buttons removed (`view=None` sends no
        components). A question that is gone is not an error; other failures are logged."""
        client = self._client
        channel_id = sent.thread_id or sent.chat_id
        if client is None or client.is_closed():
            log.info("discord: not running; a question in channel %s keeps its buttons", channel_id)
            return
        text = with_outcome(request.text, outcome, self.max_message_length)
        partial = client.get_partial_messageable(int(channel_id)).get_partial_message(int(sent.message_id))
        try:
            await partial.edit(content=text, view=None, allowed_mentions=NO_PINGS)
        except discord.NotFound:
            log.debug("discord: a question in channel %s is gone; nothing to settle", channel_id)
        except discord.Forbidden as exc:
            self._warn_channel_once(channel_id, "edit a message", exc)
        except (TimeoutError, discord.HTTPException, aiohttp.ClientError, OSError) as exc:
            log.warning("discord: settling a question in channel %s failed (%s)", channel_id, type(exc).__name__)

    async def edit(self, sent: SentMessage, text: str) -> bool:
        client = self._client
        if client is None or client.is_closed() or not text.strip():
            return False
        channel_id = sent.thread_id or sent.chat_id
        try:
            pend = self._followup_messages.get(sent.message_id)
            if pend is not None and pend.usable() and pend.followup is not None:
                await pend.followup.edit_message(int(sent.message_id), content=text, allowed_mentions=NO_PINGS)
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
