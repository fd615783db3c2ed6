"""A tenant's stored files (`<profile>/media/`) and how stored images reach the model.

A user message with images keeps them in `meta["images"]` as profile-relative paths
(`[{"path": "media/<uid>-photo.jpg", "mime": "image/jpeg", "name": "photo.jpg"}]`). The
compression view carries them on the item (`_images`), `finalize` turns them into
`image_url` parts with a `hermes-media:` placeholder URL, and `inline_images` swaps each
placeholder for a `data:` URL read from the profile just before the request (model servers
cannot fetch platform URLs, and Telegram's carry the bot token). Paths are resolved inside
the profile only: a path that would leave `media/` is dropped.
"""

from __future__ import annotations

import asyncio
import base64
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agent.attachments import sniff_image
from agent.messages import new_uid
from agent.vault import ProfileFiles, VaultError, as_files

MEDIA_DIR = "media"
PLACEHOLDER_SCHEME = "hermes-media:"
#: Token estimate of one image in a prompt: OpenAI's cost of a 1024x1024 high-detail
#: image (4 tiles x 170 + 85). Local vision models use 256-1,500; this sits in between.
IMAGE_TOKENS = 765

_SAFE_NAME = re.compile(r"[^A-Za-z0-9._-]+")


def safe_name(name: str, fallback: str) -> str:
    """A file name that is harmless on any filesystem (keeps the extension)."""
    cleaned = _SAFE_NAME.sub("_", name or "").strip("._")[-80:]
    return cleaned or fallback


def save_media(
    profile: ProfileFiles | Path,
    data: bytes,
    name: str,
    key: str | None = None,
    fallback: str = "file",
    guard: Callable[[], None] | None = None,
) -> str:
    """Store `data` under the profile's media/ as `<key>-<name>` and return its
    profile-relative path; the same key and name rewrite the same file (blocking: run it
    off the event loop). `guard` may raise to refuse the write (cluster mode: lease lost).
    In an encrypted profile the file is sealed and named by an HMAC of `key` alone: its
    name says nothing of its content or original name (docs/privacy.md#encryption-at-rest)."""
    files = as_files(profile)
    if guard is not None:
        guard()
    folder = files.path(MEDIA_DIR)
    folder.mkdir(mode=0o700, exist_ok=True)
    if files.sealed:
        rel = f"{MEDIA_DIR}/{files.hidden_name(f'media {key or new_uid()}')}"
    else:
        rel = f"{MEDIA_DIR}/{safe_name(key or new_uid(), 'file')}-{safe_name(name, fallback)}"
    files.write_bytes(rel, data)
    return rel


def resolve(profile_path: Path, rel: str) -> Path | None:
    """The file of a profile-relative media path, or None if it would leave media/."""
    base = (Path(profile_path) / MEDIA_DIR).resolve()
    try:
        full = (Path(profile_path) / rel).resolve()
    except (OSError, ValueError):
        return None
    if full.parent != base:
        return None
    return full


def image_refs(meta: dict[str, Any]) -> list[dict[str, Any]]:
    """The well-formed image references of a message's meta."""
    refs = meta.get("images") if isinstance(meta, dict) else None
    if not isinstance(refs, list):
        return []
    return [r for r in refs if isinstance(r, dict) and isinstance(r.get("path"), str)]


def image_parts(text: str, refs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI content parts: the text, then one image part per reference (placeholder URLs)."""
    parts: list[dict[str, Any]] = [{"type": "text", "text": text or "(image)"}]
    for ref in refs:
        parts.append({"type": "image_url", "image_url": {"url": PLACEHOLDER_SCHEME + ref["path"]}})
    return parts


def _read_data_url(files: ProfileFiles, rel: str) -> str | None:
    full = resolve(files.root, rel)
    if full is None:
        return None
    try:
        data = files.unseal(full.read_bytes(), rel)
    except (OSError, VaultError):
        return None
    mime = sniff_image(data)
    if mime is None:
        return None
    return f"data:{mime};base64,{base64.b64encode(data).decode('ascii')}"


def _inline_sync(wire: list[dict[str, Any]], files: ProfileFiles) -> list[dict[str, Any]]:
    out = []
    for msg in wire:
        content = msg.get("content")
        if not isinstance(content, list):
            out.append(msg)
            continue
        parts: list[Any] = []
        for part in content:
            url = (part.get("image_url") or {}).get("url", "") if isinstance(part, dict) else ""
            if isinstance(url, str) and url.startswith(PLACEHOLDER_SCHEME):
                data_url = _read_data_url(files, url[len(PLACEHOLDER_SCHEME) :])
                if data_url is None:
                    parts.append({"type": "text", "text": "[an image that is no longer available]"})
                else:
                    parts.append({"type": "image_url", "image_url": {"url": data_url}})
            else:
                parts.append(part)
        out.append({**msg, "content": parts})
    return out


async def inline_images(wire: list[dict[str, Any]], profile: ProfileFiles | Path) -> list[dict[str, Any]]:
    """`wire` with every placeholder image part replaced by a data: URL of the stored file
    (opened with the tenant's key when sealed; a missing file becomes a short text part).
    Messages without images are passed as is."""
    if not any(isinstance(m.get("content"), list) for m in wire):
        return wire
    return await asyncio.to_thread(_inline_sync, wire, as_files(profile))
