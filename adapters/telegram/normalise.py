"""Telegram updates -> `InboundMessage`: which messages are for the bot (mentions,
replies, commands, the service account's relays), where they belong (DM, group, topic,
channel), the text with the bot's @mention cut out (offsets in UTF-16 units, as Telegram
counts), attachments as file ids, and the quoted text of a reply.
"""

from __future__ import annotations

import re
import time
from typing import Any

from telegram import Message, Update

from adapters.telegram.client import log
from adapters.telegram.state import TelegramState
from core.messages import Attachment, InboundMessage
from core.text import utf16_len

# Telegram's service account that relays linked-channel posts into discussion groups.
_TELEGRAM_SERVICE_USER_ID = 777000
_ATTACHMENT_KINDS = ("photo", "document", "audio", "voice", "video", "video_note", "animation", "sticker")


def _utf16_slice(text: str, offset: int, length: int) -> str:
    # surrogatepass: a lone surrogate (broken text) counts as one unit, as Telegram counts
    # it, so a bad message still reaches the gateway, which refuses it clearly
    data = text.encode("utf-16-le", "surrogatepass")
    return data[2 * offset : 2 * (offset + length)].decode("utf-16-le", errors="surrogatepass")


def _utf16_cut(text: str, spans: list[tuple[int, int]]) -> str:
    """Remove the given (offset, length) UTF-16 spans from `text`."""
    data = text.encode("utf-16-le", "surrogatepass")
    for offset, length in sorted(spans, reverse=True):
        data = data[: 2 * offset] + data[2 * (offset + length) :]
    return data.decode("utf-16-le", errors="surrogatepass")


def _tidy(text: str) -> str:
    """Whitespace left behind by a removed mention: 'hey  , you' -> 'hey, you'."""
    text = re.sub(r"[ \t]{2,}", " ", text)
    text = re.sub(r" ([,.!?;:])", r"\1", text)
    return text.strip()


