"""Sending to Telegram: messages (as HTML, plain text when the markup is refused),
edits, typing, chat-admin lookups, attachment downloads and confirmation questions
(inline "Allow" / "Deny" buttons), paced by the flood gate.
Errors map to what the gateway does next: None (the chat is gone or refuses it, never
retried) or `DeliveryDeferred` (the outbox retries later).
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
from telegram import InlineKeyboardButton, InlineKeyboardMarkup, ReplyParameters
from telegram.constants import ChatAction, ParseMode
from telegram.error import BadRequest, ChatMigrated, Forbidden, NetworkError, RetryAfter, TelegramError, TimedOut

from adapters.telegram.client import (
    CALLBACK_DATA_MAX_BYTES,
    _retry_after_seconds,
    log,
)
from adapters.telegram.format import markdown_to_telegram_html
from adapters.telegram.state import TelegramState
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
from core.text import split_text, utf16_len


def _chat_id_param(chat_id: str) -> int | str:
    return int(chat_id) if chat_id.lstrip("-").isdigit() else chat_id


def _never_sent(exc: BaseException) -> bool:
    """True when a failed request provably never reached Telegram (safe to resend)."""
    cause = exc.__cause__
    if isinstance(cause, (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)):
        return True
    return "Pool timeout" in str(exc)


class Sending(TelegramState):
    """Sends, edits, typing and downloads (part of `TelegramAdapter`)."""

    async def download(self, attachment: Attachment, max_bytes: int) -> bytes:
        """Fetch one attachment with getFile + File.download_as_bytearray. Errors become
        `DownloadError` with a safe message (the file URL, which holds the token, never
        leaves this method)."""
        if not attachment.file_id:
            raise DownloadError("the file is not available")
        try:
            file = await self.bot.get_file(attachment.file_id)
            if file.file_size and file.file_size > max_bytes:
                raise DownloadError("the file is too large", too_big=True)
            data = await file.download_as_bytearray()
        except DownloadError:
            raise
        except BadRequest as exc:
            too_big = "too big" in str(exc).lower()
            log.warning("telegram: getFile refused a %s (%s)", attachment.type, "too big" if too_big else "bad request")
            raise DownloadError("Telegram refused the download", too_big=too_big) from None
        except (TelegramError, RuntimeError, OSError) as exc:
            log.warning("telegram: downloading a %s failed (%s)", attachment.type, type(exc).__name__)
            raise DownloadError("the download from Telegram failed") from None
        if len(data) > max_bytes:
            raise DownloadError("the file is too large", too_big=True)
        return bytes(data)

    # ----------------------------------------------------------------- delivery

    async def send(self, message: OutboundMessage) -> SentMessage | None:
        chat_id = message.chat_id
        if chat_id in self._forbidden:
            log.debug("telegram: not sending to chat %s (the bot was removed or blocked)", chat_id)
            return None
        text = message.text
        if not text.strip():
            return None
        if utf16_len(text) > self.max_message_length:  # the gateway splits; this is a safety net
            sent = None
            for piece in split_text(text, self.max_message_length, utf16_len):
                part = message.model_copy(update={"text": piece})
                result = await self._send_one(part)
                sent = sent or result
            return sent
        return await self._send_one(message)

    async def _send_one(
        self, message: OutboundMessage, reply_markup: InlineKeyboardMarkup | None = None
    ) -> SentMessage | None:
        kwargs: dict[str, Any] = {}
        if reply_markup is not None:
            kwargs["reply_markup"] = reply_markup
        if message.thread_id:
            kwargs["message_thread_id"] = int(message.thread_id)
        # ids of edited messages look like "<id>:edit:<date>": reply to the message itself
        reply_to = (message.reply_to_message_id or "").split(":", 1)[0]
        if reply_to.isdigit():
            kwargs["reply_parameters"] = ReplyParameters(message_id=int(reply_to), allow_sending_without_reply=True)
        if message.kind == "notice":
            kwargs["disable_notification"] = True
        chat_id: int | str = _chat_id_param(message.chat_id)
        html_text = markdown_to_telegram_html(message.text)
        formatted = True
        attempts = 0
        flood_waited = 0.0
        while True:
            attempts += 1
            await self._flood.wait_turn(str(chat_id))
            if message.may_send is not None and not message.may_send():  # e.g. a lease lost meanwhile
                raise DeliveryDeferred("no longer ours to send")
            try:
                if formatted:
                    sent = await self.bot.send_message(chat_id, html_text, parse_mode=ParseMode.HTML, **kwargs)
                else:
                    sent = await self.bot.send_message(chat_id, message.text, **kwargs)
                return SentMessage(
                    chat_id=str(sent.chat.id), message_id=str(sent.message_id), thread_id=message.thread_id
                )
            except RetryAfter as exc:
                # 429: Telegram did not send it, so sending the same chunk again cannot duplicate.
                wait = _retry_after_seconds(exc)
                if attempts >= self._max_send_attempts + 3 or flood_waited + wait > self._max_flood_wait:
                    log.warning(
                        "telegram: flood control in chat %s lasts long; the outbox retries later", message.chat_id
                    )
                    raise DeliveryDeferred("flood control", retry_after=wait) from None
                log.warning("telegram: flood control (429) in chat %s; retrying in %.1fs", message.chat_id, wait)
                flood_waited += wait
                self._flood.hold(str(chat_id), wait)  # the next wait_turn sleeps it off
            except Forbidden:
                self._mark_forbidden(message.chat_id)
                return None
            except ChatMigrated as exc:
                log.info("telegram: chat %s became supergroup %s; resending there", message.chat_id, exc.new_chat_id)
                chat_id = exc.new_chat_id
                kwargs.pop("reply_parameters", None)
            except BadRequest as exc:
                text = exc.message.lower()
                if formatted and ("parse entities" in text or "too long" in text or "text is empty" in text):
                    log.info("telegram: markup rejected in chat %s; resending as plain text", message.chat_id)
                    formatted = False
                    continue
                if "chat not found" in text:
                    self._mark_forbidden(message.chat_id)
                    return None
                if "thread not found" in text and "message_thread_id" in kwargs:
                    log.warning("telegram: topic %s in chat %s is gone; not sent", message.thread_id, message.chat_id)
                    return None
                log.warning("telegram: sendMessage refused in chat %s: %s", message.chat_id, exc.message)
                return None
            except (TimedOut, NetworkError) as exc:
                if _never_sent(exc) and attempts < self._max_send_attempts:
                    await asyncio.sleep(min(self._backoff_initial * attempts, self._backoff_max))
                    continue
                # The request may have reached Telegram: the outbox resends it later, which can
                # post the chunk twice (Telegram has no idempotency key; see docs/concepts.md#delivery).
                log.warning(
                    "telegram: sendMessage to chat %s failed (%s); the outbox retries it",
                    message.chat_id,
                    type(exc).__name__,
                )
                raise DeliveryDeferred(type(exc).__name__) from None
            except TelegramError as exc:
                log.warning("telegram: sendMessage to chat %s failed (%s)", message.chat_id, type(exc).__name__)
                return None

    def _mark_forbidden(self, chat_id: str) -> None:
        if chat_id not in self._forbidden:
            log.warning(
                "telegram: chat %s refused the message (the bot was removed or blocked); "
                "not sending there until it hears from that chat again",
                chat_id,
            )
        self._forbidden.add(chat_id)

    async def edit(self, sent: SentMessage, text: str) -> bool:
        if not text.strip() or sent.chat_id in self._forbidden:
            return False
        chat_id = _chat_id_param(sent.chat_id)
        message_id = int(sent.message_id)
        html_text = markdown_to_telegram_html(text)
        formatted = True
        for _ in range(self._max_send_attempts + 3):
            try:
                await self._flood.wait_turn(sent.chat_id)
            except DeliveryDeferred as exc:  # the shared pacing is unreachable: not edited now
                log.info("telegram: editMessageText in chat %s not sent (%s)", sent.chat_id, exc)
                return False
            try:
                if formatted:
                    await self.bot.edit_message_text(
                        html_text, chat_id=chat_id, message_id=message_id, parse_mode=ParseMode.HTML
                    )
                else:
                    await self.bot.edit_message_text(text, chat_id=chat_id, message_id=message_id)
                return True
            except RetryAfter as exc:
                wait = _retry_after_seconds(exc)
                if wait > self._max_flood_wait:
                    return False
                self._flood.hold(sent.chat_id, wait)  # 429: not applied, so retrying is safe
            except Forbidden:
                self._mark_forbidden(sent.chat_id)
                return False
            except BadRequest as exc:
                low = exc.message.lower()
                if "not modified" in low:
                    return True
                if formatted and ("parse entities" in low or "too long" in low or "text is empty" in low):
                    formatted = False
                    continue
                log.info("telegram: editMessageText refused in chat %s: %s", sent.chat_id, exc.message)
                return False
            except TelegramError as exc:
                log.info("telegram: editMessageText in chat %s failed (%s)", sent.chat_id, type(exc).__name__)
                return False
        return False

    # ----------------------------------------------------------------- confirmations

    async def ask(self, request: ConfirmRequest) -> SentMessage | None:
        """Post a confirmation question with "Allow" / "Deny" inline buttons (in the forum
        topic when `thread_id` is set), formatted, paced and retried like `send`: None when
        the chat refuses it for good, `DeliveryDeferred` when it may work later."""
        if request.chat_id in self._forbidden:
            return None
        allow, deny = confirm_payload(request.token, True), confirm_payload(request.token, False)
        if max(len(allow.encode()), len(deny.encode())) > CALLBACK_DATA_MAX_BYTES:
            # Telegram would refuse the buttons (BUTTON_DATA_INVALID): the call is denied
            log.error("telegram: a confirmation token is too long for a button's callback_data; not asked")
            return None
        markup = InlineKeyboardMarkup(
            [[InlineKeyboardButton("Allow", callback_data=allow), InlineKeyboardButton("Deny", callback_data=deny)]]
        )
        message = OutboundMessage(chat_id=request.chat_id, thread_id=request.thread_id, text=request.text)
        return await self._send_one(message, reply_markup=markup)

    async def settle(self, request: ConfirmRequest, sent: SentMessage, outcome: str) -> None:
        """Edit the question to say `outcome`, its buttons gone (editMessageText without
        reply_markup removes an inline keyboard). A question that is gone, or an edit the
        chat refuses, is logged by `edit` and left alone: it is not an error."""
        await self.edit(sent, with_outcome(request.text, outcome, self.max_message_length, utf16_len))

    async def is_chat_admin(self, chat_id: str, user_id: str) -> bool:
        """The chat's creator or an administrator (getChatMember); False when unsure."""
        try:
            member = await self.bot.get_chat_member(_chat_id_param(chat_id), int(user_id))
        except (TelegramError, ValueError) as exc:
            log.warning("telegram: could not look up a member of chat %s (%s)", chat_id, type(exc).__name__)
            return False
        return member.status in ("creator", "administrator")

    async def typing(self, chat_id: str, thread_id: str | None) -> None:
        if chat_id in self._forbidden:
            return
        try:
            await self.bot.send_chat_action(
                _chat_id_param(chat_id),
                ChatAction.TYPING,
                message_thread_id=int(thread_id) if thread_id else None,
            )
        except Forbidden:
            self._mark_forbidden(chat_id)
        except Exception as exc:  # typing is cosmetic: never raise, never retry
            log.debug("telegram: sendChatAction failed (%s)", type(exc).__name__)
