"""A fake Telegram Bot API: a real aiohttp server on 127.0.0.1 (ephemeral port).

    async with FakeTelegram(token="123:ABC") as tg:
        bot = telegram.Bot("123:ABC", base_url=tg.base_url)     # PTB appends the token
        tg.push_private(111, "hello")                             # queue an update
        ...
        assert tg.sent_messages(chat_id=111)[0]["text"] == "..."

What it speaks, like the real server:
- `POST|GET /bot<token>/<method>` with form-encoded (what python-telegram-bot sends: each
  non-string value JSON-encoded), multipart or JSON bodies, or query parameters.
- A wrong token gets 401 `Unauthorized` for every method; unknown methods 404.
- `getUpdates` long-polls: it waits up to `timeout` seconds for updates with
  `update_id >= offset`; passing `offset` confirms (forgets) every earlier update. A newer
  `getUpdates` ends a waiting one with 409, and `getUpdates` while a webhook is set is a 409.
- `sendMessage` returns a full Message (incrementing per-chat `message_id`, chat, date, text,
  `message_thread_id`/`is_topic_message` in forum topics, `reply_to_message`). With
  `parse_mode=HTML` the markup is checked the way Telegram does (allowed tags only, properly
  nested) and a bad one answers 400 `can't parse entities`; the stored text is the visible
  text. Empty text and text over 4096 UTF-16 units are 400s, as are unknown chats.
- Inline keyboards: `sendMessage` keeps `reply_markup` (an `inline_keyboard`; a button's
  `callback_data` over 64 bytes is 400 `BUTTON_DATA_INVALID`) on the Message it returns and
  stores; `editMessageText` replaces it, or removes it when the edit carries none (as
  Telegram does). `answerCallbackQuery` is recorded in `tg.callback_answers`
  (`callback_query_id`, `text`, `show_alert`); an unknown or already answered query is a
  400 `query is too old ...`. `tg.press_button(chat_id, message_id, user_id, text="Allow")`
  (or `data="..."` for any payload) queues the `callback_query` update a person's press
  makes; `tg.answer_to(pressed)` / `await tg.wait_answered(pressed)` give its answer.
- `editMessageText`, `sendChatAction`, `setMyCommands`/`getMyCommands`, `deleteWebhook`,
  `setWebhook`, `getWebhookInfo`, `getMe`.
- Files: `getFile` (400 `file is too big` over 20 MB, like the Bot API) and
  `GET /file/bot<token>/<file_path>` (401 with a wrong token); `add_file(data)` stores one,
  `push_media(user, "photo"|"voice"|"audio"|"document", data, ...)` sends it in a message,
  `file_downloads` records the paths fetched.

Injection: `tg.fail_next(method, status=429, retry_after=1)`, `status=403, description=...`,
`status=400, description="Bad Request: can't parse entities: ..."`; `times=n` repeats;
`tg.delay_next(method, seconds)` answers late (the call still takes effect, like a real
timeout after Telegram processed the request).

Recording: `tg.calls` is every call as `(method, params)`, `tg.responses` the matching
`(method, status)`; `tg.sent_messages(chat_id=None)` the messages the bot sent (Message
dicts, plus `"_params"` with the request parameters and `"_at"` the time.monotonic() it
arrived, `"_via"` the caller's label or None; an edit changes their text), `tg.edits` the
edits carried out (with `"_at"` and `"_via"` too); `tg.acked_offset`,
`tg.pending_updates`. Waiting helpers: `await tg.wait_for(lambda: ..., timeout=10)`,
`await tg.wait_sent(n, chat_id=None)`.

Several clients (the nodes of a cluster) can be told apart: give each the base URL
`tg.base_url_for(label)` (`.../via/<label>/bot`); sent messages record the label in `"_via"`.

Builders: `push_private`, `push_group`, `push_topic`, `push_edit`, `push_channel_post`,
`push_update(raw)` queue updates and return `Pushed(update_id, message_id, chat_id, update)`.
Entities for `@mentions` and a leading `/command` are computed with UTF-16 offsets.
"""

from __future__ import annotations

import asyncio
import contextvars
import html.parser
import itertools
import json
import re
import time
from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

__all__ = ["FakeTelegram", "Pushed", "make_entities", "utf16_len"]

BOT_ID = 987654321
BOT_USERNAME = "hermes_test_bot"

# Parameters that are plain strings (PTB sends str values as they are, everything else as JSON).
_STRING_PARAMS = {
    "text",
    "parse_mode",
    "action",
    "url",
    "secret_token",
    "ip_address",
    "caption",
    "language_code",
    "inline_message_id",
    "business_connection_id",
    "message_effect_id",
    "callback_query_id",
}
_VIA: contextvars.ContextVar[str | None] = contextvars.ContextVar("fake_telegram_via", default=None)
_COMMAND_RE = re.compile(r"^[a-z0-9_]{1,32}$")
_MENTION_RE = re.compile(r"@[A-Za-z0-9_]{3,32}")
_LEADING_COMMAND_RE = re.compile(r"^/[A-Za-z0-9_]{1,32}(?:@[A-Za-z0-9_]{3,32})?")
_ALLOWED_TAGS = {
    "b",
    "strong",
    "i",
    "em",
    "u",
    "ins",
    "s",
    "strike",
    "del",
    "code",
    "pre",
    "a",
    "tg-spoiler",
    "span",
    "blockquote",
    "tg-emoji",
}
_CHAT_ACTIONS = {
    "typing",
    "upload_photo",
    "record_video",
    "upload_video",
    "record_voice",
    "upload_voice",
    "upload_document",
    "choose_sticker",
    "find_location",
    "record_video_note",
    "upload_video_note",
}


