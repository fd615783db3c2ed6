"""A fake Discord (REST API v10 + gateway websocket) on 127.0.0.1 that the real
discord.py client connects to.

    async with FakeDiscord() as fake:
        guild = fake.add_guild("Test")
        general = fake.add_channel(guild, "general")
        alice = fake.add_user("alice")
        adapter = DiscordAdapter(DiscordConfig(enabled=True, api_base=fake.api_base,
                                               gateway_url=fake.gateway_url), fake.token)
        await adapter.start(sink)
        fake.push_guild_message(general, alice, "hi", mention_bot=True)

Every REST call and every gateway op (both directions) is recorded in `fake.calls`;
`fake.sent_messages(channel_id)` lists what the bot posted (channel messages and
interaction followups), each with the request body and the pings Discord would have
delivered given the body's `allowed_mentions` (`record["pings"]`).

Buttons: a created message keeps its `components` (an edit with `components` replaces
them; `[]` removes them). `fake.press_button(message_id, user_id, label="Allow")` (or
`custom_id=...` for any payload) dispatches the INTERACTION_CREATE (type 3, message
component) of that person pressing it; its callback (`POST /interactions/{id}/{token}/
callback`: 4 = message, with flags 64 ephemeral; 6 = deferred update; 7 = update the
message) is recorded in `fake.interaction_callbacks`, and `fake.followups(payload)` lists
the followup messages of that interaction (`body["flags"] & 64` when ephemeral).
`await fake.wait_answered(payload)` waits for its callback.

Gateway behaviour modelled: HELLO, heartbeat ACK, IDENTIFY -> READY (+ one GUILD_CREATE
per guild, with channels, threads, roles and the bot's member), dispatch with sequence
numbers, RESUME -> replay of missed events + RESUMED, INVALID_SESSION, RECONNECT-style
drops, close 4004 on a bad token and 4014 when the message content intent is refused.

Sharding: IDENTIFY's `shard` field `[shard_id, shard_count]` (absent: `[0, 1]`) makes the
connection that shard, with a session of its own; several shards can be connected at once.
Guild events go to shard `(guild_id >> 22) % shard_count`, DMs to shard 0, as on Discord
(READY and GUILD_CREATE list only the shard's guilds); an invalid shard is closed with 4010.
`fake.connected_shards` lists the shards that are connected. The single-connection helpers
(`connected`, `drop_connection`, `send_reconnect`, `session_seq`) act on shard 0.

Several clients (cluster nodes) can be told apart: `fake.api_base_for(label)` and
`fake.gateway_url_for(label)` serve the same API under `/n/<label>/`; each sent message
records its client's `sender` label and the monotonic time `at`, and `fake.shard_sessions`
lists every shard connection (`shard`, `via` label, `start` when READY/RESUMED went out,
`end` when it closed, None while open; `preempted_by` when a connection of another label
took the shard over while it was still open: two clients receiving one shard at once).
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import re
import secrets
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from aiohttp import WSMsgType, web

DISCORD_EPOCH_MS = 1420070400000

# Gateway intents (https://discord.com/developers/docs/events/gateway#gateway-intents)
INTENT_MESSAGE_CONTENT = 1 << 15
# Application flags
APP_FLAG_GATEWAY_MESSAGE_CONTENT = 1 << 18
APP_FLAG_GATEWAY_MESSAGE_CONTENT_LIMITED = 1 << 19

OP_DISPATCH, OP_HEARTBEAT, OP_IDENTIFY, OP_RESUME, OP_RECONNECT = 0, 1, 2, 6, 7
OP_INVALID_SESSION, OP_HELLO, OP_HEARTBEAT_ACK = 9, 10, 11

CH_TEXT, CH_DM, CH_GROUP_DM, CH_PUBLIC_THREAD, CH_PRIVATE_THREAD = 0, 1, 3, 11, 12

_SENDER: contextvars.ContextVar[str | None] = contextvars.ContextVar("fake_discord_sender", default=None)
_MENTION_USER = re.compile(r"<@!?(\d+)>")
_MENTION_ROLE = re.compile(r"<@&(\d+)>")


def _now_iso() -> str:
    return datetime.now(UTC).isoformat()


class _Snowflakes:
    """Real-looking, strictly increasing snowflakes (timestamp << 22 | counter)."""

    def __init__(self) -> None:
        self._last = 0

    def __call__(self) -> str:
        value = (int(time.time() * 1000) - DISCORD_EPOCH_MS) << 22
        value = max(value, self._last + 1)
        self._last = value
        return str(value)


class _Session:
    def __init__(self, session_id: str) -> None:
        self.session_id = session_id
        self.seq = 0
        self.events: list[tuple[int, str, Any]] = []  # (seq, event name, data)


class _Shard:
    """One shard's gateway connection and session."""

    def __init__(self) -> None:
        self.ws: web.WebSocketResponse | None = None
        self.session: _Session | None = None
        self.ready = False  # READY (or RESUMED) sent on the current socket
        self.replay_extra = 0


