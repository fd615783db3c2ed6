"""End to end: fake Discord (REST + gateway websocket) <- real discord.py client in the
DiscordAdapter <- the real GatewayApp -> fake LLM. Every Discord call is recorded."""

from __future__ import annotations

import json
from typing import Any

import pytest

from adapters.discord_bot import DiscordAdapter
from gateway.build import build_gateway
from gateway.runtime import GatewayApp
from tenancy.keys import tenant_dir
from tests.conftest import RecordingAdapter, dm, say
from tests.fakes.discord_api import FakeDiscord
from tests.fakes.llm import last_user_text, memory_saving_responder, reply
from tests.statedb import open_state_db

SECRET = "locker code 4711-QX"


@pytest.fixture
async def fake():
    async with FakeDiscord() as f:
        f.guild = f.add_guild("Hermes Lab")
        f.general = f.channel_named(f.guild, "general")
        f.thread = f.add_thread(f.general, "planning")
        f.alice = f.add_user("alice")
        f.bob = f.add_user("bob")
        yield f


class Rig:
    def __init__(self, fake: FakeDiscord, app: GatewayApp, adapter: DiscordAdapter, cfg: Any) -> None:
        self.fake, self.app, self.adapter, self.cfg = fake, app, adapter, cfg

    async def replies(self, channel_id: str, n: int, timeout: float = 20) -> list[dict[str, Any]]:
        """Wait until the bot has posted `n` messages in `channel_id` and all turns are done."""
        await self.fake.wait_until(lambda: len(self.fake.sent_messages(channel_id)) >= n, timeout)
        assert await self.app.drain(timeout)
        return self.fake.sent_messages(channel_id)


@pytest.fixture
async def rig(fake, config_for):
    rigs: list[Rig] = []

    async def build(*others: Any, **discord_cfg: Any) -> Rig:
        cfg = config_for(
            platforms={
                "discord": {"enabled": True, "api_base": fake.api_base, "gateway_url": fake.gateway_url, **discord_cfg}
            }
        )
        adapter = DiscordAdapter(cfg.platforms.discord, fake.token, ready_timeout=10, guild_ready_timeout=0.05)
        app = build_gateway(cfg, [adapter, *others])
        await app.start()
        r = Rig(fake, app, adapter, cfg)
        rigs.append(r)
        return r

    yield build
    for r in rigs:
        await r.app.stop(drain_timeout=5)


async def test_dm(rig, fake, fake_llm):
    r = await rig()
    assert r.adapter.status == "connected"
    m = fake.push_dm(fake.alice, "hello hermes")
    dm_channel = fake.dm_channels[fake.alice]
    (sent,) = await r.replies(dm_channel, 1)
    assert sent["content"] == "ok: hello hermes"
    assert sent["message_reference"]["message_id"] == int(m["id"])
    assert sent["allowed_mentions"] == {"parse": []}
    assert fake.typing_calls(dm_channel), "typing shown while the turn ran"
    assert last_user_text(fake_llm.requests[-1]) == "hello hermes"


async def test_two_members_in_one_channel_have_separate_lanes_and_memories(rig, fake, fake_llm):
    fake_llm.responder = memory_saving_responder
    r = await rig()
    a1 = fake.push_guild_message(fake.general, fake.alice, f"remember that my {SECRET}", mention_bot=True)
    (first,) = await r.replies(fake.general, 1)
    assert first["content"].startswith("done:") and first["message_reference"]["message_id"] == int(a1["id"])

    n = len(fake_llm.requests)
    b1 = fake.push_guild_message(fake.general, fake.bob, "what is alice's locker code?", mention_bot=True)
    await r.replies(fake.general, 2)
    b2 = fake.push_guild_message(fake.general, fake.bob, "and what did I say before?", mention_bot=True)
    replies = await r.replies(fake.general, 3)
    bob_requests = fake_llm.requests[n:]
    assert bob_requests
    for request in bob_requests:
        dumped = json.dumps(request)
        assert "4711" not in dumped and "locker code 4711" not in dumped
    # bob's lane has his own history (his first question), not alice's
    assert "what is alice's locker code?" in json.dumps(bob_requests[-1])
    assert [m["message_reference"]["message_id"] for m in replies[1:]] == [int(b1["id"]), int(b2["id"])]

    # alice's lane remembers her turn; memories live in separate profiles
    n = len(fake_llm.requests)
    fake.push_guild_message(fake.general, fake.alice, "what did I tell you?", mention_bot=True)
    await r.replies(fake.general, 4)
    assert any(SECRET in json.dumps(req) for req in fake_llm.requests[n:])
    data_dir = r.cfg.data_dir
    alice_mem = tenant_dir(data_dir, f"discord-{fake.alice}") / "memories" / "MEMORY.md"
    bob_mem = tenant_dir(data_dir, f"discord-{fake.bob}") / "memories" / "MEMORY.md"
    assert SECRET in alice_mem.read_text()
    assert not bob_mem.exists() or SECRET not in bob_mem.read_text()


