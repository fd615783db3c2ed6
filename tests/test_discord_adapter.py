"""The Discord adapter against a fake Discord that the real discord.py client connects to
(REST + gateway websocket on 127.0.0.1), with a recording sink instead of the gateway."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from adapters.discord_bot import EPHEMERAL_IN_SERVERS, INTENT_HINT, DiscordAdapter, doctor, resolve_api_base
from core.commands import COMMAND_SPECS
from core.messages import InboundMessage, OutboundMessage, SentMessage
from core.settings import ConfigError, DiscordConfig
from tests.fakes.discord_api import FakeDiscord


class World:
    """A fake Discord with one guild (#general, #free, #other, a thread under #general),
    a second guild, two people and another bot."""

    def __init__(self, fake: FakeDiscord) -> None:
        self.fake = fake
        self.guild = fake.add_guild("Hermes Lab")
        self.general = fake.channel_named(self.guild, "general")
        self.free = fake.add_channel(self.guild, "free")
        self.other = fake.add_channel(self.guild, "other")
        self.thread = fake.add_thread(self.general, "a topic")
        self.free_thread = fake.add_thread(self.free, "free topic")
        self.guild2 = fake.add_guild("Elsewhere")
        self.general2 = fake.channel_named(self.guild2, "general")
        self.alice = fake.add_user("alice")
        self.bob = fake.add_user("bob")
        self.robot = fake.add_user("otherbot", bot=True)


class Harness:
    def __init__(self, fake: FakeDiscord, world: World) -> None:
        self.fake = fake
        self.world = world
        self.got: list[InboundMessage] = []
        self.adapters: list[DiscordAdapter] = []

    async def sink(self, msg: InboundMessage) -> None:
        self.got.append(msg)

    def config(self, **kw: Any) -> DiscordConfig:
        base: dict[str, Any] = {
            "enabled": True,
            "api_base": self.fake.api_base,
            "gateway_url": self.fake.gateway_url,
            "free_response_channels": [self.world.free],
        }
        base.update(kw)
        return DiscordConfig(**base)

    async def start(self, token: str | None = None, **kw: Any) -> DiscordAdapter:
        adapter = DiscordAdapter(
            self.config(**kw), token or self.fake.token, ready_timeout=10, guild_ready_timeout=0.05
        )
        self.adapters.append(adapter)
        await adapter.start(self.sink)
        return adapter

    async def wait_for(self, n: int, timeout: float = 5.0) -> list[InboundMessage]:
        await self.fake.wait_until(lambda: len(self.got) >= n, timeout)
        return self.got

    async def settle(self) -> None:
        """Push a DM sentinel and wait for it: everything pushed before it was handled
        (the adapter hands messages over in gateway order)."""
        n = len(self.got)
        sentinel = self.fake.push_dm(self.world.bob, "sentinel")
        await self.fake.wait_until(lambda: any(m.message_id == sentinel["id"] for m in self.got[n:]), 5)
        self.got[:] = [m for m in self.got if m.message_id != sentinel["id"]]


@pytest.fixture
async def fake():
    async with FakeDiscord() as f:
        yield f


@pytest.fixture
async def h(fake):
    harness = Harness(fake, World(fake))
    yield harness
    for adapter in harness.adapters:
        await adapter.stop()


# ---------------------------------------------------------------------- unit bits
def test_api_base_forms():
    assert resolve_api_base(None) == "https://discord.com/api/v10"
    assert resolve_api_base("http://127.0.0.1:9000") == "http://127.0.0.1:9000/api/v10"
    assert resolve_api_base("http://proxy/api/") == "http://proxy/api/v10"
    assert resolve_api_base("http://proxy/api/v9") == "http://proxy/api/v9"


def test_from_config_names_the_missing_variable(monkeypatch):
    monkeypatch.delenv("HERMES_TEST_DISCORD_TOKEN", raising=False)
    with pytest.raises(ConfigError, match="HERMES_TEST_DISCORD_TOKEN"):
        DiscordAdapter.from_config(DiscordConfig(enabled=True, token_env="HERMES_TEST_DISCORD_TOKEN"))
    monkeypatch.setenv("HERMES_TEST_DISCORD_TOKEN", "abc")
    adapter = DiscordAdapter.from_config(DiscordConfig(enabled=True, token_env="HERMES_TEST_DISCORD_TOKEN"))
    assert adapter.platform == "discord" and adapter.max_message_length == 2000 and adapter.can_edit
    assert adapter.measure("héllo") == 5 and adapter.status == "stopped"


# ---------------------------------------------------------------------- connect + normalise
async def test_voice_warnings_stay_out_of_the_log_the_gateway_never_uses_voice(h, caplog, monkeypatch):
    import discord

    # discord.py warns once a process, at its first client; make this client the first
    monkeypatch.setattr(discord.VoiceClient, "warn_nacl", True)
    monkeypatch.setattr(discord.VoiceClient, "warn_dave", True)
    with caplog.at_level(logging.WARNING):
        adapter = await h.start()
    assert adapter.status == "connected"
    assert not discord.VoiceClient.warn_nacl, "the client did not get to its voice check"
    assert not [r for r in caplog.records if "voice" in r.getMessage()]


async def test_connects_identifies_with_message_content_intent(h):
    adapter = await h.start()
    assert adapter.status == "connected"
    assert adapter.bot_user_id == h.fake.bot_id
    identify = [op for op in h.fake.gateway_ops("recv") if op["op"] == 2]
    assert len(identify) == 1 and identify[0]["d"]["token"] == "<ok>"
    intents = identify[0]["d"]["intents"]
    assert intents & (1 << 15), "MESSAGE_CONTENT intent requested"
    assert intents & (1 << 0) and intents & (1 << 9) and intents & (1 << 12)  # guilds, guild/dm messages
    assert not intents & (1 << 1) and not intents & (1 << 8)  # no members / presences
    # heartbeats were acknowledged
    assert any(op["op"] == 1 for op in h.fake.gateway_ops("recv"))
    assert any(op["op"] == 11 for op in h.fake.gateway_ops("send"))


async def test_dm_is_normalised(h):
    await h.start()
    sent = h.fake.push_dm(h.world.alice, "hello there")
    (msg,) = await h.wait_for(1)
    assert msg.platform == "discord" and msg.chat_type == "dm"
    assert msg.chat_id == h.fake.dm_channels[h.world.alice] and msg.thread_id is None
    assert msg.user_id == h.world.alice and msg.user_name == "Alice"
    assert msg.message_id == sent["id"] and msg.message_id.isdigit()
    assert msg.text == "hello there" and msg.mentions_bot


async def test_guild_mention_gating(h):
    adapter = await h.start()
    w, fake = h.world, h.fake
    fake.push_guild_message(w.general, w.alice, "chatting among humans")
    m1 = fake.push_guild_message(w.general, w.alice, "what is 2+2?", mention_bot=True)
    m2 = fake.push_guild_message(w.general, w.bob, "and you?", mention_bot=True, nick_mention=True)
    m3 = fake.push_guild_message(w.free, w.bob, "no mention needed here")
    m4 = fake.push_guild_message(w.general, w.alice, "/new")
    m5 = fake.push_guild_message(w.general, w.alice, f"ask <@{w.bob}> too, <@{fake.bot_id}> please")
    await h.settle()
    by_id = {m.message_id: m for m in h.got}
    assert set(by_id) == {m1["id"], m2["id"], m3["id"], m4["id"], m5["id"]}
    assert by_id[m1["id"]].text == "what is 2+2?" and by_id[m1["id"]].mentions_bot
    assert by_id[m2["id"]].text == "and you?"
    assert by_id[m3["id"]].text == "no mention needed here" and not by_id[m3["id"]].mentions_bot
    assert by_id[m4["id"]].text == "/new"
    assert by_id[m5["id"]].text == "ask @Bob too, please"
    for m in h.got:
        assert m.chat_type == "group" and m.thread_id is None
    assert by_id[m1["id"]].chat_id == w.general and by_id[m3["id"]].chat_id == w.free
    assert {by_id[m1["id"]].user_id, by_id[m2["id"]].user_id} == {w.alice, w.bob}

    # a reply to one of the bot's messages needs no mention
    sent = await adapter.send(OutboundMessage(chat_id=w.general, text="I am the bot"))
    h.got.clear()
    r = fake.push_guild_message(w.general, w.bob, "replying to the bot", reply_to=sent.message_id)
    not_bot = fake.push_guild_message(w.general, w.bob, "replying to alice", reply_to=m1["id"])
    await h.settle()
    assert [m.message_id for m in h.got] == [r["id"]]
    assert h.got[0].reply_to_message_id == sent.message_id and h.got[0].mentions_bot
    assert not_bot["id"] not in {m.message_id for m in h.got}


async def test_mention_not_required_when_configured_off(h):
    await h.start(require_mention_in_guilds=False)
    m = h.fake.push_guild_message(h.world.other, h.world.alice, "anyone?")
    await h.settle()
    assert [x.message_id for x in h.got] == [m["id"]]


async def test_thread_lane_ids(h):
    await h.start()
    w, fake = h.world, h.fake
    fake.push_thread_message(w.thread, w.alice, "unaddressed in a thread")
    t1 = fake.push_thread_message(w.thread, w.alice, "in the thread", mention_bot=True)
    t2 = fake.push_thread_message(w.free_thread, w.bob, "thread under a free channel")
    late = fake.add_thread(w.general, "created later")  # THREAD_CREATE while connected
    t3 = fake.push_thread_message(late, w.bob, "new thread", mention_bot=True)
    await h.settle()
    by_id = {m.message_id: m for m in h.got}
    assert set(by_id) == {t1["id"], t2["id"], t3["id"]}
    assert (by_id[t1["id"]].chat_type, by_id[t1["id"]].chat_id, by_id[t1["id"]].thread_id) == (
        "thread",
        w.general,
        w.thread,
    )
    assert (by_id[t2["id"]].chat_id, by_id[t2["id"]].thread_id) == (w.free, w.free_thread)
    assert (by_id[t3["id"]].chat_id, by_id[t3["id"]].thread_id) == (w.general, late)


async def test_uncached_thread_is_resolved_via_rest(h):
    await h.start()
    w, fake = h.world, h.fake
    hidden = fake.add_thread(w.general, "private", private=True, announce=False)  # bot never saw THREAD_CREATE
    t = fake.push_thread_message(hidden, w.alice, "psst", mention_bot=True)
    await h.settle()
    (msg,) = h.got
    assert msg.message_id == t["id"] and (msg.chat_type, msg.chat_id, msg.thread_id) == ("thread", w.general, hidden)
    assert fake.rest_calls("GET", rf"^/channels/{hidden}$")


async def test_bots_and_own_messages_are_ignored(h):
    adapter = await h.start()
    w, fake = h.world, h.fake
    fake.push_guild_message(w.general, w.robot, "beep", mention_bot=True)
    fake.push_dm(w.robot, "beep in dm")
    await adapter.send(OutboundMessage(chat_id=w.free, text="my own message, echoed by the gateway"))
    await fake.wait_until(
        lambda: any(
            c["t"] == "MESSAGE_CREATE" and c["d"]["author"]["id"] == fake.bot_id for c in fake.gateway_ops("send")
        )
    )
    await h.settle()
    assert h.got == []


async def test_allowed_guilds(h):
    await h.start(allowed_guilds=[h.world.guild])
    w, fake = h.world, h.fake
    fake.push_guild_message(w.general2, w.alice, "from another server", mention_bot=True)
    ok = fake.push_guild_message(w.general, w.alice, "from the allowed server", mention_bot=True)
    dm = fake.push_dm(w.alice, "DMs are not guild-bound")
    await h.settle()
    assert [m.message_id for m in h.got] == [ok["id"], dm["id"]]
    # a slash command from the other server gets an ephemeral refusal and no InboundMessage
    fake.push_interaction("help", user_id=w.alice, channel_id=w.general2)
    await fake.wait_until(lambda: fake.rest_calls("POST", r"^/interactions/"))
    await h.settle()
    assert [m.message_id for m in h.got] == [ok["id"], dm["id"]]
    body = fake.rest_calls("POST", r"^/interactions/")[0]["json"]
    assert body["type"] == 4 and body["data"]["flags"] & 64


# ---------------------------------------------------------------------- delivery
async def test_send_never_pings_and_references_the_first_chunk(h):
    adapter = await h.start()
    w, fake = h.world, h.fake
    role = fake.add_role(w.guild, "mods")
    m = fake.push_guild_message(w.general, w.alice, "ping everyone", mention_bot=True)
    (inbound,) = await h.wait_for(1)
    text = f"@everyone @here <@{w.bob}> <@!{w.alice}> <@&{role}> hello"
    s1 = await adapter.send(OutboundMessage(chat_id=inbound.chat_id, text=text, reply_to_message_id=inbound.message_id))
    s2 = await adapter.send(OutboundMessage(chat_id=inbound.chat_id, text="second chunk"))
    assert isinstance(s1, SentMessage) and s1.chat_id == w.general and s1.message_id.isdigit()
    first, second = fake.sent_messages(w.general)
    assert first["id"] == s1.message_id and second["id"] == s2.message_id
    assert first["content"] == text
    assert first["allowed_mentions"] == {"parse": []} and second["allowed_mentions"] == {"parse": []}
    assert first["pings"]["any"] is False and first["pings"]["users"] == []
    assert first["message_reference"]["message_id"] == int(m["id"])
    assert first["message_reference"]["fail_if_not_exists"] is False
    assert second["message_reference"] is None


async def test_send_into_a_thread_and_dm(h):
    adapter = await h.start()
    w, fake = h.world, h.fake
    await adapter.send(OutboundMessage(chat_id=w.general, thread_id=w.thread, text="in thread"))
    dm_channel = fake.dm_channel(w.alice)
    await adapter.send(OutboundMessage(chat_id=dm_channel, text="in dm"))
    assert [m["content"] for m in fake.sent_messages(w.thread)] == ["in thread"]
    assert [m["content"] for m in fake.sent_messages(dm_channel)] == ["in dm"]
    assert fake.sent_messages(w.general) == []


async def test_rate_limited_send_creates_exactly_one_message(h):
    adapter = await h.start()
    w, fake = h.world, h.fake
    fake.rate_limit_next(retry_after=0.2)
    sent = await adapter.send(OutboundMessage(chat_id=w.general, text="after the 429"))
    posts = fake.rest_calls("POST", rf"^/channels/{w.general}/messages$")
    assert [p["status"] for p in posts] == [429, 200]
    assert posts[1]["time"] - posts[0]["time"] >= 0.18, "retried after retry_after"
    assert [m["content"] for m in fake.sent_messages(w.general)] == ["after the 429"]
    assert sent is not None and sent.message_id == fake.sent_messages(w.general)[0]["id"]


async def test_lost_response_is_not_a_duplicate(h):
    """Discord created the message but the answer was a 502: discord.py retries with the
    same nonce (enforce_nonce), so Discord returns the first message instead of a second."""
    adapter = await h.start()
    w, fake = h.world, h.fake
    fake.fail_after_create_next(502)
    sent = await adapter.send(OutboundMessage(chat_id=w.general, text="only once"))
    posts = fake.rest_calls("POST", rf"^/channels/{w.general}/messages$")
    assert [p["status"] for p in posts] == [502, 200]
    assert posts[0]["json"]["nonce"] == posts[1]["json"]["nonce"] and posts[0]["json"]["enforce_nonce"] is True
    assert [m["content"] for m in fake.sent_messages(w.general)] == ["only once"]
    assert sent.message_id == fake.sent_messages(w.general)[0]["id"]


async def test_forbidden_channel_returns_none_and_logs_once(h, caplog):
    adapter = await h.start()
    w, fake = h.world, h.fake
    fake.forbid_channel(w.other)
    caplog.set_level(logging.WARNING, logger="adapters.discord_bot")
    assert await adapter.send(OutboundMessage(chat_id=w.other, text="hello?")) is None
    assert await adapter.send(OutboundMessage(chat_id=w.other, text="hello again?")) is None
    await adapter.typing(w.other, None)  # never raises
    warnings = [r for r in caplog.records if r.name == "adapters.discord_bot" and w.other in r.getMessage()]
    assert len(warnings) == 1
    assert await adapter.send(OutboundMessage(chat_id="999999999999", text="gone")) is None  # unknown channel


async def test_edit_and_typing(h):
    adapter = await h.start()
    w, fake = h.world, h.fake
    sent = await adapter.send(OutboundMessage(chat_id=w.general, thread_id=w.thread, text="working…"))
    assert await adapter.edit(sent, "done @everyone")
    patch = fake.rest_calls("PATCH", rf"^/channels/{w.thread}/messages/{sent.message_id}$")
    assert patch and patch[0]["json"]["allowed_mentions"] == {"parse": []}
    assert fake.messages[sent.message_id]["content"] == "done @everyone"
    assert not await adapter.edit(SentMessage(chat_id=w.general, message_id="123"), "nope")
    await adapter.typing(w.general, w.thread)
    await adapter.typing(w.general, None)
    assert [c["path"] for c in fake.typing_calls()] == [f"/channels/{w.thread}/typing", f"/channels/{w.general}/typing"]


# ---------------------------------------------------------------------- slash commands
async def test_slash_commands_are_registered_once(h):
    adapter = await h.start()
    fake = h.fake
    await fake.wait_until(lambda: adapter.commands_synced)
    (put,) = fake.rest_calls("PUT", rf"^/applications/{fake.app_id}/commands$")
    by_name = {c["name"]: c for c in put["json"]}
    assert set(by_name) == {s.name for s in COMMAND_SPECS}
    for spec in COMMAND_SPECS:
        opts = by_name[spec.name].get("options", [])
        if spec.takes_args:
            assert [(o["name"], o["type"], o.get("required", False)) for o in opts] == [("args", 3, False)]
        else:
            assert opts == []
        assert by_name[spec.name]["description"] == spec.description
    await adapter.stop()
    # a restart with the same commands does not overwrite them again
    again = await h.start()
    await fake.wait_until(lambda: again.commands_synced)
    assert len(fake.rest_calls("PUT", r"/commands$")) == 1


async def test_slash_command_roundtrip_via_followups(h):
    adapter = await h.start()
    w, fake = h.world, h.fake
    await fake.wait_until(lambda: adapter.commands_synced)
    inter = fake.push_interaction("compress", "focus the budget", user_id=w.alice, channel_id=w.general)
    (msg,) = await h.wait_for(1)
    assert msg.message_id == f"interaction-{inter['id']}"
    assert msg.text == "/compress focus the budget"
    assert (msg.chat_type, msg.chat_id, msg.user_id) == ("group", w.general, w.alice)
    (callback,) = fake.rest_calls("POST", r"^/interactions/")
    assert callback["json"]["type"] == 5 and not (callback["json"].get("data") or {}).get("flags")  # public defer

    s1 = await adapter.send(
        OutboundMessage(chat_id=msg.chat_id, text="part one @everyone", reply_to_message_id=msg.message_id)
    )
    s2 = await adapter.send(OutboundMessage(chat_id=msg.chat_id, text="part two"))
    sent = fake.sent_messages(w.general)
    assert [m["content"] for m in sent] == ["part one @everyone", "part two"]
    assert [m["via"] for m in sent] == ["interaction", "followup"]
    assert all(m["interaction_id"] == inter["id"] for m in sent)
    assert all(m["allowed_mentions"] == {"parse": []} and not m["pings"]["any"] for m in sent)
    assert not fake.rest_calls("POST", r"^/channels/\d+/messages$")
    assert [s1.message_id, s2.message_id] == [m["id"] for m in sent]
    # edits of an interaction message go through the webhook
    assert await adapter.edit(s1, "part one, edited")
    assert fake.rest_calls("PATCH", rf"^/webhooks/{fake.app_id}/[^/]+/messages/{s1.message_id}$")
    # a later ordinary reply in the same channel is a normal channel message again
    m = fake.push_guild_message(w.general, w.bob, "hey", mention_bot=True)
    await adapter.send(OutboundMessage(chat_id=w.general, text="hi bob", reply_to_message_id=m["id"]))
    assert fake.sent_messages(w.general)[-1]["via"] == "channel"


async def test_admin_commands_are_registered_for_administrators_only(h):
    adapter = await h.start()
    fake = h.fake
    await fake.wait_until(lambda: adapter.commands_synced)
    (put,) = fake.rest_calls("PUT", rf"^/applications/{fake.app_id}/commands$")
    perms = {c["name"]: c.get("default_member_permissions") for c in put["json"]}
    admin = {s.name for s in COMMAND_SPECS if s.admin_only}
    assert admin == {"pair"}
    assert all(int(perms[name]) == 1 << 3 for name in admin)  # ADMINISTRATOR: only admins see it
    assert all(perms[name] is None for name in perms if name not in admin)  # everyone sees the rest
    await adapter.stop()
    # commands registered before (without the permission) are overwritten at the next start
    for cmd in fake.commands:
        cmd["default_member_permissions"] = None
    again = await h.start()
    await fake.wait_until(lambda: again.commands_synced)
    assert len(fake.rest_calls("PUT", r"/commands$")) == 2
    assert int({c["name"]: c["default_member_permissions"] for c in fake.commands}["pair"]) == 8


async def test_personal_commands_are_answered_ephemerally_in_servers_only(h):
    adapter = await h.start()
    w, fake = h.world, h.fake
    await fake.wait_until(lambda: adapter.commands_synced)
    assert {"whoami", "status", "memory", "usage", "tools", "why"} == EPHEMERAL_IN_SERVERS
    for n, name in enumerate(sorted(EPHEMERAL_IN_SERVERS)):
        inter = fake.push_interaction(name, user_id=w.alice, channel_id=w.general)
        msg = (await h.wait_for(n + 1))[-1]
        callback = fake.rest_calls("POST", rf"^/interactions/{inter['id']}/")[0]["json"]
        assert callback["type"] == 5 and callback["data"]["flags"] == 64  # "thinking…" only for alice
        await adapter.send(OutboundMessage(chat_id=msg.chat_id, text=f"{name} one", reply_to_message_id=msg.message_id))
        await adapter.send(OutboundMessage(chat_id=msg.chat_id, text=f"{name} two"))  # the next chunk
    sent = fake.sent_messages(w.general)
    assert len(sent) == 2 * len(EPHEMERAL_IN_SERVERS) and all(m["interaction_id"] for m in sent)
    assert all(int(m["body"].get("flags") or 0) & 64 for m in sent), [m["body"] for m in sent]
    # other commands in a server, and these in a DM, are ordinary (visible) answers
    public = fake.push_interaction("help", user_id=w.alice, channel_id=w.general)
    dm_channel = fake.dm_channel(w.bob)
    in_dm = fake.push_interaction("whoami", user_id=w.bob, channel_id=dm_channel)
    await h.wait_for(len(EPHEMERAL_IN_SERVERS) + 2)
    for inter in (public, in_dm):
        callback = fake.rest_calls("POST", rf"^/interactions/{inter['id']}/")[0]["json"]
        assert not (callback.get("data") or {}).get("flags")
    await adapter.send(
        OutboundMessage(chat_id=dm_channel, text="you are bob", reply_to_message_id=f"interaction-{in_dm['id']}")
    )
    assert not int(fake.sent_messages(dm_channel)[-1]["body"].get("flags") or 0) & 64


async def test_slash_command_in_a_dm_and_without_args(h):
    await h.start()
    w, fake = h.world, h.fake
    dm_channel = fake.dm_channel(w.bob)
    inter = fake.push_interaction("memory", user_id=w.bob, channel_id=dm_channel)
    (msg,) = await h.wait_for(1)
    assert (msg.text, msg.chat_type, msg.chat_id, msg.user_id) == ("/memory", "dm", dm_channel, w.bob)
    assert msg.message_id == f"interaction-{inter['id']}"


# ---------------------------------------------------------------------- reconnects
async def test_resume_replays_missed_and_duplicate_events_with_the_same_ids(h):
    adapter = await h.start()
    w, fake = h.world, h.fake
    first = fake.push_dm(w.alice, "before the drop")
    await h.wait_for(1)
    await fake.drop_connection(resume=True, replay_last=1)  # Discord re-sends the last event too
    missed = fake.push_dm(w.alice, "while disconnected")
    await fake.wait_until(lambda: fake.resume_count == 1 and fake.connected)
    await h.wait_for(3)
    assert [m.message_id for m in h.got] == [first["id"], first["id"], missed["id"]]  # dedupe is the gateway's
    assert fake.identify_count == 1 and adapter.status == "connected"
    resume = next(op for op in fake.gateway_ops("recv") if op["op"] == 6)["d"]
    assert resume["token"] == "<ok>" and resume["seq"] >= 1


async def test_invalid_session_reidentifies(h):
    adapter = await h.start()
    w, fake = h.world, h.fake
    await fake.drop_connection(resume=False)
    await fake.wait_until(lambda: fake.identify_count == 2 and fake.connected, 10)
    await fake.wait_until(lambda: adapter.status == "connected")
    m = fake.push_dm(w.alice, "after a new session")
    await h.wait_for(1)
    assert h.got[0].message_id == m["id"]


# ---------------------------------------------------------------------- failures
async def test_refused_intent_marks_failed_with_the_portal_hint(h, caplog):
    caplog.set_level(logging.ERROR, logger="adapters.discord_bot")
    h.fake.refuse_intents()
    adapter = await asyncio.wait_for(h.start(), timeout=10)  # returns, does not raise
    assert adapter.status.startswith("failed: ")
    assert "MESSAGE CONTENT INTENT" in adapter.status and "Privileged Gateway Intents" in adapter.status
    assert any(INTENT_HINT in r.getMessage() for r in caplog.records)
    await adapter.stop()  # clean even after a failure
    assert adapter.status.startswith("failed")


async def test_bad_token_marks_failed(h):
    adapter = await h.start(token="not-the-token")
    assert adapter.status.startswith("failed: ") and "rejected" in adapter.status
    assert "not-the-token" not in adapter.status


async def test_unreachable_api_is_retried_in_the_background(fake, caplog):
    """Discord down at boot: start() returns after ready_timeout, keeps retrying, and
    connects once the API answers."""
    caplog.set_level(logging.WARNING, logger="adapters.discord_bot")
    port = fake.port
    await fake.stop()
    cfg = DiscordConfig(enabled=True, api_base=f"http://127.0.0.1:{port}", gateway_url=f"ws://127.0.0.1:{port}/gateway")
    adapter = DiscordAdapter(cfg, fake.token, ready_timeout=1, guild_ready_timeout=0.05)

    async def sink(msg: InboundMessage) -> None: ...

    try:
        await adapter.start(sink)
        assert adapter.status == "connecting"
        assert adapter.last_error and "cannot reach the Discord API" in adapter.last_error
        assert any("retrying in" in r.getMessage() for r in caplog.records)
        await fake.start(port=port)  # Discord is back
        await fake.wait_until(lambda: adapter.status == "connected", 10)
    finally:
        await adapter.stop()


async def test_gateway_url_discovered_from_the_api_when_not_set(h):
    adapter = await h.start(gateway_url=None)
    assert adapter.status == "connected"
    assert h.fake.rest_calls("GET", r"^/gateway/bot$")


async def test_token_never_logged(h, caplog):
    caplog.set_level(logging.DEBUG)
    adapter = await h.start()
    w, fake = h.world, h.fake
    fake.push_dm(w.alice, "hello")
    (msg,) = await h.wait_for(1)
    await adapter.send(OutboundMessage(chat_id=msg.chat_id, text="hi", reply_to_message_id=msg.message_id))
    fake.push_interaction("help", user_id=w.alice, channel_id=w.general)
    (_, imsg) = await h.wait_for(2)
    await adapter.send(OutboundMessage(chat_id=imsg.chat_id, text="help text", reply_to_message_id=imsg.message_id))
    await adapter.stop()
    bad = DiscordAdapter(h.config(), "wrong-" + fake.token, ready_timeout=5)
    h.adapters.append(bad)
    await bad.start(h.sink)  # logs a failure
    assert bad.status.startswith("failed")
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "discord" in text  # discord.py's debug logging was captured
    assert f"/webhooks/{fake.app_id}/<redacted>" in text  # followup URLs were logged, tokens cut out
    interaction_token = next(iter(fake.interactions))
    assert fake.token not in text
    assert interaction_token not in text


# ---------------------------------------------------------------------- doctor
async def test_doctor_reports_token_and_intent(fake):
    cfg = DiscordConfig(enabled=True, api_base=fake.api_base)
    ok, report = await doctor(cfg, token=fake.token)
    assert ok, report
    assert "token OK" in report and "MESSAGE CONTENT INTENT is on" in report
    assert f"client_id={fake.app_id}" in report and "scope=bot+applications.commands" in report
    assert fake.token not in report

    ok, report = await doctor(cfg, token="wrong-token")
    assert not ok and "token rejected" in report and "wrong-token" not in report

    fake.app_flags = 0
    ok, report = await doctor(cfg, token=fake.token)
    assert not ok and "Privileged Gateway Intents" in report and "MESSAGE CONTENT INTENT" in report


async def test_doctor_without_a_token(monkeypatch):
    monkeypatch.delenv("HERMES_TEST_DISCORD_TOKEN", raising=False)
    ok, report = await doctor(DiscordConfig(enabled=True, token_env="HERMES_TEST_DISCORD_TOKEN"))
    assert not ok and "HERMES_TEST_DISCORD_TOKEN" in report
