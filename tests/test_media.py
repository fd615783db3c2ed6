"""Media below the platforms: token estimates of stored images, compression taking old
images out of the context (files stay), export/backup/delete, doctor checks, and the pure
attachment helpers. The platform is a loopback adapter that serves downloads from memory;
the model and the transcription server are the real fakes on 127.0.0.1."""

from __future__ import annotations

import base64
import json
import tarfile
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from agent.attachments import kind_of
from agent.compression_stages import compute_threshold_tokens, is_summary_request
from agent.media import IMAGE_TOKENS, resolve
from agent.messages import StoredMessage
from agent.tokens import TokenCounter
from core.messages import Attachment, DownloadError, InboundMessage
from gateway.backup import backup_data_dir
from gateway.build import build_gateway
from gateway.media import MediaIntake
from gateway.media_checks import check_transcription, check_vision
from gateway.tenants import delete_tenant, export_profile, find_tenant
from tenancy.keys import tenant_dir
from tests.conftest import RecordingAdapter
from tests.fakes.llm import FakeLLM, image_urls, message_text, reply
from tests.fakes.transcription import FakeTranscription
from tests.media_files import png

CTX = 4000


class FilesAdapter(RecordingAdapter):
    """The loopback platform with files: `download` serves `files[file_id]`."""

    def __init__(self) -> None:
        super().__init__()
        self.files: dict[str, bytes] = {}
        self._n = 0

    def photo(self, user: str, data: bytes, text: str = "") -> InboundMessage:
        self._n += 1
        fid = f"f{self._n}"
        self.files[fid] = data
        return InboundMessage(
            platform=self.platform,
            chat_id=f"dm-{user}",
            chat_type="dm",
            user_id=user,
            user_name=user,
            message_id=f"p{self._n}",
            text=text,
            attachments=(Attachment(type="photo", name=f"photo{self._n}.png", file_id=fid, size=len(data)),),
        )

    async def download(self, attachment: Attachment, max_bytes: int) -> bytes:
        if attachment.file_id not in self.files:
            raise DownloadError("the file is gone")
        return self.files[attachment.file_id]


@asynccontextmanager
async def gateway(config_for, **sections):
    adapter = FilesAdapter()
    app = build_gateway(config_for(**sections), [adapter])
    await app.start()
    try:
        yield app, adapter
    finally:
        await app.stop()


async def send(app, adapter, msg) -> list[str]:
    before = len(adapter.sent)
    await adapter.sink(msg)
    assert await app.drain(20)
    return [m.text for m in adapter.sent[before:]]


def media_of(app, user: str) -> list[Path]:
    folder = tenant_dir(app.cfg.data_dir, f"testchat-{user}") / "media"
    return sorted(p for p in folder.iterdir() if not p.name.startswith(".")) if folder.is_dir() else []


# ----------------------------------------------------------------------------- tokens


def test_stored_images_count_toward_the_session_tokens_with_the_documented_estimate():
    counter = TokenCounter(None)  # chars/4
    plain = StoredMessage(session_id="s", role="user", content="x" * 40)
    with_images = StoredMessage(
        session_id="s",
        role="user",
        content="x" * 40,
        meta={"images": [{"path": "media/a.png"}, {"path": "media/b.png"}]},
    )
    assert counter.count_message(with_images) - counter.count_message(plain) == 2 * IMAGE_TOKENS == 1530
    # the pre-request estimate counts an inline image as IMAGE_TOKENS, never its base64 size
    big = "data:image/png;base64," + "A" * 400_000
    wire = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "x" * 40}, {"type": "image_url", "image_url": {"url": big}}],
        }
    ]
    assert TokenCounter.estimate_rough(wire) == 10 + IMAGE_TOKENS


# ----------------------------------------------------------------------------- compression


def summarising_model(request: dict):
    if is_summary_request(request.get("messages") or []):
        return reply("## Goals\n- looked at photos")
    return reply("ok")


@pytest.mark.parametrize("in_place", [True, False])
async def test_compression_takes_old_images_out_of_the_context_and_keeps_the_files(config_for, fake_llm, in_place):
    fake_llm.responder = summarising_model
    sections = {
        "llm": {"context_length": CTX, "vision": True},
        "limits": {"rate_limit_per_minute": 1000},
        "compression": {"protect_first_n": 1, "protect_last_n": 2, "in_place": in_place},
    }
    assert compute_threshold_tokens(context_length=CTX, threshold=0.5) == 3000
    async with gateway(config_for, **sections) as (app, adapter):
        images = [png(i + 1, 1) for i in range(4)]
        for i, image in enumerate(images):
            await send(app, adapter, adapter.photo("ann", image, f"photo number {i}"))
        summaries = [r for r in fake_llm.requests if is_summary_request(r["messages"])]
        assert summaries, "four images (4 x 765 tokens) pass the 3,000-token threshold"
        last = fake_llm.requests[-1]
        assert not is_summary_request(last["messages"])
        assert len(image_urls(last)) == 1  # old images left the context, the newest stayed
        assert base64.b64decode(image_urls(last)[0].split(",", 1)[1]) == images[-1]
        first_user = next(m for m in last["messages"] if m["role"] == "user")  # kept in the head
        assert "photo number 0" in message_text(first_user)
        assert "taken out of the context to save space: photo1.png; the file is kept" in message_text(first_user)
        assert sorted(p.read_bytes() for p in media_of(app, "ann")) == sorted(images)  # every file stays
        assert not fake_llm.violations