class Normalising(TelegramState):
    """Turns raw updates into `InboundMessage`s (part of `TelegramAdapter`)."""

    def normalize(self, raw: dict[str, Any]) -> InboundMessage | None:
        """The InboundMessage for a raw update, or None when the bot must ignore it."""
        update = Update.de_json(dict(raw), self.bot)
        if update.my_chat_member is not None:
            self._on_my_chat_member(update)
            return None
        edited = False
        message: Message | None = update.message
        if message is None and self.cfg.handle_edited_messages and update.edited_message is not None:
            message, edited = update.edited_message, True
        if message is None and self.cfg.handle_channel_posts:
            if update.channel_post is not None:
                message = update.channel_post
            elif self.cfg.handle_edited_messages and update.edited_channel_post is not None:
                message, edited = update.edited_channel_post, True
        if message is None:
            return None
        return self._normalize_message(message, raw, edited=edited)

    def _on_my_chat_member(self, update: Update) -> None:
        change = update.my_chat_member
        if change is None:  # normalize() calls this only when it is set
            return
        chat_id = str(change.chat.id)
        status = change.new_chat_member.status
        if status in ("left", "kicked"):
            if chat_id not in self._forbidden:
                log.info("telegram: the bot was removed from chat %s", chat_id)
            self._forbidden.add(chat_id)
        elif status in ("member", "administrator", "creator"):
            self._forbidden.discard(chat_id)

    def _normalize_message(self, message: Message, raw: dict[str, Any], *, edited: bool) -> InboundMessage | None:
        chat = message.chat
        if chat is None or message.message_id is None:
            raise ValueError("message without chat or message_id")
        sender = message.from_user
        channel = chat.type == "channel"
        if not channel:
            if sender is None:
                return None
            if sender.is_bot or (self.bot_id is not None and sender.id == self.bot_id):
                return None
            if sender.id == _TELEGRAM_SERVICE_USER_ID or message.is_automatic_forward:
                return None  # linked-channel posts relayed into a discussion group

        text = message.text if message.text is not None else (message.caption or "")
        entities = list(message.entities or message.caption_entities or ())
        attachments = self._attachments(message)
        if not text and not attachments:
            return None  # service messages: joins, pins, topic edits, ...

        if chat.type == "private":
            chat_type = "dm"
        elif channel:
            chat_type = "channel"
        elif message.is_topic_message and message.message_thread_id is not None:
            chat_type = "thread"
        else:
            chat_type = "group"
        thread_id = (
            str(message.message_thread_id)
            if message.is_topic_message and message.message_thread_id is not None
            else None
        )

        reply_to = message.reply_to_message
        if reply_to is not None and (
            reply_to.forum_topic_created is not None
            or (thread_id is not None and reply_to.message_id == message.message_thread_id)
        ):
            reply_to = None  # every topic message "replies" to the topic's creation message
        replies_to_bot = bool(
            reply_to is not None
            and reply_to.from_user is not None
            and self.bot_id is not None
            and reply_to.from_user.id == self.bot_id
        )

        text, mentioned, command_for_other = self._strip_addressing(text, entities)
        if command_for_other:
            return None  # /cmd@otherbot
        is_command = text.startswith("/")
        if chat_type == "dm":
            mentions_bot = True
        else:
            mentions_bot = mentioned or replies_to_bot
            if self.cfg.require_mention_in_groups and not (mentions_bot or is_command):
                return None

        self._forbidden.discard(str(chat.id))
        if channel:
            user_id = str(message.sender_chat.id if message.sender_chat else chat.id)
            user_name = chat.title or chat.username or ""
        else:
            assert sender is not None  # non-channel chats returned above when it is None
            user_id = str(sender.id)
            user_name = sender.username or sender.full_name or ""
        message_id = str(message.message_id)
        stamp = message.date
        if edited:
            edit_date = message.edit_date
            # The gateway deduplicates by message id: an edit is a new message to it.
            message_id = f"{message_id}:edit:{int(edit_date.timestamp()) if edit_date else int(time.time())}"
            stamp = edit_date or stamp
        return InboundMessage(
            platform="telegram",
            chat_id=str(chat.id),
            chat_type=chat_type,
            thread_id=thread_id,
            user_id=user_id,
            user_name=user_name,
            message_id=message_id,
            text=text,
            attachments=tuple(attachments),
            reply_to_message_id=str(reply_to.message_id) if reply_to is not None else None,
            **self._reply_context(message, reply_to),
            mentions_bot=mentions_bot,
            timestamp=stamp.timestamp() if stamp else time.time(),
            raw=raw,
        )

    def _strip_addressing(self, text: str, entities: list[Any]) -> tuple[str, bool, bool]:
        """(text without @bot mentions and with `/cmd@bot` -> `/cmd`, mentioned, command
        addressed to another bot)."""
        username = (self.bot_username or "").lower()
        cuts: list[tuple[int, int]] = []
        mentioned = False
        command_for_other = False
        for entity in entities:
            kind, offset, length = entity.type, entity.offset, entity.length
            if kind == "mention":
                if username and _utf16_slice(text, offset, length).lower() == f"@{username}":
                    mentioned = True
                    cuts.append((offset, length))
            elif kind == "text_mention":
                if entity.user is not None and entity.user.id == self.bot_id:
                    mentioned = True
                    cuts.append((offset, length))
            elif kind == "bot_command" and offset == 0:
                command = _utf16_slice(text, offset, length)
                name, at, target = command.partition("@")
                if at:
                    if target.lower() == username:
                        mentioned = True
                        cuts.append((utf16_len(name), utf16_len(at + target)))
                    else:
                        command_for_other = True
        if cuts:
            text = _tidy(_utf16_cut(text, cuts))
        return text, mentioned, command_for_other

    @staticmethod
    def _attachments(message: Message) -> list[Attachment]:
        found: list[Attachment] = []
        for kind in _ATTACHMENT_KINDS:
            value = getattr(message, kind, None)
            if not value:
                continue
            if isinstance(value, (tuple, list)):  # photo sizes: keep the largest
                value = value[-1]
            name = getattr(value, "file_name", None) or kind
            size = getattr(value, "file_size", None) or 0
            mime = getattr(value, "mime_type", None) or ("image/jpeg" if kind == "photo" else "")
            # only the file id: Telegram's file URLs carry the bot token
            found.append(Attachment(type=kind, name=name, size=size, file_id=value.file_id, mime_type=mime))
        return found

    def _reply_context(self, message: Message, reply_to: Message | None) -> dict[str, Any]:
        """The quoted text of the message replied to (the part the person selected, when
        they quoted one), and who wrote it. Only what Telegram sent with this message."""
        if reply_to is None:
            return {}
        quote = message.quote.text if message.quote is not None and message.quote.text else None
        text = quote or reply_to.text or reply_to.caption
        if not text:
            return {}
        author = reply_to.from_user
        if author is not None and self.bot_id is not None and author.id == self.bot_id:
            who = "you"
        elif author is not None:
            who = author.username or author.full_name or ""
        else:
            who = reply_to.sender_chat.title if reply_to.sender_chat is not None and reply_to.sender_chat.title else ""
        return {"reply_to_text": text, "reply_to_author": who}
