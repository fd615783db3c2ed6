"""A newcomer's first hour, through the real CLI in a subprocess: piped stdin, or a
pseudo-terminal for the line editor and Ctrl-C. The model is FakeLLM on 127.0.0.1."""

from __future__ import annotations

import argparse
import fcntl
import os
import pty
import re
import select
import signal
import socket
import subprocess
import sys
import tarfile
import termios
import time
from pathlib import Path

import pytest
import yaml

from gateway.cli import build_parser
from gateway.runlock import RunLock
from tenancy.keys import person_tenant_id, tenant_dir
from tests.fakes.llm import FakeLLM, error, hang

ROOT = Path(__file__).resolve().parents[1]
ENV = {
    **os.environ,
    "PYTHONPATH": str(ROOT),
    "TERM": "xterm",
    "PROMPT_TOOLKIT_NO_CPR": "1",
    # the venv's bin is not on PATH, as for someone who just ran `make install`
    "PATH": os.pathsep.join(
        p
        for p in os.environ.get("PATH", "").split(os.pathsep)
        if Path(p).resolve() != (ROOT / ".venv" / "bin").resolve()
    ),
}
ANSI = re.compile(rb"\x1b\[[0-9;?]*[A-Za-z]")


def cli(*args: str, stdin: str = "", cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gateway.cli", *args],
        input=stdin,
        text=True,
        capture_output=True,
        cwd=cwd,
        env=ENV,
        timeout=60,
    )


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_config(path: Path, base_url: str, **llm: object) -> Path:
    path.write_text(
        yaml.safe_dump(
            {
                "data_dir": str(path.parent / "data"),
                "storage": {"fsync": "never"},
                "llm": {"base_url": base_url, "model": "fake", **llm},
            }
        )
    )
    return path


def no_traceback(proc: subprocess.CompletedProcess[str]) -> None:
    assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr, proc.stderr


