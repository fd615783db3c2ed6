"""`/more`: the pages of an answer longer than `delivery.max_reply_chars`, and the mark
gateway.db keeps of where the next page starts (docs/concepts.md#delivery)."""

from __future__ import annotations

import hashlib

from core.lanes import Lane


def more_offer(left: int) -> str:
    """The line under a page of a long answer that says how to get the rest."""
    return f"\n\n(The answer goes on for {left:,} more characters: send /more for the next part.)"


def more_key(lane: Lane) -> str:
    """gateway.db key of where the next page of the lane's last answer starts."""
    return f"more:{lane.session_key}"


def more_mark(answer: str, start: int) -> str:
    """What gateway.db keeps for `/more`: where the next page starts and a digest of the
    text before it (no text of the answer), so a mark left by an older answer is never
    applied to a newer one."""
    return f"{start}:{_digest(answer[:start])}"


def read_more_mark(mark: str, answer: str | None) -> int | None:
    """Where the next page of `answer` starts, or None when `mark` was left by another answer."""
    start_s, _, digest = mark.partition(":")
    if answer is None or not start_s.isdigit() or not 0 < int(start_s) < len(answer):
        return None
    start = int(start_s)
    return start if _digest(answer[:start]) == digest else None


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:24]
