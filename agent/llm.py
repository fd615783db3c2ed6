"""Async client for OpenAI-compatible `/chat/completions` (OpenAI, vLLM, llama.cpp, Ollama...).

Errors are an `LLMError` hierarchy: `kind` is a metrics label, `user_message` one sentence
safe to show in chat. The API key never appears in messages, reprs or logs.
"""

from __future__ import annotations

import asyncio
import email.utils
import errno
import json
import logging
import random
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit, urlunsplit

import httpx

from agent.http_pool import llm_transport
from core.errors import cause_chain
from core.redact import Redactor

if TYPE_CHECKING:
    from core.settings import LLMConfig

_log = logging.getLogger(__name__)

USER_AGENT = "hermes-gateway/0.1"
MAX_BACKOFF_S = 30.0


# --------------------------------------------------------------------------- errors


class LLMError(Exception):
    """A failed chat call. `str()` is a technical, redacted detail for logs."""

    kind: str = "error"
    default_user_message: str = (
        "The assistant's model provider refused this request; please try again, "
        "or tell an operator if it keeps happening."
    )

    def __init__(
        self,
        detail: str,
        *,
        status: int | None = None,
        user_message: str | None = None,
        attempts: int = 1,
        kind: str | None = None,
    ) -> None:
        super().__init__(detail)
        self.detail = detail
        self.status = status
        self.attempts = attempts
        self.user_message = user_message or self.default_user_message
        if kind is not None:
            self.kind = kind


class LLMAuthError(LLMError):
    kind = "auth"
    default_user_message = (
        "The assistant's model provider rejected our credentials; an operator needs to fix the API key."
    )


class LLMUnavailable(LLMError):
    kind = "unavailable"
    default_user_message = (
        "The assistant's model is unreachable right now; your message was kept — please try again in a minute."
    )


class LLMNoDescriptors(LLMUnavailable):
    """The gateway itself is out of file descriptors: no socket to the model could be
    opened. Not the model's fault, so the caller treats it as the resource fault it is."""

    kind = "no_descriptors"
    default_user_message = "I can't answer right now; your message is kept and I'll answer as soon as I can."


class LLMTimeout(LLMUnavailable):
    """The server took the request but did not finish the answer in `timeout_s`. Not
    retried: asking again would make a busy server generate the same answer again."""

    kind = "timeout"
    default_user_message = (
        "The assistant's model did not finish its answer in time; please send it again, perhaps as a shorter request."
    )


class LLMAnswerTimeout(LLMTimeout):
    """The whole answer (streaming included) took longer than `answer_timeout_s` before
    any text of it arrived: a server that keeps sending without ever finishing."""

    kind = "answer_timeout"
    default_user_message = (
        "The assistant's model kept working without finishing an answer, so it was stopped; "
        "please send it again, perhaps as a shorter request."
    )


class LLMRateLimited(LLMError):
    kind = "rate_limited"
    default_user_message = (
        "The assistant's model is over its rate limit right now; your message was kept — please try again in a minute."
    )


class ContextLengthExceeded(LLMError):
    """The prompt does not fit the model's window; `limit`/`requested` when the server said."""

    kind = "context_length"
    default_user_message = (
        "This conversation is too long for the assistant's model; use /compress or /new and try again."
    )

    def __init__(self, detail: str, *, limit: int | None = None, requested: int | None = None, **kw: Any) -> None:
        super().__init__(detail, **kw)
        self.limit = limit
        self.requested = requested


class LLMRefused(LLMError):
    """A 4xx the server gave for this conversation (e.g. vLLM's "Conversation roles must
    alternate"): sending the same history again will fail again, so say how to get out."""

    kind = "bad_request"
    default_user_message = (
        "The assistant's model provider refused this conversation; send /new to start a fresh one "
        "(your memory is kept), or tell an operator if it keeps happening."
    )


class LLMBadResponse(LLMError):
    kind = "bad_response"
    default_user_message = "The assistant's model sent a reply that could not be read; please try again."


# --------------------------------------------------------------------------- results


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def from_dict(cls, data: Any) -> Usage | None:
        if not isinstance(data, dict):
            return None

        def _int(key: str) -> int:
            v = data.get(key)
            return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else 0

        p, c = _int("prompt_tokens"), _int("completion_tokens")
        return cls(p, c, _int("total_tokens") or p + c)


