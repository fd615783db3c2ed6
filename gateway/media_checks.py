"""`doctor` checks for media: the model takes an image (with `llm.vision`) and the
transcription endpoint answers (with `transcription.base_url`)."""

from __future__ import annotations

import base64
import struct
import zlib

import httpx

from agent.llm import LLMClient, LLMError
from core.settings import Config


def tiny_png() -> bytes:
    """A valid 1x1 white PNG (what the vision probe sends)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", struct.pack(">IIBBBBB", 1, 1, 8, 2, 0, 0, 0))
        + chunk(b"IDAT", zlib.compress(b"\x00\xff\xff\xff"))
        + chunk(b"IEND", b"")
    )


async def check_vision(cfg: Config) -> tuple[bool, str]:
    """Send the model one tiny image part; a refusal means `llm.vision` must be turned off."""
    url = "data:image/png;base64," + base64.b64encode(tiny_png()).decode("ascii")
    messages = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "Reply with OK."}, {"type": "image_url", "image_url": {"url": url}}],
        }
    ]
    try:
        async with LLMClient.from_config(cfg.llm) as client:
            await client.chat(messages, max_tokens=5)
    except LLMError as err:
        status = f"HTTP {err.status}" if err.status else err.kind
        return False, (
            f"model {cfg.llm.model} refused an image ({status}); it may not support vision: "
            "set llm.vision: false or pick a vision model"
        )
    return True, f"model {cfg.llm.model} accepts images"


async def check_transcription(cfg: Config) -> tuple[bool, str]:
    """The transcription endpoint is reachable (any HTTP answer counts; 401/403 does not)."""
    t = cfg.transcription
    if t.api_key_env and not t.api_key():
        return False, f"environment variable {t.api_key_env} (transcription.api_key_env) is not set"
    url = (t.base_url or "").rstrip("/") + "/audio/transcriptions"
    headers = {"Authorization": f"Bearer {t.api_key()}"} if t.api_key() else {}
    try:
        async with httpx.AsyncClient(timeout=10) as client:
            resp = await client.post(url, headers=headers, data={"model": t.model})
    except httpx.HTTPError as err:
        return False, f"cannot reach {t.base_url} ({type(err).__name__}); is the server running?"
    if resp.status_code in (401, 403):
        return False, f"{t.base_url} rejected the API key (HTTP {resp.status_code})"
    if resp.status_code == 404:
        return False, f"{t.base_url} has no /audio/transcriptions endpoint (HTTP 404)"
    return True, f"{t.base_url} is reachable (model {t.model})"
