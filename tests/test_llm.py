"""LLMClient against the FakeLLM server over real HTTP on 127.0.0.1 (and the fake itself)."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import sys
import time

import httpx
import pytest

from agent.llm import (
    ChatResult,
    ContextLengthExceeded,
    LLMAuthError,
    LLMBadResponse,
    LLMClient,
    LLMError,
    LLMRateLimited,
    LLMRefused,
    LLMTimeout,
    LLMUnavailable,
    Usage,
)
from core.settings import LLMConfig
from tests.fakes.llm import (
    FakeLLM,
    assistant_message,
    context_length_error,
    disconnect,
    error,
    hang,
    memory_saving_responder,
    prompt_chars,
    reply,
    tool_call,
    tool_calls,
    when_user_says,
)

UNAVAILABLE = "The assistant's model is unreachable right now; your message was kept — please try again in a minute."
AUTH = "The assistant's model provider rejected our credentials; an operator needs to fix the API key."
SECRET = "sk-test-SECRET-0123456789abcdef"
USER = [{"role": "user", "content": "hello there"}]


@pytest.fixture
async def llm():
    async with FakeLLM() as server:
        yield server


def client_for(server: FakeLLM, **kw) -> LLMClient:
    kw.setdefault("backoff_base_s", 0.01)
    return LLMClient(server.base_url, "fake-model", **kw)


def closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


# --------------------------------------------------------------------------- success paths


async def test_plain_reply_with_usage(llm: FakeLLM) -> None:
    llm.script(reply("hello back"))
    async with client_for(llm, api_key=SECRET) as c:
        res = await c.chat(USER)
    assert isinstance(res, ChatResult)
    assert res.content == "hello back" and res.tool_calls is None
    assert res.finish_reason == "stop" and res.model == "fake-model"
    assert res.usage == Usage(
        prompt_tokens=len("hello there") // 4,
        completion_tokens=len("hello back") // 4,
        total_tokens=len("hello there") // 4 + len("hello back") // 4,
    )
    assert res.raw["object"] == "chat.completion" and res.attempts == 1
    assert llm.requests == [{"model": "fake-model", "messages": USER}]
    assert llm.request_headers[0]["authorization"] == f"Bearer {SECRET}"


async def test_default_answer_names_last_user_message_and_usage_override(llm: FakeLLM) -> None:
    llm.script(reply("x", usage={"prompt_tokens": 1000}))
    msgs = [
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "a"},
        {"role": "user", "content": "second"},
    ]
    async with client_for(llm) as c:
        overridden = await c.chat(msgs)
        default = await c.chat(msgs)
    assert overridden.usage == Usage(1000, 0, 1000)
    assert default.content == "ok: second"
    assert default.usage.prompt_tokens == prompt_chars({"messages": msgs}) // 4
    no_usage = reply("y", usage=False)
    llm.script(no_usage)
    async with client_for(llm) as c:
        assert (await c.chat(msgs)).usage is None


async def test_tool_call_parsing(llm: FakeLLM) -> None:
    llm.script(
        tool_call("memory", {"action": "add", "target": "user", "content": "likes tea"}, call_id="call_1"),
        tool_calls([("a", {"x": 1}), ("b", {})], content="thinking"),
        # a server that sends arguments as an object and no ids
        assistant_message(
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "type": "function",
                        "function": {"name": "session_search", "arguments": {"query": "tea", "limit": 2}},
                    },
                    {"function": {"name": "memory"}},
                ],
            },
            finish_reason="tool_calls",
        ),
    )
    async with client_for(llm) as c:
        one = await c.chat(USER)
        two = await c.chat(USER)
        odd = await c.chat(USER)
    assert one.finish_reason == "tool_calls" and one.content is None
    assert one.tool_calls == [
        {
            "id": "call_1",
            "type": "function",
            "function": {
                "name": "memory",
                "arguments": json.dumps({"action": "add", "target": "user", "content": "likes tea"}),
            },
        }
    ]
    assert [t["function"]["name"] for t in two.tool_calls] == ["a", "b"] and two.content == "thinking"
    assert two.tool_calls[0]["id"] != two.tool_calls[1]["id"]
    first, second = odd.tool_calls
    assert isinstance(first["function"]["arguments"], str)
    assert json.loads(first["function"]["arguments"]) == {"query": "tea", "limit": 2}
    assert first["id"].startswith("call_") and second["id"].startswith("call_") and first["id"] != second["id"]
    assert first["type"] == "function" and second["function"]["arguments"] == "{}"


async def test_request_shape_max_tokens_omitted_when_none(llm: FakeLLM) -> None:
    tools = [{"type": "function", "function": {"name": "memory", "parameters": {"type": "object"}}}]
    async with client_for(llm) as c:
        await c.chat(USER)
        await c.chat(USER, max_tokens=256, temperature=0.2, tools=tools, model="other-model")
    plain, full = llm.requests
    assert "max_tokens" not in plain and "temperature" not in plain and "tools" not in plain
    assert full["max_tokens"] == 256 and full["temperature"] == 0.2
    assert full["tools"] == tools and full["model"] == "other-model"
    assert "authorization" not in llm.request_headers[0]


async def test_from_config_reads_key_from_env(llm: FakeLLM, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_LLM_KEY", SECRET)
    llm.set_api_key(SECRET)
    cfg = LLMConfig(base_url=llm.base_url + "/", model="cfg-model", api_key_env="FAKE_LLM_KEY", timeout_s=5)
    async with LLMClient.from_config(cfg) as c:
        res = await c.chat(USER)
    assert res.content == "ok: hello there" and llm.requests[0]["model"] == "cfg-model"


# --------------------------------------------------------------------------- retries


async def test_retry_after_429_honours_retry_after(llm: FakeLLM) -> None:
    llm.script(
        error(429, {"error": {"message": "slow down", "type": "rate_limit"}}, headers={"Retry-After": "0.3"}),
        reply("after the wait"),
    )
    async with client_for(llm, backoff_base_s=20) as c:  # the header wins over the backoff
        t0 = time.monotonic()
        res = await c.chat(USER)
        elapsed = time.monotonic() - t0
    assert res.content == "after the wait" and res.attempts == 2
    assert 0.3 <= elapsed < 5
    assert llm.statuses == [429, 200]


async def test_retry_after_is_capped(llm: FakeLLM) -> None:
    llm.script(error(429, "busy", headers={"Retry-After": "3600"}), reply("ok"))
    async with client_for(llm, retry_after_cap_s=0.05) as c:
        t0 = time.monotonic()
        assert (await c.chat(USER)).content == "ok"
    assert time.monotonic() - t0 < 3


async def test_429_beyond_retries_is_rate_limited(llm: FakeLLM) -> None:
    llm.script(*[error(429, {"error": {"message": "rate limit"}}, headers={"Retry-After": "0"})] * 3)
    async with client_for(llm, max_retries=2) as c:
        with pytest.raises(LLMRateLimited) as info:
            await c.chat(USER)
    assert info.value.kind == "rate_limited" and info.value.attempts == 3 and len(llm.requests) == 3


async def test_retry_after_500_then_success(llm: FakeLLM) -> None:
    llm.script(error(500, {"error": {"message": "boom"}}), error(502, "<html>bad gateway</html>"), reply("fine"))
    async with client_for(llm) as c:
        res = await c.chat(USER)
    assert res.content == "fine" and res.attempts == 3 and llm.statuses == [500, 502, 200]


async def test_disconnect_is_retried(llm: FakeLLM) -> None:
    llm.script(disconnect(), reply("second try"))
    async with client_for(llm) as c:
        assert (await c.chat(USER)).content == "second try"
    assert llm.statuses == [0, 200]


async def test_5xx_beyond_retries_is_unavailable(llm: FakeLLM) -> None:
    llm.script(*[error(503, {"error": {"message": "overloaded"}})] * 10)
    async with client_for(llm, max_retries=2) as c:
        with pytest.raises(LLMUnavailable) as info:
            await c.chat(USER)
    err = info.value
    assert err.user_message == UNAVAILABLE and err.kind == "unavailable" and err.status == 503
    assert len(llm.requests) == 3 and err.attempts == 3


async def test_connection_refused_is_unavailable_quickly() -> None:
    c = LLMClient(f"http://127.0.0.1:{closed_port()}/v1", "m", max_retries=2, backoff_base_s=0.01)
    t0 = time.monotonic()
    with pytest.raises(LLMUnavailable) as info:
        await c.chat(USER)
    await c.aclose()
    assert time.monotonic() - t0 < 3
    assert info.value.user_message == UNAVAILABLE and info.value.attempts == 3 and info.value.status is None


async def test_read_timeout_is_reported_as_timeout_and_never_retried(llm: FakeLLM) -> None:
    llm.script(hang(30), hang(30))
    async with client_for(llm, timeout_s=0.3, max_retries=3) as c:
        with pytest.raises(LLMTimeout) as info:
            await c.chat(USER)
    err = info.value
    assert len(llm.requests) == 1 and err.attempts == 1  # the server is not asked to generate it again
    assert "timed out after 0.3 s" in str(err) and err.kind == "timeout"
    assert "unreachable" not in err.user_message and "in time" in err.user_message
    assert isinstance(err, LLMUnavailable)  # still "the message was kept, try again" for callers


async def test_consecutive_user_messages_reach_a_role_alternating_server_as_one() -> None:
    history = [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "hi"},
        {"role": "user", "content": "hi again"},
        {"role": "user", "content": "anyone?"},
    ]
    kept = json.loads(json.dumps(history))
    async with FakeLLM(alternating_roles=True) as server, client_for(server) as c:
        result = await c.chat(history)
        assert result.content == "ok: hi\n\nhi again\n\nanyone?"
        sent = server.requests[-1]["messages"]
        assert [m["role"] for m in sent] == ["system", "user"] and server.violations == []
        assert history == kept  # only the wire form changes


async def test_role_alternation_refusal_tells_the_person_to_start_over() -> None:
    history = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "and?"},
    ]
    async with FakeLLM(alternating_roles=True) as server, client_for(server) as c:
        with pytest.raises(LLMRefused) as info:
            await c.chat(history)
    assert "Conversation roles must alternate" in str(info.value) and len(server.requests) == 1
    assert "send /new to start a fresh one" in info.value.user_message


async def test_hang_then_reply_within_timeout(llm: FakeLLM) -> None:
    llm.script(hang(0.2, "slow but fine"))
    async with client_for(llm, timeout_s=5) as c:
        assert (await c.chat(USER)).content == "slow but fine"


# --------------------------------------------------------------------------- non-retryable errors


async def test_401_is_auth_error_without_retries(llm: FakeLLM) -> None:
    llm.set_api_key("the-right-key")
    async with client_for(llm, api_key=SECRET) as c:
        with pytest.raises(LLMAuthError) as info:
            await c.chat(USER)
    assert info.value.user_message == AUTH and info.value.kind == "auth" and info.value.status == 401
    assert len(llm.requests) == 1


async def test_403_is_auth_error(llm: FakeLLM) -> None:
    llm.script(error(403, {"error": {"message": "forbidden"}}))
    async with client_for(llm) as c:
        with pytest.raises(LLMAuthError):
            await c.chat(USER)
    assert len(llm.requests) == 1


@pytest.mark.parametrize("dialect", ["openai", "vllm", "llamacpp", "ollama", "anthropic"])
async def test_every_context_length_dialect(llm: FakeLLM, dialect: str) -> None:
    llm.script(context_length_error(dialect, limit=4096, requested=5000))
    async with client_for(llm) as c:
        with pytest.raises(ContextLengthExceeded) as info:
            await c.chat(USER)
    err = info.value
    assert err.kind == "context_length" and err.status == 400 and len(llm.requests) == 1
    if dialect != "ollama":  # Ollama's wording has no numbers
        assert err.limit == 4096
    if dialect in ("openai", "vllm", "llamacpp", "anthropic"):
        assert err.requested == 5000


@pytest.mark.parametrize(
    "status, body",
    [
        (413, "prompt is too long"),
        (400, {"error": {"message": "Input validation error: `inputs` tokens + `max_new_tokens` must be <= 4096."}}),
        (400, {"detail": "requested tokens exceed context window of n_ctx=2048"}),
        (
            500,
            {
                "error": {
                    "code": 500,
                    "message": "the request exceeds the available context size, try increasing "
                    "the context size or enable context shift",
                    "type": "server_error",
                }
            },
        ),
    ],
)
async def test_context_errors_in_other_shapes(llm: FakeLLM, status: int, body: object) -> None:
    llm.script(error(status, body))
    async with client_for(llm) as c:
        with pytest.raises(ContextLengthExceeded):
            await c.chat(USER)
    assert len(llm.requests) == 1  # never retried, even as a 500


async def test_context_errors_from_fake_context_window() -> None:
    async with FakeLLM(context_length=10, context_dialect="vllm") as llm:
        llm.script(reply("never consumed"))
        async with client_for(llm) as c:
            assert (await c.chat(USER)).content == "never consumed"  # 11 chars // 4 fits
            with pytest.raises(ContextLengthExceeded) as info:
                await c.chat([{"role": "user", "content": "x" * 100}])
    assert info.value.limit == 10 and info.value.requested == 25


async def test_other_4xx_not_retried(llm: FakeLLM) -> None:
    llm.script(error(400, {"error": {"message": "bad temperature"}}), error(404, {"error": {"message": "no model"}}))
    async with client_for(llm) as c:
        with pytest.raises(LLMError) as bad:
            await c.chat(USER)
        with pytest.raises(LLMError) as missing:
            await c.chat(USER)
    assert bad.value.kind == "bad_request" and missing.value.kind == "not_found"
    assert type(bad.value) is LLMRefused and len(llm.requests) == 2
    assert "/new" in bad.value.user_message


@pytest.mark.parametrize(
    "response",
    [
        error(200, "<html>not json</html>"),
        error(200, {"id": "x", "object": "chat.completion"}),
        error(200, {"choices": []}),
    ],
)
async def test_bad_response(llm: FakeLLM, response) -> None:
    llm.script(response)
    async with client_for(llm) as c:
        with pytest.raises(LLMBadResponse) as info:
            await c.chat(USER)
    assert info.value.kind == "bad_response" and len(llm.requests) == 1


async def test_error_body_with_status_200(llm: FakeLLM) -> None:
    llm.script(error(200, {"error": {"message": "This model's maximum context length is 8192 tokens"}}))
    async with client_for(llm) as c:
        with pytest.raises(ContextLengthExceeded):
            await c.chat(USER)


# --------------------------------------------------------------------------- secrets


async def test_api_key_never_in_errors_reprs_or_logs(llm: FakeLLM, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    echo = {"error": {"message": f"Incorrect API key provided: {SECRET}", "code": "invalid_api_key"}}
    llm.script(error(500, echo), error(401, echo))
    c = client_for(llm, api_key=SECRET)
    with pytest.raises(LLMAuthError) as info:
        await c.chat(USER)
    await c.aclose()
    err = info.value
    for text in (str(err), repr(err), err.user_message, err.detail, repr(c), caplog.text):
        assert SECRET not in text
    assert "Incorrect API key" in str(err)  # the provider's wording is kept, redacted


async def test_url_secrets_not_in_errors() -> None:
    c = LLMClient(f"http://user:urlsecret@127.0.0.1:{closed_port()}/v1", "m", api_key=SECRET, max_retries=0)
    with pytest.raises(LLMUnavailable) as info:
        await c.chat(USER)
    await c.aclose()
    for text in (str(info.value), repr(info.value), info.value.user_message, repr(c)):
        assert "urlsecret" not in text and SECRET not in text


async def test_custom_transport_is_used() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/v1/chat/completions"
        return httpx.Response(
            200,
            json={
                "model": "m",
                "choices": [
                    {
                        "message": {"role": "assistant", "content": [{"type": "text", "text": "parts"}]},
                        "finish_reason": "stop",
                    }
                ],
            },
        )

    async with LLMClient("http://llm.invalid/v1", "m", transport=httpx.MockTransport(handler)) as c:
        res = await c.chat(USER)
    assert res.content == "parts" and res.usage is None


# --------------------------------------------------------------------------- the fake itself


async def test_fake_strict_rejects_orphaned_tool_results(llm: FakeLLM) -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "memory", "arguments": "{}"}}
    good = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "{}"},
    ]
    async with client_for(llm) as c:
        await c.chat(good)
        with pytest.raises(LLMError) as orphan:
            await c.chat([{"role": "user", "content": "hi"}, good[2]])
        with pytest.raises(LLMError):
            await c.chat([*good[:2], {"role": "user", "content": "unanswered call"}])
    assert orphan.value.kind == "bad_request"
    assert len(llm.violations) == 2 and llm.statuses == [200, 400, 400]


async def test_fake_responders_and_helpers(llm: FakeLLM) -> None:
    tools = [{"type": "function", "function": {"name": "memory", "parameters": {}}}]
    llm.responder = memory_saving_responder
    async with client_for(llm) as c:
        res = await c.chat([{"role": "user", "content": "remember that I like tea"}], tools=tools)
        assert json.loads(res.tool_calls[0]["function"]["arguments"])["content"] == "I like tea"
        msgs = [
            {"role": "user", "content": "remember that I like tea"},
            {"role": "assistant", "content": None, "tool_calls": res.tool_calls},
            {"role": "tool", "tool_call_id": res.tool_calls[0]["id"], "content": '{"ok": true}'},
        ]
        assert (await c.chat(msgs, tools=tools)).content == 'done: {"ok": true}'

        async def slow(request: dict) -> object:
            await asyncio.sleep(0)
            return when_user_says({"weather": "sunny"}, fallback="dunno")(request)

        llm.responder = slow
        assert (await c.chat([{"role": "user", "content": "weather?"}])).content == "sunny"
        assert (await c.chat([{"role": "user", "content": "news?"}])).content == "dunno"
        llm.script(lambda req: reply(f"{len(req['messages'])} messages"))
        assert (await c.chat(USER)).content == "1 messages"
    assert len(llm.requests_containing("tea")) == 2 and llm.requests_containing("nothing like this") == []
    assert llm.pending == 0


async def test_fakes_are_independent_and_run_in_a_thread() -> None:
    async with FakeLLM() as a, FakeLLM() as b:
        a.script(reply("from a"))
        async with client_for(a) as ca, client_for(b) as cb:
            ra, rb = await asyncio.gather(ca.chat(USER), cb.chat(USER))
        assert (ra.content, rb.content) == ("from a", "ok: hello there")
        assert len(a.requests) == len(b.requests) == 1 and a.base_url != b.base_url

    with FakeLLM(api_key="k") as threaded:  # blocking use, e.g. around subprocess.run
        resp = httpx.post(
            threaded.base_url + "/chat/completions",
            json={"model": "m", "messages": USER},
            headers={"Authorization": "Bearer k"},
            timeout=5,
        )
        models = httpx.get(threaded.base_url + "/models", headers={"Authorization": "Bearer k"}, timeout=5)
    assert resp.json()["choices"][0]["message"]["content"] == "ok: hello there"
    assert models.json()["data"][0]["id"] == "fake-model"


async def test_stop_releases_hanging_requests() -> None:
    llm = await FakeLLM().start()
    llm.script(hang(60))
    c = client_for(llm, timeout_s=30, max_retries=0)
    task = asyncio.create_task(c.chat(USER))
    while not llm.requests:
        await asyncio.sleep(0.01)
    t0 = time.monotonic()
    await llm.stop()
    with pytest.raises(LLMUnavailable):
        await task
    await c.aclose()
    assert time.monotonic() - t0 < 5


CHILD = """
import asyncio, sys
from agent.llm import LLMClient

