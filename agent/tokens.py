"""Token counting: cl100k BPE loaded offline, with a chars/4 fallback.

The BPE ranks ship with the package (`agent/encodings/`, see the NOTICE there) and are read
with tiktoken's own loader, so counting never touches the network. Hold ONE `TokenCounter`
per process and pass it around. `TokenCounter.create()` is safe to call repeatedly (a loaded
encoding is kept per name, so only the first call pays the ~0.2 s load), but it is still a
load step, not a getter: create it at start-up.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from agent.media import IMAGE_TOKENS, image_refs
from agent.messages import StoredMessage

if TYPE_CHECKING:
    import tiktoken

ENCODINGS_DIR = Path(__file__).resolve().parent / "encodings"
DEFAULT_ENCODING = "cl100k_base"
MESSAGE_OVERHEAD = 4  # role/separator tokens of one chat message (OpenAI's rule of thumb)

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _EncodingSpec:
    """The constructor parameters of one tiktoken encoding (tiktoken_ext/openai_public.py)."""

    filename: str
    sha256: str
    pat_str: str
    special_tokens: dict[str, int]


# Copied from tiktoken_ext/openai_public.py (tiktoken 0.14); the file is ours, the hash is OpenAI's.
_SPECS: dict[str, _EncodingSpec] = {
    "cl100k_base": _EncodingSpec(
        filename="cl100k_base.tiktoken",
        sha256="223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7",
        pat_str=r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+|\s++$|\s*[\r\n]|\s+(?!\S)|\s""",
        special_tokens={
            "<|endoftext|>": 100257,
            "<|fim_prefix|>": 100258,
            "<|fim_middle|>": 100259,
            "<|fim_suffix|>": 100260,
            "<|endofprompt|>": 100276,
        },
    ),
}


@functools.cache
def load_encoding(name: str = DEFAULT_ENCODING) -> tiktoken.Encoding:
    """The named encoding built from the BPE file shipped in `agent/encodings/`.

    Raises KeyError for an encoding we do not ship, ValueError if the file's hash is wrong.
    Cached per name: an Encoding is immutable and costs ~0.2 s to build and ~25 MiB to keep.
    """
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe

    spec = _SPECS[name]
    path = ENCODINGS_DIR / spec.filename
    # tiktoken checks the hash only when its cache is enabled; check it here in every case
    if hashlib.sha256(path.read_bytes()).hexdigest() != spec.sha256:
        raise ValueError(f"{path} does not match the published {name} file (sha256 differs)")
    ranks = load_tiktoken_bpe(str(path), expected_hash=spec.sha256)
    enc = tiktoken.Encoding(name, pat_str=spec.pat_str, mergeable_ranks=ranks, special_tokens=dict(spec.special_tokens))
    # The Rust core now holds its own copy of the ranks; the Encoding keeps this dict only to
    # be pickled, which we never do. Emptying it gives back ~13 MiB of RSS per process.
    ranks.clear()
    return enc


class Encoding(Protocol):
    """What we need from a tiktoken.Encoding."""

    name: str

    def encode_ordinary(self, text: str) -> list[int]: ...


def _chars_div4(n_chars: int) -> int:
    return math.ceil(n_chars / 4) if n_chars > 0 else 0


def _is_image_part(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") == "image_url"


def _image_count(content: Any) -> int:
    return sum(1 for p in content if _is_image_part(p)) if isinstance(content, list) else 0


def _text_of(content: Any) -> str:
    """Content as text: str as is, OpenAI content parts joined (image parts left out: they
    are counted as IMAGE_TOKENS each), anything else as JSON."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                parts.append(part["text"])
            elif _is_image_part(part):
                continue
            else:
                parts.append(json.dumps(part, ensure_ascii=False, separators=(",", ":")))
        return "\n".join(parts)
    return json.dumps(content, ensure_ascii=False, separators=(",", ":"))


class TokenCounter:
    """Counts tokens with a BPE encoding, or chars/4 (ceil) when none could be loaded.

    If no encoding is available (or it fails while encoding), one warning is logged and
    every later count uses chars/4.
    """

    def __init__(
        self,
        encoding: Encoding | None,
        *,
        logger: logging.Logger | None = None,
        _why_missing: str = "no tokenizer encoding available",
    ) -> None:
        self._log = logger or _log
        self._enc: Encoding | None = encoding
        self._warned = False
        if encoding is None:
            self._fall_back(_why_missing)

    @classmethod
    def create(cls, logger: logging.Logger | None = None, *, encoding_name: str = DEFAULT_ENCODING) -> TokenCounter:
        """Load the shipped cl100k encoding (never the network); fall back to chars/4."""
        log = logger or _log
        try:
            enc = load_encoding(encoding_name)
        except Exception as exc:  # missing package, unknown name, corrupt data file
            why = f"could not load tokenizer {encoding_name!r} ({type(exc).__name__})"
            return cls(None, logger=log, _why_missing=why)
        return cls(enc, logger=log)

    def _fall_back(self, why: str) -> None:
        self._enc = None
        if not self._warned:
            self._warned = True
            self._log.warning("%s; token counts are estimated as characters/4", why)

    @property
    def exact(self) -> bool:
        """True while a real BPE encoding is in use (not the chars/4 estimate)."""
        return self._enc is not None

    @property
    def encoding_name(self) -> str | None:
        return getattr(self._enc, "name", None) if self._enc is not None else None

    def count_text(self, text: str | None) -> int:
        if not text:
            return 0
        if self._enc is not None:
            try:
                return len(self._enc.encode_ordinary(text))
            except Exception as exc:
                self._fall_back(f"tokenizer failed ({type(exc).__name__})")
        return _chars_div4(len(text))

    def count_message(self, msg: StoredMessage) -> int:
        """Tokens of one message; cached on `msg.token_count` (persisted with the message)."""
        if msg.token_count is not None:
            return msg.token_count
        n = self.count_text(_text_of(msg.content)) + MESSAGE_OVERHEAD
        n += IMAGE_TOKENS * len(image_refs(msg.meta))  # stored images sent with the message
        if msg.tool_calls:
            n += self.count_text(json.dumps(msg.tool_calls, ensure_ascii=False, separators=(",", ":")))
        msg.token_count = n
        return n

    def count_messages(self, msgs: Iterable[StoredMessage]) -> int:
        """Sum of `count_message` (no extra per-request priming tokens)."""
        return sum(self.count_message(m) for m in msgs)

    @staticmethod
    def estimate_rough(messages: list[dict[str, Any]]) -> int:
        """The seed's pre-request estimate: total characters // 4 of OpenAI-form dicts.

        Characters counted: content text, tool_calls JSON, tool_call_id and name; an image
        part counts as IMAGE_TOKENS (never its base64 payload).
        """
        chars = 0
        for m in messages:
            chars += len(_text_of(m.get("content"))) + 4 * IMAGE_TOKENS * _image_count(m.get("content"))
            if m.get("tool_calls"):
                chars += len(json.dumps(m["tool_calls"], ensure_ascii=False, separators=(",", ":")))
            for key in ("tool_call_id", "name"):
                if isinstance(m.get(key), str):
                    chars += len(m[key])
        return chars // 4

    def __repr__(self) -> str:
        return f"TokenCounter(encoding={self.encoding_name or 'chars/4'})"