# ----------------------------------------------------------------------------- export, backup, delete


async def test_stored_media_is_part_of_export_backup_and_delete(config_for, fake_llm, tmp_path):
    image = png(7, 7)
    async with gateway(config_for, llm={"vision": True}) as (app, adapter):
        await send(app, adapter, adapter.photo("bob", image, "keep this"))
        [stored] = media_of(app, "bob")
        cfg = app.cfg
        info = find_tenant(cfg, "testchat-bob")
        archive = export_profile(cfg, info, tmp_path / "bob.tar.gz")
        backup = backup_data_dir(cfg.data_dir, tmp_path / "backups")
    with tarfile.open(archive) as tar:
        assert tar.extractfile(f"profile/media/{stored.name}").read() == image
    with tarfile.open(backup) as tar:
        [member] = [m for m in tar.getmembers() if m.name.endswith(f"/media/{stored.name}")]
        assert tar.extractfile(member).read() == image
    delete_tenant(cfg, find_tenant(cfg, "testchat-bob"))
    assert not stored.exists()
    assert image not in b"".join(p.read_bytes() for p in cfg.data_dir.rglob("*") if p.is_file())


# ----------------------------------------------------------------------------- doctor


async def test_doctor_checks_that_the_model_accepts_an_image(config_for, tmp_path):
    async with FakeLLM(vision=False) as blind, FakeLLM(vision=True) as seeing:
        cfg = config_for(llm={"base_url": blind.base_url, "vision": True})
        ok, detail = await check_vision(cfg)
        assert not ok and "llm.vision: false" in detail
        cfg = config_for(llm={"base_url": seeing.base_url, "vision": True})
        ok, detail = await check_vision(cfg)
        assert ok, detail
        assert image_urls(seeing.requests[-1])


async def test_doctor_checks_the_transcription_endpoint(config_for, monkeypatch):
    monkeypatch.setenv("HERMES_STT_KEY", "stt-key")
    async with FakeTranscription(api_key="stt-key") as stt:
        ok, detail = await check_transcription(
            config_for(transcription={"base_url": stt.base_url, "api_key_env": "HERMES_STT_KEY"})
        )
        assert ok, detail
        monkeypatch.setenv("HERMES_STT_KEY", "wrong")
        ok, detail = await check_transcription(
            config_for(transcription={"base_url": stt.base_url, "api_key_env": "HERMES_STT_KEY"})
        )
        assert not ok and "rejected the API key" in detail


# ----------------------------------------------------------------------------- pure helpers


def test_attachment_kinds():
    assert kind_of("photo", "photo", "") == "image"
    assert kind_of("document", "scan.PNG", "") == "image"
    assert kind_of("voice", "voice", "audio/ogg") == "audio"
    assert kind_of("file", "talk.m4a", "audio/mp4") == "audio"
    assert kind_of("document", "report.pdf", "application/octet-stream") == "pdf"
    assert kind_of("document", "main.rs", "") == "text"
    assert kind_of("document", "data.json", "application/json") == "text"
    assert kind_of("document", "setup.exe", "application/x-msdownload") == "other"
    assert kind_of("sticker", "sticker", "image/webp") == "other"


def test_media_paths_never_leave_the_profile(tmp_path):
    profile = tmp_path / "profiles" / "a"
    (profile / "media").mkdir(parents=True)
    (profile / "media" / "x.png").write_bytes(b"x")
    assert resolve(profile, "media/x.png") == (profile / "media" / "x.png").resolve()
    for bad in ("../b/media/x.png", "media/../../b/state.db", "/etc/passwd", "media/sub/../../state.db"):
        assert resolve(profile, bad) is None


async def test_a_failed_download_is_reported_and_the_text_still_answered(config_for, fake_llm):
    async with gateway(config_for, llm={"vision": True}) as (app, adapter):
        msg = adapter.photo("cy", png(), "hello with a photo")
        adapter.files.clear()
        out = await send(app, adapter, msg)
    assert "couldn't download photo1.png" in out[0] and "the file is gone" in out[0]
    assert out[1].startswith("ok: hello with a photo")
    assert json.dumps(fake_llm.requests).count("could not be downloaded") == 1


async def test_a_message_prepared_again_after_a_crash_rewrites_its_files_instead_of_duplicating(config_for, tmp_path):
    adapter = FilesAdapter()
    msg = adapter.photo("dee", png(), "again")
    intake = MediaIntake(config_for(llm={"vision": True}))
    first = await intake.prepare(msg, adapter, tmp_path, "in-abc")
    second = await intake.prepare(msg, adapter, tmp_path, "in-abc")
    assert first.meta == second.meta
    assert len([p for p in (tmp_path / "media").iterdir() if not p.name.startswith(".")]) == 1


def test_a_media_write_under_a_lost_lease_is_refused_and_nothing_is_written(tmp_path: Path):
    from agent.media import MEDIA_DIR, save_media

    class LeaseGone(Exception):
        pass

    def lost_lease() -> None:
        raise LeaseGone("tenant lease lost")

    with pytest.raises(LeaseGone):
        save_media(tmp_path, b"\x89PNG data", "photo.png", "k1", guard=lost_lease)
    assert not (tmp_path / MEDIA_DIR).exists()
    assert save_media(tmp_path, b"\x89PNG data", "photo.png", "k1", guard=lambda: None).startswith(MEDIA_DIR)