async def test_mention_gating(rig, fake, fake_llm):
    r = await rig()
    fake.push_guild_message(fake.general, fake.alice, "talking to bob, not the bot")
    m = fake.push_guild_message(fake.general, fake.alice, "now you", mention_bot=True)
    (sent,) = await r.replies(fake.general, 1)
    assert sent["content"] == "ok: now you" and sent["message_reference"]["message_id"] == int(m["id"])
    # a reply to the bot's message needs no mention
    fake.push_guild_message(fake.general, fake.bob, "replying to you", reply_to=sent["id"])
    replies = await r.replies(fake.general, 2)
    assert replies[1]["content"] == 'ok: [In reply to you: "ok: now you"]\nreplying to you'  # the quote goes along
    texts = [last_user_text(req) for req in fake_llm.requests]
    assert "talking to bob, not the bot" not in json.dumps(fake_llm.requests)
    assert texts == ["now you", '[In reply to you: "ok: now you"]\nreplying to you']


async def test_thread_is_its_own_lane(rig, fake, fake_llm):
    r = await rig()
    fake.push_guild_message(fake.general, fake.alice, "channel message", mention_bot=True)
    await r.replies(fake.general, 1)
    t = fake.push_thread_message(fake.thread, fake.alice, "thread message", mention_bot=True)
    (sent,) = await r.replies(fake.thread, 1)
    assert sent["content"] in ("ok: thread message", "ok: [Alice]: thread message")  # shared lanes name the speaker
    assert sent["message_reference"]["message_id"] == int(t["id"])
    assert len(fake.sent_messages(fake.general)) == 1, "the thread reply went to the thread"
    thread_request = json.dumps(fake_llm.requests[-1])
    assert "channel message" not in thread_request, "thread lane does not see the channel lane"
    # the thread is a shared lane in the chat's own profile (parent channel = chat id)
    assert tenant_dir(r.cfg.data_dir, f"discord-chat-{fake.general}").exists()
    assert fake.typing_calls(fake.thread)


async def test_long_reply_with_code_fences_is_split_in_order(rig, fake, fake_llm):
    code = "\n".join(f"    print('line {i:03d} of the program')" for i in range(120))
    prose = " ".join(["This is a long explanation."] * 30)
    answer = f"{prose}\n\n```python\n{code}\n```\n\n{prose}\n\n```\n{code[:900]}\n```\nThe end."
    assert len(answer) >= 5000
    fake_llm.script(reply(answer))
    r = await rig()
    m = fake.push_dm(fake.alice, "write me a long program")
    dm_channel = fake.dm_channels[fake.alice]
    await fake.wait_until(lambda: any("The end." in s["content"] for s in fake.sent_messages(dm_channel)), 20)
    chunks = await r.replies(dm_channel, 1)
    assert len(chunks) >= 3
    for c in chunks:
        assert len(c["content"]) <= 2000
        assert c["content"].count("```") % 2 == 0, "every chunk's fences are balanced"
        assert c["allowed_mentions"] == {"parse": []}
    assert chunks[0]["message_reference"]["message_id"] == int(m["id"])
    assert all(c["message_reference"] is None for c in chunks[1:])
    joined = "\n".join(c["content"] for c in chunks)
    lines = [ln for ln in joined.splitlines() if "line " in ln]
    assert lines == [ln for ln in answer.splitlines() if "line " in ln], "in order, nothing lost"
    assert chunks[-1]["content"].endswith("The end.")
    ids = [int(c["id"]) for c in chunks]
    assert ids == sorted(ids)