class FakeDiscord:
    def __init__(
        self,
        token: str = "fake-discord-bot-token.abc123",
        *,
        bot_name: str = "hermes",
        app_flags: int = APP_FLAG_GATEWAY_MESSAGE_CONTENT_LIMITED,
        heartbeat_interval_ms: int = 41250,
    ) -> None:
        self.token = token
        self.app_flags = app_flags
        self.heartbeat_interval_ms = heartbeat_interval_ms
        self.snowflake = _Snowflakes()
        self.bot_id = self.snowflake()
        self.app_id = self.snowflake()
        self.owner_id = self.snowflake()
        self.users: dict[str, dict[str, Any]] = {
            self.bot_id: self._user_obj(self.bot_id, bot_name, bot=True),
            self.owner_id: self._user_obj(self.owner_id, "owner"),
        }
        self.guilds: dict[str, dict[str, Any]] = {}
        self.member_roles: dict[str, list[str]] = {}  # user id -> role ids (in every guild)
        self.channels: dict[str, dict[str, Any]] = {}
        self.dm_channels: dict[str, str] = {}  # user id -> DM channel id
        self.messages: dict[str, dict[str, Any]] = {}
        self.commands: list[dict[str, Any]] = []
        self.interactions: dict[str, dict[str, Any]] = {}  # token -> state
        #: interaction callbacks: {"interaction_id", "type", "flags", "content", "body"}
        self.interaction_callbacks: list[dict[str, Any]] = []
        self.calls: list[dict[str, Any]] = []
        self._sent: list[dict[str, Any]] = []
        self.forbidden_channels: set[str] = set()
        self._rate_limits: list[tuple[str, float, bool]] = []  # (path regex, retry_after, global)
        self._refuse_intents = False
        self._garbled_hellos = 0  # connections whose HELLO lacks heartbeat_interval
        self._shards: dict[int, _Shard] = {0: _Shard()}
        self.shard_count = 1  # from the last IDENTIFY
        self._pending: set[asyncio.Task[None]] = set()
        self._send_lock = asyncio.Lock()  # frames go out in dispatch order
        self._nonces: dict[str, tuple[float, str]] = {}  # enforce_nonce: nonce -> (time, message id)
        self._fail_after_create: list[int] = []  # statuses to answer after creating a message
        self.attachment_files: dict[str, bytes] = {}  # attachment id -> bytes served at its url
        self.attachment_downloads: list[dict[str, Any]] = []  # {"id", "authorization"} per GET
        self._fail_creates: list[int] = []  # statuses to answer instead of creating a message
        self.identify_count = 0
        self.resume_count = 0
        self.connection_count = 0
        self.shard_sessions: list[dict[str, Any]] = []
        self.nonce_replays = 0  # creates answered with the message an earlier one made (enforce_nonce)
        self._labels: dict[int, str | None] = {}  # id(websocket) -> the client's label
        self._runner: web.AppRunner | None = None
        self.port = 0

    # ------------------------------------------------------------------ lifecycle
    async def start(self, port: int = 0) -> FakeDiscord:
        """Serve on 127.0.0.1:`port` (0 = any). A stopped fake can be started again
        (same state, e.g. same port) to model an outage."""
        app = web.Application()
        app.router.add_get("/gateway", self._gateway_ws)
        app.router.add_route("*", "/api/{tail:.*}", self._rest)
        app.router.add_get("/n/{label}/gateway", self._gateway_ws)
        app.router.add_route("*", "/n/{label}/api/{tail:.*}", self._rest)
        app.router.add_get("/attachments/{channel}/{aid}/{name}", self._serve_attachment)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return self

    # shard 0's connection, which every unsharded client is
    @property
    def _ws(self) -> web.WebSocketResponse | None:
        return self._shards[0].ws

    @_ws.setter
    def _ws(self, ws: web.WebSocketResponse | None) -> None:
        self._shards[0].ws = ws

    @property
    def _session(self) -> _Session | None:
        return self._shards[0].session

    @_session.setter
    def _session(self, session: _Session | None) -> None:
        self._shards[0].session = session

    @property
    def _ws_ready(self) -> bool:
        return self._shards[0].ready

    @_ws_ready.setter
    def _ws_ready(self, ready: bool) -> None:
        self._shards[0].ready = ready

    @property
    def _replay_extra(self) -> int:
        return self._shards[0].replay_extra

    @_replay_extra.setter
    def _replay_extra(self, n: int) -> None:
        self._shards[0].replay_extra = n

    def shard_of(self, data: Any) -> int:
        """The shard an event goes to: its guild's, or 0 (DMs)."""
        gid = data.get("guild_id") if isinstance(data, dict) else None
        return (int(gid) >> 22) % self.shard_count if gid is not None else 0

    @property
    def connected_shards(self) -> list[int]:
        return sorted(i for i, sh in self._shards.items() if sh.ws is not None and not sh.ws.closed and sh.ready)

    async def stop(self) -> None:
        for sh in self._shards.values():
            if sh.ws is not None and not sh.ws.closed:
                await sh.ws.close(code=1001)
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> FakeDiscord:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def api_base(self) -> str:
        return f"{self.base_url}/api/v10"

    @property
    def gateway_url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/gateway"

    def api_base_for(self, label: str) -> str:
        """The REST root for one client: its messages are recorded with `sender` = label."""
        return f"{self.base_url}/n/{label}/api/v10"

    def gateway_url_for(self, label: str) -> str:
        """The gateway for one client: its shard connections are recorded with `via` = label."""
        return f"ws://127.0.0.1:{self.port}/n/{label}/gateway"

    @property
    def connected(self) -> bool:
        return self._ws is not None and not self._ws.closed and self._ws_ready

    # ------------------------------------------------------------------ world building
    @staticmethod
    def _user_obj(uid: str, name: str, bot: bool = False) -> dict[str, Any]:
        return {
            "id": uid,
            "username": name,
            "global_name": name.title(),
            "discriminator": "0",
            "avatar": None,
            "bot": bot,
            "public_flags": 0,
            "flags": 0,
        }

    @property
    def bot_user(self) -> dict[str, Any]:
        return self.users[self.bot_id]

    def add_user(self, name: str, *, bot: bool = False) -> str:
        uid = self.snowflake()
        self.users[uid] = self._user_obj(uid, name, bot=bot)
        return uid

    def add_guild(self, name: str = "Test Guild") -> str:
        gid = self.snowflake()
        bot_role = self.snowflake()
        self.guilds[gid] = {
            "id": gid,
            "name": name,
            "owner_id": self.owner_id,
            "bot_role_id": bot_role,
            "roles": [
                self._role(gid, "@everyone", permissions=str((1 << 10) | (1 << 11) | (1 << 16) | (1 << 38))),
                self._role(bot_role, "hermes", managed=True, bot_id=self.bot_id),
            ],
            "channel_ids": [],
        }
        self.add_channel(gid, "general")
        return gid

    def add_role(self, guild_id: str, name: str, *, permissions: int = 0) -> str:
        rid = self.snowflake()
        self.guilds[guild_id]["roles"].append(self._role(rid, name, permissions=str(permissions)))
        return rid

    def give_role(self, user_id: str, role_id: str) -> None:
        self.member_roles.setdefault(user_id, []).append(role_id)

    @staticmethod
    def _role(
        rid: str, name: str, *, permissions: str = "0", managed: bool = False, bot_id: str | None = None
    ) -> dict[str, Any]:
        role: dict[str, Any] = {
            "id": rid,
            "name": name,
            "color": 0,
            "hoist": False,
            "icon": None,
            "unicode_emoji": None,
            "position": 1 if managed else 0,
            "permissions": permissions,
            "managed": managed,
            "mentionable": True,
            "flags": 0,
        }
        if bot_id:
            role["tags"] = {"bot_id": bot_id}
        return role

    def channel_named(self, guild_id: str, name: str) -> str:
        for cid in self.guilds[guild_id]["channel_ids"]:
            if self.channels[cid]["name"] == name:
                return cid
        raise KeyError(name)

    def add_channel(self, guild_id: str, name: str) -> str:
        cid = self.snowflake()
        guild = self.guilds[guild_id]
        self.channels[cid] = {
            "id": cid,
            "type": CH_TEXT,
            "guild_id": guild_id,
            "name": name,
            "position": len(guild["channel_ids"]),
            "permission_overwrites": [],
            "topic": None,
            "nsfw": False,
            "last_message_id": None,
            "rate_limit_per_user": 0,
            "parent_id": None,
        }
        guild["channel_ids"].append(cid)
        if self.connected:
            self.dispatch("CHANNEL_CREATE", dict(self.channels[cid]))
        return cid

    def add_thread(self, parent_id: str, name: str, *, private: bool = False, announce: bool = True) -> str:
        """A thread under a text channel; announced with THREAD_CREATE when connected,
        otherwise included in the next GUILD_CREATE."""
        parent = self.channels[parent_id]
        tid = self.snowflake()
        self.channels[tid] = {
            "id": tid,
            "type": CH_PRIVATE_THREAD if private else CH_PUBLIC_THREAD,
            "guild_id": parent["guild_id"],
            "parent_id": parent_id,
            "owner_id": self.owner_id,
            "name": name,
            "last_message_id": None,
            "rate_limit_per_user": 0,
            "message_count": 0,
            "member_count": 1,
            "flags": 0,
            "thread_metadata": {
                "archived": False,
                "auto_archive_duration": 1440,
                "archive_timestamp": _now_iso(),
                "locked": False,
                "invitable": True,
                "create_timestamp": _now_iso(),
            },
        }
        if announce and self.connected:
            self.dispatch("THREAD_CREATE", dict(self.channels[tid], newly_created=True))
        return tid

    def dm_channel(self, user_id: str) -> str:
        cid = self.dm_channels.get(user_id)
        if cid is None:
            cid = self.snowflake()
            self.dm_channels[user_id] = cid
            self.channels[cid] = {
                "id": cid,
                "type": CH_DM,
                "last_message_id": None,
                "recipients": [self.users[user_id]],
                "flags": 0,
            }
        return cid

    def add_group_dm(self, *user_ids: str, name: str | None = None) -> str:
        """A group DM (channel type 3) of several users; the bot sees it only as a
        user-installed app or when a message names no guild."""
        cid = self.snowflake()
        self.channels[cid] = {
            "id": cid,
            "type": CH_GROUP_DM,
            "last_message_id": None,
            "recipients": [self.users[u] for u in user_ids],
            "owner_id": user_ids[0] if user_ids else self.owner_id,
            "name": name,
            "icon": None,
            "flags": 0,
        }
        return cid

    def push_group_dm_message(self, channel_id: str, user_id: str, text: str, **kw: Any) -> dict[str, Any]:
        if self.channels[channel_id]["type"] != CH_GROUP_DM:
            raise ValueError(f"{channel_id} is not a group DM")
        msg = self._user_message(channel_id, user_id, text, **kw)
        self.dispatch("MESSAGE_CREATE", msg)
        return msg

    def _guild_create(self, gid: str) -> dict[str, Any]:
        g = self.guilds[gid]
        channels = [self.channels[c] for c in g["channel_ids"]]
        threads = [
            c
            for c in self.channels.values()
            if c.get("guild_id") == gid and c["type"] in (CH_PUBLIC_THREAD, CH_PRIVATE_THREAD)
        ]
        return {
            "id": gid,
            "name": g["name"],
            "icon": None,
            "splash": None,
            "discovery_splash": None,
            "owner_id": g["owner_id"],
            "afk_channel_id": None,
            "afk_timeout": 300,
            "verification_level": 0,
            "default_message_notifications": 0,
            "explicit_content_filter": 0,
            "roles": g["roles"],
            "emojis": [],
            "stickers": [],
            "features": [],
            "mfa_level": 0,
            "application_id": None,
            "system_channel_id": None,
            "system_channel_flags": 0,
            "rules_channel_id": None,
            "vanity_url_code": None,
            "description": None,
            "banner": None,
            "premium_tier": 0,
            "preferred_locale": "en-US",
            "public_updates_channel_id": None,
            "nsfw_level": 0,
            "premium_progress_bar_enabled": False,
            "joined_at": _now_iso(),
            "large": False,
            "unavailable": False,
            "member_count": 2,
            "voice_states": [],
            "members": [self._member(self.bot_id, roles=[g["bot_role_id"]])],
            "channels": channels,
            "threads": threads,
            "presences": [],
            "stage_instances": [],
            "guild_scheduled_events": [],
            "soundboard_sounds": [],
        }

    def _member(self, user_id: str, roles: list[str] | None = None, with_user: bool = True) -> dict[str, Any]:
        m: dict[str, Any] = {
            "roles": roles if roles is not None else list(self.member_roles.get(user_id, [])),
            "joined_at": _now_iso(),
            "deaf": False,
            "mute": False,
            "flags": 0,
            "pending": False,
            "nick": None,
            "avatar": None,
            "communication_disabled_until": None,
        }
        if with_user:
            m["user"] = self.users[user_id]
        return m

    # ------------------------------------------------------------------ test controls
    def refuse_intents(self, refuse: bool = True) -> None:
        """Close with 4014 on IDENTIFY when the message content intent is requested."""
        self._refuse_intents = refuse

    def garble_next_hello(self, times: int = 1) -> None:
        """The next `times` connections get a HELLO without `heartbeat_interval`: discord.py
        raises out of `Client.connect` (not one of the errors it reconnects after)."""
        self._garbled_hellos += times

    def rate_limit_next(
        self,
        path_regex: str = r"^/channels/\d+/messages$",
        *,
        retry_after: float = 0.05,
        is_global: bool = False,
        count: int = 1,
    ) -> None:
        """The next `count` POSTs matching `path_regex` answer 429 with Discord's headers."""
        for _ in range(count):
            self._rate_limits.append((path_regex, retry_after, is_global))

    def fail_creates(self, status: int = 503, count: int = 1) -> None:
        """The next `count` channel message POSTs answer `status` without creating anything
        (an outage: 500/502/504 are retried by discord.py itself, 503 is not)."""
        self._fail_creates.extend([status] * count)

    def fail_after_create_next(self, status: int = 502) -> None:
        """The next channel message POST creates the message but answers `status`
        (a lost response): the client's retry must not create a second message."""
        self._fail_after_create.append(status)

    def forbid_channel(self, channel_id: str) -> None:
        self.forbidden_channels.add(channel_id)

    def seq_of(self, message_id: str) -> int:
        """The sequence number of the MESSAGE_CREATE of `message_id` on its shard's session."""
        for sh in self._shards.values():
            for seq, event, data in sh.session.events if sh.session is not None else ():
                if event == "MESSAGE_CREATE" and data.get("id") == message_id:
                    return seq
        raise KeyError(message_id)

    @property
    def session_seq(self) -> int:
        return self._session.seq if self._session else 0

    async def drop_connection(
        self, *, resume: bool = True, replay_last: int = 0, replay_from_message: str | None = None
    ) -> None:
        """Cut the gateway socket. `resume=True`: close with 4000 (the client RESUMEs and
        gets every event it missed; `replay_last=N` also re-sends the last N events it had
        already received, as Discord may; `replay_from_message=id` re-sends everything from that
        message's MESSAGE_CREATE on). `resume=False`: INVALID_SESSION (d=false), the
        client must IDENTIFY again and gets a new session (no replay)."""
        ws = self._ws
        if ws is None or ws.closed:
            raise RuntimeError("no gateway connection to drop")
        if replay_from_message is not None:  # replay everything from that message on
            replay_last = self.session_seq - self.seq_of(replay_from_message) + 1
        self._ws_ready = False
        if resume:
            self._replay_extra = replay_last
            await ws.close(code=4000, message=b"fake: dropped")
        else:
            self._session = None
            await self._send(ws, {"op": OP_INVALID_SESSION, "d": False, "s": None, "t": None})

    async def send_reconnect(self) -> None:
        """op 7 RECONNECT: the client closes and RESUMEs."""
        if self._ws is not None:
            await self._send(self._ws, {"op": OP_RECONNECT, "d": None, "s": None, "t": None})

    async def wait_until(self, predicate: Callable[[], bool], timeout: float = 10.0) -> None:
        deadline = asyncio.get_running_loop().time() + timeout
        while not predicate():
            if asyncio.get_running_loop().time() > deadline:
                raise AssertionError("fake discord: condition not reached in time")
            await asyncio.sleep(0.01)

    # ------------------------------------------------------------------ inspecting
    def rest_calls(self, method: str | None = None, path_regex: str | None = None) -> list[dict[str, Any]]:
        out = [c for c in self.calls if c["kind"] == "rest"]
        if method:
            out = [c for c in out if c["method"] == method]
        if path_regex:
            out = [c for c in out if re.search(path_regex, c["path"])]
        return out

    def gateway_ops(self, direction: str = "recv") -> list[dict[str, Any]]:
        return [c for c in self.calls if c["kind"] == "gateway" and c["direction"] == direction]

    def sent_messages(self, channel_id: str | None = None) -> list[dict[str, Any]]:
        """Messages the bot created (channel POSTs and interaction followups), in order."""
        return [m for m in self._sent if channel_id is None or m["channel_id"] == channel_id]

    def typing_calls(self, channel_id: str | None = None) -> list[dict[str, Any]]:
        return [
            c
            for c in self.rest_calls("POST", r"^/channels/\d+/typing$")
            if channel_id is None or c["path"].split("/")[2] == channel_id
        ]

    # ------------------------------------------------------------------ event injection
    def dispatch(self, event: str, data: Any) -> int:
        """Send a DISPATCH on the session of the event's shard (stored for RESUME replay)."""
        shard = self._shards.get(self.shard_of(data))
        session = shard.session if shard is not None else None
        if shard is None or session is None:
            raise RuntimeError(f"no gateway session on shard {self.shard_of(data)}: is the client connected?")
        session.seq += 1
        seq = session.seq
        session.events.append((seq, event, data))
        if shard.ws is not None and not shard.ws.closed and shard.ready:
            task = asyncio.get_running_loop().create_task(self._send_dispatch(shard.ws, seq, event, data))
            self._pending.add(task)
            task.add_done_callback(self._pending.discard)
        return seq

    def push_partial_message_update(self, channel_id: str, message_id: str | None = None) -> int:
        """A MESSAGE_UPDATE carrying only ids and embeds, without `type` or `author`: the
        shape Discord sends when it unfurls a link's embed, which discord.py cannot parse."""
        channel = self.channels.get(channel_id, {})
        data: dict[str, Any] = {
            "id": message_id or self.snowflake(),
            "channel_id": channel_id,
            "embeds": [{"type": "link", "url": "https://example.com/", "title": "Example"}],
        }
        if channel.get("guild_id"):
            data["guild_id"] = channel["guild_id"]
        return self.dispatch("MESSAGE_UPDATE", data)

    def _user_message(
        self,
        channel_id: str,
        user_id: str,
        content: str,
        *,
        reply_to: str | None = None,
        attachments: list[dict[str, Any]] | None = None,
        mention_ids: list[str] | None = None,
        message_type: int | None = None,
    ) -> dict[str, Any]:
        channel = self.channels[channel_id]
        guild_id = channel.get("guild_id")
        mids = list(mention_ids or [])
        for uid in _MENTION_USER.findall(content):
            if uid not in mids:
                mids.append(uid)
        msg: dict[str, Any] = {
            "id": self.snowflake(),
            "channel_id": channel_id,
            "author": self.users[user_id],
            "content": content,
            "timestamp": _now_iso(),
            "edited_timestamp": None,
            "tts": False,
            "mention_everyone": False,
            "mentions": [self.users[u] for u in mids if u in self.users],
            "mention_roles": _MENTION_ROLE.findall(content),
            "attachments": attachments or [],
            "embeds": [],
            "pinned": False,
            "type": 0,
            "flags": 0,
            "components": [],
        }
        if guild_id:
            msg["guild_id"] = guild_id
            msg["member"] = self._member(user_id, with_user=False)
        if reply_to is not None:
            msg["type"] = 19
            msg["message_reference"] = {
                "type": 0,
                "message_id": reply_to,
                "channel_id": channel_id,
                "fail_if_not_exists": False,
                **({"guild_id": guild_id} if guild_id else {}),
            }
            msg["referenced_message"] = self.messages.get(reply_to)
        if message_type is not None:
            msg["type"] = message_type
        self.messages[msg["id"]] = msg
        channel["last_message_id"] = msg["id"]
        return msg

    def attachment(
        self, channel_id: str, filename: str, data: bytes, content_type: str | None = None, *, size: int | None = None
    ) -> dict[str, Any]:
        """An attachment object for `attachments=[...]` of a pushed message; its `url` (CDN
        style, with signed-looking query parameters) serves `data`. `size` overrides the
        stated size."""
        aid = self.snowflake()
        self.attachment_files[aid] = data
        url = f"{self.base_url}/attachments/{channel_id}/{aid}/{filename}?ex=6790&is=678f&hm=abc123"
        att: dict[str, Any] = {
            "id": aid,
            "filename": filename,
            "size": len(data) if size is None else size,
            "url": url,
            "proxy_url": url,
        }
        if content_type:
            att["content_type"] = content_type
        return att

    async def _serve_attachment(self, request: web.Request) -> web.StreamResponse:
        aid = request.match_info["aid"]
        self.attachment_downloads.append({"id": aid, "authorization": request.headers.get("Authorization")})
        data = self.attachment_files.get(aid)
        if data is None:
            return web.Response(status=404, text="Not Found")
        return web.Response(body=data, content_type="application/octet-stream")

    def push_dm(self, user_id: str, text: str, **kw: Any) -> dict[str, Any]:
        msg = self._user_message(self.dm_channel(user_id), user_id, text, **kw)
        self.dispatch("MESSAGE_CREATE", msg)
        return msg

    def push_guild_message(
        self,
        channel_id: str,
        user_id: str,
        text: str,
        *,
        mention_bot: bool = False,
        nick_mention: bool = False,
        reply_to: str | None = None,
        **kw: Any,
    ) -> dict[str, Any]:
        if mention_bot:
            tag = f"<@!{self.bot_id}>" if nick_mention else f"<@{self.bot_id}>"
            text = f"{tag} {text}"
        msg = self._user_message(channel_id, user_id, text, reply_to=reply_to, **kw)
        self.dispatch("MESSAGE_CREATE", msg)
        return msg

    def push_thread_message(self, thread_id: str, user_id: str, text: str, **kw: Any) -> dict[str, Any]:
        if self.channels[thread_id]["type"] not in (CH_PUBLIC_THREAD, CH_PRIVATE_THREAD):
            raise ValueError(f"{thread_id} is not a thread")
        return self.push_guild_message(thread_id, user_id, text, **kw)

    def replay_message(self, message: dict[str, Any]) -> None:
        """Deliver the same MESSAGE_CREATE again (same id), as after a session restart."""
        self.dispatch("MESSAGE_CREATE", message)

    def push_interaction(
        self,
        name: str,
        args: str | None = None,
        *,
        user_id: str,
        channel_id: str,
    ) -> dict[str, Any]:
        """An application command (type 2, chat input) used in `channel_id`."""
        cmd = next((c for c in self.commands if c["name"] == name), None)
        data: dict[str, Any] = {"id": cmd["id"] if cmd else self.snowflake(), "name": name, "type": 1}
        if args is not None:
            data["options"] = [{"name": "args", "type": 3, "value": args}]
        return self._push_interaction(2, data, user_id=user_id, channel_id=channel_id)

    def press_button(
        self, message_id: str, user_id: str, *, label: str | None = None, custom_id: str | None = None
    ) -> dict[str, Any]:
        """`user_id` presses a button of message `message_id`: the one labelled `label` on the
        message as it is now (LookupError when it has none: a removed button cannot be
        pressed), or any `custom_id` (an old client, a forged payload). Dispatches the
        INTERACTION_CREATE (type 3) and returns its payload."""
        msg = self.messages.get(message_id)
        if msg is None:
            raise LookupError(f"no message {message_id}")
        if label is not None:
            button = next((b for b in _buttons(msg.get("components") or []) if b.get("label") == label), None)
            if button is None or "custom_id" not in button:
                raise LookupError(f"message {message_id} has no button {label!r}")
            custom_id = button["custom_id"]
        if custom_id is None:
            raise ValueError("press_button needs label= or custom_id=")
        data = {"custom_id": custom_id, "component_type": 2}
        return self._push_interaction(3, data, user_id=user_id, channel_id=msg["channel_id"], message=msg)

    def interaction_callback(self, payload: dict[str, Any]) -> dict[str, Any] | None:
        """The callback the bot made for an interaction (None while unanswered)."""
        return next((c for c in self.interaction_callbacks if c["interaction_id"] == payload["id"]), None)

    def followups(self, payload: dict[str, Any]) -> list[dict[str, Any]]:
        """The followup messages the bot sent for an interaction (sent-message records)."""
        return [m for m in self._sent if m["interaction_id"] == payload["id"] and m["via"] == "followup"]

    async def wait_answered(self, payload: dict[str, Any], timeout: float = 10.0) -> dict[str, Any]:
        """Wait for the bot's callback to an interaction; returns it."""
        await self.wait_until(lambda: self.interaction_callback(payload) is not None, timeout)
        callback = self.interaction_callback(payload)
        assert callback is not None
        return callback

    def _push_interaction(
        self,
        kind: int,
        data: dict[str, Any],
        *,
        user_id: str,
        channel_id: str,
        message: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Dispatch an INTERACTION_CREATE of type `kind` by `user_id` in `channel_id`."""
        channel = self.channels[channel_id]
        guild_id = channel.get("guild_id")
        iid = self.snowflake()
        token = "itok-" + secrets.token_urlsafe(24)
        payload: dict[str, Any] = {
            "id": iid,
            "application_id": self.app_id,
            "type": kind,
            "data": data,
            "channel_id": channel_id,
            "channel": dict(channel),
            "token": token,
            "version": 1,
            "locale": "en-US",
            "app_permissions": str((1 << 10) | (1 << 11) | (1 << 16) | (1 << 38)),
            "entitlements": [],
            "authorizing_integration_owners": {"0": guild_id} if guild_id else {"1": user_id},
            # 0 guild, 1 the bot's own DM, 2 any other private channel (a user-installed app)
            "context": 0 if guild_id else (1 if channel["type"] == CH_DM else 2),
            "attachment_size_limit": 10 * 1024 * 1024,
        }
        if guild_id:
            payload["guild_id"] = guild_id
            payload["guild_locale"] = "en-US"
            payload["member"] = {**self._member(user_id), "permissions": "0"}
        else:
            payload["user"] = self.users[user_id]
        if message is not None:
            payload["message"] = dict(message)
        self.interactions[token] = {
            "id": iid,
            "type": kind,
            "token": token,
            "channel_id": channel_id,
            "guild_id": guild_id,
            "user_id": user_id,
            "message_id": message["id"] if message is not None else None,
            "response": None,
            "original_id": None,
        }
        self.dispatch("INTERACTION_CREATE", payload)
        return payload

    # ------------------------------------------------------------------ gateway
    async def _send(self, ws: web.WebSocketResponse, payload: dict[str, Any]) -> None:
        await self._send_many(ws, [payload])

    async def _send_many(self, ws: web.WebSocketResponse, payloads: list[dict[str, Any]]) -> None:
        async with self._send_lock:  # FIFO: frames leave in the order they were queued
            for payload in payloads:
                if ws.closed:
                    return
                self.calls.append(
                    {
                        "kind": "gateway",
                        "direction": "send",
                        "op": payload["op"],
                        "t": payload.get("t"),
                        "s": payload.get("s"),
                        "d": payload.get("d"),
                    }
                )
                try:
                    await ws.send_str(json.dumps(payload))
                except ConnectionError:
                    return

    async def _send_dispatch(self, ws: web.WebSocketResponse, seq: int, event: str, data: Any) -> None:
        await self._send_many(ws, [{"op": OP_DISPATCH, "t": event, "s": seq, "d": data}])

    async def _gateway_ws(self, request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        self.connection_count += 1
        self._labels[id(ws)] = request.match_info.get("label")
        hello: dict[str, Any] = {"heartbeat_interval": self.heartbeat_interval_ms}
        if self._garbled_hellos:
            self._garbled_hellos -= 1
            hello = {}
        await self._send(ws, {"op": OP_HELLO, "d": hello, "s": None, "t": None})
        async for frame in ws:
            if frame.type != WSMsgType.TEXT:
                continue
            payload = json.loads(frame.data)
            op = payload.get("op")
            d = payload.get("d")
            logged = d
            if op in (OP_IDENTIFY, OP_RESUME) and isinstance(d, dict):
                logged = {**d, "token": "<ok>" if d.get("token") == self.token else "<wrong>"}
            self.calls.append({"kind": "gateway", "direction": "recv", "op": op, "d": logged})
            if op == OP_HEARTBEAT:
                await self._send(ws, {"op": OP_HEARTBEAT_ACK, "d": None, "s": None, "t": None})
            elif op == OP_IDENTIFY:
                await self._on_identify(ws, d)
            elif op == OP_RESUME:
                await self._on_resume(ws, d)
        for sh in self._shards.values():
            if sh.ws is ws:
                sh.ready = False
        self._session_ended(ws)
        self._labels.pop(id(ws), None)
        return ws

    def _session_started(self, shard_id: int, ws: web.WebSocketResponse) -> None:
        self.shard_sessions.append(
            {"shard": shard_id, "via": self._labels.get(id(ws)), "start": time.monotonic(), "end": None, "_ws": ws}
        )

    def _session_ended(self, ws: web.WebSocketResponse, preempted_by: str | None = None) -> None:
        for rec in self.shard_sessions:
            if rec["_ws"] is ws and rec["end"] is None:
                rec["end"] = time.monotonic()
                if preempted_by is not None and preempted_by != rec["via"]:
                    rec["preempted_by"] = preempted_by

    async def _take_over(self, shard: _Shard, ws: web.WebSocketResponse) -> None:
        """`ws` is now the shard's connection; an older one is closed."""
        old, was_ready, shard.ws, shard.ready = shard.ws, shard.ready, ws, False
        if old is not None and old is not ws and not old.closed:
            if was_ready:
                self._session_ended(old, preempted_by=self._labels.get(id(ws)))
            await old.close(code=4000)

    async def _on_identify(self, ws: web.WebSocketResponse, d: dict[str, Any]) -> None:
        self.identify_count += 1
        if d.get("token") != self.token:
            await ws.close(code=4004, message=b"Authentication failed.")
            return
        if self._refuse_intents and int(d.get("intents", 0)) & INTENT_MESSAGE_CONTENT:
            await ws.close(code=4014, message=b"Disallowed intent(s).")
            return
        raw_shard = d.get("shard") or [0, 1]
        try:
            shard_id, count = int(raw_shard[0]), int(raw_shard[1])
        except (TypeError, ValueError, IndexError):
            shard_id, count = -1, 0
        if count < 1 or not 0 <= shard_id < count:
            await ws.close(code=4010, message=b"Invalid shard.")
            return
        self.shard_count = count
        shard = self._shards.setdefault(shard_id, _Shard())
        await self._take_over(shard, ws)
        shard.session = session = _Session(secrets.token_hex(16))
        guilds = [gid for gid in self.guilds if self.shard_of({"guild_id": gid}) == shard_id]
        ready = {
            "v": 10,
            "user": self.bot_user,
            "guilds": [{"id": gid, "unavailable": True} for gid in guilds],
            "shard": [shard_id, count],
            "session_id": session.session_id,
            "resume_gateway_url": self.gateway_url,
            "application": {"id": self.app_id, "flags": self.app_flags},
            "private_channels": [],
            "relationships": [],
            "user_settings": {},
            "presences": [],
            "guild_join_requests": [],
            "geo_ordered_rtc_regions": [],
            "_trace": ["fake-discord"],
        }
        batch = []
        for event, data in [("READY", ready)] + [("GUILD_CREATE", self._guild_create(g)) for g in guilds]:
            session.seq += 1
            session.events.append((session.seq, event, data))
            batch.append({"op": OP_DISPATCH, "t": event, "s": session.seq, "d": data})
        shard.ready = True
        self._session_started(shard_id, ws)
        await self._send_many(ws, batch)

    async def _on_resume(self, ws: web.WebSocketResponse, d: dict[str, Any]) -> None:
        self.resume_count += 1
        shard = next(
            (
                sh
                for sh in self._shards.values()
                if sh.session is not None and sh.session.session_id == d.get("session_id")
            ),
            None,
        )
        if d.get("token") != self.token or shard is None or shard.session is None:
            await self._send(ws, {"op": OP_INVALID_SESSION, "d": False, "s": None, "t": None})
            return
        session = shard.session
        await self._take_over(shard, ws)
        client_seq = int(d.get("seq") or 0)
        start = max(0, client_seq - shard.replay_extra)
        shard.replay_extra = 0
        batch = [
            {"op": OP_DISPATCH, "t": event, "s": seq, "d": data}
            for seq, event, data in session.events
            if seq > start and event not in ("READY", "GUILD_CREATE", "RESUMED")
        ]
        session.seq += 1
        session.events.append((session.seq, "RESUMED", {"_trace": ["fake-discord"]}))
        batch.append({"op": OP_DISPATCH, "t": "RESUMED", "s": session.seq, "d": {"_trace": ["fake-discord"]}})
        shard.ready = True
        self._session_started(next(i for i, sh in self._shards.items() if sh is shard), ws)
        await self._send_many(ws, batch)

    # ------------------------------------------------------------------ REST
    async def _rest(self, request: web.Request) -> web.StreamResponse:
        path = "/" + request.match_info["tail"]
        m = re.match(r"^/v\d+(/.*)$", path)
        path = m.group(1) if m else path
        body: Any = None
        if request.can_read_body:
            raw = await request.read()
            try:
                body = json.loads(raw) if raw else None
            except ValueError:
                body = raw.decode("utf-8", "replace")
        auth = request.headers.get("Authorization")
        call: dict[str, Any] = {
            "kind": "rest",
            "method": request.method,
            "path": path,
            "query": dict(request.query),
            "json": body,
            "authorized": auth == f"Bot {self.token}",
            "auth_header_present": auth is not None,
            "time": time.monotonic(),
            "label": request.match_info.get("label"),
        }
        self.calls.append(call)
        _SENDER.set(call["label"])  # this request's task: _bot_message records it
        resp = await self._route(request.method, path, body, call, dict(request.query))
        call["status"] = resp.status
        return resp

    @staticmethod
    def _json(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
        # exactly "application/json": discord.py only parses that (no charset suffix)
        return web.Response(
            body=json.dumps(data).encode(),
            status=status,
            headers={**(headers or {}), "Content-Type": "application/json"},
        )

    def _error(self, status: int, code: int, message: str) -> web.Response:
        return self._json({"message": message, "code": code}, status=status)

    def _take_rate_limit(self, method: str, path: str) -> tuple[float, bool] | None:
        if method != "POST":
            return None
        for i, (rx, retry_after, is_global) in enumerate(self._rate_limits):
            if re.search(rx, path):
                del self._rate_limits[i]
                return retry_after, is_global
        return None

    def _rate_limited(self, retry_after: float, is_global: bool) -> web.Response:
        headers = {
            "Via": "1.1 google",
            "Retry-After": str(max(1, int(retry_after + 0.999))),
            "X-RateLimit-Limit": "5",
            "X-RateLimit-Remaining": "0",
            "X-RateLimit-Reset": f"{time.time() + retry_after:.3f}",
            "X-RateLimit-Reset-After": f"{retry_after:.3f}",
            "X-RateLimit-Bucket": "fake-bucket-messages",
            "X-RateLimit-Scope": "global" if is_global else "user",
        }
        if is_global:
            headers["X-RateLimit-Global"] = "true"
        return self._json(
            {"message": "You are being rate limited.", "retry_after": retry_after, "global": is_global},
            status=429,
            headers=headers,
        )

    @staticmethod
    def _ok_headers() -> dict[str, str]:
        return {
            "Via": "1.1 google",
            "X-RateLimit-Limit": "5",
            "X-RateLimit-Remaining": "4",
            "X-RateLimit-Reset": f"{time.time() + 5:.3f}",
            "X-RateLimit-Reset-After": "5.000",
            "X-RateLimit-Bucket": "fake-bucket-messages",
        }

    async def _route(
        self, method: str, path: str, body: Any, call: dict[str, Any], query: dict[str, str]
    ) -> web.Response:
        webhook = re.match(r"^/webhooks/(\d+)/([^/]+)(?:/messages/([^/]+))?$", path)
        callback = re.match(r"^/interactions/(\d+)/([^/]+)/callback$", path)
        # interaction endpoints authenticate with the interaction token, not the bot token
        if webhook:
            return self._webhook(method, webhook.group(1), webhook.group(2), webhook.group(3), body)
        if callback:
            return self._interaction_callback(callback.group(1), callback.group(2), body, query)
        if not call["authorized"]:
            return self._error(401, 0, "401: Unauthorized")
        limited = self._take_rate_limit(method, path)
        if limited is not None:
            return self._rate_limited(*limited)

        if method == "GET" and path == "/users/@me":
            return self._json(self.bot_user)
        if method == "GET" and path == "/oauth2/applications/@me":
            return self._json(self._application())
        if method == "GET" and path == "/applications/@me":
            return self._json(self._application())
        if method == "GET" and path in ("/gateway", "/gateway/bot"):
            data: dict[str, Any] = {"url": self.gateway_url}
            if path == "/gateway/bot":
                data.update(
                    shards=1,
                    session_start_limit={"total": 1000, "remaining": 999, "reset_after": 0, "max_concurrency": 1},
                )
            return self._json(data)
        m = re.match(r"^/applications/(\d+)(?:/guilds/(\d+))?/commands$", path)
        if m:
            if m.group(1) != self.app_id:
                return self._error(403, 50001, "Missing Access")
            if method == "PUT":
                self.commands = [self._command(c) for c in (body or [])]
                return self._json(self.commands)
            if method == "GET":
                return self._json(self.commands)
        m = re.match(r"^/channels/(\d+)$", path)
        if m and method == "GET":
            ch = self.channels.get(m.group(1))
            return self._json(ch) if ch else self._error(404, 10003, "Unknown Channel")
        m = re.match(r"^/channels/(\d+)/typing$", path)
        if m and method == "POST":
            if m.group(1) not in self.channels:
                return self._error(404, 10003, "Unknown Channel")
            if m.group(1) in self.forbidden_channels:
                return self._error(403, 50013, "Missing Permissions")
            return web.Response(status=204)
        m = re.match(r"^/channels/(\d+)/messages$", path)
        if m and method == "POST":
            return self._create_channel_message(m.group(1), body or {})
        m = re.match(r"^/channels/(\d+)/messages/(\d+)$", path)
        if m and method == "PATCH":
            return self._edit_message(m.group(2), body or {}, channel_id=m.group(1))
        if m and method == "GET":
            msg = self.messages.get(m.group(2))
            return self._json(msg) if msg else self._error(404, 10008, "Unknown Message")
        m = re.match(r"^/guilds/(\d+)/members/(\d+)$", path)
        if m and method == "GET":
            if m.group(1) not in self.guilds or m.group(2) not in self.users:
                return self._error(404, 10007, "Unknown Member")
            return self._json(self._member(m.group(2)))
        m = re.match(r"^/users/@me/channels$", path)
        if m and method == "POST":
            return self._json(self.channels[self.dm_channel(str(body["recipient_id"]))])
        return self._error(404, 0, f"404: Not Found ({method} {path})")

    def _application(self) -> dict[str, Any]:
        return {
            "id": self.app_id,
            "name": self.bot_user["username"],
            "icon": None,
            "description": "",
            "summary": "",
            "type": None,
            "bot_public": True,
            "bot_require_code_grant": False,
            "verify_key": "0" * 64,
            "owner": self.users[self.owner_id],
            "team": None,
            "flags": self.app_flags,
            "bot": self.bot_user,
            "rpc_origins": [],
            "interactions_endpoint_url": None,
            "install_params": {"scopes": ["bot", "applications.commands"], "permissions": "0"},
        }

    def _command(self, spec: dict[str, Any]) -> dict[str, Any]:
        return {
            "id": self.snowflake(),
            "application_id": self.app_id,
            "version": self.snowflake(),
            "type": spec.get("type", 1),
            "name": spec["name"],
            "description": spec.get("description", ""),
            "options": spec.get("options", []),
            # Discord answers with the permission bitfield as a string, whatever was sent
            "default_member_permissions": (
                None if spec.get("default_member_permissions") is None else str(spec["default_member_permissions"])
            ),
            "dm_permission": spec.get("dm_permission", True),
            "nsfw": spec.get("nsfw", False),
            "contexts": spec.get("contexts"),
            "integration_types": spec.get("integration_types", [0]),
        }

    # -- pings: what Discord would notify for this content + allowed_mentions
    def _pings(
        self, content: str, allowed: dict[str, Any] | None, channel_id: str, reply_author: str | None
    ) -> dict[str, Any]:
        if allowed is None:  # Discord's default: everything parses
            parse = {"everyone", "users", "roles"}
            users_ok: list[str] = []
            roles_ok: list[str] = []
            replied = True
        else:
            parse = set(allowed.get("parse", []))
            users_ok = [str(u) for u in allowed.get("users", [])]
            roles_ok = [str(r) for r in allowed.get("roles", [])]
            replied = bool(allowed.get("replied_user", False))
        everyone = ("@everyone" in content or "@here" in content) and "everyone" in parse
        users = [u for u in _MENTION_USER.findall(content) if "users" in parse or u in users_ok]
        roles = [r for r in _MENTION_ROLE.findall(content) if "roles" in parse or r in roles_ok]
        if reply_author and replied and reply_author not in users:
            users.append(reply_author)
        return {"everyone": everyone, "users": users, "roles": roles, "any": bool(everyone or users or roles)}

    def _bot_message(
        self,
        channel_id: str,
        body: dict[str, Any],
        *,
        reference: dict[str, Any] | None,
        via: str,
        interaction: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        channel = self.channels[channel_id]
        content = body.get("content") or ""
        ref_msg = self.messages.get(str(reference["message_id"])) if reference else None
        pings = self._pings(
            content, body.get("allowed_mentions"), channel_id, ref_msg["author"]["id"] if ref_msg else None
        )
        msg: dict[str, Any] = {
            "id": self.snowflake(),
            "channel_id": channel_id,
            "author": self.bot_user,
            "content": content,
            "timestamp": _now_iso(),
            "edited_timestamp": None,
            "tts": bool(body.get("tts", False)),
            "mention_everyone": pings["everyone"],
            "mentions": [self.users[u] for u in pings["users"] if u in self.users],
            "mention_roles": pings["roles"],
            "attachments": [],
            "embeds": body.get("embeds") or [],
            "pinned": False,
            "type": 19 if reference else 0,
            "flags": int(body.get("flags") or 0),
            "components": list(body.get("components") or []),
            "nonce": body.get("nonce"),
        }
        if channel.get("guild_id"):
            msg["guild_id"] = channel["guild_id"]
        if reference:
            msg["message_reference"] = {"type": 0, "message_id": str(reference["message_id"]), "channel_id": channel_id}
            msg["referenced_message"] = ref_msg
        if interaction is not None:
            msg["type"] = 20
            msg["webhook_id"] = self.app_id
            msg["application_id"] = self.app_id
            msg["interaction_metadata"] = {
                "id": interaction["id"],
                "type": interaction.get("type", 2),
                "user": self.users[interaction["user_id"]],
                "authorizing_integration_owners": {},
            }
        self.messages[msg["id"]] = msg
        channel["last_message_id"] = msg["id"]
        self._sent.append(
            {
                "id": msg["id"],
                "channel_id": channel_id,
                "content": content,
                "message_reference": body.get("message_reference"),
                "allowed_mentions": body.get("allowed_mentions"),
                "pings": pings,
                "via": via,
                "sender": _SENDER.get(),
                "at": time.monotonic(),
                "interaction_id": interaction["id"] if interaction else None,
                "body": body,
            }
        )
        shard = self._shards.get(self.shard_of(msg))
        if shard is not None and shard.session is not None:
            self.dispatch("MESSAGE_CREATE", msg)  # Discord echoes the bot's own messages
        return msg

    def _create_channel_message(self, channel_id: str, body: dict[str, Any]) -> web.Response:
        if channel_id not in self.channels:
            return self._error(404, 10003, "Unknown Channel")
        if channel_id in self.forbidden_channels:
            return self._error(403, 50013, "Missing Permissions")
        content = body.get("content") or ""
        if len(content) > 2000:
            return self._json(
                {
                    "message": "Invalid Form Body",
                    "code": 50035,
                    "errors": {
                        "content": {
                            "_errors": [{"code": "BASE_TYPE_MAX_LENGTH", "message": "Must be 2000 or fewer in length."}]
                        }
                    },
                },
                status=400,
            )
        if not content and not body.get("embeds"):
            return self._error(400, 50006, "Cannot send an empty message")
        reference = body.get("message_reference")
        if reference is not None and str(reference.get("message_id")) not in self.messages:
            if reference.get("fail_if_not_exists", True):
                return self._json(
                    {
                        "message": "Invalid Form Body",
                        "code": 50035,
                        "errors": {
                            "message_reference": {
                                "_errors": [{"code": "REPLIES_UNKNOWN_MESSAGE", "message": "Unknown message"}]
                            }
                        },
                    },
                    status=400,
                )
            reference = None
        if self._fail_creates:
            return self._error(self._fail_creates.pop(0), 0, "fake: outage")
        nonce = body.get("nonce")
        if nonce is not None and body.get("enforce_nonce"):
            seen = self._nonces.get(str(nonce))
            if seen is not None and time.monotonic() - seen[0] < 300 and seen[1] in self.messages:
                self.nonce_replays += 1
                return self._json(self.messages[seen[1]], headers=self._ok_headers())  # Discord's dedupe
        msg = self._bot_message(channel_id, body, reference=reference, via="channel")
        if nonce is not None and body.get("enforce_nonce"):
            self._nonces[str(nonce)] = (time.monotonic(), msg["id"])
        if self._fail_after_create:
            return self._error(self._fail_after_create.pop(0), 0, "fake: response lost")
        return self._json(msg, headers=self._ok_headers())

    def _edit_message(self, message_id: str, body: dict[str, Any], *, channel_id: str | None = None) -> web.Response:
        msg = self.messages.get(message_id)
        if msg is None or (channel_id and msg["channel_id"] != channel_id):
            return self._error(404, 10008, "Unknown Message")
        if msg["author"]["id"] != self.bot_id:
            return self._error(403, 50005, "Cannot edit a message authored by another user")
        if "content" in body:
            if len(body["content"] or "") > 2000:
                return self._error(400, 50035, "Invalid Form Body")
            msg["content"] = body["content"]
        if "components" in body:
            msg["components"] = list(body["components"] or [])
        msg["edited_timestamp"] = _now_iso()
        for rec in self._sent:
            if rec["id"] == message_id:
                rec["content"] = msg["content"]
                rec.setdefault("edits", []).append(body)
        return self._json(msg)

    def _interaction_callback(self, iid: str, token: str, body: Any, query: dict[str, str]) -> web.Response:
        state = self.interactions.get(token)
        if state is None or state["id"] != iid:
            return self._error(404, 10062, "Unknown interaction")
        if state["response"] is not None:
            return self._error(400, 40060, "Interaction has already been acknowledged.")
        state["response"] = body
        rtype = int((body or {}).get("type", 0))
        rdata = (body or {}).get("data") or {}
        self.interaction_callbacks.append(
            {
                "interaction_id": iid,
                "type": rtype,
                "flags": int(rdata.get("flags") or 0),
                "content": rdata.get("content"),
                "body": body,
            }
        )
        if rtype in (6, 7) and state.get("message_id") is None:
            return self._error(400, 40004, "Interaction has no message to update")
        if rtype == 7:  # update the message the component is on
            self._edit_message(state["message_id"], rdata)
        if rtype == 4:  # immediate message
            msg = self._bot_message(
                state["channel_id"],
                (body or {}).get("data") or {},
                reference=None,
                via="interaction",
                interaction=state,
            )
            state["original_id"] = msg["id"]
        if query.get("with_response") in ("1", "true", "True"):
            return self._json(
                {
                    "interaction": {
                        "id": iid,
                        "type": state.get("type", 2),
                        "response_message_loading": rtype == 5,
                        "response_message_ephemeral": bool(((body or {}).get("data") or {}).get("flags", 0) & 64),
                        **({"response_message_id": state["original_id"]} if state["original_id"] else {}),
                    },
                    "resource": {"type": rtype},
                }
            )
        return web.Response(status=204)

    def _webhook(self, method: str, app_id: str, token: str, message_id: str | None, body: Any) -> web.Response:
        state = self.interactions.get(token)
        if app_id != self.app_id or state is None:
            return self._error(404, 10015, "Unknown Webhook")
        if state["response"] is None:
            return self._error(404, 10015, "Unknown Webhook")
        if method == "POST" and message_id is None:
            body = body or {}
            content = body.get("content") or ""
            if len(content) > 2000:
                return self._error(400, 50035, "Invalid Form Body")
            deferred = int(state["response"].get("type", 0)) == 5
            msg = self._bot_message(
                state["channel_id"],
                body,
                reference=None,
                via="followup" if state["original_id"] or not deferred else "interaction",
                interaction=state,
            )
            if deferred and state["original_id"] is None:
                state["original_id"] = msg["id"]  # the first followup replaces "thinking..."
            return self._json(msg)
        mid = state["original_id"] if message_id == "@original" else message_id
        if message_id == "@original" and mid is None and method == "DELETE":
            state["original_deleted"] = True  # the "thinking..." placeholder goes away
            return web.Response(status=204)
        if mid is None or mid not in self.messages:
            return self._error(404, 10008, "Unknown Message")
        if method == "PATCH":
            return self._edit_message(mid, body or {})
        if method == "DELETE":
            self.messages.pop(mid, None)
            self._sent = [r for r in self._sent if r["id"] != mid]
            return web.Response(status=204)
        if method == "GET":
            return self._json(self.messages[mid])
        return self._error(405, 0, "405: Method Not Allowed")


def _buttons(components: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every button (type 2) in a message's components, action rows and containers opened."""
    found: list[dict[str, Any]] = []
    for component in components:
        if component.get("type") == 2:
            found.append(component)
        found.extend(_buttons(component.get("components") or []))
    return found
