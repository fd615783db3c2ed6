"""A fake OpenAI-compatible speech-to-text server: a real aiohttp server on 127.0.0.1.

    async with FakeTranscription() as stt:
        stt.transcripts[b"<audio bytes>"] = "hello there"
        cfg: transcription.base_url = stt.base_url        # ".../v1"
        ...
        assert stt.requests[0]["model"] == "whisper-1"

`POST /v1/audio/transcriptions` takes a multipart form with `file` and `model` (as
whisper.cpp's server, faster-whisper servers and OpenAI do) and answers `{"text": ...}`:
the transcript registered for the file's bytes, else `"transcript of <filename>"`. A form
without `file` or `model` is a 400. `fail_next(status)` answers the next request with an
error; `api_key` makes it require `Authorization: Bearer <key>`. Each request is recorded
as {"model", "filename", "content_type", "data", "authorization", "fields"}. With
`duration_s` set, a `response_format: verbose_json` request gets it as `duration`.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from tests.fakes.serve import serve_on_loopback


class FakeTranscription:
    def __init__(self, *, api_key: str | None = None) -> None:
        self.api_key = api_key
        self.transcripts: dict[bytes, str] = {}
        self.duration_s: float | None = None  # set: `verbose_json` answers carry this duration
        self.requests: list[dict[str, Any]] = []
        self._fail: list[int] = []
        self._runner: web.AppRunner | None = None
        self.port = 0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def fail_next(self, status: int = 500) -> None:
        self._fail.append(status)

    async def start(self) -> FakeTranscription:
        app = web.Application(client_max_size=50 * 1024 * 1024)
        app.router.add_post("/v1/audio/transcriptions", self._handle)
        self._runner, self.port = await serve_on_loopback(app)
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> FakeTranscription:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def _handle(self, request: web.Request) -> web.Response:
        auth = request.headers.get("Authorization")
        record: dict[str, Any] = {"authorization": auth, "fields": {}}
        if self.api_key is not None and auth != f"Bearer {self.api_key}":
            self.requests.append(record)
            return web.json_response({"error": {"message": "Incorrect API key"}}, status=401)
        if not request.content_type.startswith("multipart/"):
            self.requests.append(record)
            return web.json_response({"error": {"message": "expected a multipart form"}}, status=400)
        reader = await request.multipart()
        async for part in reader:
            if part.name == "file":
                record["filename"] = part.filename
                record["content_type"] = part.headers.get("Content-Type")
                record["data"] = bytes(await part.read())
            elif part.name:
                record["fields"][part.name] = await part.text()
        record["model"] = record["fields"].get("model")
        self.requests.append(record)
        if self._fail:
            return web.json_response({"error": {"message": "server error"}}, status=self._fail.pop(0))
        if "data" not in record or not record["model"]:
            return web.json_response({"error": {"message": "file and model are required"}}, status=400)
        text = self.transcripts.get(record["data"], f"transcript of {record.get('filename')}")
        if record["fields"].get("response_format") == "verbose_json" and self.duration_s is not None:
            return web.json_response({"text": text, "duration": self.duration_s, "segments": []})
        return web.json_response({"text": text})
