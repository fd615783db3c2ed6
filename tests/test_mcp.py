"""agent/mcp_tools.py: MCP tool servers through the official SDK, against a real fake server
(tests/fakes/mcp_server.py) in a real subprocess, over stdio and streamable HTTP."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

from agent.mcp_tools import McpHub, McpServerSpec, _qualified_names

FAKE = str(Path(__file__).parent / "fakes" / "mcp_server.py")
OPENAI_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
FAKE_TOOLS = {"echo", "add", "slow", "crash", "big", "whoami", "fails"}


def fake(name: str = "fake", *args: str, **options: Any) -> McpServerSpec:
    """The fake server over stdio, with short timeouts unless a test says otherwise."""
    options.setdefault("call_timeout_s", 5.0)
    options.setdefault("start_timeout_s", 10.0)
    return McpServerSpec(name, command=sys.executable, args=(FAKE, *args), **options)


def script(name: str, code: str, *args: str, **options: Any) -> McpServerSpec:
    """A server command that is not an MCP server: `python -c code args...`."""
    return McpServerSpec(name, command=sys.executable, args=("-c", code, *args), **options)


class Clock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
async def hubs():
    """Build hubs with `hubs(*specs, **options)`; every one is closed after the test."""
    made: list[McpHub] = []

    def make(*specs: McpServerSpec, **options: Any) -> McpHub:
        hub = McpHub(specs, **options)
        made.append(hub)
        return hub

    yield make
    for hub in made:
        await hub.close()


async def call(hub: McpHub, qualified: str, tenant: str = "t1", **arguments: Any) -> dict[str, Any]:
    return json.loads(await hub.call(tenant, qualified, arguments))


async def whoami(hub: McpHub, qualified: str = "fake__whoami", tenant: str = "t1") -> dict[str, Any]:
    reply = await call(hub, qualified, tenant)
    assert reply["success"], reply
    return json.loads(reply["content"])


def process_state(pid: int) -> str | None:
    """The process's state letter (Z for a zombie), or None when it is gone and reaped."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return None


def processes_with(marker: str) -> list[int]:
    """Live processes whose command line holds `marker`."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if marker.encode() in cmdline and process_state(int(entry.name)) not in (None, "Z"):
                found.append(int(entry.name))
    return found


async def gone(pid: int, within: float = 8.0) -> bool:
    deadline = time.monotonic() + within
    while process_state(pid) is not None:
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.05)
    return True


@pytest.fixture
def http_server():
    """The fake server over streamable HTTP on a free 127.0.0.1 port, once it answers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, FAKE, "--http", str(port), "--tag", "web"])
    url = f"http://127.0.0.1:{port}/mcp"
    deadline = time.monotonic() + 15
    while True:
        try:
            httpx.get(url, timeout=1)  # any HTTP answer: the app is up
            break
        except httpx.TransportError:
            assert proc.poll() is None, "the HTTP fake server exited"
            assert time.monotonic() < deadline, "the HTTP fake server did not come up"
            time.sleep(0.05)
    yield url
    proc.terminate()
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


async def test_tools_of_a_stdio_server_are_listed_with_safe_qualified_names(hubs):
    long_name = "L" * 60 + "_1"  # server__tool cut at 64 leaves no room for the tool: all collide
    hub = hubs(fake(), fake(long_name))
    tools = await hub.tools("t1")

    plain = {t.name: t for t in tools if t.server == "fake"}
    assert set(plain) == FAKE_TOOLS
    assert {t.qualified for t in plain.values()} == {f"fake__{n}" for n in FAKE_TOOLS}
    echo = plain["echo"].openai_tool()
    assert echo["type"] == "function"
    assert echo["function"]["name"] == "fake__echo"
    assert echo["function"]["description"] == "Return the text unchanged."
    assert echo["function"]["parameters"]["type"] == "object"
    assert echo["function"]["parameters"]["required"] == ["text"]

    cut = {t.name: t.qualified for t in tools if t.server == long_name}
    assert set(cut) == FAKE_TOOLS
    assert len(set(cut.values())) == len(cut), "colliding names were made unique"
    assert all(OPENAI_NAME.match(t.qualified) for t in tools)
    alone = {t.name: t.qualified for t in await hubs(fake(long_name)).tools("t1")}
    assert alone == cut, "the unique names do not depend on what else is listed"
    assert await call(hub, cut["echo"], text="routed") == {"success": True, "content": "routed"}

    pair = [("srv", "get.weather"), ("srv", "get weather")]  # both sanitise to srv__get_weather
    named = _qualified_names(pair)
    assert len(set(named)) == 2 and all(re.fullmatch(r"srv__get_weather_[0-9a-f]{8}", n) for n in named)
    assert _qualified_names(pair[::-1]) == named[::-1], "each keeps its name whatever the order"
    assert _qualified_names([("srv", "read.file")]) == ["srv__read_file"]


