"""The web and MCP tools through the real gateway (docs/concepts.md#tools): configured in
`tools`, offered by tier, their results kept in the lane's session and its export, counted
per tool; servers are real (a page server and a fake SearXNG on 127.0.0.1, reached through
`tools.web.allow_hosts`; an MCP server written with the SDK in a subprocess)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from tests.conftest import dm, group, running_gateway, say
from tests.fakes.llm import offered_tools, reply, tool_call
from tests.fakes.web import FakeSearchAPI, PageServer

FAKE_MCP = str(Path(__file__).parent / "fakes" / "mcp_server.py")


def tool_results(request: dict[str, Any]) -> list[dict[str, Any]]:
    return [json.loads(m["content"]) for m in request.get("messages", []) if m.get("role") == "tool"]


async def test_a_dm_fetches_a_page_the_group_is_never_offered_it_and_the_result_is_the_lanes_data(config_for, fake_llm):
    async with PageServer() as pages:
        url = pages.url("/page")
        fake_llm.script(tool_call("web_fetch", {"url": url}), reply(f"It is the field guide ({url})."), reply("hi"))
        tools = {"web_fetch": {"enabled": True}, "web": {"allow_hosts": [f"127.0.0.1:{pages.port}"]}}
        async with running_gateway(config_for, tools=tools) as (app, adapter):
            assert await say(app, adapter, dm("ada", "what is on this page?")) == [f"It is the field guide ({url})."]
            [result] = tool_results(fake_llm.requests[-1])
            assert result["success"] is True and "Field Guide" in result["title"]
            assert "do-not-read-me" not in result["content"]  # scripts are not text
            await say(app, adapter, group("g1", "ada", "and here?"))
            assert "web_fetch" not in offered_tools(fake_llm.requests[-1])
            [export] = await say(app, adapter, dm("ada", "/export"))
            assert "Exported" in export
            assert 'hermes_tool_calls_total{tool="web_fetch",outcome="ok"} 1' in app.metrics.render()
            profile = app.profiles._open["testchat-ada"].path
        dump = json.loads(sorted((profile / "exports").glob("*.json"))[-1].read_text(encoding="utf-8"))
        messages = [m for s in dump["sessions"] for m in s["messages"]]
        calls = [m for m in messages if m["role"] == "assistant" and m.get("tool_calls")]
        results = [m for m in messages if m["role"] == "tool" and m.get("tool_name") == "web_fetch"]
        assert calls and results and "Field Guide" in results[0]["content"]
        journals = b"".join(p.read_bytes() for p in (profile / "sessions").glob("*.jsonl"))
        assert b"Hermes carries messages" in journals, "the tool result is journaled like any message"


async def test_a_private_address_is_refused_as_a_tool_error_not_a_crash(config_for, fake_llm):
    async with PageServer() as pages:
        fake_llm.script(tool_call("web_fetch", {"url": pages.url("/page")}), reply("I could not read it."))
        async with running_gateway(config_for, tools={"web_fetch": {"enabled": True}}) as (app, adapter):
            assert await say(app, adapter, dm("ada", "read it")) == ["I could not read it."]
            [result] = tool_results(fake_llm.requests[-1])
            assert result["success"] is False and "127.0.0.1" in result["error"]
            assert pages.requests == []
            assert 'hermes_tool_calls_total{tool="web_fetch",outcome="error"} 1' in app.metrics.render()


async def test_web_search_through_searxng_gives_the_model_titles_urls_and_snippets(config_for, fake_llm):
    async with FakeSearchAPI(api_key="unused") as api:
        fake_llm.script(tool_call("web_search", {"query": "hermes gateway"}), reply("Found it."))
        tools = {"web_search": {"provider": "searxng", "base_url": api.base_url}}
        async with running_gateway(config_for, tools=tools) as (app, adapter):
            await say(app, adapter, dm("ada", "search the web"))
            [result] = tool_results(fake_llm.requests[-1])
            assert result["success"] is True and result["results"]
            assert {"title", "url", "snippet"} <= set(result["results"][0])
            assert api.requests[-1]["provider"] == "searxng"


async def test_an_mcp_servers_tools_are_offered_by_its_rule_and_called_for_the_tenant(config_for, fake_llm):
    fake_llm.script(tool_call("fake__echo", {"text": "ping"}), reply("It said ping."), reply("no tools here"))
    server = {"command": sys.executable, "args": [FAKE_MCP], "timeout_s": 10}
    tools = {"mcp": {"servers": {"fake": server}}}
    async with running_gateway(config_for, tools=tools) as (app, adapter):
        assert await say(app, adapter, dm("ada", "echo ping")) == ["It said ping."]
        assert {"fake__echo", "fake__add"} <= offered_tools(fake_llm.requests[0])
        [result] = tool_results(fake_llm.requests[-1])
        assert result["success"] is True and "ping" in result["content"]
        await say(app, adapter, group("g1", "ada", "and in the group?"))
        assert not {t for t in offered_tools(fake_llm.requests[-1]) if t.startswith("fake__")}
        [listing] = await say(app, adapter, dm("ada", "/tools"))
        assert "fake__echo" in listing


async def test_one_mcp_tool_can_be_opened_to_everyone_while_its_server_stays_dm_only(config_for, fake_llm):
    fake_llm.script(reply("hello group"))
    server = {"command": sys.executable, "args": [FAKE_MCP], "tools": {"add": {"allow": "everyone"}}}
    async with running_gateway(config_for, tools={"mcp": {"servers": {"fake": server}}}) as (app, adapter):
        await say(app, adapter, group("g1", "ada", "hi all"))
        offered = {t for t in offered_tools(fake_llm.requests[-1]) if t.startswith("fake__")}
        assert offered == {"fake__add"}


async def test_a_servers_credential_comes_from_the_gateways_variable_and_never_reaches_the_logs(
    config_for, fake_llm, monkeypatch
):
    from gateway.logs import secrets_from_config

    monkeypatch.setenv("HERMES_TEST_MCP_TOKEN", "tok-7731-SECRET")
    monkeypatch.setenv("HERMES_SECRET_CANARY", "the gateway's own secret")
    fake_llm.script(tool_call("fake__whoami", {}), reply("It knows its token."))
    server = {
        "command": sys.executable,
        "args": [FAKE_MCP, "--tag", "{tenant}"],
        "env_from": {"FAKE_MCP_TAG": "HERMES_TEST_MCP_TOKEN"},
        "per_tenant": True,
    }
    async with running_gateway(config_for, tools={"mcp": {"servers": {"fake": server}}}) as (app, adapter):
        await say(app, adapter, dm("ada", "who is the server?"))
        [result] = tool_results(fake_llm.requests[-1])
        seen = json.loads(result["content"])
        assert seen["env_tag"] == "tok-7731-SECRET" and seen["tag"] == "testchat-ada"
        assert seen["canary_visible"] is False
        assert "tok-7731-SECRET" in secrets_from_config(app.cfg)


def test_doctor_fails_an_mcp_server_that_cannot_start_and_passes_one_that_does(tmp_path, capsys):
    import yaml

    from gateway.cli import main
    from tests.fakes.llm import FakeLLM

    with FakeLLM() as llm:
        servers = {
            "good": {"command": sys.executable, "args": [FAKE_MCP]},
            "broken": {"command": sys.executable, "args": ["-c", "import sys; sys.exit(3)"]},
            "mine": {"command": "no-such-mcp-program", "per_tenant": True},
        }
        path = tmp_path / "gw.yaml"
        config = {
            "data_dir": str(tmp_path / "d"),
            "llm": {"base_url": llm.base_url},
            "tools": {"mcp": {"servers": servers}},
        }
        path.write_text(yaml.safe_dump(config))
        assert main(["doctor", "-c", str(path)]) == 1
    out = capsys.readouterr().out
    assert "[ok] MCP good: started, " in out
    assert "[FAIL] MCP broken: the MCP server broken is unavailable: it could not start" in out
    assert "[FAIL] MCP mine: the command 'no-such-mcp-program' is not found" in out


async def test_doctor_checks_that_the_search_provider_answers_with_its_key(monkeypatch):
    from core.settings import parse_config
    from gateway.tool_checks import check_web_search

    async with FakeSearchAPI(api_key="k-123") as api:
        searx = parse_config({"tools": {"web_search": {"provider": "searxng", "base_url": api.base_url}}})
        ok, detail = await check_web_search(searx)
        assert ok and "searxng answered" in detail
        brave = {"provider": "brave", "base_url": api.base_url, "api_key_env": "HERMES_TEST_BRAVE_KEY"}
        cfg = parse_config({"tools": {"web_search": brave}})
        monkeypatch.delenv("HERMES_TEST_BRAVE_KEY", raising=False)
        ok, detail = await check_web_search(cfg)
        assert not ok and "HERMES_TEST_BRAVE_KEY is not set" in detail
        monkeypatch.setenv("HERMES_TEST_BRAVE_KEY", "wrong-key")
        ok, detail = await check_web_search(cfg)
        assert not ok and "wrong-key" not in detail
        monkeypatch.setenv("HERMES_TEST_BRAVE_KEY", "k-123")
        ok, _ = await check_web_search(cfg)
        assert ok


async def test_a_server_no_one_in_the_lane_may_use_is_never_started_for_it(config_for, fake_llm, tmp_path):
    fake_llm.script(reply("hello group"), reply("hello ada"))
    marker = tmp_path / "started"
    server = {
        "command": "sh",
        "args": ["-c", f'touch "{marker}-$0"; exec "{sys.executable}" "{FAKE_MCP}"', "{tenant}"],
        "per_tenant": True,
    }
    async with running_gateway(config_for, tools={"mcp": {"servers": {"own": server}}}) as (app, adapter):
        await say(app, adapter, group("g1", "ada", "hi all"))
        assert not list(tmp_path.glob("started-*")), "a dm-only server was started for a group lane"
        await say(app, adapter, dm("ada", "hi"))
        assert [p.name for p in tmp_path.glob("started-*")] == ["started-testchat-ada"]
        assert "own__echo" in offered_tools(fake_llm.requests[-1])
