"""What an attachment is and what text it holds: pure functions over bytes, no I/O.

`kind_of` sorts an attachment into image / audio / text / pdf / other from the platform's
type, the file name and the MIME type; `extract_text` reads a text-like file or a PDF's
text layer (pypdf) and cuts it at a character budget.
"""

from __future__ import annotations

import io
import logging
import mimetypes
from pathlib import PurePosixPath
from typing import Literal

Kind = Literal["image", "audio", "text", "pdf", "other"]

log = logging.getLogger("hermes.attachments")

IMAGE_MIMES = frozenset({"image/jpeg", "image/png", "image/gif", "image/webp"})
_AUDIO_TYPES = frozenset({"voice", "audio", "video_note"})
TEXT_EXTENSIONS = frozenset(
    {
        ".txt",
        ".md",
        ".markdown",
        ".rst",
        ".csv",
        ".tsv",
        ".json",
        ".jsonl",
        ".yaml",
        ".yml",
        ".toml",
        ".ini",
        ".cfg",
        ".conf",
        ".log",
        ".xml",
        ".html",
        ".htm",
        ".css",
        ".sql",
        ".tex",
        ".py",
        ".js",
        ".mjs",
        ".ts",
        ".tsx",
        ".jsx",
        ".java",
        ".kt",
        ".c",
        ".h",
        ".cc",
        ".cpp",
        ".hpp",
        ".cs",
        ".go",
        ".rs",
        ".rb",
        ".php",
        ".swift",
        ".scala",
        ".sh",
        ".bash",
        ".zsh",
        ".ps1",
        ".lua",
        ".r",
        ".pl",
        ".hs",
        ".ex",
        ".exs",
        ".erl",
        ".clj",
        ".dart",
        ".vue",
        ".svelte",
        ".diff",
        ".patch",
    }
)
_TEXT_MIMES = frozenset(
    {
        "application/json",
        "application/xml",
        "application/x-yaml",
        "application/yaml",
        "application/csv",
        "application/x-sh",
        "application/javascript",
        "application/sql",
    }
)


def suffix_of(name: str) -> str:
    return PurePosixPath(name or "").suffix.lower()


def sniff_image(data: bytes) -> str | None:
    """The MIME type of an image by its magic bytes (only the formats vision models take)."""
    if data.startswith(b"\xff\xd8\xff"):
        return "image/jpeg"
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "image/png"
    if data[:6] in (b"GIF87a", b"GIF89a"):
        return "image/gif"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    return None


def kind_of(att_type: str, name: str, mime: str) -> Kind:
    """image / audio / text / pdf / other for one attachment, before it is downloaded."""
    mime = (mime or "").lower().split(";", 1)[0].strip()
    if not mime and name:
        mime = mimetypes.guess_type(name)[0] or ""
    suffix = suffix_of(name)
    if att_type == "photo" or (mime in IMAGE_MIMES and att_type not in ("sticker", "animation")):
        return "image"
    if att_type in _AUDIO_TYPES or mime.startswith("audio/"):
        return "audio"
    if mime == "application/pdf" or suffix == ".pdf":
        return "pdf"
    if mime.startswith("text/") or mime in _TEXT_MIMES or suffix in TEXT_EXTENSIONS:
        return "text"
    return "other"


def clip(text: str, max_chars: int) -> tuple[str, bool]:
    """`text` cut to `max_chars` (True when something was cut)."""
    if len(text) <= max_chars:
        return text, False
    return text[:max_chars], True


def decode_text(data: bytes) -> str | None:
    """A text file's content (UTF-8, UTF-16 with BOM, else Latin-1), None if it looks binary."""
    if data.startswith((b"\xff\xfe", b"\xfe\xff")):
        try:
            return data.decode("utf-16")
        except UnicodeDecodeError:
            return None
    if b"\x00" in data[:8192]:
        return None
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError:
        return data.decode("latin-1")


def pdf_text(data: bytes, max_chars: int) -> str | None:
    """The text layer of a PDF, page by page until `max_chars + 1` are read; None when the
    file is not a readable PDF (broken, encrypted)."""
    from pypdf import PdfReader
    from pypdf.errors import PyPdfError

    try:
        reader = PdfReader(io.BytesIO(data))
        if reader.is_encrypted:
            return None
        pages: list[str] = []
        total = 0
        for page in reader.pages:
            text = (page.extract_text() or "").strip()
            if text:
                pages.append(text)
                total += len(text) + 2
            if total > max_chars:
                break
        return "\n\n".join(pages)
    except (PyPdfError, ValueError, KeyError, TypeError, AttributeError, OSError, RecursionError) as err:
        log.info("pdf text extraction failed (%s)", type(err).__name__)
        return None


def extract_text(kind: Kind, data: bytes, max_chars: int) -> tuple[str | None, bool]:
    """(text, truncated) of a text-like file or a PDF; (None, False) when unreadable."""
    if kind == "pdf":
        text = pdf_text(data, max_chars)
    elif kind == "text":
        text = decode_text(data)
    else:
        return None, False
    if text is None:
        return None, False
    return clip(text.strip(), max_chars)