@dataclass
class ChatResult:
    content: str | None
    tool_calls: list[dict[str, Any]] | None
    finish_reason: str | None
    usage: Usage | None
    model: str
    raw: dict[str, Any]
    attempts: int = 1
    latency_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)  # e.g. reasoning_content

    @property
    def cut(self) -> bool:
        """True when the answer deadline ended the answer: `content` is what came before it."""
        return self.finish_reason == CUT_FINISH_REASON


# finish_reason of an answer the client ended at `answer_timeout_s` (no server sends it)
CUT_FINISH_REASON = "deadline"


# --------------------------------------------------------------------------- error classification

_CONTEXT_RE = re.compile(
    r"context[_ ]length[_ ]exceeded|exceed_context_size|maximum context length"
    r"|context length (?:is|of) \d+|exceeds? (?:the )?(?:model'?s? )?(?:maximum |available )?context"
    r"|prompt is too long|input (?:is )?too long|context size|n_ctx|context window"
    r"|reduce the length of the (?:messages|prompt|input)|max_new_tokens.{0,3} must be <="
    r"|too many tokens",
    re.IGNORECASE,
)
_LIMIT_RES = (
    re.compile(r"maximum context length is (\d+)", re.I),
    re.compile(r"context length (?:is|of) (\d+)", re.I),
    re.compile(r"n_ctx\W{0,4}(\d+)", re.I),
    re.compile(r"> ?(\d+) maximum", re.I),
    re.compile(r"must be <= ?(\d+)", re.I),
)
_REQUESTED_RES = (
    re.compile(r"you requested (\d+)", re.I),
    re.compile(r"resulted in (\d+)", re.I),
    re.compile(r"n_prompt_tokens\W{0,4}(\d+)", re.I),
    re.compile(r"prompt is too long: (\d+)", re.I),
)


def looks_like_context_error(text: str) -> bool:
    """True if an error text says the prompt did not fit the context window (any dialect)."""
    return bool(_CONTEXT_RE.search(text))


def _first_int(patterns: tuple[re.Pattern[str], ...], text: str) -> int | None:
    for pat in patterns:
        m = pat.search(text)
        if m:
            return int(m.group(1))
    return None


def _error_text(body: Any, raw_text: str) -> str:
    """All the error wording of a body: message, type and code, whatever the dialect."""
    if isinstance(body, dict):
        parts: list[str] = []
        err = body.get("error", body)
        if isinstance(err, str):
            parts.append(err)
        elif isinstance(err, dict):
            for key in ("message", "type", "code", "detail"):
                if err.get(key) is not None:
                    parts.append(str(err[key]))
            for key in ("n_prompt_tokens", "n_ctx"):
                if key in err:
                    parts.append(f"{key}={err[key]}")
        if body.get("message") and body is not err:
            parts.append(str(body["message"]))
        if parts:
            return " | ".join(parts)
    return raw_text


def _parse_retry_after(headers: httpx.Headers) -> float | None:
    ms = headers.get("retry-after-ms")
    if ms:
        try:
            return max(0.0, float(ms) / 1000)
        except ValueError:
            pass
    value = headers.get("retry-after")
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


# --------------------------------------------------------------------------- client


