"""A fake OpenAI-compatible chat server: a real aiohttp server on 127.0.0.1, ephemeral port.

    async with FakeLLM() as llm:                 # or: await llm.start() ... await llm.stop()
        llm.script(reply("hi"), tool_call("memory", {"action": "add", ...}))
        client = LLMClient(llm.base_url, "fake-model")
        ...
        assert llm.requests_containing("remember")

Unscripted requests go to `llm.responder` (if set), else the default answer
`"ok: <last user message text>"`. A gateway in a subprocess can use it too: keep the test's
event loop running (asyncio subprocess APIs), or use the blocking form
`with FakeLLM() as llm:` which serves from a background thread.

Responses are built by the pure functions below (`reply`, `tool_call`, `tool_calls`,
`assistant_message`, `error`, `context_length_error`, `hang`, `disconnect`). Anywhere a
response is expected you may also give a `str` (a reply), `None` (the default answer) or a
callable `(request_json) -> response` (sync or async).

With `strict=True` (the default) requests are checked the way OpenAI checks them: every
assistant `tool_calls` entry must be answered by a `tool` message with its id before the next
non-tool message, tool messages must answer a pending call, arguments must be JSON strings.
Violations get a 400 and are listed in `llm.violations`. Content parts are checked too: text
parts, and image parts (user messages only) whose URL must be a base64 `data:` URL of an
image, since a local model server cannot fetch URLs. `FakeLLM(vision=False)` answers any
image part with a 400, as a text-only model does; `image_urls(request)` lists what came in.

With `alternating_roles=True` the fake also refuses, like vLLM with a Llama-2/Mistral/Gemma
chat template, any request whose user and assistant turns do not alternate (system messages
only at the start, tool results between an assistant's calls and its answer): 400 with
"Conversation roles must alternate user/assistant/user/assistant/...".
"""

from __future__ import annotations

import asyncio
import inspect
import json
import re
import threading
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from aiohttp import web
from multidict import CIMultiDict

__all__ = [
    "CANARY_RE",
    "FakeLLM",
    "Response",
    "assistant_message",
    "canaries_in",
    "canary_repeater",
    "context_length_error",
    "default_responder",
    "disconnect",
    "endless",
    "error",
    "hang",
    "image_urls",
    "is_review_request",
    "last_user_text",
    "memory_saving_responder",
    "message_text",
    "offered_tools",
    "paused",
    "prompt_chars",
    "reply",
    "tool_call",
    "tool_calls",
    "when_reviewing",
    "when_user_says",
]


# --------------------------------------------------------------------------- responses


@dataclass(frozen=True)
class Response:
    """What the fake answers. Build with the functions below rather than directly."""

    kind: Literal["completion", "http", "default", "disconnect"]
    status: int = 200
    message: Mapping[str, Any] | None = None  # the assistant message of a completion
    finish_reason: str | None = "stop"
    usage: Mapping[str, int] | Literal[False] | None = None  # None: computed; False: omitted
    body: Any = None  # for kind="http": a dict (sent as JSON) or str (sent as text)
    headers: Mapping[str, str] = field(default_factory=dict)
    delay_s: float = 0.0
    # when the request streams: content characters per SSE chunk, and (optionally) where the
    # stream stops until `FakeLLM.resume_streams()` (content characters sent before pausing)
    chunk_chars: int = 8
    pause_after_chars: int | None = None
    # when the request streams: seconds between two content chunks (a model writing slowly)
    chunk_delay_s: float = 0.0
    # when the request streams: after the text, the last chunk again every this many seconds,
    # forever, without a finish_reason (a runaway model); without streaming: never answers
    endless_every_s: float | None = None


Responder = Callable[[dict[str, Any]], "ResponseLike | Awaitable[ResponseLike]"]
ResponseLike = Response | str | None | Responder


def assistant_message(
    message: Mapping[str, Any],
    *,
    finish_reason: str | None = "stop",
    usage: Mapping[str, int] | Literal[False] | None = None,
) -> Response:
    """A completion whose assistant message is sent exactly as given (for odd dialects)."""
    return Response(kind="completion", message=dict(message), finish_reason=finish_reason, usage=usage)


