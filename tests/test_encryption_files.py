"""Per-tenant encryption of a profile's files and of gateway.db (docs/privacy.md#encryption-at-rest):
after real traffic with `storage.encryption: per_tenant`, a canary the person sent is in no
byte and no file name under the data directory; each store round-trips sealed, a record
sealed for one place or tenant opens nowhere else, and plain mode writes what it always did."""

from __future__ import annotations

import base64
import json
import logging
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.ledger import read_override, write_override
from agent.media import inline_images, save_media
from agent.memory import MemoryStore
from agent.memory_approval import PendingWrites
from agent.model_choice import ModelChoice, read_model, write_model
from agent.persona import PersonaChoice, read_choice, write_choice
from agent.providers import LocalNotesProvider
from agent.reminders import ReminderChat, ReminderStore
from agent.sessions import db as q
from agent.skills import SkillStore
from agent.vault import Keyring, ProfileFiles, TenantKeys, VaultError
from agent.visibility import GROUP_LANE
from core.messages import InboundMessage
from gateway.build import build_gateway
from gateway.cli import main as cli_main
from gateway.inbox import Inbox
from gateway.outbox import Draft, Outbox
from gateway.sealing import MessageSeal
from tenancy.keys import tenant_dir
from tests.conftest import RecordingAdapter, dm, say, telegram_gateway
from tests.fakes.llm import image_urls, reply, tool_call
from tests.fakes.telegram_api import FakeTelegram
from tests.media_files import png

CANARY = "zebra-quokka-4711"
TOKEN = "123456:AAE2eVAULTtokenSECRET_-xyz"
TOKEN_ENV = "HERMES_VAULT_TG_TOKEN"
MASTER_ENV = "HERMES_VAULT_TEST_MASTER"
USER = 111
TENANT = f"telegram-{USER}"
# what the other helper's branch seals (agent/sessions/): state.db and the session journals
SESSION_FILES = ("state.db", "state.db-wal", "state.db-shm", "state.db-journal")


# ------------------------------------------------------------------ end to end