class LLMClient:
    """One OpenAI-compatible endpoint; one pooled httpx.AsyncClient per instance.

    Retries (bounded, exponential backoff with jitter) on 429, 5xx, connect errors and
    connect timeouts; never on a read timeout (the server may still be generating), other
    4xx or context-length errors.
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key: str | None = None,
        timeout_s: float = 120,
        max_retries: int = 3,
        backoff_base_s: float = 0.5,
        transport: httpx.AsyncBaseTransport | None = None,
        *,
        retry_after_cap_s: float = 30.0,
        answer_timeout_s: float | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.timeout_s = float(timeout_s)
        # the whole answer, retries and streaming included (`timeout_s` bounds only the
        # gap between bytes, which a server streaming without end never exceeds)
        self.answer_timeout_s = float(answer_timeout_s) if answer_timeout_s else None
        self.max_retries = max(0, int(max_retries))
        self.backoff_base_s = max(0.0, float(backoff_base_s))
        self.retry_after_cap_s = max(0.0, float(retry_after_cap_s))
        self._api_key = api_key or None
        self._can_stream = True  # False once the server refused a streaming request
        self._url = f"{self.base_url}/chat/completions"
        self._safe_base = _safe_url(self.base_url)
        headers = {"User-Agent": USER_AGENT, "Accept": "application/json"}
        if self._api_key:
            headers["Authorization"] = f"Bearer {self._api_key}"
        self._http = httpx.AsyncClient(
            headers=headers,
            timeout=httpx.Timeout(self.timeout_s, connect=min(self.timeout_s, 10.0)),
            # aiohttp's pool under httpx's API (agent/http_pool.py); httpx's own when a proxy
            # from the environment applies
            transport=transport if transport is not None else llm_transport(self.base_url),
            follow_redirects=False,
            trust_env=transport is None,
        )

    @classmethod
    def from_config(cls, cfg: LLMConfig, **kw: Any) -> LLMClient:
        """Build from the `llm` config section (the key is read from `cfg.api_key_env`)."""
        return cls(
            base_url=cfg.base_url,
            model=cfg.model,
            api_key=cfg.api_key(),
            timeout_s=cfg.timeout_s,
            max_retries=cfg.max_retries,
            answer_timeout_s=cfg.answer_timeout_s,
            **kw,
        )

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> LLMClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        return f"LLMClient(base_url={self._safe_base!r}, model={self.model!r})"

    # ------------------------------------------------------------------ chat

    async def chat(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        max_tokens: int | None = None,
        model: str | None = None,
        temperature: float | None = None,
        on_text: Callable[[str], None] | None = None,
    ) -> ChatResult:
        """One chat completion. Raises an `LLMError` subclass on failure.

        With `on_text` the answer is streamed (SSE, usage from the final chunk) and
        `on_text(text_so_far)` is called as it grows; a server that cannot stream (ignores
        `stream` or refuses the request) is asked again without streaming, and not streamed
        to again by this client. The result is the same either way.

        Past `answer_timeout_s` the answer is ended: the text streamed so far comes back
        with `cut` set (no tool calls), or `LLMAnswerTimeout` when none came."""
        if self.answer_timeout_s is None:
            return await self._chat(messages, tools, max_tokens, model, temperature, on_text)
        streamed: list[str] = [""]
        seen = None
        if on_text is not None:
            report = on_text

            def seen(text: str) -> None:
                streamed[0] = text
                report(text)

        started = time.monotonic()
        try:
            async with asyncio.timeout(self.answer_timeout_s):
                return await self._chat(messages, tools, max_tokens, model, temperature, seen)
        except TimeoutError:
            pass
        _log.warning(
            "LLM answer from %s cut at answer_timeout_s=%g s (%d characters streamed before it)",
            self._safe_base,
            self.answer_timeout_s,
            len(streamed[0]),
        )
        if not streamed[0].strip():
            raise LLMAnswerTimeout(
                f"the answer from {self._safe_base} did not finish within answer_timeout_s={self.answer_timeout_s:g} s"
            )
        return ChatResult(
            content=streamed[0],
            tool_calls=None,
            finish_reason=CUT_FINISH_REASON,
            usage=None,
            model=model or self.model,
            raw={},
            latency_s=time.monotonic() - started,
        )

    async def _chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        max_tokens: int | None,
        model: str | None,
        temperature: float | None,
        on_text: Callable[[str], None] | None,
    ) -> ChatResult:
        payload: dict[str, Any] = {"model": model or self.model, "messages": wire_messages(messages)}
        if tools:
            payload["tools"] = tools
        if max_tokens is not None:
            payload["max_tokens"] = max_tokens
        if temperature is not None:
            payload["temperature"] = temperature

        started = time.monotonic()
        stream = on_text is not None and self._can_stream
        attempt = 0
        while True:
            attempt += 1
            if stream:
                assert on_text is not None
                err, retry_after, data = await self._attempt_stream(payload, attempt, on_text)
                if err is not None and err.kind == "bad_request":  # e.g. stream_options refused
                    _log.info("LLM server refused a streaming request (%s); asking without streaming", err.detail)
                    stream = False
                    err, retry_after, data = await self._attempt(payload, attempt)
                    if err is None:
                        self._can_stream = False
            else:
                err, retry_after, data = await self._attempt(payload, attempt)
            if err is None:
                assert data is not None
                result = self._parse(data, payload["model"], attempt)
                result.latency_s = time.monotonic() - started
                if on_text is not None and result.content:
                    on_text(result.content)  # the whole text (also when the server did not stream)
                return result
            if not self._retryable(err) or attempt > self.max_retries:
                raise err
            delay = self._backoff(attempt, retry_after)
            _log.warning(
                "LLM call failed (%s, status=%s), retry %d/%d in %.2fs: %s",
                err.kind,
                err.status,
                attempt,
                self.max_retries,
                delay,
                err.detail,
            )
            await asyncio.sleep(delay)

    async def _attempt_stream(
        self, payload: dict[str, Any], attempt: int, on_text: Callable[[str], None]
    ) -> tuple[LLMError | None, float | None, dict[str, Any] | None]:
        """One streamed round trip, its chunks assembled into a non-streaming body. A JSON
        answer (a server that ignores `stream`) is taken as it is."""
        body = {**payload, "stream": True, "stream_options": {"include_usage": True}}
        try:
            async with self._http.stream("POST", self._url, json=body) as resp:
                if resp.status_code < 400 and "text/event-stream" in resp.headers.get("content-type", ""):
                    return await self._read_sse(resp, payload["model"], attempt, on_text)
                await resp.aread()
                return self._judge(resp, attempt)
        except httpx.HTTPError as exc:
            return self._transport_error(exc, attempt), None, None

    async def _read_sse(
        self, resp: httpx.Response, model: str, attempt: int, on_text: Callable[[str], None]
    ) -> tuple[LLMError | None, float | None, dict[str, Any] | None]:
        text: list[str] = []
        extra: dict[str, list[str]] = {}
        calls: dict[int, dict[str, Any]] = {}
        finish: str | None = None
        usage: Any = None
        seen_model = model
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue  # comments (": keep-alive"), event names, blank separators
            data = line[5:].strip()
            if data == "[DONE]":
                break
            try:
                chunk = json.loads(data)
            except ValueError:
                return (
                    LLMBadResponse(self._redact(f"unreadable stream chunk: {data[:200]!r}"), attempts=attempt),
                    None,
                    None,
                )
            if not isinstance(chunk, dict):
                continue
            if chunk.get("error"):
                code = chunk["error"].get("code") if isinstance(chunk["error"], dict) else None
                status = code if isinstance(code, int) and 400 <= code < 600 else 500
                return self._classify(status, chunk, data, resp.headers, attempt), None, None
            usage = chunk.get("usage") or usage
            seen_model = chunk.get("model") or seen_model
            for choice in chunk.get("choices") or []:
                if not isinstance(choice, dict):
                    continue
                finish = choice.get("finish_reason") or finish
                delta = choice.get("delta") or {}
                if not isinstance(delta, dict):
                    continue
                if isinstance(delta.get("content"), str) and delta["content"]:
                    text.append(delta["content"])
                    on_text("".join(text))
                for key in ("reasoning_content", "reasoning"):
                    if isinstance(delta.get(key), str):
                        extra.setdefault(key, []).append(delta[key])
                for part in delta.get("tool_calls") or []:
                    _merge_tool_delta(calls, part)
        message: dict[str, Any] = {"role": "assistant", "content": "".join(text) or None}
        if calls:
            message["tool_calls"] = [calls[i] for i in sorted(calls)]
        message.update({k: "".join(v) for k, v in extra.items()})
        return (
            None,
            None,
            {
                "model": seen_model,
                "choices": [{"index": 0, "message": message, "finish_reason": finish}],
                "usage": usage,
            },
        )

    async def _attempt(
        self, payload: dict[str, Any], attempt: int
    ) -> tuple[LLMError | None, float | None, dict[str, Any] | None]:
        """One HTTP round trip: (error, retry_after_s, body)."""
        try:
            resp = await self._http.post(self._url, json=payload)
        except httpx.HTTPError as exc:
            return self._transport_error(exc, attempt), None, None
        return self._judge(resp, attempt)

    def _transport_error(self, exc: httpx.HTTPError, attempt: int) -> LLMError:
        """No HTTP answer: which error it stands for (the same whether streaming or not)."""
        if any(isinstance(c, OSError) and c.errno in (errno.EMFILE, errno.ENFILE) for c in cause_chain(exc)):
            return LLMNoDescriptors(
                self._redact(f"no socket to {self._safe_base}: too many open files"), attempts=attempt
            )
        if isinstance(exc, (httpx.ConnectTimeout, httpx.PoolTimeout)):  # nothing was generated: retryable
            return LLMUnavailable(
                self._redact(f"timed out connecting to {self._safe_base} ({type(exc).__name__})"), attempts=attempt
            )
        if isinstance(exc, httpx.TimeoutException):
            return LLMTimeout(
                self._redact(
                    f"timed out after {self.timeout_s:g} s waiting for {self._safe_base} "
                    f"to answer ({type(exc).__name__})"
                ),
                attempts=attempt,
            )
        if isinstance(exc, (httpx.NetworkError, httpx.RemoteProtocolError)):
            return LLMUnavailable(
                self._redact(f"cannot reach {self._safe_base}: {type(exc).__name__}: {exc}"), attempts=attempt
            )
        return LLMError(  # bad URL/protocol: configuration, not transient
            self._redact(f"cannot call {self._safe_base}: {type(exc).__name__}: {exc}"),
            kind="config",
            user_message="The assistant's model endpoint is misconfigured; an operator needs to fix it.",
            attempts=attempt,
        )

    def _judge(self, resp: httpx.Response, attempt: int) -> tuple[LLMError | None, float | None, dict[str, Any] | None]:
        """A complete (non-streamed) answer: its body, or the error it stands for."""
        raw_text = resp.text
        try:
            body: Any = resp.json()
        except ValueError:
            body = None
        status = resp.status_code

        if status < 400 and isinstance(body, dict) and "choices" in body:
            return None, None, body
        if status < 400:
            if isinstance(body, dict) and body.get("error"):  # some proxies answer errors with 200
                code = body["error"].get("code") if isinstance(body["error"], dict) else None
                status = code if isinstance(code, int) and 400 <= code < 600 else 400
            else:
                what = "a non-JSON body" if body is None else "JSON without choices"
                return (
                    LLMBadResponse(
                        self._redact(f"HTTP {status} with {what}: {raw_text[:200]!r}"),
                        status=resp.status_code,
                        attempts=attempt,
                    ),
                    None,
                    None,
                )
        return self._classify(status, body, raw_text, resp.headers, attempt), _parse_retry_after(resp.headers), None

    def _classify(self, status: int, body: Any, raw_text: str, headers: httpx.Headers, attempt: int) -> LLMError:
        text = self._redact(_error_text(body, raw_text))[:500]
        detail = f"HTTP {status} from {self._safe_base}: {text}"
        kw: dict[str, Any] = {"status": status, "attempts": attempt}
        if status in (401, 403):
            return LLMAuthError(detail, **kw)
        if status == 429:
            return LLMRateLimited(detail, **kw)
        if status not in (408,) and looks_like_context_error(text):
            return ContextLengthExceeded(
                detail, limit=_first_int(_LIMIT_RES, text), requested=_first_int(_REQUESTED_RES, text), **kw
            )
        if status >= 500 or status == 408:
            return LLMUnavailable(detail, **kw)
        if status == 404:
            return LLMError(
                detail,
                kind="not_found",
                user_message="The assistant's model or endpoint was not found; an operator needs to fix the configuration.",
                **kw,
            )
        return LLMRefused(detail, **kw)

    @staticmethod
    def _retryable(err: LLMError) -> bool:
        return isinstance(err, (LLMUnavailable, LLMRateLimited)) and not isinstance(err, LLMTimeout)

    def _backoff(self, attempt: int, retry_after: float | None) -> float:
        if retry_after is not None:
            return min(retry_after, self.retry_after_cap_s)
        base = min(MAX_BACKOFF_S, self.backoff_base_s * (2 ** (attempt - 1)))
        return base / 2 + random.uniform(0, base / 2)

    # ------------------------------------------------------------------ parsing

    def _parse(self, data: dict[str, Any], requested_model: str, attempt: int) -> ChatResult:
        choices = data.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            raise LLMBadResponse("response has no choices", attempts=attempt)
        choice = choices[0]
        msg = choice.get("message") or {}
        if not isinstance(msg, dict):
            raise LLMBadResponse("choice has no message object", attempts=attempt)
        content = _content_text(msg.get("content"))
        calls = msg.get("tool_calls")
        if not calls and isinstance(msg.get("function_call"), dict):  # legacy single call
            calls = [{"type": "function", "function": msg["function_call"]}]
        tool_calls = _normalize_tool_calls(calls) if isinstance(calls, list) else None
        extra = {k: msg[k] for k in ("reasoning_content", "reasoning", "refusal") if msg.get(k)}
        return ChatResult(
            content=content,
            tool_calls=tool_calls or None,
            finish_reason=choice.get("finish_reason"),
            usage=Usage.from_dict(data.get("usage")),
            model=str(data.get("model") or requested_model),
            raw=data,
            attempts=attempt,
            extra=extra,
        )

    def _redact(self, text: str) -> str:
        text = Redactor([self._api_key or ""], mark="***", patterns=False, min_len=1)(text)
        if self.base_url != self._safe_base and self.base_url in text:
            text = text.replace(self.base_url, self._safe_base)
        return text


def _safe_url(url: str) -> str:
    """The URL without userinfo, query or fragment (which may hold secrets)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<invalid url>"
    host = parts.hostname or ""
    if parts.port:
        host = f"{host}:{parts.port}"
    return urlunsplit((parts.scheme, host, parts.path, "", ""))