def utf16_len(text: str) -> int:
    return len(text.encode("utf-16-le")) // 2


def _utf16_index(text: str, py_index: int) -> int:
    return utf16_len(text[:py_index])


def make_entities(text: str) -> list[dict[str, Any]]:
    """`mention` entities for every @username and a `bot_command` for a leading /command."""
    entities: list[dict[str, Any]] = []
    m = _LEADING_COMMAND_RE.match(text)
    if m:
        entities.append({"type": "bot_command", "offset": 0, "length": utf16_len(m.group(0))})
    for m in _MENTION_RE.finditer(text):
        if m.start() > 0 and (text[m.start() - 1].isalnum() or text[m.start() - 1] in "_/@"):
            continue
        entities.append(
            {
                "type": "mention",
                "offset": _utf16_index(text, m.start()),
                "length": utf16_len(m.group(0)),
            }
        )
    return sorted(entities, key=lambda e: e["offset"])


class _ParseError(Exception):
    pass


class _TelegramHTML(html.parser.HTMLParser):
    """Telegram's HTML parse mode, strictly enough to reject what Telegram rejects."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.stack: list[str] = []
        self.out: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag not in _ALLOWED_TAGS:
            raise _ParseError(f'Unsupported start tag "{tag}"')
        if tag == "pre" and "pre" in self.stack:
            raise _ParseError("Can't nest pre entities")
        if self.stack and self.stack[-1] == "pre" and tag != "code":
            raise _ParseError(f'Unsupported tag "{tag}" inside pre')
        if tag == "a" and not dict(attrs).get("href"):
            raise _ParseError("Can't find href in a tag")
        self.stack.append(tag)

    def handle_endtag(self, tag: str) -> None:
        if not self.stack or self.stack[-1] != tag:
            raise _ParseError(
                f'Can\'t find end tag corresponding to start tag "{self.stack[-1] if self.stack else tag}"'
            )
        self.stack.pop()

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        raise _ParseError(f'Unsupported start tag "{tag}"')

    def handle_data(self, data: str) -> None:
        self.out.append(data)

    def unknown_decl(self, data: str) -> None:  # pragma: no cover
        raise _ParseError("Unsupported declaration")


def _parse_html(text: str) -> str:
    # Telegram accepts only &lt; &gt; &amp; &quot; and numeric entities; a bare '<' that
    # does not start a tag is an error too.
    for m in re.finditer(r"&([A-Za-z]+|#\d+|#x[0-9A-Fa-f]+);?", text):
        name = m.group(1)
        if not name.startswith("#") and name not in ("lt", "gt", "amp", "quot"):
            raise _ParseError(f'Unsupported HTML entity "&{name}"')
    if re.search(r"<(?![A-Za-z/])", text):
        raise _ParseError("Unexpected < character")
    parser = _TelegramHTML()
    parser.feed(text)
    parser.close()
    if parser.stack:
        raise _ParseError(f'Can\'t find end tag corresponding to start tag "{parser.stack[-1]}"')
    return "".join(parser.out)


@dataclass(frozen=True)
class Pushed:
    update_id: int
    message_id: int | None
    chat_id: int | None
    update: dict[str, Any]
    callback_query_id: str | None = None  # set for a button press (`press_button`)


@dataclass
class _Failure:
    status: int
    description: str
    retry_after: int | None
    times: int


class FakeTelegram:
    def __init__(
        self,
        token: str = "123:ABC",
        *,
        bot_id: int = BOT_ID,
        bot_username: str = BOT_USERNAME,
        can_read_all_group_messages: bool = False,
        first_update_id: int = 100000,
    ) -> None:
        self.token = token
        self.bot_user = {"id": bot_id, "is_bot": True, "first_name": "Hermes", "username": bot_username}
        self.can_read_all_group_messages = can_read_all_group_messages
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.responses: list[tuple[str, int]] = []
        self.updates: list[dict[str, Any]] = []  # pending (unconfirmed) updates, in order
        self.acked_offset: int | None = None
        self.commands: list[dict[str, Any]] = []
        self.webhook: dict[str, Any] = {"url": "", "secret_token": None, "allowed_updates": None}
        self.chats: dict[int, dict[str, Any]] = {}
        #: chat id -> {user id: "creator" | "administrator"}; everyone else is a "member"
        self.chat_admins: dict[int, dict[int, str]] = defaultdict(dict)
        self.messages: dict[tuple[int, int], dict[str, Any]] = {}
        self.sent: list[dict[str, Any]] = []
        self.edits: list[dict[str, Any]] = []
        self.chat_actions: list[dict[str, Any]] = []
        #: answerCallbackQuery calls: {"callback_query_id", "text", "show_alert"}
        self.callback_answers: list[dict[str, Any]] = []
        self._open_queries: set[str] = set()  # pressed, not yet answered
        self._query_ids = itertools.count(4_382_907_126_115_000_001)
        self._update_ids = itertools.count(first_update_id)
        self._message_ids: dict[int, itertools.count[int]] = defaultdict(lambda: itertools.count(1))
        self._failures: dict[str, deque[_Failure]] = defaultdict(deque)
        self._delays: dict[str, deque[float]] = defaultdict(deque)
        self.files: dict[str, dict[str, Any]] = {}  # file_id -> {"data", "file_path", "file_unique_id"}
        self.file_downloads: list[str] = []  # file paths fetched from /file/bot<token>/...
        self.lost_files: set[str] = set()  # file ids getFile answers but whose download is a 404
        self._file_ids = itertools.count(1)
        self._changed = asyncio.Condition()
        self._poll_generation = 0
        self._runner: web.AppRunner | None = None
        self.port: int | None = None

    # ----------------------------------------------------------------- lifecycle

    async def __aenter__(self) -> FakeTelegram:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def start(self) -> None:
        app = web.Application(client_max_size=50 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    async def stop(self) -> None:
        if self._runner is not None:
            self._poll_generation += 1
            await self._notify()
            await self._runner.cleanup()
            self._runner = None

    @property
    def root_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        """For `telegram.Bot(base_url=...)` / `platforms.telegram.base_url` (token appended)."""
        return f"{self.root_url}/bot"

    def base_url_for(self, label: str) -> str:
        """A base URL whose calls are recorded as made by `label` (`"_via"` of sent messages)."""
        return f"{self.root_url}/via/{label}/bot"

    @property
    def base_file_url(self) -> str:
        return f"{self.root_url}/file/bot"

    @property
    def bot_id(self) -> int:
        return self.bot_user["id"]

    @property
    def bot_username(self) -> str:
        return self.bot_user["username"]

    # ----------------------------------------------------------------- injection

    def fail_next(
        self,
        method: str,
        status: int = 429,
        description: str | None = None,
        retry_after: int | None = None,
        times: int = 1,
    ) -> None:
        """The next `times` calls of `method` fail with this error instead of running."""
        if description is None:
            description = {
                429: f"Too Many Requests: retry after {retry_after or 1}",
                403: "Forbidden: bot was blocked by the user",
                400: "Bad Request: can't parse entities: Unsupported start tag",
                401: "Unauthorized",
                409: "Conflict: terminated by other getUpdates request",
                500: "Internal Server Error",
                502: "Bad Gateway",
            }.get(status, "Error")
        if status == 429 and retry_after is None:
            retry_after = 1
        self._failures[method].append(_Failure(status, description, retry_after, times))

    def delay_next(self, method: str, seconds: float) -> None:
        """The next call of `method` is carried out, but answered only after `seconds`."""
        self._delays[method].append(seconds)

    # ----------------------------------------------------------------- recording

    def sent_messages(self, chat_id: int | str | None = None) -> list[dict[str, Any]]:
        if chat_id is None:
            return list(self.sent)
        return [m for m in self.sent if str(m["chat"]["id"]) == str(chat_id)]

    def calls_of(self, method: str) -> list[dict[str, Any]]:
        return [params for name, params in self.calls if name == method]

    @property
    def pending_updates(self) -> list[dict[str, Any]]:
        return list(self.updates)

    async def wait_for(self, predicate: Callable[[], bool], timeout: float = 10.0) -> None:
        """Wait until `predicate()` holds (checked after every call and push, and every 50 ms
        for conditions that change outside the fake)."""

        async def waiter() -> None:
            async with self._changed:
                while not predicate():
                    try:
                        await asyncio.wait_for(self._changed.wait(), 0.05)
                    except TimeoutError:
                        pass

        try:
            await asyncio.wait_for(waiter(), timeout)
        except TimeoutError:
            raise AssertionError(f"FakeTelegram: condition not met within {timeout}s") from None

    async def wait_sent(self, n: int, chat_id: int | str | None = None, timeout: float = 10.0) -> list[dict[str, Any]]:
        await self.wait_for(lambda: len(self.sent_messages(chat_id)) >= n, timeout)
        return self.sent_messages(chat_id)

    async def wait_acked(self, timeout: float = 10.0) -> None:
        """Wait until every pushed update has been confirmed with an offset."""
        await self.wait_for(lambda: not self.updates, timeout)

    def answer_to(self, pressed: Pushed) -> dict[str, Any] | None:
        """The answerCallbackQuery call for a press (`press_button`), None while unanswered."""
        return next((a for a in self.callback_answers if a["callback_query_id"] == pressed.callback_query_id), None)

    async def wait_answered(self, pressed: Pushed, timeout: float = 10.0) -> dict[str, Any]:
        """Wait for the bot to answer a press; returns the answer."""
        await self.wait_for(lambda: self.answer_to(pressed) is not None, timeout)
        answer = self.answer_to(pressed)
        assert answer is not None
        return answer

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    def _notify_soon(self) -> None:
        try:
            asyncio.get_running_loop().create_task(self._notify())
        except RuntimeError:  # pushed before the loop runs
            pass

    # ----------------------------------------------------------------- builders

    def add_chat(self, chat_id: int, type: str, **fields: Any) -> dict[str, Any]:
        chat = self.chats.get(chat_id)
        if chat is None:
            chat = {"id": chat_id, "type": type}
            if type == "private":
                chat.setdefault("first_name", fields.pop("first_name", f"User{chat_id}"))
            else:
                chat.setdefault("title", fields.pop("title", f"Chat {chat_id}"))
            chat.update(fields)
            self.chats[chat_id] = chat
        return chat

    def _user(
        self, user_id: int, *, is_bot: bool = False, username: str | None = None, first_name: str | None = None
    ) -> dict[str, Any]:
        user: dict[str, Any] = {"id": user_id, "is_bot": is_bot, "first_name": first_name or f"User{user_id}"}
        user["username"] = username if username is not None else f"user{user_id}"
        return user

    def _new_message(
        self, chat: dict[str, Any], sender: dict[str, Any] | None, text: str | None, **extra: Any
    ) -> dict[str, Any]:
        message_id = next(self._message_ids[chat["id"]])
        msg: dict[str, Any] = {"message_id": message_id, "date": int(time.time()), "chat": dict(chat)}
        if sender is not None:
            msg["from"] = sender
        if text is not None:
            msg["text"] = text
        msg.update({k: v for k, v in extra.items() if v is not None})
        self.messages[(chat["id"], message_id)] = msg
        return msg

    def _reply_stub(self, chat_id: int, message_id: int) -> dict[str, Any]:
        target = self.messages.get((chat_id, message_id))
        if target is None:
            raise KeyError(f"no message {message_id} in chat {chat_id}")
        return {k: v for k, v in target.items() if k != "reply_to_message"}

    def add_file(self, data: bytes, *, file_path: str | None = None, size: int | None = None) -> dict[str, Any]:
        """Store a file the Bot API serves (getFile + GET /file/bot<token>/<file_path>);
        returns the file object fields for a message (`file_id`, `file_unique_id`, `file_size`).
        `size` overrides the stated size (to model a file larger than what is stored)."""
        n = next(self._file_ids)
        file_id = f"AgACAgFAKEfile{n:04d}"
        path = file_path or f"documents/file_{n}.bin"
        stated = len(data) if size is None else size
        self.files[file_id] = {"data": data, "file_path": path, "file_unique_id": f"uniq{n}", "file_size": stated}
        return {"file_id": file_id, "file_unique_id": f"uniq{n}", "file_size": stated}

    def push_media(
        self,
        user_id: int,
        kind: str,
        data: bytes,
        *,
        chat_id: int | None = None,
        caption: str | None = None,
        file_name: str | None = None,
        mime_type: str | None = None,
        size: int | None = None,
        username: str | None = None,
        reply_to_message_id: int | None = None,
    ) -> Pushed:
        """A photo / voice / audio / document message from `user_id` (in their DM, or in
        group `chat_id` addressed to the bot by a mention in the caption)."""
        user = self._user(user_id, username=username)
        if chat_id is None:
            chat = self.add_chat(user_id, "private", first_name=user["first_name"], username=user["username"])
        else:
            chat = self.add_chat(chat_id, "supergroup", title=f"Group {chat_id}")
        ext = {"photo": "jpg", "voice": "oga", "audio": "mp3"}.get(kind, "bin")
        ref = self.add_file(data, file_path=f"{kind}s/file_{len(self.files) + 1}.{ext}", size=size)
        if kind == "photo":
            value: Any = [
                {
                    **ref,
                    "file_id": ref["file_id"] + "s",
                    "file_unique_id": "thumb",
                    "file_size": 100,
                    "width": 90,
                    "height": 90,
                },
                {**ref, "width": 800, "height": 600},
            ]
            self.files[ref["file_id"] + "s"] = {**self.files[ref["file_id"]], "data": data[:100]}
        elif kind == "voice":
            value = {**ref, "duration": 3, "mime_type": mime_type or "audio/ogg"}
        elif kind == "audio":
            value = {
                **ref,
                "duration": 30,
                "mime_type": mime_type or "audio/mpeg",
                "file_name": file_name or "audio.mp3",
            }
        else:
            value = {**ref, "file_name": file_name or "file.bin", "mime_type": mime_type or "application/octet-stream"}
        fields: dict[str, Any] = {kind: value}
        if caption:
            fields.update(caption=caption, caption_entities=make_entities(caption) or None)
        if reply_to_message_id:
            fields["reply_to_message"] = self._reply_stub(chat["id"], reply_to_message_id)
        msg = self._new_message(chat, user, None, **fields)
        return self._push_message("message", msg)

    def push_update(self, raw: dict[str, Any]) -> Pushed:
        """Queue a raw update (an `update_id` is assigned if missing)."""
        update = dict(raw)
        if "update_id" not in update:
            update["update_id"] = next(self._update_ids)
        self.updates.append(update)
        self._notify_soon()
        inner = next((v for v in update.values() if isinstance(v, dict) and "message_id" in v), None)
        return Pushed(
            update["update_id"],
            inner.get("message_id") if inner else None,
            inner["chat"].get("id") if inner and isinstance(inner.get("chat"), dict) else None,
            update,
        )

    def _push_message(self, kind: str, msg: dict[str, Any]) -> Pushed:
        return self.push_update({kind: msg})

    def push_private(
        self,
        user_id: int,
        text: str,
        *,
        username: str | None = None,
        first_name: str | None = None,
        is_bot: bool = False,
        reply_to_message_id: int | None = None,
        entities: list[dict[str, Any]] | None = None,
    ) -> Pushed:
        user = self._user(user_id, is_bot=is_bot, username=username, first_name=first_name)
        chat = self.add_chat(user_id, "private", first_name=user["first_name"], username=user["username"])
        ents = make_entities(text) if entities is None else entities
        msg = self._new_message(
            chat,
            user,
            text,
            entities=ents or None,
            reply_to_message=self._reply_stub(user_id, reply_to_message_id) if reply_to_message_id else None,
        )
        return self._push_message("message", msg)

    def push_group(
        self,
        chat_id: int,
        user_id: int,
        text: str,
        *,
        reply_to_bot_message_id: int | None = None,
        reply_to_message_id: int | None = None,
        chat_type: str = "supergroup",
        title: str | None = None,
        username: str | None = None,
        first_name: str | None = None,
        is_bot: bool = False,
        entities: list[dict[str, Any]] | None = None,
        caption: bool = False,
        extra: dict[str, Any] | None = None,
    ) -> Pushed:
        user = self._user(user_id, is_bot=is_bot, username=username, first_name=first_name)
        chat = self.add_chat(chat_id, chat_type, title=title or f"Group {chat_id}")
        ents = make_entities(text) if entities is None else entities
        target = reply_to_bot_message_id or reply_to_message_id
        fields: dict[str, Any] = {
            "reply_to_message": self._reply_stub(chat_id, target) if target else None,
        }
        if caption:
            fields.update(
                caption=text,
                caption_entities=ents or None,
                document={
                    "file_id": "doc1",
                    "file_unique_id": "u1",
                    "file_name": "notes.txt",
                    "file_size": 12,
                },
            )
            msg = self._new_message(chat, user, None, **fields)
        else:
            msg = self._new_message(chat, user, text, entities=ents or None, **fields)
        if extra:
            msg.update(extra)
        return self._push_message("message", msg)

    def ensure_topic(self, chat_id: int, thread_id: int, name: str = "Topic") -> dict[str, Any]:
        """The forum topic's creation message (its id is the topic's `message_thread_id`)."""
        chat = self.add_chat(chat_id, "supergroup", title=f"Forum {chat_id}", is_forum=True)
        chat["is_forum"] = True
        key = (chat_id, thread_id)
        if key not in self.messages:
            counter = self._message_ids[chat_id]
            # keep per-chat ids increasing past the topic's id
            nxt = next(counter)
            if nxt <= thread_id:
                self._message_ids[chat_id] = itertools.count(thread_id + 1)
            self.messages[key] = {
                "message_id": thread_id,
                "date": int(time.time()),
                "chat": dict(chat),
                "from": self._user(1),
                "message_thread_id": thread_id,
                "forum_topic_created": {"name": name, "icon_color": 7322096},
                "is_topic_message": True,
            }
        return self.messages[key]

    def push_topic(
        self,
        chat_id: int,
        thread_id: int,
        user_id: int,
        text: str,
        *,
        reply_to_message_id: int | None = None,
        username: str | None = None,
        is_bot: bool = False,
        entities: list[dict[str, Any]] | None = None,
    ) -> Pushed:
        root = self.ensure_topic(chat_id, thread_id)
        chat = self.chats[chat_id]
        user = self._user(user_id, is_bot=is_bot, username=username)
        ents = make_entities(text) if entities is None else entities
        reply = self._reply_stub(chat_id, reply_to_message_id) if reply_to_message_id else dict(root.items())
        msg = self._new_message(
            chat,
            user,
            text,
            entities=ents or None,
            message_thread_id=thread_id,
            is_topic_message=True,
            reply_to_message=reply,
        )
        return self._push_message("message", msg)

    def push_edit(self, chat_id: int, message_id: int, text: str) -> Pushed:
        original = self.messages[(chat_id, message_id)]
        edited = dict(original, text=text, edit_date=int(time.time()) + 1)
        ents = make_entities(text)
        if ents:
            edited["entities"] = ents
        else:
            edited.pop("entities", None)
        self.messages[(chat_id, message_id)] = edited
        kind = "edited_channel_post" if original["chat"]["type"] == "channel" else "edited_message"
        return self.push_update({kind: edited})

    def push_channel_post(self, chat_id: int, text: str) -> Pushed:
        chat = self.add_chat(chat_id, "channel", title=f"Channel {chat_id}")
        msg = self._new_message(chat, None, text, sender_chat=dict(chat), entities=make_entities(text) or None)
        return self._push_message("channel_post", msg)

    def press_button(
        self,
        chat_id: int,
        message_id: int,
        user_id: int,
        *,
        text: str | None = None,
        data: str | None = None,
        username: str | None = None,
    ) -> Pushed:
        """Queue the `callback_query` update of `user_id` pressing a button of message
        `message_id` in `chat_id`: the inline button labelled `text` on the message as it is
        now (LookupError when it has none: a removed button cannot be pressed), or any
        `data` (an old client, a forged payload). For webhook delivery pass the result to
        `post_to_webhook`."""
        msg = self.messages.get((chat_id, message_id))
        if msg is None:
            raise LookupError(f"no message {message_id} in chat {chat_id}")
        if text is not None:
            rows = (msg.get("reply_markup") or {}).get("inline_keyboard") or []
            button = next((b for row in rows for b in row if b.get("text") == text), None)
            if button is None or "callback_data" not in button:
                raise LookupError(f"message {message_id} in chat {chat_id} has no button {text!r}")
            data = button["callback_data"]
        if data is None:
            raise ValueError("press_button needs text= or data=")
        query_id = str(next(self._query_ids))
        self._open_queries.add(query_id)
        query: dict[str, Any] = {
            "id": query_id,
            "from": self._user(user_id, username=username),
            "message": dict(msg),
            "chat_instance": f"{abs(chat_id) * 7919}",  # a stable per-chat id, as Telegram gives
            "data": data,
        }
        pushed = self.push_update({"callback_query": query})
        return Pushed(pushed.update_id, message_id, chat_id, pushed.update, callback_query_id=query_id)

    async def post_to_webhook(
        self, update: dict[str, Any] | Pushed, *, url: str | None = None, secret_token: str | bool | None = True
    ) -> int:
        """POST an update to the registered webhook the way Telegram does; returns the HTTP
        status. `secret_token=True` sends the registered secret, None/False sends none, a
        string sends that string."""
        if isinstance(update, Pushed):
            update = update.update
            if update in self.updates:
                self.updates.remove(update)
        target = url or self.webhook["url"]
        headers = {}
        secret = self.webhook.get("secret_token") if secret_token is True else secret_token
        if secret:
            headers["X-Telegram-Bot-Api-Secret-Token"] = secret
        async with aiohttp.ClientSession() as session, session.post(target, json=update, headers=headers) as resp:
            await resp.read()
            return resp.status

    # ----------------------------------------------------------------- HTTP

    async def _params(self, request: web.Request) -> dict[str, Any]:
        params: dict[str, Any] = dict(request.query)
        ctype = request.content_type
        if request.method == "POST" and request.can_read_body:
            if ctype == "application/json":
                body = await request.json()
                if isinstance(body, dict):
                    return {**params, **body}
            else:
                form = await request.post()
                for key, value in form.items():
                    params[key] = value if isinstance(value, str) else "<file>"
        decoded: dict[str, Any] = {}
        for key, value in params.items():
            if key in _STRING_PARAMS or not isinstance(value, str):
                decoded[key] = value
                continue
            try:
                decoded[key] = json.loads(value)
            except ValueError:
                decoded[key] = value
        return decoded

    def _error(
        self, method: str, status: int, description: str, parameters: dict[str, Any] | None = None
    ) -> web.Response:
        body: dict[str, Any] = {"ok": False, "error_code": status, "description": description}
        if parameters:
            body["parameters"] = parameters
        self.responses.append((method, status))
        return web.json_response(body, status=status)

    def _ok(self, method: str, result: Any) -> web.Response:
        self.responses.append((method, 200))
        return web.json_response({"ok": True, "result": result})

    async def _handle(self, request: web.Request) -> web.Response:
        path = request.path
        f = re.match(r"^/file/bot([^/]+)/(.+)$", path)
        if f:
            return self._serve_file(f.group(1), f.group(2))
        m = re.match(r"^(?:/via/([^/]+))?/bot([^/]+)/([A-Za-z_]+)$", path)
        if not m:
            return web.json_response({"ok": False, "error_code": 404, "description": "Not Found"}, status=404)
        via, token, method = m.group(1), m.group(2), m.group(3)
        _VIA.set(via)  # each request is its own task: the label stays with this request
        try:
            params = await self._params(request)
        except Exception:
            return self._error(method, 400, "Bad Request: can't parse request body")
        self.calls.append((method, params))
        try:
            if token != self.token:
                return self._error(method, 401, "Unauthorized")
            failures = self._failures.get(method)
            if failures:
                failure = failures[0]
                failure.times -= 1
                if failure.times <= 0:
                    failures.popleft()
                extra = {"retry_after": failure.retry_after} if failure.retry_after else None
                return self._error(method, failure.status, failure.description, extra)
            handler = getattr(self, f"_api_{method.lower()}", None)
            if handler is None:
                return self._error(method, 404, "Not Found")
            delay = self._delays[method].popleft() if self._delays.get(method) else 0.0
            response = await handler(params)
            if delay:
                await asyncio.sleep(delay)
            return response
        finally:
            await self._notify()

    # ----------------------------------------------------------------- methods

    def _serve_file(self, token: str, file_path: str) -> web.Response:
        if token != self.token:
            return web.json_response({"ok": False, "error_code": 401, "description": "Unauthorized"}, status=401)
        for file_id, entry in self.files.items():
            if entry["file_path"] == file_path and file_id not in self.lost_files:
                self.file_downloads.append(file_path)
                return web.Response(body=entry["data"], content_type="application/octet-stream")
        return web.json_response({"ok": False, "error_code": 404, "description": "Not Found"}, status=404)

    async def _api_getfile(self, params: dict[str, Any]) -> web.Response:
        entry = self.files.get(str(params.get("file_id")))
        if entry is None:
            return self._error("getFile", 400, "Bad Request: invalid file_id")
        if entry["file_size"] > 20 * 1024 * 1024:  # the Bot API's download cap
            return self._error("getFile", 400, "Bad Request: file is too big")
        return self._ok(
            "getFile",
            {
                "file_id": params["file_id"],
                "file_unique_id": entry["file_unique_id"],
                "file_size": entry["file_size"],
                "file_path": entry["file_path"],
            },
        )

    async def _api_getme(self, params: dict[str, Any]) -> web.Response:
        return self._ok(
            "getMe",
            {
                **self.bot_user,
                "can_join_groups": True,
                "can_read_all_group_messages": self.can_read_all_group_messages,
                "supports_inline_queries": False,
                "can_connect_to_business": False,
                "has_main_web_app": False,
            },
        )

    async def _api_getupdates(self, params: dict[str, Any]) -> web.Response:
        if self.webhook["url"]:
            return self._error(
                "getUpdates",
                409,
                "Conflict: can't use getUpdates method while webhook is active; use deleteWebhook to delete the webhook first",
            )
        offset = params.get("offset")
        limit = int(params.get("limit") or 100)
        timeout = float(params.get("timeout") or 0)
        allowed = params.get("allowed_updates")
        if isinstance(offset, int) and offset > 0:
            self.updates = [u for u in self.updates if u["update_id"] >= offset]
            self.acked_offset = max(self.acked_offset or 0, offset)
        elif isinstance(offset, int) and offset < 0:
            self.updates = self.updates[offset:]
        self._poll_generation += 1
        generation = self._poll_generation

        def ready() -> list[dict[str, Any]]:
            out = [u for u in self.updates if not allowed or any(k in allowed for k in u if k != "update_id")]
            # updates of kinds not allowed are dropped, as Telegram does
            if allowed:
                self.updates = [u for u in self.updates if u in out]
            return out[:limit]

        await self._notify()
        deadline = asyncio.get_running_loop().time() + timeout
        async with self._changed:
            while True:
                if generation != self._poll_generation:
                    return self._error(
                        "getUpdates",
                        409,
                        "Conflict: terminated by other getUpdates request; make sure that only one bot instance is running",
                    )
                batch = ready()
                if batch:
                    return self._ok("getUpdates", batch)
                remaining = deadline - asyncio.get_running_loop().time()
                if remaining <= 0:
                    return self._ok("getUpdates", [])
                try:
                    await asyncio.wait_for(self._changed.wait(), remaining)
                except TimeoutError:
                    pass

    def _chat_or_error(self, method: str, chat_id: Any) -> dict[str, Any] | web.Response:
        try:
            cid = int(chat_id)
        except (TypeError, ValueError):
            return self._error(method, 400, "Bad Request: chat not found")
        chat = self.chats.get(cid)
        if chat is None:
            return self._error(method, 400, "Bad Request: chat not found")
        return chat

    def _visible(self, method: str, params: dict[str, Any]) -> str | web.Response:
        text = params.get("text")
        if not isinstance(text, str):
            text = "" if text is None else str(text)
        parse_mode = params.get("parse_mode")
        if parse_mode and str(parse_mode).lower() == "html":
            try:
                text = _parse_html(text)
            except _ParseError as exc:
                return self._error(method, 400, f"Bad Request: can't parse entities: {exc}")
        if not text.strip():
            return self._error(method, 400, "Bad Request: message text is empty")
        if utf16_len(text) > 4096:
            return self._error(method, 400, "Bad Request: message is too long")
        return text

    async def _api_sendmessage(self, params: dict[str, Any]) -> web.Response:
        chat = self._chat_or_error("sendMessage", params.get("chat_id"))
        if isinstance(chat, web.Response):
            return chat
        text = self._visible("sendMessage", params)
        if isinstance(text, web.Response):
            return text
        extra: dict[str, Any] = {}
        thread_id = params.get("message_thread_id")
        if thread_id is not None:
            thread_id = int(thread_id)
            if chat.get("is_forum"):
                if (chat["id"], thread_id) not in self.messages:
                    return self._error("sendMessage", 400, "Bad Request: message thread not found")
                extra["message_thread_id"] = thread_id
                extra["is_topic_message"] = True
        reply = params.get("reply_parameters")
        reply_id = reply.get("message_id") if isinstance(reply, dict) else params.get("reply_to_message_id")
        allow_without = (
            (reply or {}).get("allow_sending_without_reply")
            if isinstance(reply, dict)
            else params.get("allow_sending_without_reply")
        )
        if reply_id is not None:
            try:
                extra["reply_to_message"] = self._reply_stub(chat["id"], int(reply_id))
            except KeyError:
                if not allow_without:
                    return self._error("sendMessage", 400, "Bad Request: message to be replied not found")
        elif "message_thread_id" in extra:
            extra["reply_to_message"] = dict(self.messages[(chat["id"], extra["message_thread_id"])].items())
        markup = self._inline_markup("sendMessage", params)
        if isinstance(markup, web.Response):
            return markup
        extra["reply_markup"] = markup
        msg = self._new_message(chat, dict(self.bot_user), text, **extra)
        record = dict(msg)
        record["_params"] = dict(params)
        record["_at"] = time.monotonic()  # arrival time, to check the adapter's pacing
        record["_via"] = _VIA.get()
        self.sent.append(record)
        return self._ok("sendMessage", msg)

    async def _api_editmessagetext(self, params: dict[str, Any]) -> web.Response:
        chat = self._chat_or_error("editMessageText", params.get("chat_id"))
        if isinstance(chat, web.Response):
            return chat
        key = (chat["id"], int(params.get("message_id", 0)))
        msg = self.messages.get(key)
        if msg is None:
            return self._error("editMessageText", 400, "Bad Request: message to edit not found")
        if msg.get("from", {}).get("id") != self.bot_id:
            return self._error("editMessageText", 400, "Bad Request: message can't be edited")
        text = self._visible("editMessageText", params)
        if isinstance(text, web.Response):
            return text
        markup = self._inline_markup("editMessageText", params)
        if isinstance(markup, web.Response):
            return markup
        if msg.get("text") == text and msg.get("reply_markup") == markup:
            return self._error(
                "editMessageText",
                400,
                "Bad Request: message is not modified: specified new message content and reply markup are exactly the same as a current content and reply markup of the message",
            )
        msg = dict(msg, text=text, edit_date=int(time.time()))
        msg.pop("reply_markup", None)  # an edit without reply_markup removes the keyboard
        if markup is not None:
            msg["reply_markup"] = markup
        self.messages[key] = msg
        for sent in self.sent:
            if sent["chat"]["id"] == key[0] and sent["message_id"] == key[1]:
                sent["text"] = text
                sent.pop("reply_markup", None)
                if markup is not None:
                    sent["reply_markup"] = markup
        self.edits.append(
            {
                "chat_id": key[0],
                "message_id": key[1],
                "text": text,
                "reply_markup": markup,
                "_at": time.monotonic(),
                "_via": _VIA.get(),
            }
        )
        return self._ok("editMessageText", msg)

    def _inline_markup(self, method: str, params: dict[str, Any]) -> dict[str, Any] | web.Response | None:
        """The inline keyboard of a send or edit (None without one), checked as Telegram does."""
        markup = params.get("reply_markup")
        if markup is None:
            return None
        rows = markup.get("inline_keyboard") if isinstance(markup, dict) else None
        if rows is None:
            return None  # reply keyboards and the like: not kept on the message
        if not isinstance(rows, list) or not all(isinstance(r, list) for r in rows):
            return self._error(method, 400, "Bad Request: can't parse inline keyboard button")
        for button in (b for row in rows for b in row):
            if not isinstance(button, dict) or not button.get("text"):
                return self._error(method, 400, "Bad Request: can't parse inline keyboard button: text is empty")
            data = button.get("callback_data")
            if data is not None and not 1 <= len(str(data).encode()) <= 64:
                return self._error(method, 400, "Bad Request: BUTTON_DATA_INVALID")
        return {"inline_keyboard": rows}

    async def _api_answercallbackquery(self, params: dict[str, Any]) -> web.Response:
        query_id = str(params.get("callback_query_id", ""))
        if query_id not in self._open_queries:
            return self._error(
                "answerCallbackQuery",
                400,
                "Bad Request: query is too old and response timeout expired or query ID is invalid",
            )
        text = params.get("text")
        if text is not None and len(str(text)) > 200:
            return self._error("answerCallbackQuery", 400, "Bad Request: MESSAGE_TOO_LONG")
        self._open_queries.discard(query_id)
        self.callback_answers.append(
            {"callback_query_id": query_id, "text": text, "show_alert": bool(params.get("show_alert", False))}
        )
        return self._ok("answerCallbackQuery", True)

    async def _api_sendchataction(self, params: dict[str, Any]) -> web.Response:
        chat = self._chat_or_error("sendChatAction", params.get("chat_id"))
        if isinstance(chat, web.Response):
            return chat
        if params.get("action") not in _CHAT_ACTIONS:
            return self._error("sendChatAction", 400, "Bad Request: wrong parameter action in request")
        self.chat_actions.append(dict(params))
        return self._ok("sendChatAction", True)

    async def _api_getchatmember(self, params: dict[str, Any]) -> web.Response:
        chat = self._chat_or_error("getChatMember", params.get("chat_id"))
        if isinstance(chat, web.Response):
            return chat
        try:
            user_id = int(params.get("user_id"))
        except (TypeError, ValueError):
            return self._error("getChatMember", 400, "Bad Request: invalid user_id specified")
        user = self._user(user_id)
        status = self.chat_admins[chat["id"]].get(user_id, "member")
        member: dict[str, Any] = {"status": status, "user": user}
        if status == "creator":
            member["is_anonymous"] = False
        elif status == "administrator":
            member.update(
                dict.fromkeys(
                    (
                        "can_be_edited",
                        "can_manage_chat",
                        "can_delete_messages",
                        "can_manage_video_chats",
                        "can_restrict_members",
                        "can_change_info",
                        "can_invite_users",
                        "can_post_stories",
                        "can_edit_stories",
                        "can_delete_stories",
                    ),
                    True,
                ),
                is_anonymous=False,
                can_promote_members=False,
            )
        return self._ok("getChatMember", member)

    async def _api_setmycommands(self, params: dict[str, Any]) -> web.Response:
        commands = params.get("commands")
        if not isinstance(commands, list) or len(commands) > 100:
            return self._error("setMyCommands", 400, "Bad Request: commands must be an array")
        for c in commands:
            if not isinstance(c, dict) or not _COMMAND_RE.match(str(c.get("command", ""))):
                return self._error("setMyCommands", 400, "Bad Request: BOT_COMMAND_INVALID")
            if not 1 <= len(str(c.get("description", ""))) <= 256:
                return self._error("setMyCommands", 400, "Bad Request: BOT_COMMAND_DESCRIPTION_INVALID")
        self.commands = commands
        return self._ok("setMyCommands", True)

    async def _api_getmycommands(self, params: dict[str, Any]) -> web.Response:
        return self._ok("getMyCommands", self.commands)

    async def _api_deletewebhook(self, params: dict[str, Any]) -> web.Response:
        self.webhook = {"url": "", "secret_token": None, "allowed_updates": None}
        if params.get("drop_pending_updates"):
            self.updates.clear()
        return self._ok("deleteWebhook", True)

    async def _api_setwebhook(self, params: dict[str, Any]) -> web.Response:
        url = params.get("url") or ""
        secret = params.get("secret_token")
        if secret is not None and not re.match(r"^[A-Za-z0-9_-]{1,256}$", str(secret)):
            return self._error("setWebhook", 400, "Bad Request: secret token contains unallowed characters")
        if url and not str(url).startswith(("https://", "http://")):
            return self._error("setWebhook", 400, "Bad Request: bad webhook: An HTTPS URL must be provided for webhook")
        self.webhook = {"url": url, "secret_token": secret, "allowed_updates": params.get("allowed_updates")}
        if params.get("drop_pending_updates"):
            self.updates.clear()
        return self._ok("setWebhook", True)

    async def _api_getwebhookinfo(self, params: dict[str, Any]) -> web.Response:
        info: dict[str, Any] = {
            "url": self.webhook["url"],
            "has_custom_certificate": False,
            "pending_update_count": len(self.updates),
        }
        if self.webhook.get("allowed_updates"):
            info["allowed_updates"] = self.webhook["allowed_updates"]
        return self._ok("getWebhookInfo", info)