async def test_model_reply_with_everyone_pings_nobody(rig, fake, fake_llm):
    role = fake.add_role(fake.guild, "moderators")
    fake_llm.script(reply(f"@everyone @here look, <@{fake.bob}> and <@&{role}>!"))
    r = await rig()
    fake.push_guild_message(fake.general, fake.alice, "announce something", mention_bot=True)
    (sent,) = await r.replies(fake.general, 1)
    assert "@everyone" in sent["content"]
    assert sent["allowed_mentions"] == {"parse": []}
    assert sent["pings"] == {"everyone": False, "users": [], "roles": [], "any": False}
    assert fake.messages[sent["id"]]["mention_everyone"] is False


async def test_resume_replaying_a_message_answers_it_once(rig, fake, fake_llm):
    r = await rig()
    m = fake.push_dm(fake.alice, "question one")
    dm_channel = fake.dm_channels[fake.alice]
    await r.replies(dm_channel, 1)
    # the connection drops; on RESUME Discord replays from that MESSAGE_CREATE on
    await fake.drop_connection(resume=True, replay_from_message=m["id"])
    await fake.wait_until(lambda: fake.resume_count == 1 and fake.connected)
    # a new session after INVALID_SESSION, and the same event delivered yet again
    await fake.drop_connection(resume=False)
    await fake.wait_until(lambda: fake.identify_count == 2 and fake.connected, 15)
    await fake.wait_until(lambda: r.adapter.status == "connected")
    fake.replay_message(m)
    fake.push_dm(fake.alice, "question two")
    replies = await r.replies(dm_channel, 2)
    assert [s["content"] for s in replies] == ["ok: question one", "ok: question two"]
    assert [last_user_text(req) for req in fake_llm.requests] == ["question one", "question two"]
    # the replayed MESSAGE_CREATE really reached the client again
    replayed = [c for c in fake.gateway_ops("send") if c["t"] == "MESSAGE_CREATE" and c["d"]["id"] == m["id"]]
    assert len(replayed) == 3


async def test_slash_command_answered_through_the_interaction(rig, fake, fake_llm):
    r = await rig()
    await fake.wait_until(lambda: r.adapter.commands_synced)
    inter = fake.push_interaction("whoami", user_id=fake.bob, channel_id=fake.general)
    (sent,) = await r.replies(fake.general, 1)
    assert sent["via"] == "interaction" and sent["interaction_id"] == inter["id"]
    assert fake.bob in sent["content"]
    assert not fake_llm.requests, "a chat command, not a model turn"
    # the typed form works too, without a mention
    fake.push_guild_message(fake.general, fake.alice, "/whoami")
    replies = await r.replies(fake.general, 2)
    assert replies[1]["via"] == "channel" and fake.alice in replies[1]["content"]


async def test_refused_intent_keeps_other_platforms_running(rig, fake, fake_llm):
    fake.refuse_intents()
    other = RecordingAdapter()
    r = await rig(other)
    assert r.adapter.status.startswith("failed: ") and "MESSAGE CONTENT INTENT" in r.adapter.status
    out = await say(r.app, other, dm("carol", "are you there?"))
    assert out == ["ok: are you there?"]