class Terminal:
    """The CLI on a pseudo-terminal that is its controlling terminal, so Ctrl-C is a real
    SIGINT from the tty driver, as in `make run`."""

    def __init__(self, *args: str) -> None:
        master, slave = pty.openpty()

        def become_session_leader() -> None:
            os.setsid()
            fcntl.ioctl(0, termios.TIOCSCTTY, 0)

        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gateway.cli", *args],
            stdin=slave,
            stdout=slave,
            stderr=subprocess.PIPE,
            cwd=ROOT,
            env=ENV,
            preexec_fn=become_session_leader,
        )
        os.close(slave)
        self.master = master
        self.raw = b""

    def _pump(self, wait: float) -> None:
        ready, _, _ = select.select([self.master], [], [], wait)
        if ready:
            try:
                self.raw += os.read(self.master, 65536)
            except OSError:  # the child closed the terminal
                time.sleep(wait)

    @property
    def screen(self) -> str:
        return ANSI.sub(b"", self.raw).decode("utf-8", "replace")

    def expect(self, text: str, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.screen:
            if time.monotonic() > deadline:
                raise AssertionError(f"{text!r} never appeared; screen so far:\n{self.screen}")
            self._pump(0.05)

    def expect_prompt_after(self, text: str, prompt: str, timeout: float = 30) -> None:
        """Wait for `text`, then for the prompt drawn after it (typing before would race)."""
        deadline = time.monotonic() + timeout
        while text not in self.screen or prompt not in self.screen.rsplit(text, 1)[1]:
            if time.monotonic() > deadline:
                raise AssertionError(f"no {prompt!r} after {text!r}; screen so far:\n{self.screen}")
            self._pump(0.05)

    def expect_count(self, text: str, n: int, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while self.screen.count(text) < n:
            if time.monotonic() > deadline:
                raise AssertionError(f"{text!r} seen {self.screen.count(text)} times, wanted {n}:\n{self.screen}")
            self._pump(0.05)

    def send(self, data: str) -> None:
        raw = data.encode()
        for i in range(0, len(raw), 512):  # keep reading, so the child never blocks writing
            os.write(self.master, raw[i : i + 512])
            self._pump(0)

    def wait(self, timeout: float = 30) -> int:
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None:
            if time.monotonic() > deadline:
                self.proc.kill()
                raise AssertionError(f"the chat did not exit; screen:\n{self.screen}")
            self._pump(0.05)
        self._pump(0)
        return self.proc.returncode

    @property
    def stderr(self) -> str:
        return self.proc.stderr.read().decode() if self.proc.stderr else ""

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        os.close(self.master)


@pytest.fixture
def terminals():
    opened: list[Terminal] = []

    def open_(*args: str) -> Terminal:
        opened.append(Terminal(*args))
        return opened[-1]

    yield open_
    for t in opened:
        t.close()


def wait_for(condition, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition never became true"
        time.sleep(0.02)


# ----- 1. Ctrl-C and Ctrl-D ------------------------------------------------------------------


def test_ctrl_c_during_a_slow_reply_quits_at_once_and_keeps_the_message(tmp_path, terminals):
    with FakeLLM() as llm:
        llm.script(hang(300))  # a reply that would take five minutes
        config = write_config(tmp_path / "gw.yaml", llm.base_url)
        term = terminals("chat", "-c", str(config), "--user", "amy")
        term.expect("amy>")
        term.send("hello slow model\r")
        wait_for(lambda: len(llm.requests) == 1)
        term.send("\x03")
        assert term.wait() == 130
        err = term.stderr
        assert "Interrupted; your message is kept" in err and "Traceback" not in err
        # the message was kept: the next chat answers it first
        again = cli("chat", "-c", str(config), "--user", "amy", stdin="")
    assert again.returncode == 0, again.stderr
    assert "Hermes: ok: hello slow model" in again.stdout


def test_sigint_stops_a_piped_chat_waiting_on_the_model_and_on_stdin(tmp_path):
    with FakeLLM() as llm:
        llm.script(hang(300))
        config = write_config(tmp_path / "gw.yaml", llm.base_url)
        proc = subprocess.Popen(
            [sys.executable, "-m", "gateway.cli", "chat", "-c", str(config), "--user", "amy"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=ROOT,
            env=ENV,
            text=True,
        )
        try:
            proc.stdin.write("hello\n")
            proc.stdin.flush()  # stdin stays open: the reader thread is blocked on it too
            wait_for(lambda: len(llm.requests) == 1)
            proc.send_signal(signal.SIGINT)
            out, err = proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == 130
    assert "Traceback" not in err and "Fatal Python error" not in err
    assert out == ""  # nothing half-written on the conversation stream


def test_ctrl_c_at_the_prompt_exits_130_and_ctrl_d_ends_the_line(tmp_path, terminals):
    config = write_config(tmp_path / "gw.yaml", f"http://127.0.0.1:{closed_port()}/v1")
    term = terminals("chat", "-c", str(config), "--user", "amy")
    term.expect("amy>")
    term.send("\x03")
    assert term.wait() == 130
    term = terminals("chat", "-c", str(config), "--user", "amy")
    term.expect("amy>")
    term.send("\x04")
    assert term.wait() == 0
    assert "\n" in term.screen.rsplit("amy>", 1)[1]  # the shell prompt starts on a fresh line


# ----- 2. banner, thinking, a dead model explained -------------------------------------------


def test_terminal_chat_has_a_banner_and_a_thinking_line(tmp_path, terminals):
    with FakeLLM() as llm:
        config = write_config(tmp_path / "gw.yaml", llm.base_url)
        term = terminals("chat", "-c", str(config), "--user", "amy")
        term.expect("amy>")
        banner = term.screen
        assert f"model fake at {llm.base_url}" in banner and str(tmp_path / "data") in banner
        assert "Ctrl-D or Ctrl-C quits" in banner
        term.send("hi\r")
        term.expect_prompt_after("Hermes: ok: hi", "amy>")
        assert "thinking…" in term.screen.split("Hermes: ok: hi")[0]
        term.send("\x04")
        assert term.wait() == 0


def test_dead_model_names_the_url_the_config_and_doctor(tmp_path):
    url = f"http://127.0.0.1:{closed_port()}/v1"
    config = write_config(tmp_path / "gw.yaml", url, max_retries=0)
    proc = cli("chat", "-c", str(config), "--user", "zed", stdin="anyone?\n")
    assert proc.returncode == 1  # piped: the unanswered message shows in the exit status
    no_traceback(proc)
    out = proc.stdout
    assert "error: The assistant's model is unreachable right now; your message was kept" in out
    assert f"cannot reach {url}" in out and str(config) in out
    assert f".venv/bin/hermes-gateway doctor -c {config}" in out
    # piped: no banner, no prompt, no thinking line; just the conversation
    assert "thinking" not in out and "Ctrl-D" not in out and "zed>" not in out


# ----- 3. kept messages on a role-alternating server -----------------------------------------


def test_messages_kept_while_the_model_was_down_reach_a_strict_server_as_one_turn(tmp_path):
    config = write_config(tmp_path / "gw.yaml", f"http://127.0.0.1:{closed_port()}/v1", max_retries=0)
    down = cli("chat", "-c", str(config), "--user", "zed", stdin="hi\nhi\nhi\n")
    assert down.stdout.count("model is unreachable") == 3
    with FakeLLM(alternating_roles=True) as llm:
        write_config(config, llm.base_url)
        up = cli("chat", "-c", str(config), "--user", "zed", stdin="are you back?\n")
        assert up.returncode == 0 and "error:" not in up.stdout, up.stdout
        assert llm.violations == [] and llm.statuses == [200]
        roles = [m["role"] for m in llm.requests[0]["messages"]]
        assert roles == ["system", "user"]
        assert llm.requests[0]["messages"][1]["content"] == "hi\n\nhi\n\nhi\n\nare you back?"


def test_a_provider_refusal_says_what_to_do(tmp_path):
    with FakeLLM() as llm:
        llm.script(
            error(
                400,
                {
                    "object": "error",
                    "type": "BadRequestError",
                    "code": 400,
                    "message": "Conversation roles must alternate user/assistant/user/assistant/...",
                },
            )
        )
        config = write_config(tmp_path / "gw.yaml", llm.base_url)
        proc = cli("chat", "-c", str(config), "--user", "zed", stdin="hi\n")
    assert "refused this conversation; send /new to start a fresh one" in proc.stdout
    assert "Conversation roles must alternate" in proc.stdout  # the operator's hint has the detail


# ----- 4. a read timeout is not retried ------------------------------------------------------


def test_a_slow_model_times_out_once_and_says_so(tmp_path):
    with FakeLLM() as llm:
        llm.script(hang(300), hang(300), hang(300), hang(300))
        config = write_config(tmp_path / "gw.yaml", llm.base_url, timeout_s=0.5, max_retries=3)
        proc = cli("chat", "-c", str(config), "--user", "zed", stdin="write me an epic\n")
        assert len(llm.requests) == 1  # never asked to generate the same answer again
    assert "did not finish its answer in time; please send it again" in proc.stdout
    assert "timed out after 0.5 s" in proc.stdout and "unreachable" not in proc.stdout


# ----- 5. doctor catches broken configs ------------------------------------------------------


def test_doctor_fails_a_base_url_without_v1(tmp_path):
    with FakeLLM() as llm:
        config = write_config(tmp_path / "gw.yaml", llm.base_url.removesuffix("/v1"))
        proc = cli("doctor", "-c", str(config))
    assert proc.returncode == 1
    assert "[FAIL] model endpoint:" in proc.stdout
    assert "/chat/completions answered HTTP 404: llm.base_url has the wrong path" in proc.stdout
    assert "end in /v1" in proc.stdout and "1 check failed." in proc.stdout


def test_doctor_tries_a_real_one_token_completion(tmp_path):
    with FakeLLM() as llm:
        config = write_config(tmp_path / "gw.yaml", llm.base_url)
        llm.script(error(404, {"error": {"message": "model 'fake' not found", "type": "not_found_error"}}))
        bad = cli("doctor", "-c", str(config))
        good = cli("doctor", "-c", str(config))
        sent = llm.requests[-1]
    assert bad.returncode == 1 and "model 'fake' not found" in bad.stdout and "check llm.model" in bad.stdout
    assert good.returncode == 0, good.stdout
    assert "answered a one-token chat completion with model fake" in good.stdout
    assert sent["max_tokens"] == 1 and sent["model"] == "fake"


def test_doctor_warns_that_run_has_no_platform(tmp_path):
    with FakeLLM() as llm:
        config = write_config(tmp_path / "gw.yaml", llm.base_url)
        proc = cli("doctor", "-c", str(config))
    assert proc.returncode == 0
    assert "[warn] platforms: none enabled: `run` will refuse to start" in proc.stdout
    assert "All checks passed, with 1 warning." in proc.stdout


@pytest.mark.parametrize(
    "section, key, value, says",
    [
        ("memory", "provider", "mem0", "memory.provider: unknown memory provider 'mem0'"),
        ("observability", "listen", "banana", "observability.listen: 'banana' must look like 127.0.0.1:9464"),
        ("llm", "base_url", "localhost:11434/v1", "llm.base_url: 'localhost:11434/v1' must be an http(s) URL"),
    ],
)
def test_doctor_refuses_config_values_that_would_fail_later(tmp_path, section, key, value, says):
    config = tmp_path / "gw.yaml"
    config.write_text(yaml.safe_dump({section: {key: value}}))
    proc = cli("doctor", "-c", str(config))
    assert proc.returncode == 2 and says in proc.stderr
    no_traceback(proc)


# ----- 6. one sentence, non-zero exit --------------------------------------------------------


def test_a_second_chat_on_a_data_dir_in_use_is_refused_in_one_line(tmp_path):
    config = write_config(tmp_path / "gw.yaml", f"http://127.0.0.1:{closed_port()}/v1")
    with RunLock(tmp_path / "data").acquire():  # as a first chat or a running gateway does
        proc = cli("chat", "-c", str(config), "--user", "amy", stdin="hi\n")
    assert proc.returncode == 1
    assert proc.stderr.startswith("error: ") and "is in use" in proc.stderr
    no_traceback(proc)


def test_unreadable_configs_are_one_sentence(tmp_path):
    latin1 = tmp_path / "latin1.yaml"
    latin1.write_bytes("agent_name: Hérmes\n".encode("latin-1"))
    dup = tmp_path / "dup.yaml"
    dup.write_text("llm:\n  model: a\n  timeout_s: 5\n  model: b\n")
    for path, says in (
        (latin1, "is not UTF-8 text"),
        (tmp_path, "is a directory"),
        (dup, "line 4: not valid YAML: duplicate key 'model' (first given on line 2)"),
    ):
        proc = cli("chat", "-c", str(path))
        assert proc.returncode == 2 and says in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1
        no_traceback(proc)


def test_init_creates_parent_directories_and_names_a_command_that_exists(tmp_path):
    target = tmp_path / "sub" / "dir" / "x.yaml"
    proc = cli("init", "-c", str(target))
    assert proc.returncode == 0, proc.stderr
    assert target.is_file()
    assert f"`.venv/bin/hermes-gateway chat -c {target} --user you`" in proc.stdout
    assert (ROOT / ".venv" / "bin" / "hermes-gateway").exists()
    again = cli("init", "-c", str(tmp_path))
    assert again.returncode == 2 and "is a directory" in again.stderr


def test_output_into_a_closed_pipe_ends_quietly(tmp_path):
    config = write_config(tmp_path / "gw.yaml", f"http://127.0.0.1:{closed_port()}/v1", max_retries=0)
    cli("chat", "-c", str(config), "--user", "amy", stdin="hello\n")
    # `profiles show ... | head -0`: the reader is gone before anything is written
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "profiles", "show", "console:amy", "-c", str(config)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=ROOT,
        env=ENV,
    )
    proc.stdout.close()
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 141
    assert b"Traceback" not in err and b"Exception ignored" not in err and err == b""


# ----- 7. a real line editor -----------------------------------------------------------------


def test_terminal_input_edits_recalls_history_and_takes_long_pastes(tmp_path, terminals):
    with FakeLLM() as llm:
        config = write_config(tmp_path / "gw.yaml", llm.base_url)
        term = terminals("chat", "-c", str(config), "--user", "amy")
        term.expect("amy>")
        term.send("helo\x1b[Dl\r")  # left arrow, then fix the typo
        term.expect_prompt_after("Hermes: ok: hello", "amy>")
        term.send("\x1b[A\r")  # up arrow: the last line again
        term.expect_count("Hermes: ok: hello", 2)
        term.expect_prompt_after("Hermes: ok: hello", "amy>")
        paste = "".join(f"{i:05d} " for i in range(1500))  # 9,000 characters
        term.send(f"\x1b[200~{paste}\x1b[201~\r")  # a bracketed paste, as terminals send it
        wait_for(lambda: len(llm.requests) == 3)
        term.expect_prompt_after("01499", "amy>")
        term.send("\x04")
        assert term.wait() == 0
        contents = [r["messages"][-1]["content"] for r in llm.requests]
    assert contents[:2] == ["hello", "hello"]
    assert contents[2] == paste and len(contents[2]) > 4095


def test_piped_long_lines_are_not_cut(tmp_path):
    with FakeLLM() as llm:
        config = write_config(tmp_path / "gw.yaml", llm.base_url)
        line = "y" * 10_000
        proc = cli("chat", "-c", str(config), "--user", "amy", stdin=f"{line}\n")
        assert proc.returncode == 0
        assert llm.requests[0]["messages"][-1]["content"] == line


# ----- 9. backups ---------------------------------------------------------------------------


def test_backup_is_always_an_archive_in_the_directory_and_keep_is_honoured(tmp_path):
    config = write_config(tmp_path / "gw.yaml", f"http://127.0.0.1:{closed_port()}/v1", max_retries=0)
    cli("chat", "-c", str(config), "--user", "amy", stdin="hello\n")
    dest = tmp_path / "backups"  # does not exist yet
    written = []
    for _ in range(3):  # all three may fall in the same second
        proc = cli("backup", str(dest), "--keep", "2", "-c", str(config))
        assert proc.returncode == 0, proc.stderr
        written.append(Path(proc.stdout.strip().removeprefix("backup written to ")))
    assert len(set(written)) == 3
    kept = sorted(dest.iterdir())
    assert kept == sorted(written[1:])
    for archive in kept:
        with tarfile.open(archive) as tar:
            assert "BACKUP.json" in tar.getnames()
    refused = cli("backup", str(tmp_path / "one.tar.gz"), "-c", str(config))
    assert refused.returncode == 1 and "inside a directory" in refused.stderr
    no_traceback(refused)


# ----- 10. small things ----------------------------------------------------------------------


def test_every_flag_has_help_text():
    missing = []

    def walk(parser, path):
        for action in parser._actions:
            if action.help is None and not isinstance(action, argparse._SubParsersAction):
                missing.append(f"{path} {'/'.join(action.option_strings) or action.dest}")
            for name, child in (getattr(action, "choices", None) or {}).items():
                if hasattr(child, "_actions"):
                    walk(child, f"{path} {name}")

    walk(build_parser(), "hermes-gateway")
    assert missing == []


def test_profiles_path_gives_the_hermes_home_of_a_principal(tmp_path):
    config = write_config(tmp_path / "gw.yaml", f"http://127.0.0.1:{closed_port()}/v1", max_retries=0)
    cli("chat", "-c", str(config), "--user", "amy:x", stdin="hello\n")
    proc = cli("profiles", "path", "console:amy:x", "-c", str(config))
    assert proc.returncode == 0, proc.stderr
    home = Path(proc.stdout.strip())
    assert home.parent == (tmp_path / "data" / "profiles").resolve() and (home / "tenant.json").is_file()
    assert home.name != "console-amy:x"  # the escaped name that a hand-written path gets wrong
    fresh = cli("profiles", "path", "telegram:42", "-c", str(config))
    expected = tenant_dir(tmp_path / "data", person_tenant_id("telegram", "42")).resolve()
    assert fresh.returncode == 0 and fresh.stdout.strip() == str(expected)
    assert "has no profile yet" in fresh.stderr
    unknown = cli("profiles", "path", "nobody", "-c", str(config))
    assert unknown.returncode == 1 and "no profile found" in unknown.stderr


def test_yaml_merge_keys_may_still_be_overridden():
    from core.settings import parse_yaml

    doc = parse_yaml("base: &b {timeout_s: 1, model: a}\nllm:\n  <<: *b\n  model: b\n")
    assert doc["llm"] == {"timeout_s": 1, "model": "b"}  # an override, not a duplicate
