"""TokenCounter: the shipped cl100k encoding, the per-message cache and the chars/4 fallback."""

from __future__ import annotations

import hashlib
import logging
import shutil
import socket
import tracemalloc

import pytest
import tiktoken_ext.openai_public as openai_public
from tiktoken.load import load_tiktoken_bpe

import agent.tokens
from agent.messages import StoredMessage
from agent.tokens import DEFAULT_ENCODING, ENCODINGS_DIR, MESSAGE_OVERHEAD, TokenCounter, load_encoding


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"network access attempted: {args!r}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)


def test_offline_encoding_loads_without_network(
    no_network: None, monkeypatch: pytest.MonkeyPatch, tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    # force a real load (not the in-process copy) and an empty tiktoken cache
    load_encoding.cache_clear()
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    caplog.set_level(logging.WARNING)
    counter = TokenCounter.create()
    assert counter.exact and counter.encoding_name == DEFAULT_ENCODING
    assert counter.count_text("hello world") == 2  # the real BPE, not chars/4 (= 3)
    assert counter.count_text("") == 0 and counter.count_text(None) == 0
    assert counter.count_text("<|endoftext|>") > 1  # special tokens are plain text here
    assert caplog.records == []


def test_create_is_cheap_after_the_first_load() -> None:
    a, b = TokenCounter.create(), TokenCounter.create()
    assert a._enc is b._enc  # one Encoding per name and process


def test_shipped_encoding_is_the_one_tiktoken_defines(monkeypatch: pytest.MonkeyPatch) -> None:
    """Our constructor parameters equal tiktoken's own cl100k_base (fed the shipped file)."""
    path = ENCODINGS_DIR / "cl100k_base.tiktoken"
    seen: list[str] = []

    def local_file(url: str, expected_hash: str | None = None) -> dict[bytes, int]:
        seen.append(url)
        assert hashlib.sha256(path.read_bytes()).hexdigest() == expected_hash
        return load_tiktoken_bpe(str(path))  # the ranks, read from the shipped file

    monkeypatch.setattr(openai_public, "load_tiktoken_bpe", local_file)
    theirs = openai_public.cl100k_base()
    ours = load_encoding()
    assert seen and seen[0].endswith("/cl100k_base.tiktoken")
    assert theirs["pat_str"] == ours._pat_str
    assert theirs["special_tokens"] == ours._special_tokens
    assert theirs["name"] == ours.name == "cl100k_base"
    assert ours.n_vocab == 100277
    assert ours.encode("hello world<|endoftext|>", allowed_special="all") == [15339, 1917, 100257]


def test_the_loaded_encoding_keeps_no_python_copy_of_its_ranks() -> None:
    """The ranks live in tiktoken's Rust core; a second copy as a Python dict cost ~13 MiB."""
    load_encoding.cache_clear()
    tracemalloc.start()
    try:
        enc = load_encoding()
        kept, _peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert kept < 2 * 2**20, f"{kept / 2**20:.1f} MiB of Python objects kept by the loaded encoding"
    text = "Grüße, 世界! How are you? <not special>"
    assert enc.decode(enc.encode_ordinary(text)) == text and enc.n_vocab == 100277


def test_a_tampered_encoding_file_falls_back_to_chars(
    monkeypatch: pytest.MonkeyPatch, tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    bad_dir = tmp_path / "encodings"
    bad_dir.mkdir()
    shutil.copy(ENCODINGS_DIR / "cl100k_base.tiktoken", bad_dir / "cl100k_base.tiktoken")
    with open(bad_dir / "cl100k_base.tiktoken", "ab") as f:
        f.write(b"IQ== 100300\n")
    monkeypatch.setattr(agent.tokens, "ENCODINGS_DIR", bad_dir)
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "")  # tiktoken's cache off: it would not check the hash
    load_encoding.cache_clear()
    caplog.set_level(logging.WARNING)
    try:
        counter = TokenCounter.create()
    finally:
        load_encoding.cache_clear()
    assert not counter.exact
    assert "ValueError" in caplog.text and "characters/4" in caplog.text


def test_count_message_caches_on_the_record() -> None:
    counter = TokenCounter.create()
    calls = [{"id": "c1", "type": "function", "function": {"name": "memory", "arguments": '{"action":"add"}'}}]
    msg = StoredMessage(session_id="s", role="assistant", content="hello world", tool_calls=calls)
    n = counter.count_message(msg)
    assert n > 2 + MESSAGE_OVERHEAD and msg.token_count == n
    assert StoredMessage.from_json(msg.to_json()).token_count == n  # persisted with the message
    msg.content = "something much longer than before " * 10
    assert counter.count_message(msg) == n  # the stored count is trusted
    plain = StoredMessage(session_id="s", role="user", content="hello world")
    assert counter.count_message(plain) == 2 + MESSAGE_OVERHEAD
    empty = StoredMessage(session_id="s", role="assistant", content=None)
    assert counter.count_message(empty) == MESSAGE_OVERHEAD
    assert counter.count_messages([msg, plain, empty]) == n + 2 + 2 * MESSAGE_OVERHEAD


def test_fallback_when_no_encoding_loads(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    counter = TokenCounter.create(encoding_name="no_such_encoding")
    assert not counter.exact and "chars/4" in repr(counter)
    assert counter.count_text("hello world") == 3  # ceil(11 / 4)
    assert counter.count_text("abcd") == 1 and counter.count_text("abcde") == 2
    msg = StoredMessage(session_id="s", role="user", content="x" * 40)
    assert counter.count_message(msg) == 10 + MESSAGE_OVERHEAD
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "characters/4" in warnings[0].getMessage()


def test_encoding_that_fails_while_encoding_falls_back_once(caplog: pytest.LogCaptureFixture) -> None:
    class Broken:
        name = "broken"

        def encode_ordinary(self, text: str) -> list[int]:
            raise RuntimeError("corrupt ranks")

    log = logging.getLogger("test.tokens")
    caplog.set_level(logging.WARNING, logger="test.tokens")
    counter = TokenCounter(Broken(), logger=log)
    assert counter.count_text("hello world") == 3
    assert counter.count_text("hello world again") == 5
    assert not counter.exact
    assert len([r for r in caplog.records if r.name == "test.tokens"]) == 1


def test_none_encoding_warns_once(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    counter = TokenCounter(None)
    for _ in range(3):
        counter.count_text("abc")
    assert len(caplog.records) == 1


def test_estimate_rough_is_chars_over_4() -> None:
    msgs = [
        {"role": "system", "content": "a" * 40},
        {"role": "user", "content": [{"type": "text", "text": "b" * 20}]},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c", "type": "function", "function": {"name": "m", "arguments": "{}"}}],
        },
        {"role": "tool", "tool_call_id": "c", "content": "ok"},
    ]
    import json

    tc_chars = len(json.dumps(msgs[2]["tool_calls"], separators=(",", ":")))
    assert TokenCounter.estimate_rough(msgs) == (40 + 20 + tc_chars + 1 + 2) // 4
    assert TokenCounter.create().estimate_rough([]) == 0
