"""Splitting a long reply at the platform limit never leaves a code fence broken, whichever
fence the model used (``` or ~~~, of any length), as CommonMark reads it."""

from __future__ import annotations

import re

from hypothesis import given, settings
from hypothesis import strategies as st

from core.text import _fence_state, split_text

FENCE_LINE = re.compile(r"^ {0,3}(`{3,}|~{3,})")


def balanced(chunk: str) -> bool:
    return _fence_state(chunk, None) is None


def test_a_tilde_fence_cut_in_two_is_closed_and_reopened():
    code = "\n".join(f"line {i} = {i * i}" for i in range(60))
    text = "Here:\n\n~~~python\n" + code + "\n~~~\n\nDone."
    chunks = split_text(text, 300)
    assert len(chunks) > 2
    assert all(balanced(c) for c in chunks), chunks
    assert all(c.startswith("~~~python") for c in chunks[1:-1])
    assert all(len(c) <= 300 for c in chunks)


def test_backticks_inside_a_tilde_fence_do_not_close_it():
    body = "\n".join(["```", "not a fence here", "```"] * 20)
    chunks = split_text("~~~\n" + body + "\n~~~", 120)
    assert all(balanced(c) for c in chunks), chunks
    assert all(c.startswith("~~~") for c in chunks)


def test_a_longer_fence_is_closed_only_by_one_as_long():
    assert _fence_state("````md\n```\ninner\n```", None) == "````md"
    assert _fence_state("````md\n```\n````", None) is None
    assert _fence_state("~~~\n```\n", None) == "~~~"


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.sampled_from(["```py", "~~~", "````", "word " * 12, "x" * 40, "", "```", "~~~~"]), min_size=1, max_size=60
    ),
    st.integers(min_value=40, max_value=400),
)
def test_every_chunk_fits_and_keeps_fences_balanced(lines, limit):
    text = "\n".join(lines)
    if _fence_state(text, None) is not None:
        text += "\n" + ("~~~~~~~~~~" if _fence_state(text, None).startswith("~") else "``````````")
    for chunk in split_text(text, limit):
        assert len(chunk) <= limit
        assert balanced(chunk), chunk