def wire_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` with each run of consecutive user messages merged into one (texts joined
    by a blank line), so servers whose chat template needs alternating roles (vLLM,
    llama.cpp with Mistral or Gemma templates) accept a history where messages were kept
    while the model was down. The stored history is not changed."""
    out: list[dict[str, Any]] = []
    for msg in messages:
        prev = out[-1] if out else None
        if prev is not None and msg.get("role") == "user" and prev.get("role") == "user":
            out[-1] = {**prev, "content": _join_contents(prev.get("content"), msg.get("content"))}
        else:
            out.append(msg)
    return out


def _join_contents(a: Any, b: Any) -> Any:
    if isinstance(a, str) and isinstance(b, str):
        return f"{a}\n\n{b}"

    def parts(c: Any) -> list[Any]:
        return list(c) if isinstance(c, list) else [{"type": "text", "text": c or ""}]

    return [*parts(a), {"type": "text", "text": "\n\n"}, *parts(b)]


def _content_text(content: Any) -> str | None:
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts
        texts = [p.get("text", "") for p in content if isinstance(p, dict) and p.get("type", "text") == "text"]
        return "".join(t for t in texts if isinstance(t, str))
    return str(content)


def _merge_tool_delta(calls: dict[int, dict[str, Any]], part: Any) -> None:
    """Add one streamed tool-call fragment: id and name arrive once, arguments in pieces."""
    if not isinstance(part, dict):
        return
    raw_index = part.get("index")
    index = raw_index if isinstance(raw_index, int) else len(calls)
    call = calls.setdefault(index, {"id": "", "type": "function", "function": {"name": "", "arguments": ""}})
    if isinstance(part.get("id"), str) and part["id"]:
        call["id"] = part["id"]
    raw_fn = part.get("function")
    fn: dict[str, Any] = raw_fn if isinstance(raw_fn, dict) else {}
    name, args = fn.get("name"), fn.get("arguments")
    if isinstance(name, str) and name and not call["function"]["name"]:
        call["function"]["name"] = name
    if isinstance(args, str):
        call["function"]["arguments"] += args


def _normalize_tool_calls(calls: list[Any]) -> list[dict[str, Any]]:
    """OpenAI form; object-valued arguments serialised, missing ids generated."""
    out: list[dict[str, Any]] = []
    for call in calls:
        if not isinstance(call, dict):
            continue
        sub = call.get("function")
        fn = sub if isinstance(sub, dict) else call
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            continue
        args = fn.get("arguments", fn.get("parameters"))
        if args is None:
            args = "{}"
        elif not isinstance(args, str):
            args = json.dumps(args, ensure_ascii=False)
        call_id = call.get("id")
        if not isinstance(call_id, str) or not call_id:
            call_id = f"call_{uuid.uuid4().hex[:24]}"
        out.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": args}})
    return out
