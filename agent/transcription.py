"""Speech to text through an OpenAI-compatible `/v1/audio/transcriptions` endpoint.

Works with whisper.cpp's server (`--inference-path /v1/audio/transcriptions`),
faster-whisper servers and hosted APIs: a multipart form with `file` and `model`, answered
with JSON `{"text": ...}`. Errors are `TranscriptionError` with a message fit for chat.
With `timed=True` it asks for `verbose_json`, whose `duration` prices the minutes
(`transcription.price_per_minute`, docs/concepts.md#budgets).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import httpx

log = logging.getLogger("hermes.transcription")


class TranscriptionError(Exception):
    """Transcription failed; the message says why in words a person understands."""


#: when a server answers without a duration, the minutes are reckoned from the file's size at
#: this rate (a voice note's Opus bit rate), so compressed audio is over-counted, never under
FALLBACK_BYTES_PER_SECOND = 2000


@dataclass(frozen=True)
class Transcript:
    text: str
    seconds: float  # the audio's length: the server's `duration`, else reckoned from its size


class Transcriber:
    """One endpoint; `transcribe(data, filename, mime)` returns the text."""

    def __init__(self, base_url: str, model: str, *, api_key: str | None = None, timeout_s: float = 120.0) -> None:
        base = base_url.rstrip("/")
        self.url = base if base.endswith("/audio/transcriptions") else base + "/audio/transcriptions"
        self.model = model
        self._api_key = api_key
        self._timeout = timeout_s

    async def transcribe(
        self, data: bytes, filename: str, mime: str = "application/octet-stream", *, timed: bool = False
    ) -> Transcript:
        headers = {"Authorization": f"Bearer {self._api_key}"} if self._api_key else {}
        files = {"file": (filename or "audio.ogg", data, mime or "application/octet-stream")}
        form = {"model": self.model, "response_format": "verbose_json" if timed else "json"}
        try:
            async with httpx.AsyncClient(timeout=self._timeout) as client:
                resp = await client.post(self.url, data=form, files=files, headers=headers)
        except httpx.TimeoutException:
            raise TranscriptionError("the transcription service timed out") from None
        except httpx.HTTPError as err:
            log.warning("transcription request failed: %s", type(err).__name__)
            raise TranscriptionError("the transcription service could not be reached") from None
        if resp.status_code in (401, 403):
            raise TranscriptionError("the transcription service rejected our credentials")
        if resp.status_code >= 400:
            log.warning("transcription service answered HTTP %d", resp.status_code)
            raise TranscriptionError(f"the transcription service answered with an error (HTTP {resp.status_code})")
        try:
            body = resp.json()
            text, duration = body.get("text"), body.get("duration")
        except (ValueError, AttributeError):
            text, duration = None, None
        if not isinstance(text, str):
            raise TranscriptionError("the transcription service sent an unreadable answer")
        if isinstance(duration, (int, float)) and not isinstance(duration, bool) and duration >= 0:
            seconds = float(duration)
        else:
            seconds = len(data) / FALLBACK_BYTES_PER_SECOND
        return Transcript(text.strip(), seconds)
