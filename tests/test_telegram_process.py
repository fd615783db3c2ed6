"""The real `hermes-gateway run` process against the fake Bot API and the fake LLM."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

from tests.fakes.telegram_api import FakeTelegram

TOKEN = "123456:AAEprocessFAKEtoken_-proc"
BIN = Path(sys.executable).parent / "hermes-gateway"


async def run_gateway(config: Path, env: dict[str, str]) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        str(BIN),
        "run",
        "-c",
        str(config),
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )


async def test_gateway_process_dm_restart_and_clean_logs(tmp_path, fake_llm):
    async with FakeTelegram(token=TOKEN) as tg:
        config = tmp_path / "hermes-gateway.yaml"
        config.write_text(
            f"data_dir: {tmp_path / 'data'}\n"
            f"llm: {{base_url: '{fake_llm.base_url}', model: fake, timeout_s: 10, max_retries: 1}}\n"
            "logging: {level: DEBUG}\n"
            "platforms:\n"
            "  telegram:\n"
            "    enabled: true\n"
            "    token_env: HERMES_PROC_TG_TOKEN\n"
            f"    base_url: '{tg.base_url}'\n"
            "    poll_timeout_s: 2\n"
        )
        env = dict(os.environ, HERMES_PROC_TG_TOKEN=TOKEN)
        logs = b""

        proc = await run_gateway(config, env)
        try:
            first = tg.push_private(111, "hello process")
            await tg.wait_sent(1, 111, timeout=30)
            await tg.wait_acked(timeout=10)
        finally:
            proc.send_signal(signal.SIGTERM)
            out, _ = await asyncio.wait_for(proc.communicate(), 30)
            logs += out
        assert proc.returncode == 0, out.decode(errors="replace")[-2000:]

        # queued while the process is down, plus the first update once more
        second = tg.push_private(111, "while you were away")
        tg.updates.insert(0, first.update)
        proc = await run_gateway(config, env)
        try:
            await tg.wait_sent(2, 111, timeout=30)
            await tg.wait_acked(timeout=10)
            await asyncio.sleep(0.5)
        finally:
            proc.send_signal(signal.SIGTERM)
            out, _ = await asyncio.wait_for(proc.communicate(), 30)
            logs += out
        assert proc.returncode == 0

    assert [m["text"] for m in tg.sent_messages(111)] == ["ok: hello process", "ok: while you were away"]
    assert [m["reply_to_message"]["message_id"] for m in tg.sent_messages(111)] == [first.message_id, second.message_id]
    text = logs.decode(errors="replace")
    assert TOKEN not in text and TOKEN.split(":")[1] not in text