async def test_a_tool_is_called_over_stdio_and_over_streamable_http(hubs, http_server):
    hub = hubs(fake(), McpServerSpec("web", url=http_server, headers={"Authorization": "Bearer t0ken"}))
    names = {t.qualified for t in await hub.tools("t1")}
    assert {"fake__add", "web__add", "web__echo"} <= names

    assert await call(hub, "fake__add", a=2, b=3) == {"success": True, "content": "5"}
    assert await call(hub, "web__add", a=20, b=22) == {"success": True, "content": "42"}
    assert await call(hub, "web__echo", text="over http") == {"success": True, "content": "over http"}
    assert (await whoami(hub, "web__whoami"))["tag"] == "web"


async def test_a_server_is_started_only_when_first_used(hubs):
    marker = f"lazy-{uuid.uuid4().hex}"
    hub = hubs(fake("fake", "--tag", marker))
    await asyncio.sleep(0.3)
    assert processes_with(marker) == [], "nothing runs before the first use"

    await hub.tools("t1")
    running = processes_with(marker)
    assert len(running) == 1
    await hub.tools("t1")
    assert (await whoami(hub))["pid"] == running[0], "the second use reuses the session"
    assert processes_with(marker) == running


async def test_a_slow_tool_times_out_with_a_clear_error(hubs):
    hub = hubs(fake(call_timeout_s=0.5))
    pid = (await whoami(hub))["pid"]
    started = time.monotonic()
    reply = await call(hub, "fake__slow", seconds=10)
    assert reply == {"success": False, "error": "the tool fake__slow did not answer within 0.5 s"}
    assert time.monotonic() - started < 3
    assert (await whoami(hub))["pid"] == pid, "a timeout is not a crash: the server keeps running"


async def test_a_big_result_is_cut_at_the_output_cap(hubs):
    hub = hubs(fake(max_output_chars=1000))
    reply = await call(hub, "fake__big", n=5000)
    assert reply == {"success": True, "content": "x" * 1000, "truncated": True}
    assert await call(hub, "fake__big", n=1000) == {"success": True, "content": "x" * 1000}


async def test_a_crashed_server_gives_a_clear_error_and_is_restarted(hubs):
    hub = hubs(fake())
    first = (await whoami(hub))["pid"]
    reply = await call(hub, "fake__crash")
    assert reply == {"success": False, "error": "the MCP server fake stopped; it will be restarted"}

    assert await call(hub, "fake__echo", text="back") == {"success": True, "content": "back"}
    second = (await whoami(hub))["pid"]
    assert second != first
    assert await gone(first)


async def test_a_crash_looping_server_is_restarted_with_backoff_not_hammered(hubs):
    marker = f"loop-{uuid.uuid4().hex}"
    clock = Clock()
    hub = hubs(fake("fake", "--tag", marker), clock=clock)
    await hub.tools("t1")

    # the first crash: restarted at the next use
    assert (await call(hub, "fake__crash"))["error"] == "the MCP server fake stopped; it will be restarted"
    # the second in a row, with no good answer between: the next start waits 1 s, then 2 s
    assert (await call(hub, "fake__crash"))["error"] == "the MCP server fake stopped; it will be restarted"
    reply = await call(hub, "fake__echo", text="too soon")
    assert reply["success"] is False
    assert reply["error"].startswith("the MCP server fake is unavailable: it stopped")
    assert reply["error"].endswith("it will be tried again in 1 s")
    assert [t.qualified for t in await hub.tools("t1")] == [], "left out while backing off"
    await asyncio.sleep(0.3)
    assert processes_with(marker) == [], "no start was tried while backing off"

    clock.now += 1.0
    assert (await call(hub, "fake__crash"))["success"] is False
    clock.now += 1.0
    assert (await call(hub, "fake__echo", text="x"))["error"].endswith("it will be tried again in 1 s")
    await asyncio.sleep(0.3)
    assert processes_with(marker) == []

    clock.now += 1.0
    assert await call(hub, "fake__echo", text="steady") == {"success": True, "content": "steady"}
    # an answer proves the server works again: its next crash is restarted at once
    assert (await call(hub, "fake__crash"))["success"] is False
    assert await call(hub, "fake__echo", text="again") == {"success": True, "content": "again"}


async def test_per_tenant_servers_run_one_process_per_tenant_with_the_tenant_substituted(hubs):
    per_tenant = fake("mine", "--tag", "tag-{tenant}", env={"FAKE_MCP_TAG": "env-{tenant}"}, per_tenant=True)
    hub = hubs(per_tenant, fake("shared"))
    a = await whoami(hub, "mine__whoami", tenant="discord:1")
    b = await whoami(hub, "mine__whoami", tenant="telegram:2")
    assert (a["tag"], a["env_tag"]) == ("tag-discord:1", "env-discord:1")
    assert (b["tag"], b["env_tag"]) == ("tag-telegram:2", "env-telegram:2")
    assert a["pid"] != b["pid"]
    assert (await whoami(hub, "mine__whoami", tenant="discord:1"))["pid"] == a["pid"]

    shared_a = await whoami(hub, "shared__whoami", tenant="discord:1")
    shared_b = await whoami(hub, "shared__whoami", tenant="telegram:2")
    assert shared_a["pid"] == shared_b["pid"]
    assert shared_a["tag"] == "" and shared_a["env_tag"] is None


