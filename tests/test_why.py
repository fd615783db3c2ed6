"""`/why` (docs/concepts.md#why-an-answer-said-what-it-said): each answer keeps, in its own
stored message, references to what went into its prompt; `/why [N]` names them for the
person asking, as far as the place they ask in may show them. Real gateway, loopback
platform, the fake model on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
import re
import tarfile
import time

from agent.visibility import entry_key
from core.messages import Attachment, DownloadError, InboundMessage
from gateway.build import build_gateway
from gateway.tenants import export_profile, find_tenant
from tests.conftest import RecordingAdapter, dm, group, running_gateway, say
from tests.fakes.llm import canaries_in, reply, tool_call, tool_calls
from tests.fakes.web import PageServer


def memory_add(content: str, target: str = "memory") -> object:
    return tool_call("memory", {"action": "add", "target": target, "content": content})


async def number_of(app, adapter, user: str, needle: str) -> str:
    """The number /memory gives the entry holding `needle` (in the person's private chat)."""
    listing = (await say(app, adapter, dm(user, "/memory")))[0]
    for line in listing.splitlines():
        m = re.match(r"(\d+)\. \[(?:private|shared)\] (.*)", line)
        if m and needle in m.group(2):
            return m.group(1)
    raise AssertionError(f"{needle} not in /memory: {listing}")


def system_text(request: dict) -> str:
    messages = request.get("messages") or []
    return messages[0]["content"] if messages and messages[0]["role"] == "system" else ""


def tool_results(request: dict) -> dict[str, dict]:
    """The tool results of a request by tool name (the last one of each)."""
    return {m["name"]: json.loads(m["content"]) for m in request["messages"] if m["role"] == "tool"}


class FilesAdapter(RecordingAdapter):
    """The loopback platform with downloads: `download` serves `files[file_id]`."""

    def __init__(self) -> None:
        super().__init__()
        self.files: dict[str, bytes] = {}

    def document(self, chat: str, user: str, name: str, data: bytes, text: str) -> InboundMessage:
        fid = f"f{len(self.files) + 1}"
        self.files[fid] = data
        return InboundMessage(
            platform=self.platform,
            chat_id=chat,
            chat_type="group",
            user_id=user,
            user_name=user,
            message_id=f"doc-{fid}",
            text=text,
            mentions_bot=True,
            attachments=(Attachment(type="document", name=name, file_id=fid, size=len(data)),),
        )

    async def download(self, attachment: Attachment, max_bytes: int) -> bytes:
        if attachment.file_id not in self.files:
            raise DownloadError("the file is gone")
        return self.files[attachment.file_id]


async def test_why_after_a_reply_that_used_a_shared_and_a_private_entry_lists_both_with_their_owners(
    config_for, fake_llm
):
    async with running_gateway(config_for) as (app, adapter):
        fake_llm.script(
            memory_add("CANARY-priv1 keeps a diary"),
            reply("Noted."),
            memory_add("CANARY-shr2 plays in team blue", target="user"),
            reply("Noted too."),
        )
        await say(app, adapter, dm("alice", "I keep a diary"))
        await say(app, adapter, dm("alice", "I play in team blue"))
        # the prompt of this session was taken before the entries existed: only the tool ran
        before = (await say(app, adapter, dm("alice", "/why")))[0]
        assert "memory (worked)" in before and "CANARY" not in before
        n = await number_of(app, adapter, "alice", "CANARY-shr2")
        assert "Shared" in (await say(app, adapter, dm("alice", f"/memory share {n}")))[0]
        await say(app, adapter, dm("alice", "/new"))
        await say(app, adapter, dm("alice", "what do you know about me?"))
        prompt = system_text(fake_llm.requests[-1])
        assert "CANARY-priv1" in prompt and "CANARY-shr2" in prompt  # both really went in
        why = (await say(app, adapter, dm("alice", "/why")))[0]
    assert why.startswith("My last reply")
    assert '- your private note: "CANARY-priv1 keeps a diary"' in why
    assert '- your shared profile entry (groups may see it): "CANARY-shr2 plays in team blue"' in why
    assert "memory (worked)" not in why  # no tool ran in this turn
    assert "cannot see" not in why


async def test_why_in_a_group_never_names_another_members_entries(config_for, fake_llm, tmp_path):
    async with running_gateway(config_for) as (app, adapter):
        fake_llm.script(memory_add("CANARY-ashare alice bakes bread"), reply("Noted."))
        await say(app, adapter, dm("alice", "I bake bread"))
        n = await number_of(app, adapter, "alice", "CANARY-ashare")
        await say(app, adapter, dm("alice", f"/memory share {n}"))
        fake_llm.script(memory_add("CANARY-apriv alice's health note"), reply("Noted."))
        await say(app, adapter, dm("alice", "a private health note"))
        # bob saves a shared entry in his own lane of the same group, then both are answered there
        fake_llm.script(memory_add("CANARY-bob bob climbs"), reply("Noted, bob."))
        await say(app, adapter, group("g1", "bob", "I climb"))
        await say(app, adapter, group("g1", "bob", "/new"))
        fake_llm.script(reply("Hello alice."), reply("Hello bob."))
        await say(app, adapter, group("g1", "alice", "hello"))
        assert "CANARY-ashare" in system_text(fake_llm.requests[-1])
        await say(app, adapter, group("g1", "bob", "hello"))
        assert "CANARY-bob" in system_text(fake_llm.requests[-1])
        why = (await say(app, adapter, group("g1", "alice", "/why")))[0]
        assert '"Hello alice."' in why  # her own lane's last reply, not the chat's last one
        assert '- your shared note: "CANARY-ashare alice bakes bread"' in why
        assert canaries_in(why) == {"CANARY-ashare"}, why
        assert "bob" not in why
        bobs = (await say(app, adapter, group("g1", "bob", "/why")))[0]
        assert canaries_in(bobs) == {"CANARY-bob"}, bobs
        # alice takes it back: the group is told an entry is not shown, never which
        await say(app, adapter, dm("alice", f"/memory unshare {n}"))
        hidden = (await say(app, adapter, group("g1", "alice", "/why")))[0]
        assert not canaries_in(hidden), hidden
        assert "And 1 entry you cannot see here." in hidden
        # in her private chat the same entry is hers to see
        assert "CANARY-apriv" not in (await say(app, adapter, dm("alice", "/why")))[0]

    # a shared lane: the group's memory is the group's; what another member sent is counted
    cfg = config_for(
        tenancy={"group_sessions_per_user": False},
        access={"admins": ["testchat:carol"]},
        limits={"rate_limit_per_minute": 1000},
    )
    files = FilesAdapter()
    app = build_gateway(cfg, [files])
    await app.start()
    try:
        fake_llm.script(memory_add("CANARY-team our team meets on fridays"), reply("Saved for the group."))
        await say(app, files, group("g2", "carol", "we meet on fridays"))
        await say(app, files, group("g2", "carol", "/new"))  # the group's next prompt holds the entry
        fake_llm.script(reply("Thanks for the notes."))
        note = files.document("g2", "bob", "bob-medical.txt", b"CANARY-doc private notes", "my notes")
        await say(app, files, note)
        why = (await say(app, files, group("g2", "alice", "/why")))[0]
        mine = (await say(app, files, group("g2", "bob", "/why")))[0]
    finally:
        await app.stop()
    assert '"Thanks for the notes."' in why
    assert '- this group\'s shared memory: "CANARY-team our team meets on fridays"' in why
    assert "bob" not in why and canaries_in(why) == {"CANARY-team"}, why
    assert "And 1 file from another member you cannot see here." in why
    # bob, who sent it, sees it named
    assert "- bob-medical.txt (a text file you sent with the message I answered)" in mine, mine


async def test_why_lists_the_session_search_hits_and_tools_of_the_turn(config_for, fake_llm):
    async with PageServer() as pages:
        tools = {"web_fetch": {"enabled": True}, "web": {"allow_hosts": [f"127.0.0.1:{pages.port}"]}}
        async with running_gateway(config_for, tools=tools) as (app, adapter):
            await say(app, adapter, dm("alice", "my bike is a CANARY-bike7 roadster"))
            await say(app, adapter, group("g1", "alice", "anyone else ride a CANARY-bike7?"))
            fake_llm.script(
                tool_calls(
                    [
                        ("session_search", {"query": "CANARY-bike7"}),
                        ("web_fetch", {"url": pages.url("/page")}),
                        ("memory", {"action": "remove", "target": "memory", "old_text": "no such entry"}),
                        ("teleport", {"to": "mars"}),
                    ]
                ),
                reply("You ride a roadster."),
            )
            await say(app, adapter, dm("alice", "what bike do I have?"))
            results = tool_results(fake_llm.requests[-1])
            why = (await say(app, adapter, dm("alice", "/why")))[0]
    found = results["session_search"]["results"]
    assert results["session_search"]["count"] == len(found) >= 2
    assert f"a search of earlier conversations, which found {len(found)}:" in why
    lanes = re.findall(r"(?:a message|my reply) in ([^;]+?) of \d{4}-\d\d-\d\d \d\d:\d\d UTC", why)
    assert len(lanes) == len(found)
    assert "this chat" in lanes and "your conversation in a group on testchat (chat g1)" in lanes
    assert "CANARY" not in why  # which messages, never their text
    line = next(x for x in why.splitlines() if x.startswith("- tools:"))
    assert "session_search (worked)" in line and "web_fetch (worked)" in line
    assert "memory (failed)" in line and "teleport (was refused)" in line


async def test_why_n_reaches_earlier_replies(config_for, fake_llm):
    async with running_gateway(config_for) as (app, adapter):
        fake_llm.script(
            tool_call("session_search", {"query": "anything"}),
            reply("First answer."),
            reply("Second answer."),
            memory_add("CANARY-n3 likes tea"),
            reply("Third answer."),
        )
        for text in ("one", "two", "three"):
            await say(app, adapter, dm("alice", text))
        last, two, three, four = [
            (await say(app, adapter, dm("alice", c)))[0] for c in ("/why", "/why 2", "/why 3", "/why 4")
        ]
        bad = (await say(app, adapter, dm("alice", "/why soon")))[0]
    assert last.startswith("My last reply") and '"Third answer."' in last and "memory (worked)" in last
    assert "session_search" not in last
    assert two.startswith("My reply before last") and '"Second answer."' in two and "nothing stored went into it" in two
    assert three.startswith("My reply 3 back") and '"First answer."' in three and "session_search (worked)" in three
    assert "memory" not in three
    assert "3 replies" in four and "/why 3 is the oldest" in four
    assert bad.startswith("Usage: /why")


async def test_why_with_nothing_to_explain_says_so(config_for, fake_llm):
    async with running_gateway(config_for) as (app, adapter):
        assert "nothing to explain" in (await say(app, adapter, dm("alice", "/why")))[0]
        assert "nothing to explain" in (await say(app, adapter, group("g1", "bob", "/why")))[0]
        await say(app, adapter, dm("alice", "hello"))
        plain = (await say(app, adapter, dm("alice", "/why")))[0]
        # with an entry in the prompt the same question has something to say
        fake_llm.script(memory_add("CANARY-e1 prefers mornings"), reply("Noted."))
        await say(app, adapter, dm("alice", "I prefer mornings"))
        await say(app, adapter, dm("alice", "/new"))
        await say(app, adapter, dm("alice", "hello again"))
        used = (await say(app, adapter, dm("alice", "/why")))[0]
    assert "nothing stored went into it" in plain and "\n- " not in plain
    assert "nothing stored" not in used and "CANARY-e1" in used


async def test_the_provenance_is_in_the_export_and_holds_no_prompt_text(config_for, fake_llm):
    entry = "CANARY-x9 has a cat called Miso"
    async with running_gateway(config_for) as (app, adapter):
        fake_llm.script(memory_add(entry), reply("Noted."))
        await say(app, adapter, dm("alice", "I have a cat"))
        await say(app, adapter, dm("alice", "/new"))
        fake_llm.script(tool_call("session_search", {"query": "cat"}), reply("Your cat is Miso."))
        await say(app, adapter, dm("alice", "what is my cat called?"))
        assert "CANARY-x9" in system_text(fake_llm.requests[-1])
        assert "Exported" in (await say(app, adapter, dm("alice", "/export")))[0]
        profile = app.profiles._open["testchat-alice"].path
    dump = json.loads(sorted((profile / "exports").glob("*.json"))[-1].read_text(encoding="utf-8"))
    answer = next(
        m
        for s in dump["sessions"]
        for m in s["messages"]
        if m["role"] == "assistant" and m["content"] == "Your cat is Miso."
    )
    prov = answer["meta"]["provenance"]
    assert prov["memory"] == [entry_key("memory", entry)[:12]]  # a reference to the entry
    assert [t["name"] for t in prov["tools"]] == ["session_search"] and prov["search"]
    text = json.dumps(prov)
    assert "CANARY" not in text and "Miso" not in text and "cat" not in text  # no entry, snippet or prompt text
    assert set(prov["search"][0]) == {"session", "uid", "at", "role"}
    # the same record is in the answer's own journal line (one write: journal and row agree)
    lines = [json.loads(x) for p in (profile / "sessions").glob("*.jsonl") for x in p.read_text().splitlines()]
    [journaled] = [m for m in lines if m.get("type") == "message" and m["uid"] == answer["uid"]]
    assert journaled["meta"]["provenance"] == prov
    # and in the operator's archive of the profile
    cfg = config_for()
    archive = export_profile(cfg, find_tenant(cfg, "testchat-alice"), profile.parent.parent / "out.tar.gz")
    with tarfile.open(archive) as tar:
        dumped = tar.extractfile("profile/state.sql").read().decode()  # type: ignore[union-attr]
    assert entry_key("memory", entry)[:12] in dumped and '"provenance"' in dumped


async def test_a_forgotten_entry_is_no_longer_named_by_why(config_for, fake_llm):
    async with running_gateway(config_for) as (app, adapter):
        fake_llm.script(
            memory_add("CANARY-f1 owes Sam ten euros"),
            reply("Noted."),
            memory_add("CANARY-k2 likes jazz"),
            reply("Noted."),
        )
        await say(app, adapter, dm("alice", "I owe Sam"))
        await say(app, adapter, dm("alice", "I like jazz"))
        await say(app, adapter, dm("alice", "/new"))
        await say(app, adapter, dm("alice", "hi"))
        assert canaries_in((await say(app, adapter, dm("alice", "/why")))[0]) == {"CANARY-f1", "CANARY-k2"}
        n = await number_of(app, adapter, "alice", "CANARY-f1")
        assert "forgot" in (await say(app, adapter, dm("alice", f"/forget {n}")))[0]
        after = (await say(app, adapter, dm("alice", "/why")))[0]
        await say(app, adapter, dm("alice", "and now?"))  # its prompt is rebuilt without the entry
        fresh = (await say(app, adapter, dm("alice", "/why")))[0]
        old = (await say(app, adapter, dm("alice", "/why 2")))[0]
        profile = app.profiles._open["testchat-alice"].path
    assert canaries_in(after) == {"CANARY-k2"} and "- an entry since forgotten (a note)" in after
    assert canaries_in(fresh) == {"CANARY-k2"} and "forgotten" not in fresh
    assert "- an entry since forgotten (a note)" in old
    # no answer's record ever held the entry's text, only its key
    lines = [json.loads(x) for p in (profile / "sessions").glob("*.jsonl") for x in p.read_text().splitlines()]
    records = [m["meta"]["provenance"] for m in lines if "provenance" in (m.get("meta") or {})]
    assert records and not canaries_in(records)


async def test_why_after_a_reminder_names_the_reminder(config_for, fake_llm):
    cfg = config_for()
    fake_llm.script(
        tool_call("reminders", {"action": "create", "text": "water the plants", "in_minutes": 30}), reply("Okay.")
    )
    adapter = RecordingAdapter()
    app = build_gateway(cfg, [adapter])
    await app.start()
    try:
        await say(app, adapter, dm("hal", "remind me to water the plants"))
    finally:
        await app.stop()
    later = build_gateway(cfg, [adapter])
    later.reminders.clock = lambda: time.time() + 31 * 60
    await later.start()
    try:
        deadline = time.monotonic() + 10
        while not any("Reminder" in t for t in adapter.texts()):
            assert time.monotonic() < deadline, adapter.texts()
            await asyncio.sleep(0.02)
        assert await later.drain(10)
        why = (await say(later, adapter, dm("hal", "/why")))[0]
        before = (await say(later, adapter, dm("hal", "/why 2")))[0]
    finally:
        await later.stop()
    assert why.startswith("My last reply") and "water the plants" in why
    assert re.search(r"was reminder #1, due \d{4}-\d\d-\d\d \d\d:\d\d UTC", why), why
    assert "reminders (worked)" in before