def reply(
    text: str | None,
    *,
    usage: Mapping[str, int] | Literal[False] | None = None,
    finish_reason: str | None = "stop",
) -> Response:
    """A plain text answer. `usage` keys override the computed ones; `False` omits usage."""
    return assistant_message({"role": "assistant", "content": text}, finish_reason=finish_reason, usage=usage)


def tool_calls(
    calls: Iterable[tuple[str, Mapping[str, Any]] | tuple[str, Mapping[str, Any], str]],
    *,
    content: str | None = None,
    usage: Mapping[str, int] | Literal[False] | None = None,
) -> Response:
    """Several tool calls in one turn: `[(name, args), (name, args, call_id), ...]`."""
    out = []
    for call in calls:
        name, args = call[0], call[1]
        call_id = call[2] if len(call) > 2 else None  # type: ignore[misc]
        out.append(
            {
                "id": call_id or f"call_{uuid.uuid4().hex[:16]}",
                "type": "function",
                "function": {"name": name, "arguments": json.dumps(dict(args), ensure_ascii=False)},
            }
        )
    msg = {"role": "assistant", "content": content, "tool_calls": out}
    return assistant_message(msg, finish_reason="tool_calls", usage=usage)


def tool_call(
    name: str,
    arguments: Mapping[str, Any],
    *,
    call_id: str | None = None,
    content: str | None = None,
    usage: Mapping[str, int] | Literal[False] | None = None,
) -> Response:
    """One tool call (arguments sent as a JSON string, as OpenAI does)."""
    return tool_calls([(name, arguments, call_id)] if call_id else [(name, arguments)], content=content, usage=usage)


def error(status: int, body: Mapping[str, Any] | str = "", headers: Mapping[str, str] | None = None) -> Response:
    """Any HTTP answer: a dict body goes out as JSON, a str as text/plain."""
    if isinstance(body, Mapping):
        body = dict(body)
    return Response(kind="http", status=status, body=body, headers=dict(headers or {}))


def context_length_error(
    dialect: Literal["openai", "vllm", "llamacpp", "ollama", "anthropic"] = "openai",
    *,
    limit: int = 8192,
    requested: int = 9000,
) -> Response:
    """The 'prompt does not fit' error exactly as each server family words it."""
    if dialect == "openai":
        return error(
            400,
            {
                "error": {
                    "message": f"This model's maximum context length is {limit} tokens. However, your messages "
                    f"resulted in {requested} tokens. Please reduce the length of the messages.",
                    "type": "invalid_request_error",
                    "param": "messages",
                    "code": "context_length_exceeded",
                }
            },
        )
    if dialect == "vllm":
        return error(
            400,
            {
                "object": "error",
                "message": f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{requested} tokens ({requested - 100} in the messages, 100 in the completion). "
                "Please reduce the length of the messages or completion.",
                "type": "BadRequestError",
                "param": None,
                "code": 400,
            },
        )
    if dialect == "llamacpp":
        return error(
            400,
            {
                "error": {
                    "code": 400,
                    "message": "the request exceeds the available context size, try increasing it",
                    "type": "exceed_context_size_error",
                    "n_prompt_tokens": requested,
                    "n_ctx": limit,
                }
            },
        )
    if dialect == "ollama":
        return error(
            400,
            {
                "error": {
                    "message": "input length exceeds the context length",
                    "type": "invalid_request_error",
                    "param": None,
                    "code": None,
                }
            },
        )
    if dialect == "anthropic":
        return error(
            400,
            {
                "type": "error",
                "error": {
                    "type": "invalid_request_error",
                    "message": f"prompt is too long: {requested} tokens > {limit} maximum",
                },
            },
        )
    raise ValueError(f"unknown dialect {dialect!r}")


def paused(text: str, after_chars: int, *, chunk_chars: int = 4) -> Response:
    """A streamed reply that stops after `after_chars` characters of `text` until
    `FakeLLM.resume_streams()` (or the client goes away). Without streaming: a plain reply."""
    return replace(reply(text), pause_after_chars=after_chars, chunk_chars=chunk_chars)


def endless(text: str = "and more", *, every_s: float = 0.3) -> Response:
    """A model that never finishes: streamed, `text` sent again every `every_s` seconds
    with no finish_reason until the client goes away; not streamed, no answer at all."""
    return replace(reply(text, finish_reason=None), chunk_chars=len(text) or 1, endless_every_s=every_s)