async def test_slash_command_from_a_stranger_gets_an_answer_not_silence(rig, fake, fake_llm, config_for):
    r = await rig()
    await r.app.stop(drain_timeout=5)  # rebuild with an allowlist that leaves bob out
    cfg = config_for(
        access={"allowed_users": [f"discord:{fake.alice}"]},
        platforms={"discord": {"enabled": True, "api_base": fake.api_base, "gateway_url": fake.gateway_url}},
    )
    adapter = DiscordAdapter(cfg.platforms.discord, fake.token, ready_timeout=10, guild_ready_timeout=0.05)
    app = build_gateway(cfg, [adapter])
    await app.start()
    try:
        await fake.wait_until(lambda: adapter.commands_synced)
        before = len(fake.sent_messages(fake.general))
        inter = fake.push_interaction("help", user_id=fake.bob, channel_id=fake.general)
        await fake.wait_until(lambda: len(fake.sent_messages(fake.general)) > before, 20)
        sent = fake.sent_messages(fake.general)[-1]
        assert sent["interaction_id"] == inter["id"] and "not on this bot's list" in sent["content"]
        # an ordinary message from the stranger stays unanswered
        m = fake.push_guild_message(fake.general, fake.bob, "hello?", mention_bot=True)
        await fake.wait_until(lambda: _recorded(app, fake.general, m["id"]), 10)
        assert await app.drain(10)
        assert len(fake.sent_messages(fake.general)) == before + 1
        assert not fake_llm.requests
    finally:
        await app.stop(drain_timeout=5)


def _recorded(app: GatewayApp, channel_id: str, message_id: str) -> bool:
    """Whether the gateway's inbox has taken in a Discord message (sync peek for wait_until)."""
    import sqlite3

    con = sqlite3.connect(app.inbox.path)
    try:
        row = con.execute(
            "SELECT status FROM inbound WHERE platform='discord' AND chat_id=? AND message_id=?",
            (str(channel_id), str(message_id)),
        ).fetchone()
    finally:
        con.close()
    return row is not None and row[0] == "done"


async def test_private_thread_is_its_own_tenant(rig, fake, fake_llm):
    from tenancy.keys import chat_tenant_id
    from tests.fakes.llm import tool_call

    private = fake.add_thread(fake.general, "hush", private=True)
    r = await rig()
    fake_llm.script(tool_call("memory", {"action": "add", "target": "memory", "content": SECRET}))
    fake.push_thread_message(private, fake.alice, f"remember that {SECRET}", mention_bot=True)
    await r.replies(private, 1)
    data_dir = r.cfg.data_dir
    own = tenant_dir(data_dir, chat_tenant_id("discord", private)) / "memories" / "MEMORY.md"
    assert SECRET in own.read_text(), "the private thread keeps its own memory"
    parent = tenant_dir(data_dir, chat_tenant_id("discord", fake.general))
    assert not parent.exists() or not any(
        SECRET in p.read_text(errors="ignore") for p in parent.rglob("*") if p.is_file()
    )
    # a public thread of the same channel (the parent channel's shared tenant) never sees it
    n = len(fake_llm.requests)
    fake.push_thread_message(fake.thread, fake.bob, "what do you remember?", mention_bot=True)
    await r.replies(fake.thread, 1)
    assert fake_llm.requests[n:] and SECRET not in json.dumps(fake_llm.requests[n:])
    assert (tenant_dir(data_dir, chat_tenant_id("discord", fake.general)) / "tenant.json").exists()


async def test_group_dm_is_a_group_never_a_dm(rig, fake, fake_llm):
    r = await rig()
    gdm = fake.add_group_dm(fake.alice, fake.bob)
    # a message in a group DM reaches the gateway as a group message (per-member group lane)
    fake.push_group_dm_message(gdm, fake.alice, f"<@{fake.bot_id}> /link")
    (sent,) = await r.replies(gdm, 1)
    assert "private chat" in sent["content"] and "code" not in sent["content"].lower()
    routes_dir = tenant_dir(r.cfg.data_dir, f"discord-{fake.alice}")
    conn = open_state_db(routes_dir / "state.db")
    keys = [k for (k,) in conn.execute("SELECT session_key FROM sessions")]
    conn.close()
    assert keys == [] or all(":group:" in k for k in keys)
    # a slash command used there (a user-installed app's private-channel context) is a group too
    fake.push_interaction("link", user_id=fake.bob, channel_id=gdm)
    sent = await r.replies(gdm, 2)
    assert "private chat" in sent[-1]["content"]
    # the bot's own DM is still a DM
    fake.push_dm(fake.alice, "/link")
    (dm_sent,) = await r.replies(fake.dm_channels[fake.alice], 1)
    assert "Your link code is" in dm_sent["content"]


