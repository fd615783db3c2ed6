"""Attachments and reply context of one inbound message, made ready for the model.

Runs in the lane worker, inside the profile of the lane the message arrived in (the only
place its files are stored): photos and image files are downloaded into `media/` and
referenced from the message (`meta.images`, sent as image parts when `llm.vision` is on),
voice notes and audio are kept in `media/` and transcribed into the message text,
text-like files and PDFs are kept and their text attached up to
`limits.max_attachment_chars`, anything else is named. Files over
`limits.max_attachment_bytes` are refused before download when the platform states the
size. Downloads go through the adapter's `download` (the platform's own client library);
their errors are reduced to safe words here, so no file URL (Telegram's carry the bot
token) reaches a log line, a notice, the prompt or a stored message.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent.attachments import Kind, extract_text, kind_of, sniff_image
from agent.media import MEDIA_DIR, save_media
from agent.metering import AudioCharge
from agent.transcription import Transcriber, TranscriptionError
from agent.vault import ProfileFiles, as_files
from core.messages import Attachment, DownloadError, InboundMessage
from core.protocols import Downloads
from core.settings import Config

log = logging.getLogger("hermes.media")

REPLY_QUOTE_MAX_CHARS = 1500
VISION_OFF_MARK = ".vision-off-told"  # in media/: this tenant was told images are not read
VISION_OFF_NOTICE = (
    "Note: I can't see images here (image reading is turned off), so I only read the text you send with them."
)


def human_bytes(n: int) -> str:
    for unit in ("bytes", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:,} {unit}" if unit == "bytes" else f"{n:.1f} {unit}".replace(".0 ", " ")
        n /= 1024  # type: ignore[assignment]
    return f"{n} bytes"  # pragma: no cover


_AUDIO_EXTENSIONS = {
    "audio/ogg": ".ogg",
    "audio/opus": ".ogg",
    "audio/mpeg": ".mp3",
    "audio/mp3": ".mp3",
    "audio/mp4": ".m4a",
    "audio/x-m4a": ".m4a",
    "audio/wav": ".wav",
    "audio/x-wav": ".wav",
    "audio/webm": ".webm",
    "audio/flac": ".flac",
    "video/mp4": ".mp4",
}


def file_name(att: Attachment, kind: str) -> str:
    """The attachment's name with an extension (speech-to-text servers tell the format by
    it; Telegram voice notes come without a name)."""
    name = att.name or att.type
    if "." in name.strip("."):
        return name
    if kind == "audio":
        mime = (att.mime_type or "").split(";", 1)[0].strip().lower()
        return name + _AUDIO_EXTENSIONS.get(mime, ".mp4" if att.type == "video_note" else ".ogg")
    return name


@dataclass
class Prepared:
    """One message as the model gets it: `text` (also what history and search show),
    `meta` (stored images and files), `notices` for the person, and whether there is
    anything for the model to answer at all."""

    text: str
    meta: dict[str, Any] = field(default_factory=dict)
    notices: list[str] = field(default_factory=list)
    answerable: bool = True


def reply_context(msg: InboundMessage) -> str:
    """The quoted message a person replied to, as a line before their text ("" if none)."""
    quote = (msg.reply_to_text or "").strip()
    if not quote:
        return ""
    if len(quote) > REPLY_QUOTE_MAX_CHARS:
        quote = quote[:REPLY_QUOTE_MAX_CHARS] + "…"
    who = f" {msg.reply_to_author}" if msg.reply_to_author else ""
    return f'[In reply to{who}: "{quote}"]'


class MediaIntake:
    """Turns an inbound message's attachments into model input; per gateway, holds no
    per-tenant state (the profile path is passed in)."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg

    def _transcriber(self) -> Transcriber | None:
        t = self.cfg.transcription
        if not t.base_url:
            return None
        return Transcriber(t.base_url, t.model, api_key=t.api_key(), timeout_s=t.timeout_s)

    async def prepare(
        self,
        msg: InboundMessage,
        adapter: Any,
        profile: ProfileFiles | Path,
        uid: str,
        guard: Callable[[], None] | None = None,
        charge: AudioCharge | None = None,
        vision: bool | None = None,
    ) -> Prepared:
        """`uid` (the stored message's) names the files, so a message replayed after a
        crash rewrites its files instead of storing them twice. `vision`: whether the model
        the tenant chose reads images (None: `llm.vision`). `profile`: the profile's files,
        where the stored files are sealed when it is encrypted (a bare path: a plain one)."""
        files = as_files(profile)
        quote = reply_context(msg)
        body = msg.text.strip()
        if not msg.attachments:
            return Prepared("\n".join(p for p in (quote, msg.text) if p))
        work = _Work(
            files,
            uid,
            Prepared(""),
            said=[body] if body else [],
            guard=guard,
            charge=charge,
            vision=self.cfg.llm.vision if vision is None else vision,
        )
        content = bool(body)
        for n, att in enumerate(msg.attachments):
            got = await self._one(att, n, adapter, work)
            content = content or got
        parts = (quote, "\n".join(work.said), "\n".join(work.notes), "\n\n".join(work.blocks))
        work.out.text = "\n".join(p for p in parts if p)
        work.out.answerable = content
        return work.out

    async def _one(self, att: Attachment, n: int, adapter: Any, work: _Work) -> bool:
        """Handle one attachment; True when it gave the model something to answer."""
        kind = kind_of(att.type, att.name, att.mime_type)
        label = att.name or att.type
        if kind == "image" and not work.vision:
            work.notes.append(f"[The person sent an image ({label}); image reading is off, so you cannot see it.]")
            if await asyncio.to_thread(_first_time, work.files.root, work.guard):
                work.out.notices.append(VISION_OFF_NOTICE)
            return True
        if kind == "other":
            work.notes.append(f"[attached {att.type}: {label} (not read: this kind of file isn't supported)]")
            return True
        if not isinstance(adapter, Downloads):
            work.notes.append(f"[attached {att.type}: {label} (not read: files can't be fetched here)]")
            return True
        data = await self._fetch(att, label, adapter, work)
        if data is None:
            return False
        key = work.file_key(n)
        if kind == "image":
            return await self._image(att, label, data, key, work)
        name = file_name(att, kind)
        rel = await asyncio.to_thread(save_media, work.files, data, name, key, att.type, work.guard)
        work.out.meta.setdefault("files", []).append({"path": rel, "name": label, "kind": kind, "bytes": len(data)})
        if kind == "audio":
            return await self._audio(att, name, label, data, work)
        return await self._document(kind, label, data, work)

    async def _fetch(self, att: Attachment, label: str, adapter: Downloads, work: _Work) -> bytes | None:
        """The attachment's bytes through the adapter, or None (and a notice) when it is too
        large or the download failed. Errors are reduced to safe words (no URLs)."""
        limit = self.cfg.limits.max_attachment_bytes
        if att.size and att.size > limit:  # refused before anything is downloaded
            work.out.notices.append(self._too_big(label, att.size))
            work.notes.append(f"[attached {label}: not read, over the size limit]")
            return None
        try:
            data = bytes(await adapter.download(att, limit))
        except DownloadError as err:
            if err.too_big:
                work.out.notices.append(self._too_big(label, att.size or None))
            else:
                work.out.notices.append(f"I couldn't download {label}: {err}. Please try sending it again.")
            work.notes.append(f"[attached {label}: could not be downloaded]")
            return None
        except Exception as err:  # a download must never break the turn, nor leak its URL
            log.warning("download of a %s attachment failed (%s)", att.type, type(err).__name__)
            work.out.notices.append(f"I couldn't download {label}. Please try sending it again.")
            work.notes.append(f"[attached {label}: could not be downloaded]")
            return None
        if len(data) > limit:
            work.out.notices.append(self._too_big(label, len(data)))
            work.notes.append(f"[attached {label}: not read, over the size limit]")
            return None
        return data

    async def _image(self, att: Attachment, label: str, data: bytes, key: str, work: _Work) -> bool:
        mime = sniff_image(data)
        if mime is None:
            work.notes.append(f"[attached {label}: not an image format I can read]")
            return True
        fallback = "photo." + mime.split("/", 1)[1].replace("jpeg", "jpg")
        name = att.name if att.name and "." in att.name else fallback
        rel = await asyncio.to_thread(save_media, work.files, data, name, key, "image", work.guard)
        work.out.meta.setdefault("images", []).append({"path": rel, "name": label, "mime": mime})
        work.notes.append(f"[image: {label}]")
        return True

    async def _audio(self, att: Attachment, name: str, label: str, data: bytes, work: _Work) -> bool:
        """The transcript becomes what the person said; failures are told, not guessed at."""
        transcriber = self._transcriber()
        what = "voice note" if att.type in ("voice", "video_note") else f"audio file {label}"
        if transcriber is None:
            work.out.notices.append(
                f"I can't listen to your {what}: no transcription service is configured "
                "(transcription.base_url). Please send it as text."
            )
            work.notes.append(f"[{what}: not transcribed]")
            return False
        try:
            if work.charge is not None:
                await work.charge.check()  # over the budget: no call (BudgetExceeded ends the turn)
            heard = await transcriber.transcribe(
                data, name, att.mime_type or "audio/ogg", timed=work.charge is not None
            )
            transcript = heard.text
            if work.charge is not None:
                await work.charge.minutes(heard.seconds)
        except TranscriptionError as err:
            work.out.notices.append(f"I couldn't transcribe your {what}: {err}. Please try again or send it as text.")
            work.notes.append(f"[{what}: transcription failed]")
            return False
        if not transcript:
            work.out.notices.append(f"I couldn't hear any words in your {what}.")
            work.notes.append(f"[{what}: no speech recognised]")
            return False
        work.said.append(transcript)
        work.out.meta["transcribed"] = True
        return True

    async def _document(self, kind: Kind, label: str, data: bytes, work: _Work) -> bool:
        """A text file's or PDF's text, cut at `limits.max_attachment_chars`, as a block."""
        max_chars = self.cfg.limits.max_attachment_chars
        text, cut = await asyncio.to_thread(extract_text, kind, data, max_chars)
        if text is None:
            work.notes.append(f"[attached {label}: could not be read as text]")
        elif not text:
            work.notes.append(
                f"[attached {label}: it has no text layer]" if kind == "pdf" else f"[attached {label}: empty]"
            )
        else:
            head = f"[attached file {label}" + (f", first {max_chars:,} characters" if cut else "") + "]"
            work.blocks.append(f"{head}\n{text}\n[end of {label}]")
        return True

    def _too_big(self, label: str, size: int | None) -> str:
        limit = human_bytes(self.cfg.limits.max_attachment_bytes)
        size_txt = f" ({human_bytes(size)})" if size else ""
        return f"{label}{size_txt} is too large: I can take files up to {limit}, so I didn't read it."


@dataclass
class _Work:
    """One message being prepared: where its files go and the text collected so far."""

    files: ProfileFiles  # the profile's (sealed when it is encrypted)
    uid: str
    out: Prepared
    said: list[str] = field(default_factory=list)  # what the person said (text, transcripts)
    notes: list[str] = field(default_factory=list)  # short bracketed notes about attachments
    blocks: list[str] = field(default_factory=list)  # extracted document text
    guard: Callable[[], None] | None = None  # may raise to refuse a write (cluster mode: lease lost)
    charge: AudioCharge | None = None  # transcription's price, counted to the lane's tenant
    vision: bool = False  # the chosen model reads images

    def file_key(self, n: int) -> str:
        return f"{self.uid}-{n}"


def _first_time(profile_path: Path, guard: Callable[[], None] | None = None) -> bool:
    """True once per profile: the vision-off notice has not been shown to this tenant yet."""
    if guard is not None:
        guard()
    folder = Path(profile_path) / MEDIA_DIR
    folder.mkdir(mode=0o700, exist_ok=True)
    try:
        with open(folder / VISION_OFF_MARK, "x", encoding="utf-8") as fh:
            fh.write("told\n")
        return True
    except FileExistsError:
        return False