def hang(seconds: float, then: ResponseLike = None) -> Response:
    """Wait `seconds` before answering with `then` (default: the default answer)."""
    if isinstance(then, Response):
        return replace(then, delay_s=then.delay_s + seconds)
    if then is None:
        return Response(kind="default", delay_s=seconds)
    if isinstance(then, str):
        return replace(reply(then), delay_s=seconds)
    raise TypeError("hang(then=...) takes a Response, a str or None")


def disconnect() -> Response:
    """Close the connection without sending any answer."""
    return Response(kind="disconnect")


# --------------------------------------------------------------------------- request helpers


def message_text(msg: Mapping[str, Any]) -> str:
    """The text of a message's content (content parts joined)."""
    content = msg.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def image_urls(request: Mapping[str, Any]) -> list[str]:
    """Every `image_url` URL in a request's messages, in order."""
    urls = []
    for msg in request.get("messages") or []:
        content = msg.get("content") if isinstance(msg, Mapping) else None
        for part in content if isinstance(content, list) else []:
            if isinstance(part, Mapping) and part.get("type") == "image_url":
                urls.append(str((part.get("image_url") or {}).get("url", "")))
    return urls


def last_user_text(request: Mapping[str, Any]) -> str:
    for msg in reversed(request.get("messages") or []):
        if isinstance(msg, Mapping) and msg.get("role") == "user":
            return message_text(msg)
    return ""


def prompt_chars(request: Mapping[str, Any]) -> int:
    """Characters of the request messages: content text plus tool_calls JSON."""
    n = 0
    for msg in request.get("messages") or []:
        if isinstance(msg, Mapping):
            n += len(message_text(msg))
            if msg.get("tool_calls"):
                n += len(json.dumps(msg["tool_calls"], ensure_ascii=False, separators=(",", ":")))
    return n


def default_responder(request: dict[str, Any]) -> Response:
    """`ok: <last user message text>`."""
    return reply(f"ok: {last_user_text(request)}")


_REMEMBER = re.compile(r"^\s*remember(?:\s+that)?\s*:?\s+(.+)$", re.IGNORECASE | re.DOTALL)


def memory_saving_responder(request: dict[str, Any]) -> Response:
    """A model that saves memories: "remember X" -> memory add X; a tool result -> "done: <result>".

    Only calls the tool if the request offers a `memory` tool; otherwise answers by default.
    """
    messages = request.get("messages") or []
    if messages and messages[-1].get("role") == "tool":
        return reply(f"done: {message_text(messages[-1])}")
    offered = {t.get("function", {}).get("name") for t in request.get("tools") or [] if isinstance(t, dict)}
    m = _REMEMBER.match(last_user_text(request))
    if m and "memory" in offered:
        return tool_call("memory", {"action": "add", "target": "memory", "content": m.group(1).strip()})
    return default_responder(request)


CANARY_RE = re.compile(r"CANARY-[A-Za-z0-9]+")


def canaries_in(obj: Any) -> set[str]:
    """Every canary token (CANARY-<alnum>) anywhere in `obj`: a str, or any JSON-able value
    (a request body, a message list), tool calls and tool results included."""
    text = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)
    return set(CANARY_RE.findall(text))


def canary_repeater(inner: Responder = memory_saving_responder) -> Responder:
    """The worst-case model for isolation tests: it acts as `inner` (by default it saves
    "remember X"), and every text answer it gives ends with EVERY canary it can see anywhere
    in the request (system prompt, history, tool results), so whatever reaches a prompt
    reaches the chat."""

    async def responder(request: dict[str, Any]) -> ResponseLike:
        response = inner(request)
        if inspect.isawaitable(response):
            response = await response
        if response is None:
            response = default_responder(request)
        elif isinstance(response, str):
            response = reply(response)
        seen = sorted(canaries_in(request.get("messages") or []))
        if not seen or not isinstance(response, Response) or response.kind != "completion":
            return response
        message = dict(response.message or {})
        if message.get("tool_calls"):
            return response
        message["content"] = f"{message.get('content') or ''} [I can see: {' '.join(seen)}]".strip()
        return replace(response, message=message)

    return responder


