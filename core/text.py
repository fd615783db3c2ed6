"""Splitting a reply into platform-sized chunks without breaking code fences."""

from __future__ import annotations

import re
from collections.abc import Callable

Measure = Callable[[str], int]


def utf16_len(text: str) -> int:
    """Length in UTF-16 code units, the unit Telegram's 4096 limit counts."""
    return len(text.encode("utf-16-le")) // 2


_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})(.*)$")


def _fence_state(text: str, open_fence: str | None) -> str | None:
    """The fence line (e.g. "```python" or "~~~") still open after `text`, given the one
    open before it. As in CommonMark, a fence is closed only by a line of the same
    character, at least as long, with nothing after it."""
    for line in text.split("\n"):
        m = _FENCE.match(line)
        if m is None:
            continue
        marker, info = m.group(1), m.group(2)
        if open_fence is None:
            if not (marker[0] == "`" and "`" in info):
                open_fence = line.strip()
        elif (
            not info.strip()
            and marker[0] == open_fence[0]
            and len(marker) >= len(open_fence) - len(open_fence.lstrip(open_fence[0]))
        ):
            open_fence = None
    return open_fence


def _closer(fence: str) -> str:
    """The line that closes `fence` (same character, same length)."""
    return "\n" + fence[: len(fence) - len(fence.lstrip(fence[0]))]


def _cut_point(text: str, limit: int, measure: Measure) -> int:
    """Largest prefix length of `text` that fits, preferring a newline, then a space."""
    lo, hi = 1, len(text)
    while lo < hi:  # binary search on measure: the widest prefix that fits
        mid = (lo + hi + 1) // 2
        if measure(text[:mid]) <= limit:
            lo = mid
        else:
            hi = mid - 1
    fit = lo
    if fit >= len(text):
        return fit
    for sep in ("\n\n", "\n", " "):
        idx = text.rfind(sep, 0, fit)
        if idx > fit // 2:
            return idx + len(sep)
    return fit


def split_text(text: str, limit: int, measure: Measure = len) -> list[str]:
    """Split `text` into chunks of at most `limit` units; a code fence cut in two is
    closed at the end of one chunk and reopened (with its language) at the next."""
    if limit < 16:
        raise ValueError("limit too small to split sensibly")
    if measure(text) <= limit:
        return [text] if text else []
    chunks: list[str] = []
    rest = text
    fence: str | None = None  # fence open at the start of `rest`
    longest_closer = "\n" + "`" * 10  # budget for any closer
    while rest:
        prefix = f"{fence}\n" if fence else ""
        if measure(prefix + rest) <= limit:
            chunks.append(prefix + rest)
            break
        budget = limit - measure(prefix) - measure(longest_closer)
        cut = _cut_point(rest, budget, measure)
        piece = rest[:cut]
        open_after = _fence_state(piece, fence)
        body = prefix + piece.rstrip("\n") if open_after else prefix + piece
        if open_after:
            body += _closer(open_after)
        chunks.append(body.rstrip() if not open_after else body)
        rest = rest[cut:]
        if not open_after:
            rest = rest.lstrip("\n")
        fence = open_after
    return [c for c in chunks if c.strip()]


def page_text(text: str, start: int, limit: int) -> tuple[str, int]:
    """The page of `text` from `start` that fits `limit` characters (`delivery.max_reply_chars`),
    cut at a paragraph, line or word where one is near, and where the next page starts
    (`len(text)` when this is the last). A code fence open across the cut is closed at the
    end of the page and reopened at the start of the next."""
    fence = _fence_state(text[:start], None) if start else None
    prefix = f"{fence}\n" if fence else ""
    rest = text[start:]
    if len(prefix) + len(rest) <= limit:
        return prefix + rest, len(text)
    cut = _cut_point(rest, max(16, limit - len(prefix) - 12), len)
    open_after = _fence_state(rest[:cut], fence)
    page = prefix + rest[:cut].rstrip()
    return (page + _closer(open_after) if open_after else page), start + cut