async def test_thread_new_undo_forget_need_manage_messages(rig, fake, fake_llm):
    moderators = fake.add_role(fake.guild, "mods", permissions=1 << 13)  # Manage Messages
    fake.give_role(fake.alice, moderators)
    r = await rig()
    fake.push_thread_message(fake.thread, fake.bob, "the plan is the blue door", mention_bot=True)
    await r.replies(fake.thread, 1)
    for i, command in enumerate(("/new", "/undo", "/forget"), start=2):
        fake.push_thread_message(fake.thread, fake.bob, command)
        sent = await r.replies(fake.thread, i)
        assert "only the chat's admins" in sent[-1]["content"], sent[-1]
    # the slash command form is refused the same way
    fake.push_interaction("new", user_id=fake.bob, channel_id=fake.thread)
    sent = await r.replies(fake.thread, 5)
    assert "only the chat's admins" in sent[-1]["content"]
    # a member with Manage Messages may
    fake.push_thread_message(fake.thread, fake.alice, "/undo")
    sent = await r.replies(fake.thread, 6)
    assert sent[-1]["content"].startswith("Took back")
    fake.push_interaction("new", user_id=fake.alice, channel_id=fake.thread)
    sent = await r.replies(fake.thread, 7)
    assert sent[-1]["content"].startswith("Started a new conversation")


async def test_whoami_in_a_server_answers_privately_and_typed_hides_links(rig, fake, fake_llm):
    from tests.test_linking import CODE_RE

    tg = RecordingAdapter("telegram")
    r = await rig(tg)
    await fake.wait_until(lambda: r.adapter.commands_synced)
    dm_channel = fake.dm_channel(fake.alice)
    # alice links her Discord account with her Telegram account (confirmed from Discord)
    fake.push_dm(fake.alice, "/link")
    (issued,) = await r.replies(dm_channel, 1)
    code = CODE_RE.search(issued["content"]).group(1)
    assert (await say(r.app, tg, dm("111", f"/link {code}", platform="telegram")))[0].startswith("Code accepted")
    await r.replies(dm_channel, 2)  # the confirmation request
    fake.push_dm(fake.alice, "/link confirm")
    await r.replies(dm_channel, 3)
    await r.app.linking.wait_idle(30)
    assert r.app.links.name_for(f"discord:{fake.alice}") == r.app.links.name_for("telegram:111") is not None

    # typed in the channel: everyone reads it, so no linked accounts and no profile
    fake.push_guild_message(fake.general, fake.alice, "/whoami")
    (typed,) = await r.replies(fake.general, 1)
    assert fake.alice in typed["content"] and "private chat" in typed["content"]
    assert "telegram:111" not in typed["content"] and "link-" not in typed["content"]
    # as a slash command: answered ephemerally (only alice sees it), with the whole answer
    inter = fake.push_interaction("whoami", user_id=fake.alice, channel_id=fake.general)
    sent = await r.replies(fake.general, 2)
    answer = sent[-1]
    assert answer["interaction_id"] == inter["id"] and "telegram:111" in answer["content"]
    state = next(s for s in fake.interactions.values() if s["id"] == inter["id"])
    assert state["response"]["data"]["flags"] & 64, "the deferred response is ephemeral"
    assert (answer["body"].get("flags") or 0) & 64
    # other slash commands in the channel stay public
    inter = fake.push_interaction("help", user_id=fake.bob, channel_id=fake.general)
    sent = await r.replies(fake.general, 3)
    state = next(s for s in fake.interactions.values() if s["id"] == inter["id"])
    assert not ((state["response"].get("data") or {}).get("flags", 0) & 64)