def when_user_says(rules: Mapping[str, ResponseLike], fallback: ResponseLike = None) -> Responder:
    """A responder: the first rule whose key is a substring of the last user message wins.

    The last message must be the user's (after a tool result the fallback answers).
    """

    def responder(request: dict[str, Any]) -> ResponseLike:
        messages = request.get("messages") or []
        if messages and messages[-1].get("role") == "user":
            text = last_user_text(request)
            for needle, response in rules.items():
                if needle in text:
                    return response
        return fallback

    return responder


REVIEW_MARKER = "[BACKGROUND REVIEW]"  # the first line of agent.review's instruction


def is_review_request(request: Mapping[str, Any]) -> bool:
    """True for a background memory/skill review request (its last user message is the
    review instruction; tool results of the review may follow it). The client merges a run of
    user messages into one, so the instruction may follow the lane's last user message."""
    text = last_user_text(request)
    return text.startswith(REVIEW_MARKER) or f"\n\n{REVIEW_MARKER}" in text


def offered_tools(request: Mapping[str, Any]) -> set[str]:
    return {t.get("function", {}).get("name") for t in request.get("tools") or [] if isinstance(t, dict)}


def when_reviewing(then: ResponseLike, otherwise: ResponseLike = None, *, done: str = "Saved.") -> Responder:
    """A responder for the background review: the first request of each review gets `then`
    (e.g. a `tool_call("memory", ...)`, or a callable of the request), the request after the
    tool results gets the reply `done`; every other request gets `otherwise`."""

    def responder(request: dict[str, Any]) -> ResponseLike:
        if not is_review_request(request):
            return otherwise(request) if callable(otherwise) else otherwise
        messages = request.get("messages") or []
        if messages and messages[-1].get("role") == "tool":
            return reply(done)
        return then(request) if callable(then) else then

    return responder


# --------------------------------------------------------------------------- validation


def _violations(body: Any) -> list[str]:
    """What a strict OpenAI endpoint would reject in this request body."""
    if not isinstance(body, dict):
        return ["request body must be a JSON object"]
    problems: list[str] = []
    if not isinstance(body.get("model"), str) or not body["model"]:
        problems.append("'model' is required")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return [*problems, "'messages' must be a non-empty list"]
    if "stream_options" in body and not body.get("stream"):
        problems.append("'stream_options' is only allowed when 'stream' is true")
    pending: dict[str, int] = {}
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            problems.append(f"messages[{i}] is not an object")
            continue
        role = msg.get("role")
        if role not in ("system", "developer", "user", "assistant", "tool"):
            problems.append(f"messages[{i}].role {role!r} is invalid")
            continue
        if role == "tool":
            cid = msg.get("tool_call_id")
            if cid not in pending:
                problems.append(
                    f"messages[{i}]: messages with role 'tool' must be a response to a preceding "
                    f"message with 'tool_calls' (tool_call_id {cid!r})"
                )
            else:
                del pending[cid]
            if not isinstance(msg.get("content"), (str, list)):
                problems.append(f"messages[{i}]: tool message content must be a string")
            continue
        if pending:
            problems.append(
                f"messages[{i}]: an assistant message with 'tool_calls' must be followed by tool messages "
                f"responding to each 'tool_call_id'; missing: {sorted(pending)}"
            )
            pending.clear()
        if role == "user" and msg.get("content") is None:
            problems.append(f"messages[{i}]: user message content is required")
        if isinstance(msg.get("content"), list):
            problems.extend(_part_violations(i, role, msg["content"]))
        if role == "assistant" and msg.get("tool_calls") is not None:
            calls = msg["tool_calls"]
            if not isinstance(calls, list) or not calls:
                problems.append(f"messages[{i}].tool_calls must be a non-empty list")
                continue
            for j, call in enumerate(calls):
                fn = call.get("function") if isinstance(call, dict) else None
                if not isinstance(call, dict) or not isinstance(call.get("id"), str) or not isinstance(fn, dict):
                    problems.append(f"messages[{i}].tool_calls[{j}] needs 'id' and 'function'")
                    continue
                if not isinstance(fn.get("name"), str) or not isinstance(fn.get("arguments"), str):
                    problems.append(f"messages[{i}].tool_calls[{j}].function needs string 'name' and 'arguments'")
                pending[call["id"]] = i
    if pending:
        problems.append(f"tool_call_ids without a tool response: {sorted(pending)}")
    for k, tool in enumerate(body.get("tools") or []):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if (
            not isinstance(tool, dict)
            or tool.get("type") != "function"
            or not isinstance(fn, dict)
            or not isinstance(fn.get("name"), str)
        ):
            problems.append(f"tools[{k}] must be {{'type': 'function', 'function': {{'name': ...}}}}")
    return problems


