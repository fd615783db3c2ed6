"""Stopping always stops: the real `hermes-gateway run` process, signalled while a model
streams without end, while the disk is full, or twice; and Ctrl-C in its first second."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest

from tests.fakes.llm import endless
from tests.fakes.telegram_api import FakeTelegram
from tests.test_faults import fill, small_disk
from tests.test_telegram_process import TOKEN, run_gateway


def write_config(path: Path, data: Path, llm_url: str, tg_url: str, *, drain: float, answer_s: float = 300) -> Path:
    path.write_text(
        f"data_dir: {data}\n"
        f"llm: {{base_url: '{llm_url}', model: fake, timeout_s: 10, max_retries: 1, answer_timeout_s: {answer_s}}}\n"
        f"delivery: {{drain_timeout_s: {drain}, retry_initial_s: 0.2, retry_max_s: 1}}\n"
        "storage: {fsync: never}\n"
        "platforms:\n"
        "  telegram:\n"
        "    enabled: true\n"
        "    token_env: HERMES_PROC_TG_TOKEN\n"
        f"    base_url: '{tg_url}'\n"
        "    poll_timeout_s: 1\n"
    )
    return path


class Output:
    """The merged stdout/stderr of a process, read as it comes."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.text = ""
        self._task = asyncio.create_task(self._read(proc))

    async def _read(self, proc: asyncio.subprocess.Process) -> None:
        assert proc.stdout is not None
        while line := await proc.stdout.readline():
            self.text += line.decode(errors="replace")

    async def wait_for(self, needle: str, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while needle not in self.text:
            assert time.monotonic() < deadline, f"{needle!r} never appeared in:\n{self.text[-3000:]}"
            await asyncio.sleep(0.05)

    async def done(self) -> str:
        await self._task
        return self.text


async def ended_within(proc: asyncio.subprocess.Process, seconds: float) -> float:
    """Seconds the process took to exit (killed, and the test failed, past `seconds`)."""
    started = time.monotonic()
    try:
        await asyncio.wait_for(proc.wait(), seconds)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise AssertionError(f"the process was still running {seconds:g} s after the signal") from None
    return time.monotonic() - started


async def asking(llm, timeout: float = 30) -> None:
    """Until the model has been asked (its answer may never end)."""
    deadline = time.monotonic() + timeout
    while not llm.requests:
        assert time.monotonic() < deadline, "the model was never asked"
        await asyncio.sleep(0.05)


@pytest.fixture
def env():
    return dict(os.environ, HERMES_PROC_TG_TOKEN=TOKEN)


async def test_sigterm_during_an_endless_answer_stops_within_the_drain_timeout(tmp_path, fake_llm, env):
    fake_llm.responder = endless("and more", every_s=0.3)
    async with FakeTelegram(token=TOKEN) as tg:
        config = write_config(tmp_path / "c.yaml", tmp_path / "data", fake_llm.base_url, tg.base_url, drain=2)
        proc = await run_gateway(config, env)
        out = Output(proc)
        await out.wait_for("running: telegram")
        tg.push_private(111, "tell me everything")
        await asking(fake_llm)
        await asyncio.sleep(1)  # the answer is streaming
        proc.send_signal(signal.SIGTERM)
        took = await ended_within(proc, 2 + 10)
        text = await out.done()
    assert "waiting up to 2 s for 1 running turn; Ctrl-C again to stop now" in text
    assert took < 2 + 6, text[-2000:]
    assert "Traceback" not in text


async def test_a_second_ctrl_c_during_the_drain_stops_at_once(tmp_path, fake_llm, env):
    fake_llm.responder = endless("and more", every_s=0.3)
    async with FakeTelegram(token=TOKEN) as tg:
        config = write_config(tmp_path / "c.yaml", tmp_path / "data", fake_llm.base_url, tg.base_url, drain=60)
        proc = await run_gateway(config, env)
        out = Output(proc)
        await out.wait_for("running: telegram")
        tg.push_private(111, "tell me everything")
        await asking(fake_llm)
        proc.send_signal(signal.SIGINT)
        await out.wait_for("Ctrl-C again to stop now")
        proc.send_signal(signal.SIGINT)
        took = await ended_within(proc, 10)
        text = await out.done()
    assert took < 5 and proc.returncode == 130, text[-2000:]
    assert "stopped at once" in text and "Traceback" not in text


async def test_sigterm_while_the_disk_is_full_stops_and_leaves_the_update_unacknowledged(tmp_path, fake_llm, env):
    data = tmp_path / "data"
    with small_disk(data) as disk:

        def fill_then_answer(request):  # the disk fills while the model answers the first message
            fill(disk)
            return "an answer that cannot be stored"

        fake_llm.responder = fill_then_answer
        async with FakeTelegram(token=TOKEN) as tg:
            config = write_config(tmp_path / "c.yaml", data, fake_llm.base_url, tg.base_url, drain=2)
            proc = await run_gateway(config, env)
            out = Output(proc)
            await out.wait_for("running: telegram")
            tg.push_private(111, "hello")
            await out.wait_for("storage fault")
            second = tg.push_private(111, "x" * 3000)  # cannot be recorded: the disk is full
            await out.wait_for("could not record update")
            proc.send_signal(signal.SIGTERM)
            took = await ended_within(proc, 2 + 10)
            text = await out.done()
            acked = tg.acked_offset
    assert took < 2 + 6, text[-3000:]
    assert acked is None or acked <= second.update["update_id"], "an update never recorded was acknowledged"
    assert "Traceback" not in text


@pytest.mark.parametrize("after_s", [0.2, 0.4, 0.6, 0.9, 1.3])
async def test_ctrl_c_in_the_first_second_of_run_prints_no_traceback(tmp_path, fake_llm, env, after_s):
    async with FakeTelegram(token=TOKEN) as tg:
        config = write_config(tmp_path / "c.yaml", tmp_path / "data", fake_llm.base_url, tg.base_url, drain=2)
        proc = await run_gateway(config, env)
        out = Output(proc)
        await asyncio.sleep(after_s)
        proc.send_signal(signal.SIGINT)
        await ended_within(proc, 15)
        text = await out.done()
    assert "Traceback" not in text, text
    assert proc.returncode in (0, 130), text
