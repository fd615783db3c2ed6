"""Running means serving: a `hermes-gateway run` with nothing to serve exits non-zero with
one sentence (real processes, with a timeout so a hang fails the test); every adapter,
Telegram included, reports its state in /healthz and /metrics; the Discord adapter
survives an event discord.py cannot parse."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from adapters.discord_bot import DiscordAdapter
from adapters.telegram import TelegramAdapter
from core.messages import InboundMessage
from core.settings import DiscordConfig, TelegramConfig
from gateway.build import build_gateway
from gateway.cli import main as cli_main
from gateway.runtime import GatewayApp
from tests.conftest import RecordingAdapter
from tests.fakes.discord_api import FakeDiscord
from tests.fakes.telegram_api import FakeTelegram
from tests.test_ops_observability import parse_prometheus, value

TOKEN = "123456:AAEservingFAKEtoken_-serve"
BIN = Path(sys.executable).parent / "hermes-gateway"
EXIT_WITHIN_S = 30.0  # "within a few seconds", with room for a loaded test machine


class Exited:
    def __init__(self, code: int, output: str, seconds: float) -> None:
        self.code = code
        self.output = output
        self.seconds = seconds


async def run_until_exit(*args: str, env: dict[str, str], stdin: bytes | None = None) -> Exited:
    """Run `hermes-gateway <args>` and wait for it to exit by itself; a hang fails the test."""
    began = time.monotonic()
    proc = await asyncio.create_subprocess_exec(
        str(BIN),
        *args,
        env=env,
        stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    try:
        out, _ = await asyncio.wait_for(proc.communicate(stdin), EXIT_WITHIN_S)
    except TimeoutError:
        proc.kill()
        out, _ = await proc.communicate()
        pytest.fail(f"`{' '.join(args)}` still running after {EXIT_WITHIN_S:.0f}s:\n{out.decode(errors='replace')}")
    assert proc.returncode is not None
    return Exited(proc.returncode, out.decode(errors="replace"), time.monotonic() - began)


def write_config(tmp_path: Path, llm_url: str, body: str) -> Path:
    config = tmp_path / "hermes-gateway.yaml"
    config.write_text(
        f"data_dir: {tmp_path / 'data'}\n"
        f"llm: {{base_url: '{llm_url}', model: fake, timeout_s: 10, max_retries: 1}}\n" + body
    )
    return config


def telegram_section(tg: FakeTelegram, **extra: str) -> str:
    lines = [
        "platforms:",
        "  telegram:",
        "    enabled: true",
        "    token_env: HERMES_SERVE_TG_TOKEN",
        f"    base_url: '{tg.base_url}'",
        "    poll_timeout_s: 1",
    ]
    lines += [f"    {k}: {v}" for k, v in extra.items()]
    return "\n".join(lines) + "\n"


def assert_one_sentence(result: Exited, *needles: str) -> None:
    text = result.output
    assert result.code != 0, text
    assert "Traceback" not in text, text
    assert "running:" not in text, text
    assert "still running after" not in text and "did not finish" not in text, "no work was cut short: " + text
    last = text.strip().splitlines()[-1]
    assert last.startswith("error: "), text
    for needle in needles:
        assert needle in last, text


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A port really in use: a listening socket held for the test."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(1)
    try:
        yield sock.getsockname()[1]
    finally:
        sock.close()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ----- the process: nothing to serve -> one sentence, non-zero, no hang ----------------------


async def test_run_with_the_only_platform_refusing_the_token_exits_with_one_sentence(tmp_path, fake_llm):
    async with FakeTelegram(token=TOKEN) as tg:
        listen = f"127.0.0.1:{free_port()}"
        config = write_config(
            tmp_path, fake_llm.base_url, telegram_section(tg) + f"observability: {{listen: '{listen}'}}\n"
        )
        env = dict(os.environ, HERMES_SERVE_TG_TOKEN="123456:AAErevokedTOKEN_-nope")
        result = await run_until_exit("run", "-c", str(config), env=env)
    assert_one_sentence(result, "telegram", "rejected the bot token", "HERMES_SERVE_TG_TOKEN")
    assert "AAErevokedTOKEN" not in result.output


async def test_run_with_the_telegram_webhook_port_in_use_exits_with_one_sentence(tmp_path, fake_llm, taken_port):
    async with FakeTelegram(token=TOKEN) as tg:
        body = telegram_section(tg, mode="webhook") + (
            f"    webhook: {{listen: 127.0.0.1, port: {taken_port}, secret_token_env: HERMES_SERVE_TG_SECRET}}\n"
        )
        config = write_config(tmp_path, fake_llm.base_url, body)
        env = dict(os.environ, HERMES_SERVE_TG_TOKEN=TOKEN, HERMES_SERVE_TG_SECRET="s3cret")
        result = await run_until_exit("run", "-c", str(config), env=env)
    assert_one_sentence(result, "telegram", f"127.0.0.1:{taken_port}", "webhook")


async def test_run_with_discord_refusing_the_message_content_intent_exits_with_one_sentence(tmp_path, fake_llm):
    async with FakeDiscord() as dc:
        dc.refuse_intents()
        body = (
            "platforms:\n  discord:\n    enabled: true\n    token_env: HERMES_SERVE_DC_TOKEN\n"
            f"    api_base: '{dc.api_base}'\n    gateway_url: '{dc.gateway_url}'\n"
        )
        config = write_config(tmp_path, fake_llm.base_url, body)
        result = await run_until_exit("run", "-c", str(config), env=dict(os.environ, HERMES_SERVE_DC_TOKEN=dc.token))
    assert_one_sentence(result, "discord", "MESSAGE CONTENT INTENT")


async def test_run_with_the_observability_address_taken_exits_instead_of_hanging(tmp_path, fake_llm, taken_port):
    async with FakeTelegram(token=TOKEN) as tg:
        body = telegram_section(tg) + f"observability: {{listen: '127.0.0.1:{taken_port}'}}\n"
        config = write_config(tmp_path, fake_llm.base_url, body)
        result = await run_until_exit("run", "-c", str(config), env=dict(os.environ, HERMES_SERVE_TG_TOKEN=TOKEN))
        assert not tg.calls_of("getUpdates"), "the listener is bound before any platform is started"
    assert_one_sentence(result, "observability.listen", f"127.0.0.1:{taken_port}")


@pytest.mark.parametrize("command", ["run", "chat"])
async def test_a_gateway_db_that_is_not_a_database_ends_the_process_with_one_sentence(tmp_path, fake_llm, command):
    async with FakeTelegram(token=TOKEN) as tg:
        config = write_config(tmp_path, fake_llm.base_url, telegram_section(tg) if command == "run" else "")
        data = tmp_path / "data"
        data.mkdir(mode=0o700)
        garbage = os.urandom(3000)
        (data / "gateway.db").write_bytes(garbage)
        env = dict(os.environ, HERMES_SERVE_TG_TOKEN=TOKEN)
        result = await run_until_exit(command, "-c", str(config), env=env, stdin=b"hello\n")
        assert not tg.calls_of("getMe"), "no platform is started on storage that cannot be opened"
    assert_one_sentence(result, "gateway.db", "backup")
    assert (data / "gateway.db").read_bytes() == garbage, "the damaged file is left for the operator"


async def test_a_token_revoked_while_running_ends_the_process_with_one_sentence(tmp_path, fake_llm):
    async with FakeTelegram(token=TOKEN) as tg:
        config = write_config(tmp_path, fake_llm.base_url, telegram_section(tg))
        env = dict(os.environ, HERMES_SERVE_TG_TOKEN=TOKEN)
        proc = await asyncio.create_subprocess_exec(
            str(BIN),
            "run",
            "-c",
            str(config),
            env=env,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        try:
            tg.push_private(111, "hello")
            await tg.wait_sent(1, 111, timeout=30)
            tg.token = "123456:AAEanotherTOKEN_-revoked"  # @BotFather /revoke: the old one answers 401
            await asyncio.wait_for(proc.wait(), EXIT_WITHIN_S)
        except TimeoutError:
            proc.send_signal(signal.SIGKILL)
            await proc.wait()
            pytest.fail("still running after the token was revoked")
        finally:
            assert proc.stdout is not None
            out = await proc.stdout.read()
    text = out.decode(errors="replace")
    assert proc.returncode != 0 and "Traceback" not in text, text
    assert "running: telegram" in text  # it was serving before
    last = text.strip().splitlines()[-1]
    assert last.startswith("error: ") and "rejected the bot token" in last, text


# ----- /healthz, `health` and /metrics see Telegram ------------------------------------------


def tg_adapter(tg: FakeTelegram, token: str = TOKEN, **cfg: Any) -> TelegramAdapter:
    config = TelegramConfig(enabled=True, base_url=tg.base_url, poll_timeout_s=1, **cfg)
    return TelegramAdapter(config, token, backoff_initial_s=0.05, backoff_max_s=0.2)


async def get(app: GatewayApp, path: str) -> httpx.Response:
    assert app.observability is not None
    async with httpx.AsyncClient(timeout=10) as client:
        return await client.get(f"{app.observability.url}{path}")


async def wait_until(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


async def test_healthz_and_metrics_report_a_working_telegram_as_connected(config_for, fake_llm):
    async with FakeTelegram(token=TOKEN) as tg:
        app = build_gateway(config_for(observability={"listen": "127.0.0.1:0"}), [tg_adapter(tg)])
        await app.start()
        try:
            await tg.wait_for(lambda: len(tg.calls_of("getUpdates")) >= 2)
            health = await get(app, "/healthz")
            entry = health.json()["checks"]["adapters"]["telegram"]
            assert entry["connected"] is True and entry["status"] == "connected (polling)", entry
            _, samples = parse_prometheus((await get(app, "/metrics")).text)
            assert value(samples, "hermes_adapter_connected", platform="telegram") == 1
        finally:
            await app.stop()


async def test_a_refused_telegram_token_is_red_while_another_platform_runs(config_for, fake_llm, tmp_path):
    async with FakeTelegram(token=TOKEN) as tg:
        cfg = config_for(observability={"listen": "127.0.0.1:0"})
        app = build_gateway(cfg, [tg_adapter(tg, token="123456:AAEwrongTOKEN_-x"), RecordingAdapter()])
        await app.start()  # the other platform still serves: no exit
        try:
            health = await get(app, "/healthz")
            assert health.status_code == 503, health.text
            entry = health.json()["checks"]["adapters"]["telegram"]
            assert entry["ok"] is False and entry["connected"] is False
            assert entry["status"].startswith("failed: ") and "rejected the bot token" in entry["status"]
            _, samples = parse_prometheus((await get(app, "/metrics")).text)
            assert value(samples, "hermes_adapter_connected", platform="telegram") == 0
            assert ("hermes_adapter_connected", frozenset({("platform", "telegram")})) in samples
            conf = tmp_path / "probe.yaml"
            conf.write_text(f"data_dir: {cfg.data_dir}\nllm: {{base_url: '{fake_llm.base_url}'}}\n")
            listen = f"127.0.0.1:{app.observability.bound_port}"  # type: ignore[union-attr]
            assert await asyncio.to_thread(cli_main, ["health", "-q", "--listen", listen, "-c", str(conf)]) == 1
        finally:
            await app.stop()


async def test_an_unreachable_bot_api_turns_healthz_red_after_unhealthy_after_s(config_for, fake_llm):
    async with FakeTelegram(token=TOKEN) as tg:
        grace = 1.5
        app = build_gateway(
            config_for(observability={"listen": "127.0.0.1:0", "unhealthy_after_s": grace}), [tg_adapter(tg)]
        )
        await app.start()
        try:
            await tg.wait_for(lambda: len(tg.calls_of("getUpdates")) >= 1)
            assert (await get(app, "/healthz")).status_code == 200
            tg.fail_next("getUpdates", 502, times=10_000)  # the Bot API is down from here on
            adapter = app.adapters["telegram"]
            await wait_until(lambda: adapter.status.startswith("connecting"))  # type: ignore[attr-defined]
            early = await get(app, "/healthz")
            entry = early.json()["checks"]["adapters"]["telegram"]
            assert entry["connected"] is False and "getUpdates failed" in entry["status"], entry
            assert early.status_code == 200, "a short outage is within unhealthy_after_s"
            await asyncio.sleep(grace + 0.2)
            late = await get(app, "/healthz")
            assert late.status_code == 503 and late.json()["checks"]["adapters"]["telegram"]["ok"] is False
            tg._failures.clear()  # the Bot API is back
            await wait_until(lambda: adapter.status == "connected (polling)")  # type: ignore[attr-defined]
            assert (await get(app, "/healthz")).status_code == 200
        finally:
            await app.stop()


# ----- Discord survives what discord.py cannot parse -----------------------------------------


async def test_a_partial_message_update_is_skipped_and_discord_keeps_answering(caplog):
    async with FakeDiscord() as dc:
        guild = dc.add_guild("Lab")
        general = dc.channel_named(guild, "general")
        alice = dc.add_user("alice")
        cfg = DiscordConfig(enabled=True, api_base=dc.api_base, gateway_url=dc.gateway_url)
        adapter = DiscordAdapter(cfg, dc.token, ready_timeout=10, guild_ready_timeout=0.05)
        got: list[InboundMessage] = []

        async def sink(msg: InboundMessage) -> None:
            got.append(msg)

        await adapter.start(sink)
        try:
            assert adapter.status == "connected"
            first = dc.push_dm(alice, "before the unfurl")
            await dc.wait_until(lambda: len(got) == 1)
            dc.push_partial_message_update(general, first["id"])
            after = dc.push_dm(alice, "after the unfurl")
            await dc.wait_until(lambda: len(got) == 2, 10)
            assert got[1].message_id == after["id"]
            assert adapter.status == "connected" and adapter.skipped_events == 1
            assert any("MESSAGE_UPDATE" in r.getMessage() and "skipped" in r.getMessage() for r in caplog.records)
        finally:
            await adapter.stop()


async def test_discord_reconnects_after_the_connection_ends_in_an_error_discord_py_does_not_retry():
    async with FakeDiscord() as dc:
        alice = dc.add_user("alice")
        cfg = DiscordConfig(enabled=True, api_base=dc.api_base, gateway_url=dc.gateway_url)
        adapter = DiscordAdapter(cfg, dc.token, ready_timeout=10, guild_ready_timeout=0.05)
        got: list[InboundMessage] = []

        async def sink(msg: InboundMessage) -> None:
            got.append(msg)

        await adapter.start(sink)
        try:
            identified = dc.identify_count
            dc.garble_next_hello()
            await dc.drop_connection()  # its RESUME meets the garbled HELLO
            await dc.wait_until(lambda: adapter.status != "connected", 5)
            await dc.wait_until(lambda: adapter.status == "connected", 15)
            assert dc.identify_count > identified, "a fresh session after the failed one"
            later = dc.push_dm(alice, "still there?")
            await dc.wait_until(lambda: any(m.message_id == later["id"] for m in got), 10)
        finally:
            await adapter.stop()


async def test_skipped_platform_events_are_counted_on_metrics(config_for, fake_llm):
    async with FakeDiscord() as dc:
        guild = dc.add_guild("Lab")
        general = dc.channel_named(guild, "general")
        cfg = config_for(
            observability={"listen": "127.0.0.1:0"},
            platforms={"discord": {"enabled": True, "api_base": dc.api_base, "gateway_url": dc.gateway_url}},
        )
        adapter = DiscordAdapter(cfg.platforms.discord, dc.token, ready_timeout=10, guild_ready_timeout=0.05)
        app = build_gateway(cfg, [adapter])
        await app.start()
        try:
            dc.push_partial_message_update(general)
            dc.push_partial_message_update(general)
            await dc.wait_until(lambda: adapter.skipped_events == 2)
            types, samples = parse_prometheus((await get(app, "/metrics")).text)
            assert types["hermes_adapter_events_skipped_total"] == "counter"
            assert value(samples, "hermes_adapter_events_skipped_total", platform="discord") == 2
            assert value(samples, "hermes_adapter_connected", platform="discord") == 1
        finally:
            await app.stop()