async def main():
    async with LLMClient(sys.argv[1], "child-model", api_key="k") as c:
        print((await c.chat([{"role": "user", "content": "from the child"}])).content)

asyncio.run(main())
"""


async def test_fake_serves_a_subprocess() -> None:
    async with FakeLLM(api_key="k") as llm:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", CHILD, llm.base_url, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
        )
        out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 0, err.decode()
    assert out.decode().strip() == "ok: from the child"
    assert llm.requests[0]["model"] == "child-model"


async def test_a_descriptor_limit_of_our_own_is_not_called_the_model_being_down():
    """EMFILE while connecting is the gateway's own resource fault: its own kind, so the turn
    sheds idle profiles and says "I can't answer right now", not "can't reach my model"."""
    import errno

    from agent.llm import LLMNoDescriptors

    c = LLMClient("http://127.0.0.1:9/v1", "m", max_retries=0)
    try:
        cause = OSError(errno.EMFILE, "Too many open files")
        err = httpx.ConnectError("connect failed")
        err.__cause__ = cause
        judged = c._transport_error(err, 1)
        assert isinstance(judged, LLMNoDescriptors) and judged.kind == "no_descriptors"
        assert "model" not in judged.user_message
        plain = c._transport_error(httpx.ConnectError("refused"), 1)
        assert plain.kind == "unavailable"
    finally:
        await c.aclose()