def _part_violations(i: int, role: str, parts: list[Any]) -> list[str]:
    """Content parts as OpenAI checks them: text parts and (user only) image parts whose URL
    is a base64 data: URL of an image (this fake, like a local server, cannot fetch URLs)."""
    problems = []
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            continue
        if kind == "image_url" and role == "user":
            url = (part.get("image_url") or {}).get("url") if isinstance(part.get("image_url"), dict) else None
            m = re.match(r"^data:image/(png|jpeg|gif|webp);base64,([A-Za-z0-9+/=]+)$", url or "")
            if not m:
                problems.append(f"messages[{i}].content[{j}]: image_url.url must be a base64 data: URL of an image")
            continue
        problems.append(f"messages[{i}].content[{j}]: unsupported content part {kind!r} for role {role!r}")
    return problems


ALTERNATION_ERROR = "Conversation roles must alternate user/assistant/user/assistant/..."


def _alternation_violation(body: Any) -> str | None:
    """vLLM's chat-template check: after leading system messages, user and assistant turns
    alternate, starting with user (tool results sit between a call and its answer)."""
    messages = body.get("messages") if isinstance(body, dict) else None
    if not isinstance(messages, list):
        return None
    expect: str | None = "user"  # None: after tool results either may follow
    started = False
    for i, msg in enumerate(messages):
        role = msg.get("role") if isinstance(msg, dict) else None
        if role in ("system", "developer"):
            if started:
                return f"{ALTERNATION_ERROR} (messages[{i}] is a {role} message after the first turn)"
            continue
        started = True
        if role == "tool":
            expect = None
            continue
        if expect is not None and role != expect:
            return f"{ALTERNATION_ERROR} (messages[{i}] is {role}, expected {expect})"
        expect = "assistant" if role == "user" else "user"
    return None


# --------------------------------------------------------------------------- the server


