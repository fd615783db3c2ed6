"""Photos, voice notes, documents, size limits and reply context, end to end: the real
GatewayApp and TelegramAdapter (python-telegram-bot over HTTP) against the fake Bot API
(getFile + file downloads), the fake model and the fake transcription server."""

from __future__ import annotations

import base64
import json
import logging
import tarfile
from pathlib import Path
from typing import Any

import pytest

from gateway.backup import backup_data_dir
from gateway.runtime import GatewayApp
from gateway.tenants import export_profile, find_tenant
from tenancy.keys import tenant_dir
from tests.conftest import telegram_gateway
from tests.fakes.llm import image_urls, last_user_text, tool_call
from tests.fakes.telegram_api import FakeTelegram
from tests.fakes.transcription import FakeTranscription
from tests.media_files import pdf, png
from tests.statedb import open_state_db

TOKEN = "123456:AAE2eMEDIAtokenSECRET_-xyz"
TOKEN_ENV = "HERMES_MEDIA_TG_TOKEN"
BOT = "hermes_test_bot"
GROUP = -1001234567890


@pytest.fixture
async def tg(monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    async with FakeTelegram(token=TOKEN, bot_username=BOT) as fake:
        yield fake


@pytest.fixture
async def stt():
    async with FakeTranscription() as fake:
        yield fake


def tg_config(config_for, tg: FakeTelegram, **sections: Any):
    section = {"enabled": True, "token_env": TOKEN_ENV, "base_url": tg.base_url, "poll_timeout_s": 2}
    return config_for(platforms={"telegram": section}, **sections)


gateway = telegram_gateway


async def answered(tg: FakeTelegram, app: GatewayApp, n: int, chat_id: int, timeout: float = 20) -> list[dict]:
    await tg.wait_sent(n, chat_id, timeout=timeout)
    assert await app.drain(timeout)
    return tg.sent_messages(chat_id)


def profile_of(cfg, tenant: str) -> Path:
    return tenant_dir(cfg.data_dir, tenant)


def media_files(profile: Path) -> dict[str, bytes]:
    folder = profile / "media"
    if not folder.is_dir():
        return {}
    return {p.name: p.read_bytes() for p in folder.iterdir() if not p.name.startswith(".")}


def user_rows(profile: Path) -> list[tuple[str, dict]]:
    conn = open_state_db(profile / "state.db")
    try:
        rows = conn.execute("SELECT content, meta FROM messages WHERE role = 'user' ORDER BY id").fetchall()
    finally:
        conn.close()
    return [(content, json.loads(meta or "{}")) for content, meta in rows]


def decoded_images(request: dict) -> list[bytes]:
    out = []
    for url in image_urls(request):
        assert url.startswith("data:image/")
        out.append(base64.b64decode(url.split(",", 1)[1]))
    return out


# ----------------------------------------------------------------------------- photos


async def test_photo_reaches_the_model_as_an_image_part_and_is_stored_in_media(tg, fake_llm, config_for):
    image = png(3, 2)
    cfg = tg_config(config_for, tg, llm={"vision": True})
    async with gateway(cfg) as app:
        tg.push_media(111, "photo", image, caption="what colour is this?")
        sent = await answered(tg, app, 1, 111)
    assert sent[-1]["text"].startswith("ok: what colour is this?")
    [request] = fake_llm.requests
    assert decoded_images(request) == [image]  # the largest photo size, inline as data: URL
    assert not fake_llm.violations
    profile = profile_of(cfg, "telegram-111")
    assert list(media_files(profile).values()) == [image]
    [(content, meta)] = user_rows(profile)
    assert "what colour is this?" in content
    assert [Path(ref["path"]).parent.name for ref in meta["images"]] == ["media"]


async def test_image_document_is_read_as_an_image(tg, fake_llm, config_for):
    image = png()
    cfg = tg_config(config_for, tg, llm={"vision": True})
    async with gateway(cfg) as app:
        tg.push_media(111, "document", image, file_name="diagram.png", mime_type="image/png")
        await answered(tg, app, 1, 111)
    assert decoded_images(fake_llm.requests[-1]) == [image]
    assert "[image: diagram.png]" in last_user_text(fake_llm.requests[-1])


async def test_with_vision_off_images_are_not_sent_and_the_person_is_told_once(tg, fake_llm, config_for):
    cfg = tg_config(config_for, tg)  # llm.vision defaults to off
    async with gateway(cfg) as app:
        tg.push_media(111, "photo", png(), caption="look at this")
        first = await answered(tg, app, 2, 111)
        tg.push_media(111, "photo", png(), caption="and this one")
        sent = await answered(tg, app, 3, 111)
    notices = [m["text"] for m in sent if "can't see images" in m["text"]]
    assert len(notices) == 1 and first[0]["text"] == notices[0]
    assert all(not image_urls(r) for r in fake_llm.requests)
    assert "image reading is off" in last_user_text(fake_llm.requests[-1])
    assert not tg.file_downloads  # nothing fetched that the model would never see


# ----------------------------------------------------------------------------- voice


async def test_voice_note_transcript_is_the_message_text_and_is_searchable(tg, fake_llm, stt, config_for):
    voice = b"OggS fake opus voice payload"
    stt.transcripts[voice] = "please book the pelican restaurant for friday"
    cfg = tg_config(config_for, tg, transcription={"base_url": stt.base_url, "model": "whisper-large-v3"})
    async with gateway(cfg) as app:
        tg.push_media(111, "voice", voice)
        sent = await answered(tg, app, 1, 111)
        assert sent[-1]["text"] == "ok: please book the pelican restaurant for friday"
        [req] = stt.requests
        assert req["model"] == "whisper-large-v3" and req["data"] == voice
        assert req["filename"] == "voice.ogg" and req["content_type"] == "audio/ogg"  # servers go by the extension
        # the model searches its history for it in a later turn
        fake_llm.script(tool_call("session_search", {"query": "pelican"}))
        tg.push_private(111, "which restaurant did I mention?")
        await answered(tg, app, 2, 111)
    tool_msgs = [m for m in fake_llm.requests[-1]["messages"] if m["role"] == "tool"]
    assert "pelican" in tool_msgs[-1]["content"]
    profile = profile_of(cfg, "telegram-111")
    [(content, _meta), _] = user_rows(profile)
    assert content == "please book the pelican restaurant for friday"
    assert voice in media_files(profile).values()  # the audio is kept


async def test_voice_note_without_a_transcription_endpoint_gets_a_clear_message(tg, fake_llm, config_for):
    cfg = tg_config(config_for, tg)
    async with gateway(cfg) as app:
        tg.push_media(111, "voice", b"OggS voice")
        [answer] = await answered(tg, app, 1, 111)
    assert "no transcription service is configured" in answer["text"]
    assert not fake_llm.requests
    assert b"OggS voice" in media_files(profile_of(cfg, "telegram-111")).values()


async def test_failed_transcription_is_reported_and_the_caption_still_answered(tg, fake_llm, stt, config_for):
    stt.fail_next(503)
    cfg = tg_config(config_for, tg, transcription={"base_url": stt.base_url})
    async with gateway(cfg) as app:
        tg.push_media(111, "audio", b"ID3 mp3 bytes", caption="summarise this memo")
        sent = await answered(tg, app, 2, 111)
    assert "couldn't transcribe" in sent[0]["text"] and "HTTP 503" in sent[0]["text"]
    assert sent[1]["text"].startswith("ok: summarise this memo")


# ----------------------------------------------------------------------------- documents


async def test_pdf_text_reaches_the_model(tg, fake_llm, config_for):
    cfg = tg_config(config_for, tg)
    async with gateway(cfg) as app:
        tg.push_media(
            111,
            "document",
            pdf("Invoice 2231", "Total due: 4711 EUR"),
            file_name="invoice.pdf",
            mime_type="application/pdf",
            caption="what is the total?",
        )
        await answered(tg, app, 1, 111)
    text = last_user_text(fake_llm.requests[-1])
    assert "what is the total?" in text
    assert "Total due: 4711 EUR" in text and "[attached file invoice.pdf]" in text


async def test_text_document_is_cut_at_max_attachment_chars_and_other_files_are_named(tg, fake_llm, config_for):
    cfg = tg_config(config_for, tg, limits={"max_attachment_chars": 50})
    async with gateway(cfg) as app:
        tg.push_media(111, "document", ("a,b\n" + "1,2\n" * 100).encode(), file_name="data.csv", mime_type="text/csv")
        await answered(tg, app, 1, 111)
        tg.push_media(111, "document", b"PK\x03\x04zip", file_name="archive.zip", mime_type="application/zip")
        await answered(tg, app, 2, 111)
    first = fake_llm.requests[0]["messages"][-1]["content"]
    assert "first 50 characters" in first and first.count("1,2") == 11  # 4 + 11*4 = 48 chars of the file
    second = last_user_text(fake_llm.requests[-1])
    assert "archive.zip" in second and "not read" in second
    assert len(tg.file_downloads) == 1  # the zip was named, not fetched


# ----------------------------------------------------------------------------- limits and safety


async def test_over_limit_file_is_refused_clearly_before_download(tg, fake_llm, config_for):
    cfg = tg_config(config_for, tg, limits={"max_attachment_bytes": 1000})
    async with gateway(cfg) as app:
        tg.push_media(111, "document", b"x" * 5000, file_name="big.txt", mime_type="text/plain")
        [answer] = await answered(tg, app, 1, 111)
    assert "big.txt" in answer["text"] and "too large" in answer["text"] and "1,000 bytes" in answer["text"]
    assert not tg.calls_of("getFile") and not tg.file_downloads
    assert not fake_llm.requests


async def test_file_over_telegrams_download_cap_is_refused(tg, fake_llm, config_for):
    cfg = tg_config(config_for, tg)
    async with gateway(cfg) as app:
        # Telegram did not state the size in the message; getFile refuses (> 20 MB)
        pushed = tg.push_media(111, "document", b"tiny", file_name="movie.txt", mime_type="text/plain")
        msg = pushed.update["message"]
        tg.files[msg["document"]["file_id"]]["file_size"] = 30 * 1024 * 1024
        del msg["document"]["file_size"]
        [answer] = await answered(tg, app, 1, 111)
    assert "movie.txt" in answer["text"] and "too large" in answer["text"]
    assert not tg.file_downloads and not fake_llm.requests


async def test_bot_token_never_reaches_logs_messages_exports_or_the_model(
    tg, fake_llm, stt, config_for, caplog, tmp_path
):
    caplog.set_level(logging.DEBUG)
    cfg = tg_config(config_for, tg, llm={"vision": True}, transcription={"base_url": stt.base_url})
    async with gateway(cfg) as app:
        tg.push_media(111, "photo", png(), caption="photo")
        await answered(tg, app, 1, 111)
        tg.push_media(111, "voice", b"OggS")
        await answered(tg, app, 2, 111)
        tg.push_media(111, "document", pdf("hello"), file_name="a.pdf", mime_type="application/pdf")
        await answered(tg, app, 3, 111)
        # a download that fails after getFile answered (the file URL holds the token)
        tg.lost_files.add(tg.add_file(b"")["file_id"])  # ids are sequential: the next file is lost too
        pushed = tg.push_media(111, "document", b"text", file_name="gone.txt", mime_type="text/plain")
        tg.lost_files.add(pushed.update["message"]["document"]["file_id"])
        await answered(tg, app, 4, 111)
    sent_texts = [m["text"] for m in tg.sent_messages(111)]
    assert any("couldn't download gone.txt" in t for t in sent_texts)
    assert tg.file_downloads  # files really were fetched with the token in the URL
    profile = profile_of(cfg, "telegram-111")
    info = find_tenant(cfg, "telegram-111")
    archive = export_profile(cfg, info, tmp_path / "export.tar.gz")
    backup = backup_data_dir(cfg.data_dir, tmp_path / "backups")
    haystacks: dict[str, bytes] = {
        "logs": "\n".join(r.getMessage() + (r.exc_text or "") for r in caplog.records).encode(),
        "model requests": json.dumps(fake_llm.requests).encode(),
        "chat": json.dumps(sent_texts).encode(),
        "transcription requests": repr(stt.requests).encode(),
    }
    for path in [*list(profile.rglob("*")), cfg.data_dir / "gateway.db"]:
        if path.is_file():
            haystacks[str(path)] = path.read_bytes()
    for tar_path in (archive, backup):
        with tarfile.open(tar_path) as tar:
            for member in tar.getmembers():
                if member.isfile():
                    haystacks[f"{tar_path.name}:{member.name}"] = tar.extractfile(member).read()
    secret = TOKEN.split(":", 1)[1].encode()
    leaks = [where for where, data in haystacks.items() if secret in data]
    assert not leaks, f"bot token found in: {leaks}"


async def test_files_stay_in_the_profile_of_the_lane_they_arrived_in(tg, fake_llm, config_for):
    image = png(4, 4)
    cfg = tg_config(config_for, tg, llm={"vision": True}, tenancy={"group_sessions_per_user": False})
    async with gateway(cfg) as app:
        tg.push_media(111, "photo", image, chat_id=GROUP, caption=f"@{BOT} group photo")
        await answered(tg, app, 1, GROUP)
    group_profile = profile_of(cfg, f"telegram-chat-{GROUP}")
    assert list(media_files(group_profile).values()) == [image]
    assert not media_files(profile_of(cfg, "telegram-111"))


# ----------------------------------------------------------------------------- reply context


async def test_reply_to_the_bots_message_carries_the_quoted_text(tg, fake_llm, config_for):
    cfg = tg_config(config_for, tg)
    fake_llm.script("The capital of Australia is Canberra.")
    async with gateway(cfg) as app:
        tg.push_private(111, "capital of australia?")
        [bot_reply] = await answered(tg, app, 1, 111)
        tg.push_private(111, "are you sure?", reply_to_message_id=bot_reply["message_id"])
        await answered(tg, app, 2, 111)
    text = last_user_text(fake_llm.requests[-1])
    assert text.startswith('[In reply to you: "The capital of Australia is Canberra."]')
    assert text.endswith("are you sure?")


async def test_reply_to_another_group_member_carries_their_text(tg, fake_llm, config_for):
    cfg = tg_config(config_for, tg)
    async with gateway(cfg) as app:
        other = tg.push_group(GROUP, 222, "the meeting moved to 3pm", username="bob")  # not for the bot
        tg.push_group(GROUP, 111, f"@{BOT} is that right?", reply_to_message_id=other.message_id)
        await answered(tg, app, 1, GROUP)
    [request] = fake_llm.requests
    assert '[In reply to bob: "the meeting moved to 3pm"]' in last_user_text(request)