@pytest.fixture
async def tg(monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    monkeypatch.setenv(MASTER_ENV, base64.b64encode(os.urandom(32)).decode())
    async with FakeTelegram(token=TOKEN, bot_username="hermes_vault_bot") as fake:
        yield fake


def encrypted_config(config_for, tg: FakeTelegram):
    telegram = {"enabled": True, "token_env": TOKEN_ENV, "base_url": tg.base_url, "poll_timeout_s": 2}
    return config_for(
        platforms={"telegram": telegram},
        storage={"encryption": "per_tenant", "master_key_env": MASTER_ENV},
        memory={"provider": "local"},
        llm={"vision": True},
        limits={"rate_limit_per_minute": 1000},
    )


gateway = telegram_gateway


async def traffic(cfg, tg: FakeTelegram, fake_llm) -> list[dict]:
    """A person's canary through every store: a memory entry, the user profile, a skill
    named after it, a reminder, their own persona, a document and an image named after it."""
    fake_llm.script(
        tool_call("memory", {"action": "add", "target": "memory", "content": f"the secret word is {CANARY}"}),
        tool_call("memory", {"action": "add", "target": "user", "content": f"goes by {CANARY}"}),
        tool_call(
            "skill_manage",
            {"action": "create", "name": CANARY, "description": f"about {CANARY}", "content": f"say {CANARY}"},
        ),
        tool_call("reminders", {"action": "create", "text": f"say {CANARY}", "in_minutes": 30}),
        reply("Saved all of it."),
    )
    sent = 0
    async with gateway(cfg) as app:
        for push in (
            lambda: tg.push_private(USER, f"please remember {CANARY}"),
            lambda: tg.push_private(USER, f"/persona custom Always greet me as {CANARY}."),
            lambda: tg.push_media(
                USER, "document", f"notes about {CANARY}\n".encode(), file_name=f"{CANARY}.txt", mime_type="text/plain"
            ),
            lambda: tg.push_media(
                USER, "document", png(3, 2), file_name=f"{CANARY}.png", mime_type="image/png", caption="look"
            ),
        ):
            push()
            sent += 1
            await tg.wait_sent(sent, USER, timeout=20)
            assert await app.drain(20)
    return fake_llm.requests


def every_file(root: Path) -> Iterator[Path]:
    for base, dirs, files in os.walk(root):
        for name in dirs + files:
            yield Path(base) / name


def holding(root: Path, needle: str) -> list[str]:
    """Every path under `root` whose name or bytes hold `needle` (as UTF-8), relative."""
    raw = needle.encode()
    out = []
    for path in every_file(root):
        if needle in path.name or (path.is_file() and raw in path.read_bytes()):
            out.append(path.relative_to(root).as_posix())
    return sorted(out)


def session_file(rel: str) -> bool:
    """state.db and the journals, which another branch seals (agent/sessions/)."""
    parts = rel.split("/")
    return parts[-1] in SESSION_FILES or (len(parts) >= 2 and parts[-2] == "sessions")


async def test_a_canary_a_person_sends_is_in_no_profile_file_gateway_db_or_log_line_when_encrypted(
    tg, fake_llm, config_for, caplog
):
    caplog.set_level(logging.DEBUG)
    cfg = encrypted_config(config_for, tg)
    requests = await traffic(cfg, tg, fake_llm)
    profile = tenant_dir(cfg.data_dir, TENANT)
    # the traffic really stored it all (so the absence below means sealed, not missing)
    assert any(CANARY in json.dumps(r) for r in requests)
    keys = TenantKeys(Keyring.open(cfg.data_dir, base64.b64decode(os.environ[MASTER_ENV])))
    files = keys.files(TENANT, profile)
    memory = MemoryStore(profile, files=files)
    assert any(CANARY in e for e in await memory.entries("memory"))
    assert any(CANARY in e for e in await memory.entries("user"))
    assert [s.name for s in await SkillStore(profile, files=files).index(shared_only=False)] == [CANARY]
    assert [r.text for r in await ReminderStore(files).all()] == [f"say {CANARY}"]
    assert CANARY in (read_choice(files).custom or "")
    stored = sorted((profile / "media").iterdir())
    assert len([p for p in stored if not p.name.startswith(".")]) == 2
    assert f"notes about {CANARY}\n".encode() in [files.read_bytes(f"media/{p.name}") for p in stored], stored
    # the image reached the model: opened from its sealed file
    assert any(url.startswith("data:image/png;base64,") for r in requests for url in image_urls(r))
    # ...and none of it is readable on disk, outside state.db and the journals
    leaks = [rel for rel in holding(cfg.data_dir, CANARY) if not session_file(rel)]
    assert leaks == []
    assert not [r.getMessage() for r in caplog.records if CANARY in r.getMessage()]


async def test_a_canary_a_person_sends_is_in_no_byte_of_the_data_dir_or_its_backup_when_encrypted(
    tg, fake_llm, config_for, tmp_path
):
    import tarfile

    from agent.vault import open_keyring
    from gateway.backup import backup_data_dir

    cfg = encrypted_config(config_for, tg)
    await traffic(cfg, tg, fake_llm)
    assert holding(cfg.data_dir, CANARY) == []
    storage = cfg.storage
    keyring = open_keyring(cfg.data_dir, storage.encryption, storage.master_key_env, storage.master_key_file)
    archive = backup_data_dir(cfg.data_dir, tmp_path / "backups", keyring=keyring)
    with tarfile.open(archive) as tar:  # every member, decompressed
        members = [m for m in tar.getmembers() if m.isfile()]
        leaks = [m.name for m in members if CANARY in m.name or CANARY.encode() in tar.extractfile(m).read()]
    assert len(members) > 10 and leaks == []


async def test_budget_set_seals_budget_json_and_the_running_gateway_obeys_it(
    config_for, fake_llm, tmp_path, monkeypatch
):
    monkeypatch.setenv(MASTER_ENV, base64.b64encode(os.urandom(32)).decode())
    storage = {"fsync": "never", "encryption": "per_tenant", "master_key_env": MASTER_ENV}
    caps = {"per_person": {"tokens_per_day": 100}}
    cfg = config_for(budgets=caps, storage=storage, limits={"rate_limit_per_minute": 1000})
    conf = tmp_path / "cfg.json"
    llm = {"base_url": cfg.llm.base_url, "model": "fake-model"}
    conf.write_text(json.dumps({"data_dir": str(cfg.data_dir), "llm": llm, "storage": storage, "budgets": caps}))
    adapter = RecordingAdapter()
    app = build_gateway(cfg, [adapter])
    await app.start()
    try:
        await say(app, adapter, dm("alice", "hello"))
        assert len(await say(app, adapter, dm("alice", "more"))) == 1  # over the cap: the refusal
        assert cli_main(["-c", str(conf), "budget", "set", "testchat:alice", "--tokens-per-day", "1000000"]) == 0
        budget = tenant_dir(cfg.data_dir, "testchat-alice") / "budget.json"
        assert budget.read_bytes().startswith(b"HGS1") and b"tokens_per_day" not in budget.read_bytes()
        calls = len(fake_llm.requests)
        assert await say(app, adapter, dm("alice", "lifted?")) != []
        assert len(fake_llm.requests) == calls + 1  # the gateway read the sealed caps
    finally:
        await app.stop()


# ------------------------------------------------------------------ the stores, sealed


@pytest.fixture
def keys(tmp_path) -> TenantKeys:
    return TenantKeys(Keyring.open(tmp_path, os.urandom(32)))


def files_of(keys: TenantKeys, tmp_path: Path, tenant: str = "alice") -> ProfileFiles:
    profile = tmp_path / "profiles" / tenant
    profile.mkdir(parents=True, exist_ok=True)
    return keys.files(tenant, profile)


def no_canary_under(root: Path) -> None:
    assert holding(root, CANARY) == []


async def test_memory_marks_baselines_and_approvals_round_trip_sealed(keys, tmp_path):
    files = files_of(keys, tmp_path)
    store = MemoryStore(files.root, files=files)
    assert (await store.add("memory", f"note {CANARY}"))["success"]
    assert (await store.add("user", f"name {CANARY}"))["success"]
    assert await store.set_visibility("memory", f"note {CANARY}", "shared")
    group = MemoryStore(files.root, scope=GROUP_LANE, files=files)
    assert await group.entries("memory") == [f"note {CANARY}"]  # the marks opened
    assert await store.entries("user") == [f"name {CANARY}"]
    staged = await PendingWrites(store.memory_dir, files).stage(
        "add", "memory", f"later {CANARY}", None, origin="private"
    )
    assert staged["success"]
    assert [p.content for p in await store.pending_writes().list()] == [f"later {CANARY}"]
    assert (await store.replace("memory", "note", f"new note {CANARY}"))["success"]  # the baseline opened: no drift
    no_canary_under(tmp_path)


async def test_skills_reminders_persona_model_budget_and_provider_notes_round_trip_sealed(keys, tmp_path):
    files = files_of(keys, tmp_path)
    skills = SkillStore(files.root, files=files)
    assert (await skills.create(CANARY, f"about {CANARY}", f"do {CANARY}", visibility="private"))["success"]
    assert (await skills.view(CANARY, shared_only=False))["content"] == f"do {CANARY}"
    assert (await skills.update(CANARY, description=None, content=f"redo {CANARY}", shared_only=False))["success"]
    assert [s.name for s in await skills.index(shared_only=False)] == [CANARY]
    chat = ReminderChat(platform="testchat", chat_id="dm-a", chat_type="dm", thread_id=None, user_id="a")
    reminders = ReminderStore(files)
    await reminders.add(f"remind {CANARY}", 2e9, chat, tz="Europe/Berlin", repeat=None, cap=5, now=1e9)
    assert [r.text for r in await reminders.all()] == [f"remind {CANARY}"]
    assert str(reminders.zone_now()) == "Europe/Berlin"
    write_choice(files, PersonaChoice(custom=f"be {CANARY}"))
    assert read_choice(files).custom == f"be {CANARY}"
    write_model(files, ModelChoice(f"model-{CANARY}"))
    assert read_model(files).name == f"model-{CANARY}"
    write_override(files, {"tokens_per_day": 1234})
    assert read_override(files) == {"tokens_per_day": 1234}
    provider = LocalNotesProvider()
    await provider.initialize("alice", files.root, files=files)
    await provider.sync_turn(f"tell me about {CANARY}s", "sure")
    assert CANARY in await provider.prefetch(f"{CANARY}s please")
    no_canary_under(tmp_path)


async def test_a_media_file_is_sealed_and_named_after_neither_its_content_nor_its_name(keys, tmp_path):
    files = files_of(keys, tmp_path)
    image = png(2, 2)
    rel = save_media(files, image, f"{CANARY}.png", key="in-1-0", fallback="image")
    assert rel == save_media(files, image, f"{CANARY}.png", key="in-1-0")  # a replay rewrites the same file
    assert CANARY not in rel and "in-1-0" not in rel and not rel.endswith(".png")
    assert files.path(rel).read_bytes() != image
    wire = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": f"hermes-media:{rel}"}}]}]
    [msg] = await inline_images(wire, files)
    assert msg["content"][0]["image_url"]["url"] == "data:image/png;base64," + base64.b64encode(image).decode()
    no_canary_under(tmp_path)


def test_a_record_sealed_for_one_place_or_tenant_does_not_open_as_another(keys, tmp_path):
    alice, bob = files_of(keys, tmp_path, "alice"), files_of(keys, tmp_path, "bob")
    alice.path("memories").mkdir()
    alice.write_text("memories/MEMORY.md", f"note {CANARY}")
    os.replace(alice.path("memories/MEMORY.md"), alice.path("memories/USER.md"))
    with pytest.raises(VaultError) as moved:
        alice.read_text("memories/USER.md")
    bob.path("memories").mkdir()
    alice.write_text("memories/MEMORY.md", f"note {CANARY}")
    bob.path("memories/MEMORY.md").write_bytes(alice.path("memories/MEMORY.md").read_bytes())
    with pytest.raises(VaultError) as copied:
        bob.read_text("memories/MEMORY.md")
    for err in (moved.value, copied.value):
        assert "\n" not in str(err) and "does not open with its key" in str(err)
    # a plain view neither reads a sealed file nor writes plain text beside it
    with pytest.raises(VaultError, match=r"encrypted, but storage\.encryption is off"):
        ProfileFiles(alice.root).read_text("memories/MEMORY.md")
    with pytest.raises(VaultError, match="would be written in plain text"):
        write_choice(alice.root, PersonaChoice(custom=f"be {CANARY}"))
    assert not alice.path("persona.json").exists()


def test_a_new_tenants_key_is_made_exactly_once_when_many_ask_at_once(keys, tmp_path):
    profile = tmp_path / "profiles" / "newcomer"
    got: list[bytes] = []
    start = threading.Barrier(8)

    def ask() -> None:
        start.wait()
        key = keys.key_for("newcomer", profile)
        assert key is not None
        got.append(key.raw)

    threads = [threading.Thread(target=ask) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 8 and len(set(got)) == 1
    fresh = TenantKeys(keys.keyring).key_for("newcomer", profile)  # another process unwraps the same key
    assert fresh is not None and fresh.raw == got[0]


# ------------------------------------------------------------------ plain mode is unchanged


async def test_plain_profiles_keep_exactly_the_bytes_and_names_they_always_had(tmp_path):
    files = ProfileFiles(tmp_path)
    store = MemoryStore(tmp_path, files=files)
    await store.add("memory", "one")
    await store.add("memory", "two")
    assert (tmp_path / "memories" / "MEMORY.md").read_bytes() == b"one\n\xc2\xa7\ntwo"
    write_choice(files, PersonaChoice(name="pirate"))
    assert (tmp_path / "persona.json").read_bytes() == b'{"name": "pirate", "custom": null}'
    write_model(files, ModelChoice("big"))
    assert (tmp_path / "model.json").read_bytes() == b'{"name": "big"}'
    write_override(files, {"tokens_per_day": 5})
    assert (tmp_path / "budget.json").read_bytes() == b'{\n "tokens_per_day": 5\n}'
    skills = SkillStore(tmp_path, files=files)
    await skills.create("tea", "how to brew", "boil water", visibility="private")
    assert (tmp_path / "skills" / "tea" / "SKILL.md").read_bytes() == (
        b"---\nname: tea\ndescription: how to brew\nvisibility: private\n---\nboil water\n"
    )
    rel = save_media(files, b"hello", "notes.txt", key="in-9-0")
    assert rel == "media/in-9-0-notes.txt" and (tmp_path / rel).read_bytes() == b"hello"
    chat = ReminderChat(platform="t", chat_id="c", chat_type="dm", thread_id=None, user_id="u")
    await ReminderStore(files).add("tea", 2e9, chat, tz=None, repeat=None, cap=5, now=1e9)
    data = json.loads((tmp_path / "reminders.json").read_bytes())
    assert [r["text"] for r in data["reminders"]] == ["tea"]
    provider = LocalNotesProvider()
    await provider.initialize("t", tmp_path)
    await provider.sync_turn("hi", "hello")
    line = (tmp_path / "provider" / "notes.jsonl").read_text()
    assert json.loads(line) == {"kind": "turn", "user": "hi", "assistant": "hello", "visibility": "private"}


# ------------------------------------------------------------------ gateway.db


def message(text: str, n: int = 1) -> InboundMessage:
    return InboundMessage(
        platform="testchat", chat_id="dm-alice", chat_type="dm", user_id="alice", message_id=f"m{n}", text=text
    )


def gateway_db_bytes(path: Path) -> bytes:
    return b"".join(p.read_bytes() for p in path.parent.glob(f"{path.name}*") if p.is_file())


async def test_a_pending_message_and_an_unsent_chunk_are_sealed_in_gateway_db_and_replay_intact(keys, tmp_path):
    seal = MessageSeal(keys, tmp_path, lambda msg: "alice")
    path = tmp_path / "gateway.db"
    inbox = Inbox(path, seal=seal)
    outbox = Outbox(inbox)
    await inbox.open()
    await outbox.open()
    try:
        msg = message(f"my secret is {CANARY}")
        assert await inbox.record(msg)
        [chunk_id] = await outbox.record([Draft("testchat", "dm-alice", None, f"yours is {CANARY}")], source=msg)
        assert CANARY.encode() not in gateway_db_bytes(path)
        assert [m.text for m in await inbox.pending()] == [msg.text]
        chunk = await outbox.next_for("testchat", "dm-alice")
        assert chunk is not None and chunk.id == chunk_id and chunk.text == f"yours is {CANARY}"
        # the tenant deleted (its key shredded): the row does not open; it is dropped, not replayed
        keys.keyring.shred("alice", tmp_path / "profiles" / "alice")  # type: ignore[union-attr]
        keys.forget("alice")
        assert await inbox.pending() == []
        assert await inbox.status("testchat", "dm-alice", "m1") == "done"
        assert await outbox.next_for("testchat", "dm-alice") is None
    finally:
        await outbox.close()
        await inbox.close()


async def test_a_row_moved_to_another_message_does_not_open(keys, tmp_path):
    seal = MessageSeal(keys, tmp_path, lambda msg: "alice")
    path = tmp_path / "gateway.db"
    inbox = Inbox(path, seal=seal)
    await inbox.open()
    try:
        assert await inbox.record(message(f"first {CANARY}", 1))
        assert await inbox.record(message("second", 2))
        await inbox.db.execute(
            "UPDATE inbound SET payload=(SELECT payload FROM inbound WHERE message_id='m1') WHERE message_id='m2'"
        )
        assert [m.message_id for m in await inbox.pending()] == ["m1"]  # m2's moved record is refused
    finally:
        await inbox.close()


async def test_an_answered_messages_sealed_text_leaves_gateway_db_and_its_wal(keys, tmp_path):
    inbox = Inbox(tmp_path / "gateway.db", seal=MessageSeal(keys, tmp_path, lambda msg: "alice"))
    await inbox.open()
    try:
        msg = message(f"secret {CANARY}")
        assert list(await inbox.db.execute_fetchall("PRAGMA secure_delete")) == [(1,)]
        assert await inbox.record(msg)
        rows = await inbox.db.execute_fetchall("SELECT payload FROM inbound")
        [(payload,)] = list(rows)
        record = payload.encode()
        await inbox.finish(msg, "replied")
        assert await inbox.checkpoint()
        assert record[-40:] not in gateway_db_bytes(tmp_path / "gateway.db")  # zeroed, not only unlinked
    finally:
        await inbox.close()


def test_state_db_erases_for_real(tmp_path):
    db = q.connect(tmp_path / "state.db", "never")
    try:
        assert db.execute("PRAGMA secure_delete").fetchall() == [(1,)]
    finally:
        db.close()
