"""The CLI as a person uses it: init, config errors, and console chats with piped stdin,
several people one process after another over the same data directory."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import pytest
import yaml

from core.settings import ConfigError, load_config, parse_config
from gateway.cli import main
from tests.fakes.llm import memory_saving_responder

ROOT = Path(__file__).resolve().parents[1]


async def chat(config: Path, user: str, stdin: str, *extra: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "gateway.cli",
        "chat",
        "-c",
        str(config),
        "--user",
        user,
        *extra,
        cwd=ROOT,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    out, err = await asyncio.wait_for(proc.communicate(stdin.encode()), 60)
    return proc.returncode, out.decode(), err.decode()


@pytest.fixture
def config_file(tmp_path, fake_llm) -> Path:
    path = tmp_path / "gw.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "data_dir": "data",  # relative: resolved next to the config file
                "llm": {"base_url": fake_llm.base_url, "model": "fake"},
            }
        )
    )
    return path


async def test_piped_console_sessions_keep_people_apart(config_file, fake_llm, tmp_path):
    fake_llm.responder = memory_saving_responder
    code, out, err = await chat(config_file, "alice", "remember I keep bees\nhello there\n")
    assert code == 0, err
    assert "Hermes: done:" in out and "Hermes: ok: hello there" in out
    n = len(fake_llm.requests)
    code, out, _ = await chat(config_file, "bob", "/memory\nhi\n")
    assert code == 0
    assert "don't remember anything about you" in out and "Hermes: ok: hi" in out
    bob_requests = fake_llm.requests[n:]
    assert len(bob_requests) == 1 and "bees" not in str(bob_requests)
    code, out, _ = await chat(config_file, "alice", "/memory\n")
    assert "I keep bees" in out
    code, out, _ = await chat(config_file, "carol", "hello room\n", "--group", "lounge")
    assert "Hermes: ok: hello room" in out
    assert (tmp_path / "data" / "profiles").is_dir()


async def test_console_reports_dead_model_in_one_sentence(tmp_path):
    path = tmp_path / "gw.yaml"
    path.write_text(
        yaml.safe_dump(
            {"data_dir": str(tmp_path / "d"), "llm": {"base_url": "http://127.0.0.1:9/v1", "max_retries": 0}}
        )
    )
    code, out, err = await chat(path, "zed", "anyone?\n")
    assert code == 1  # piped: a script sees that the message was not answered
    assert "error: The assistant's model is unreachable right now; your message was kept" in out
    assert "Traceback" not in err


async def test_piped_chat_exits_non_zero_after_a_refused_message(config_file):
    code, out, err = await chat(config_file, "amy", "x" * 100_000 + "\nhello\n")
    assert "error: Your message is 100,000 characters long" in out and "Hermes: ok: hello" in out
    assert code == 1 and "Traceback" not in err


async def test_piped_chat_without_errors_exits_zero(config_file):
    code, out, err = await chat(config_file, "amy", "hello\n")
    assert code == 0 and "Hermes: ok: hello" in out, err


def test_init_writes_a_config_that_loads(tmp_path, capsys):
    path = tmp_path / "new.yaml"
    assert main(["init", "-c", str(path)]) == 0
    cfg = load_config(path)
    assert cfg.llm.base_url == "http://127.0.0.1:11434/v1"
    assert cfg.memory.memory_char_limit == 2200 and cfg.compression.threshold == 0.5
    assert main(["init", "-c", str(path)]) == 1  # never overwrites silently


def test_config_errors_name_the_key(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text("llm:\n  modle: x\nlimits:\n  rate_limit_per_minute: -1\n")
    assert main(["chat", "-c", str(path)]) == 2
    err = capsys.readouterr().err
    assert "llm.modle: unknown key" in err and "limits.rate_limit_per_minute" in err
    with pytest.raises(ConfigError, match="no such config file"):
        load_config(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match="not valid YAML"):
        (tmp_path / "broken.yaml").write_text("llm: [")
        load_config(tmp_path / "broken.yaml")


def test_secrets_come_only_from_env(monkeypatch):
    cfg = parse_config({"llm": {"api_key_env": "HG_TEST_KEY"}})
    monkeypatch.delenv("HG_TEST_KEY", raising=False)
    assert cfg.llm.api_key() is None
    monkeypatch.setenv("HG_TEST_KEY", "sk-123")
    assert cfg.llm.api_key() == "sk-123"
    with pytest.raises(ConfigError, match=r"llm\.api_key: unknown key"):
        parse_config({"llm": {"api_key": "sk-inline"}})


def test_doctor_says_what_is_wrong(tmp_path, capsys):
    from tests.fakes.llm import FakeLLM

    path = tmp_path / "gw.yaml"
    path.write_text(yaml.safe_dump({"data_dir": str(tmp_path / "d"), "llm": {"base_url": "http://127.0.0.1:9/v1"}}))
    assert main(["doctor", "-c", str(path)]) == 1
    out = capsys.readouterr().out
    assert "[FAIL] model endpoint: cannot reach http://127.0.0.1:9/v1" in out
    assert "[ok] data directory" in out and "[ok] tokenizer" in out

    with FakeLLM() as llm:  # served from a background thread
        path.write_text(yaml.safe_dump({"data_dir": str(tmp_path / "d"), "llm": {"base_url": llm.base_url}}))
        assert main(["doctor", "-c", str(path)]) == 0
    assert "All checks passed, with 1 warning." in capsys.readouterr().out  # no platform for `run`


def test_unsupported_compression_modes_are_refused_not_ignored():
    for key, value in (("micro_compact", True), ("idle_compact_after_seconds", 600), ("proactive_prune_tokens", 1000)):
        with pytest.raises(ConfigError, match=f"{key} is not supported"):
            parse_config({"compression": {key: value}})