async def test_the_least_recently_used_tenant_session_is_closed_past_the_cap(hubs):
    hub = hubs(fake("mine", "--tag", "{tenant}", per_tenant=True), max_tenant_sessions=2)
    a = (await whoami(hub, "mine__whoami", tenant="a"))["pid"]
    b = (await whoami(hub, "mine__whoami", tenant="b"))["pid"]
    await whoami(hub, "mine__whoami", tenant="a")  # b is now the least recently used
    c = (await whoami(hub, "mine__whoami", tenant="c"))["pid"]

    assert await gone(b), "b's server was closed to make room"
    assert process_state(a) not in (None, "Z") and process_state(c) not in (None, "Z")
    assert (await whoami(hub, "mine__whoami", tenant="b"))["tag"] == "b", "b starts again when used"


async def test_the_gateways_environment_does_not_reach_a_server(hubs, monkeypatch):
    monkeypatch.setenv("HERMES_SECRET_CANARY", "s3cret-bot-token")
    hub = hubs(
        fake("plain", env={"FAKE_MCP_TAG": "given"}),
        fake("control", env={"HERMES_SECRET_CANARY": "passed on purpose"}),
    )
    plain = await whoami(hub, "plain__whoami")
    assert plain["canary_visible"] is False
    assert plain["env_tag"] == "given", "the spec's own env does reach it"
    assert (await whoami(hub, "control__whoami"))["canary_visible"] is True, "whoami does see the variable"


async def test_a_tool_error_result_is_a_tool_error(hubs):
    hub = hubs(fake())
    pid = (await whoami(hub))["pid"]
    reply = await call(hub, "fake__fails")
    assert reply["success"] is False
    assert "this tool always fails" in reply["error"]
    assert (await whoami(hub))["pid"] == pid, "a tool error is not a crash"
    assert await call(hub, "fake__nope") == {"success": False, "error": "unknown tool fake__nope"}


async def test_close_leaves_no_process_behind(hubs):
    hub = hubs(fake("shared"), fake("mine", per_tenant=True))
    pids = {
        (await whoami(hub, "shared__whoami", tenant="a"))["pid"],
        (await whoami(hub, "mine__whoami", tenant="a"))["pid"],
        (await whoami(hub, "mine__whoami", tenant="b"))["pid"],
    }
    assert len(pids) == 3
    in_flight = asyncio.create_task(hub.call("a", "shared__slow", {"seconds": 30}))
    await asyncio.sleep(0.3)

    started = time.monotonic()
    await hub.close()
    assert time.monotonic() - started < 8
    assert json.loads(await asyncio.wait_for(in_flight, 1))["success"] is False
    assert {pid: process_state(pid) for pid in pids} == dict.fromkeys(pids), "every child gone and reaped"
    assert [t.get_name() for t in asyncio.all_tasks() if t.get_name().startswith("mcp")] == []
    assert await hub.tools("a") == []
    assert (await call(hub, "shared__echo", "a", text="x"))["success"] is False


async def test_a_server_that_cannot_start_is_left_out_and_said(hubs, tmp_path, caplog):
    starts = tmp_path / "starts"
    clock = Clock()
    hub = hubs(
        fake(),
        McpServerSpec("missing", command="/nonexistent/mcp-server"),
        script("dies", "import sys; open(sys.argv[1], 'a').write('x'); sys.exit(3)", str(starts)),
        script("mute", "import sys; sys.stdin.read()", start_timeout_s=0.5),
        clock=clock,
    )
    caplog.set_level(logging.WARNING, logger="agent.mcp_tools")
    assert {t.server for t in await hub.tools("t1")} == {"fake"}
    said = {r.getMessage() for r in caplog.records}
    assert any("missing" in m and "could not start" in m and "No such file" in m for m in said), said
    assert any("dies" in m and "could not start" in m for m in said), said
    assert any("mute" in m and "did not start within 0.5 s" in m for m in said), said
    assert starts.read_text() == "x"

    await hub.tools("t1")  # the first retry is at once; the next waits 1 s
    assert starts.read_text() == "xx"
    caplog.clear()
    await hub.tools("t1")
    assert starts.read_text() == "xx", "not retried while backing off"
    assert not [r for r in caplog.records if "dies" in r.getMessage()], "said once per failure"
    clock.now += 1.0
    await hub.tools("t1")
    assert starts.read_text() == "xxx"
    assert await call(hub, "fake__echo", text="still here") == {"success": True, "content": "still here"}