async def test_link_code_posted_in_a_discord_thread_is_burnt(rig, fake, fake_llm):
    from tests.test_linking import CODE_RE

    r = await rig()
    dm_channel = fake.dm_channel(fake.alice)
    fake.push_dm(fake.alice, "/link")
    (issued,) = await r.replies(dm_channel, 1)
    code = CODE_RE.search(issued["content"]).group(1)
    fake.push_thread_message(fake.thread, fake.alice, f"here: {code.lower()}", mention_bot=True)
    await r.replies(fake.thread, 1)
    await r.app.linking.wait_idle(10)
    sent = await r.replies(dm_channel, 2)
    assert "cancelled" in sent[-1]["content"]
    fake.push_dm(fake.bob, f"/link {code}")
    (refused,) = await r.replies(fake.dm_channel(fake.bob), 1)
    assert "unknown, expired or already used" in refused["content"]


async def test_link_code_pasted_in_a_server_without_mention_is_burnt(rig, fake, fake_llm):
    """The adapter drops server messages that don't mention the bot (the default), but a
    live link code in one is still burnt; the bot's own DM with the code burns nothing."""
    from tests.test_linking import CODE_RE

    r = await rig()
    fake.push_dm(fake.alice, "/link")
    (issued,) = await r.replies(fake.dm_channels[fake.alice], 1)
    code = CODE_RE.search(issued["content"]).group(1)
    fake.push_guild_message(fake.general, fake.alice, f"my code: {code}")  # no mention
    notices = await r.replies(fake.dm_channels[fake.alice], 2)
    assert "cancelled" in notices[-1]["content"]
    # a fresh code, shown only in the private chat, stays good
    fake.push_dm(fake.alice, "/link")
    sent = await r.replies(fake.dm_channels[fake.alice], 3)
    code = CODE_RE.search(sent[-1]["content"]).group(1)
    fake.push_guild_message(fake.general, fake.bob, "unrelated chatter")
    fake.push_dm(fake.bob, f"/link {code}")
    (accepted,) = await r.replies(fake.dm_channels[fake.bob], 1)
    assert accepted["content"].startswith("Code accepted")


async def test_a_confirm_tool_asks_with_buttons_and_anyone_elses_press_is_refused_only_to_them(
    fake, fake_llm, config_for
):
    """docs/concepts.md#tool-confirmations through the real adapter: Allow / Deny buttons,
    an ephemeral refusal for another member, the asker's Deny stops the call and the
    question then says so without buttons."""
    from tests.fakes.llm import tool_call

    fake_llm.script(tool_call("session_search", {"query": "plans"}), reply("As you wish."))
    cfg = config_for(
        platforms={"discord": {"enabled": True, "api_base": fake.api_base, "gateway_url": fake.gateway_url}},
        tools={"session_search": {"confirm": True}},
    )
    adapter = DiscordAdapter(cfg.platforms.discord, fake.token, ready_timeout=10, guild_ready_timeout=0.05)
    app = build_gateway(cfg, [adapter])
    await app.start()
    try:
        fake.push_guild_message(fake.general, fake.alice, "search my plans", mention_bot=True)
        await fake.wait_until(lambda: any(m["body"].get("components") for m in fake.sent_messages(fake.general)), 20)
        question = next(m for m in fake.sent_messages(fake.general) if m["body"].get("components"))
        assert "session_search" in question["content"]
        other = fake.press_button(question["id"], fake.bob, label="Allow")
        await fake.wait_until(lambda: bool(fake.followups(other)), 10)
        [refusal] = fake.followups(other)
        assert int(refusal["body"].get("flags") or 0) & 64 and "Only the person who asked" in refusal["body"]["content"]
        assert len(fake_llm.requests) == 1
        fake.press_button(question["id"], fake.alice, label="Deny")
        await fake.wait_until(lambda: any(m["content"] == "As you wish." for m in fake.sent_messages(fake.general)), 20)
        assert await app.drain(10)
        [result] = [json.loads(m["content"]) for m in fake_llm.requests[-1]["messages"] if m["role"] == "tool"]
        assert result["success"] is False and "did not allow" in result["error"]
        assert fake.messages[question["id"]]["content"].endswith("Denied.")
        assert not fake.messages[question["id"]].get("components")
    finally:
        await app.stop(drain_timeout=5)