class FakeLLM:
    """An OpenAI-compatible `/v1/chat/completions` (and `/v1/models`) on 127.0.0.1.

    Recorded per chat request, in arrival order: `requests` (parsed JSON bodies),
    `request_headers` (case-insensitive), `statuses` (HTTP status answered).
    """

    def __init__(
        self,
        *,
        model: str = "fake-model",
        api_key: str | None = None,
        context_length: int | None = None,
        context_dialect: str = "openai",
        strict: bool = True,
        alternating_roles: bool = False,
        host: str = "127.0.0.1",
        port: int = 0,
        vision: bool = True,
        streaming: Literal["sse", "ignore", "reject"] = "sse",
    ) -> None:
        self.model = model
        # how `"stream": true` is served: SSE chunks (with usage in a final chunk when
        # stream_options.include_usage), ignored (a plain JSON answer, as some servers do), or
        # refused with a 400 (a server that does not know stream_options)
        self.streaming = streaming
        self.streamed: list[list[str]] = []  # the SSE data lines of each streamed answer
        self._resume: asyncio.Event | None = None
        self.vision = vision  # False: image parts get a 400, as from a text-only model
        self.context_length = context_length  # prompt_chars//4 above this -> context error
        self.context_dialect = context_dialect
        self.strict = strict
        self.alternating_roles = alternating_roles
        self.responder: ResponseLike = None
        self.requests: list[dict[str, Any]] = []
        self.request_headers: list[CIMultiDict[str]] = []
        self.peers: list[Any] = []  # (host, port) of the client connection of each request
        self.statuses: list[int] = []
        self.usage_sent: list[dict[str, int]] = []  # the usage of each answer as the client received it
        self.violations: list[str] = []
        self.responder_errors: list[BaseException] = []
        self._api_key = api_key
        self._host, self._port = host, port
        self._queue: deque[ResponseLike] = deque()
        self._runner: web.AppRunner | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping: asyncio.Event | None = None
        self._thread: threading.Thread | None = None
        self._counter = 0
        self.base_url = ""

    # ------------------------------------------------------------------ scripting

    def script(self, *responses: ResponseLike) -> FakeLLM:
        """Queue responses, consumed one per chat request in order (then the responder)."""
        self._queue.extend(responses)
        return self

    @property
    def pending(self) -> int:
        """Scripted responses not yet consumed."""
        return len(self._queue)

    def set_api_key(self, key: str | None) -> None:
        """Require `Authorization: Bearer <key>` (None: accept anything); others get 401."""
        self._api_key = key

    def requests_containing(self, text: str) -> list[dict[str, Any]]:
        """Requests where any message's content contains `text`."""
        return [
            r
            for r in self.requests
            if any(isinstance(m, Mapping) and text in message_text(m) for m in r.get("messages") or [])
        ]

    def resume_streams(self) -> None:
        """Let every paused stream (`paused(...)`) go on to its end."""
        assert self._loop is not None and self._resume is not None
        self._loop.call_soon_threadsafe(self._resume.set)

    @property
    def last_request(self) -> dict[str, Any] | None:
        return self.requests[-1] if self.requests else None

    def reset(self) -> None:
        """Forget recorded requests, scripted responses and the responder."""
        self.requests.clear()
        self.request_headers.clear()
        self.peers.clear()
        self.statuses.clear()
        self.usage_sent.clear()
        self.violations.clear()
        self.responder_errors.clear()
        self._queue.clear()
        self.responder = None

    async def wait_for_requests(self, n: int, timeout: float = 10.0) -> list[dict[str, Any]]:
        """Wait (from any loop) until at least `n` chat requests were answered."""
        deadline = time.monotonic() + timeout
        while len(self.statuses) < n:
            if time.monotonic() > deadline:
                raise TimeoutError(f"FakeLLM saw {len(self.statuses)} chat requests, wanted {n}")
            await asyncio.sleep(0.01)
        return self.requests[:]

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> FakeLLM:
        if self._runner is not None:
            return self
        self._loop = asyncio.get_running_loop()
        self._stopping = asyncio.Event()
        self._resume = asyncio.Event()
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/chat/completions", self._handle_chat)
        app.router.add_get("/v1/models", self._handle_models)
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
        await runner.setup()
        site = web.TCPSite(runner, self._host, self._port)
        await site.start()
        self._runner = runner
        host, port = runner.addresses[0][:2]
        self.base_url = f"http://{host}:{port}/v1"
        return self

    async def stop(self) -> None:
        if self._runner is None:
            return
        assert self._stopping is not None
        self._stopping.set()  # wakes hanging handlers, which then drop their connections
        runner, self._runner = self._runner, None
        await runner.cleanup()

    async def __aenter__(self) -> FakeLLM:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def start_in_thread(self) -> FakeLLM:
        """Serve from a background thread with its own loop (for blocking tests)."""
        ready = threading.Event()
        failure: list[BaseException] = []
        loop = asyncio.new_event_loop()

        def run() -> None:
            asyncio.set_event_loop(loop)
            try:
                loop.run_until_complete(self.start())
            except BaseException as exc:  # pragma: no cover - reported to the caller
                failure.append(exc)
                ready.set()
                return
            ready.set()
            loop.run_forever()
            loop.run_until_complete(self.stop())
            loop.close()

        self._thread = threading.Thread(target=run, name="FakeLLM", daemon=True)
        self._thread.start()
        ready.wait(10)
        if failure:
            raise failure[0]
        return self

    def stop_thread(self) -> None:
        if self._thread is None or self._loop is None:
            return
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._thread = None

    def __enter__(self) -> FakeLLM:
        return self.start_in_thread()

    def __exit__(self, *exc: object) -> None:
        self.stop_thread()

    # ------------------------------------------------------------------ handlers

    async def _handle_models(self, request: web.Request) -> web.StreamResponse:
        if not self._authorized(request):
            return self._unauthorized()
        return web.json_response(
            {"object": "list", "data": [{"id": self.model, "object": "model", "created": 0, "owned_by": "fake"}]}
        )

    def _authorized(self, request: web.Request) -> bool:
        return self._api_key is None or request.headers.get("Authorization") == f"Bearer {self._api_key}"

    @staticmethod
    def _unauthorized() -> web.Response:
        return web.json_response(
            {
                "error": {
                    "message": "Incorrect API key provided.",
                    "type": "invalid_request_error",
                    "param": None,
                    "code": "invalid_api_key",
                }
            },
            status=401,
        )

    async def _handle_chat(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        try:
            body: Any = json.loads(raw or b"null")
        except ValueError:
            body = None
        self.requests.append(body if isinstance(body, dict) else {"_raw": raw.decode("utf-8", "replace")})
        self.request_headers.append(CIMultiDict(request.headers))
        self.peers.append(request.transport.get_extra_info("peername") if request.transport else None)
        try:
            response = await self._answer(request, body)
        except Exception as exc:
            self.responder_errors.append(exc)
            response = web.json_response(
                {"error": {"message": f"FakeLLM responder failed: {exc!r}", "type": "server_error"}}, status=500
            )
        self.statuses.append(response.status if response is not None else 0)  # 0: disconnected
        if response is None:
            if request.transport is not None:
                request.transport.abort()
            return web.Response()
        return response

    async def _answer(self, request: web.Request, body: Any) -> web.StreamResponse | None:
        if not self._authorized(request):
            return self._unauthorized()
        if self.strict or not isinstance(body, dict):
            problems = _violations(body) if self.strict else ["request body must be a JSON object"]
            if problems:
                self.violations.extend(problems)
                return web.json_response(
                    {"error": {"message": "; ".join(problems), "type": "invalid_request_error", "code": None}},
                    status=400,
                )
        if body.get("stream") and self.streaming == "reject":
            self.violations.append("stream requested from a server that cannot stream")
            return web.json_response(
                {
                    "error": {
                        "message": "Unrecognized request argument supplied: stream_options",
                        "type": "invalid_request_error",
                        "code": None,
                    }
                },
                status=400,
            )
        if not self.vision and image_urls(body):
            self.violations.append("image input sent to a model without vision")
            return web.json_response(
                {
                    "error": {
                        "message": "this model does not support image input",
                        "type": "invalid_request_error",
                        "code": None,
                    }
                },
                status=400,
            )
        if self.alternating_roles and (problem := _alternation_violation(body)):
            self.violations.append(problem)
            return web.json_response(
                {"object": "error", "message": problem, "type": "BadRequestError", "param": None, "code": 400},
                status=400,
            )
        estimate = prompt_chars(body) // 4
        if self.context_length is not None and estimate > self.context_length:
            chosen: ResponseLike = context_length_error(
                self.context_dialect, limit=self.context_length, requested=estimate
            )  # type: ignore[arg-type]
        elif self._queue:
            chosen = self._queue.popleft()
        else:
            chosen = self.responder
        resp = await self._resolve(chosen, body)
        if resp.delay_s > 0:
            assert self._stopping is not None
            try:
                await asyncio.wait_for(self._stopping.wait(), resp.delay_s)
                return None  # server stopping: drop the connection
            except TimeoutError:
                pass
        if resp.kind == "default":
            resp = replace(
                default_responder(body), chunk_chars=resp.chunk_chars, pause_after_chars=resp.pause_after_chars
            )
        if body.get("stream") and self.streaming == "sse" and resp.kind == "completion":
            return await self._stream(request, resp, body)
        if resp.endless_every_s is not None:
            assert self._stopping is not None
            await self._stopping.wait()
            return None
        return self._render(resp, body)

    async def _resolve(self, value: ResponseLike, body: dict[str, Any]) -> Response:
        for _ in range(10):  # callables may return callables; bounded
            if value is None:
                return Response(kind="default")
            if isinstance(value, Response):
                return value
            if isinstance(value, str):
                return reply(value)
            if callable(value):
                value = value(body)
                if inspect.isawaitable(value):
                    value = await value
                continue
            raise TypeError(f"FakeLLM cannot answer with {type(value).__name__}")
        raise TypeError("FakeLLM responder returned callables 10 levels deep")

    async def _stream(self, request: web.Request, resp: Response, body: dict[str, Any]) -> web.StreamResponse | None:
        """The answer as OpenAI streams it: role, content pieces, tool-call pieces (id and
        name first, arguments in two halves), finish_reason, then usage if asked, [DONE]."""
        full = self._render(resp, body, record=False)
        assert isinstance(full, web.Response) and full.body is not None
        data = json.loads(full.body)
        choice = data["choices"][0]
        message, base = choice["message"], {k: data[k] for k in ("id", "object", "created", "model")}
        base["object"] = "chat.completion.chunk"

        def chunk(delta: dict[str, Any] | None, finish: str | None = None, **extra: Any) -> str:
            choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}]
            return json.dumps({**base, "choices": choices, **extra}, ensure_ascii=False)

        out = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream", **resp.headers})
        lines: list[str] = []
        self.streamed.append(lines)
        await out.prepare(request)

        async def send(line: str) -> None:
            lines.append(line)
            await out.write(f"data: {line}\n\n".encode())

        try:
            await send(chunk({"role": "assistant", "content": ""}))
            text = message_text(message)
            step = max(1, resp.chunk_chars)
            pause = resp.pause_after_chars
            for i in range(0, len(text), step):
                if pause is not None and i >= pause:
                    pause = None
                    await self._wait_resume()
                if i and resp.chunk_delay_s:
                    await asyncio.sleep(resp.chunk_delay_s)
                await send(chunk({"content": text[i : i + step]}))
            while resp.endless_every_s is not None:
                await asyncio.sleep(resp.endless_every_s)
                if self._stopping is None or self._stopping.is_set():
                    raise ConnectionResetError("fake server stopping")
                await send(chunk({"content": " " + text[-step:]}))
            for k, call in enumerate(message.get("tool_calls") or []):
                args = call["function"]["arguments"]
                half = len(args) // 2
                await send(
                    chunk(
                        {
                            "tool_calls": [
                                {
                                    "index": k,
                                    "id": call["id"],
                                    "type": "function",
                                    "function": {"name": call["function"]["name"], "arguments": args[:half]},
                                }
                            ]
                        }
                    )
                )
                await send(chunk({"tool_calls": [{"index": k, "function": {"arguments": args[half:]}}]}))
            await send(chunk({}, choice["finish_reason"]))
            if (body.get("stream_options") or {}).get("include_usage") and "usage" in data:
                await send(chunk(None, usage=data["usage"]))
                self.usage_sent.append(data["usage"])
            await out.write(b"data: [DONE]\n\n")
            await out.write_eof()
        except (ConnectionResetError, ConnectionError):
            lines.append("[client went away]")
        return out

    async def _wait_resume(self) -> None:
        assert self._resume is not None and self._stopping is not None
        waiters = [asyncio.ensure_future(self._resume.wait()), asyncio.ensure_future(self._stopping.wait())]
        try:
            await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waiters:
                w.cancel()

    def _render(self, resp: Response, body: dict[str, Any], *, record: bool = True) -> web.StreamResponse | None:
        if resp.kind == "disconnect":
            return None
        if resp.kind == "http":
            if isinstance(resp.body, (dict, list)):
                return web.json_response(resp.body, status=resp.status, headers=resp.headers)
            return web.Response(text=str(resp.body or ""), status=resp.status, headers=resp.headers)
        message = dict(resp.message or {"role": "assistant", "content": ""})
        self._counter += 1
        out: dict[str, Any] = {
            "id": f"chatcmpl-fake-{self._counter}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.get("model") or self.model,
            "choices": [{"index": 0, "message": message, "finish_reason": resp.finish_reason, "logprobs": None}],
        }
        if resp.usage is not False:
            completion_text = message_text(message)
            if message.get("tool_calls"):
                completion_text += json.dumps(message["tool_calls"], ensure_ascii=False, separators=(",", ":"))
            given = dict(resp.usage or {})
            usage = {"prompt_tokens": prompt_chars(body) // 4, "completion_tokens": len(completion_text) // 4}
            usage.update(given)
            if "total_tokens" not in given:
                usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
            out["usage"] = usage
            if record:
                self.usage_sent.append(usage)
        return web.json_response(out, status=resp.status, headers=resp.headers)
