"""Markdown -> Telegram HTML on a corpus of realistic model replies (tests/data/model_replies):
every reply becomes markup Telegram accepts, loses no words, and renders what it means."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from adapters.telegram.format import markdown_to_telegram_html
from core.text import utf16_len
from tests.fakes.telegram_api import _parse_html

CORPUS = Path(__file__).parent / "data" / "model_replies"
REPLIES = sorted(CORPUS.glob("*.md"))
_FENCE_LINE_RE = re.compile(r"^\s*(`{3,}|~{3,}).*$", re.M)
_WORD_RE = re.compile(r"[^\W_]{2,}")


def convert(name: str) -> str:
    return markdown_to_telegram_html((CORPUS / name).read_text())


def test_the_corpus_covers_what_models_write():
    assert len(REPLIES) >= 12
    text = "\n".join(p.read_text() for p in REPLIES)
    for feature in (
        "\n### ",
        "\n   - ",
        "***",
        "__",
        "~~",
        "](https://",
        "_(",
        "~~~",
        "```python",
        "|---",
        "\n> ",
        "> >",
        "`a < b",
        "🇩🇪",
        "<script>",
    ):
        assert feature in text, feature


@pytest.mark.parametrize("path", REPLIES, ids=lambda p: p.name)
def test_every_reply_becomes_markup_telegram_accepts_and_keeps_its_words(path):
    source = path.read_text()
    converted = markdown_to_telegram_html(source)
    visible = _parse_html(converted)  # allowed tags only, balanced, known entities; else raises
    assert not re.search(r"&(?!(?:lt|gt|amp|quot);)", converted), "a bare & in the markup"
    assert utf16_len(visible) <= utf16_len(source)  # a chunk that fits still fits
    words = set(_WORD_RE.findall(_FENCE_LINE_RE.sub("", source)))
    hrefs = " ".join(re.findall(r'<a href="([^"]*)"', converted))  # a link's URL is not lost
    missing = words - set(_WORD_RE.findall(visible + " " + hrefs))
    assert not missing, f"words lost: {sorted(missing)}"


def test_links_keep_parentheses_and_underscores_in_the_url():
    out = convert("03_links.md")
    assert '<a href="https://w.org/a_(b)">x</a>' in out
    assert '<a href="https://en.wikipedia.org/wiki/Python_(programming_language)">the Wikipedia article</a> for' in out
    assert '<a href="https://peps.python.org/pep-0008/#naming_conventions">PEP 8 – Style Guide</a>' in out
    assert '<a href="https://example.com/search?q=a&amp;b=c_d">search</a>' in out


def test_bold_italic_combinations():
    out = convert("02_emphasis.md")
    assert "this is <b><i>both</i></b> and" in out
    assert "<b>bold</b>" in out and "<i>italic</i>" in out and "<b>also bold</b>" in out
    assert "<i>italic <b>inside bold</b> here</i>" in out
    assert "<s>strikethrough</s>" in out and "<tg-spoiler>spoiler</tg-spoiler>" in out
    assert "snake_case_name and 2*3*4 = 24" in out
    math = convert("11_math_and_stars.md")
    assert "a*b + c*d, and 10 * 20 = 200" in math and "<code>**kwargs</code>" in math
    assert "x_1 and x_2" in math and "my_file_name.txt" in math


def test_tilde_and_backtick_fences_become_pre_blocks():
    out = convert("06_tilde_fences.md")
    assert '<pre><code class="language-yaml">llm:\n  model: "qwen2.5:7b"   # *not* italic' in out
    assert '<pre><code class="language-markdown">```js\nconsole.log("hi");\n```</code></pre>' in out
    assert "~~~" not in out
    code = convert("05_code_fences.md")
    assert '<pre><code class="language-python">def greet(name: str) -&gt; str:' in code
    assert 'return "**hi** &amp; welcome"' in code
    assert "<pre>plain fence, no language</pre>" in code
    mixed = convert("10_mixed.md")  # a fence indented in a list item loses the list indent
    assert '<pre><code class="language-python">if "user_id" in data:\n    ...</code></pre>' in mixed


def test_inline_code_and_text_escape_html():
    out = convert("04_inline_code.md")
    assert "<code>a &lt; b &amp;&amp; c &gt; d</code>" in out
    assert '<code>&lt;div class="x"&gt;</code>' in out and "<code>std::vector&lt;int&gt;</code>" in out
    assert "5 &gt; 3 &amp; 2 &lt; 4" in out and "Tags like &lt;b&gt; in text" in out
    raw = convert("12_horizontal_rule_and_html.md")
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in raw


def test_tables_headings_lists_and_quotes():
    table = convert("07_table.md")
    assert table.startswith("<pre>| Model | Context | Price ($/1M) |\n|-------|")
    assert "| <code>" not in table  # the table is kept verbatim in monospace
    lists = convert("01_headings_lists.md")
    assert lists.startswith("<b>Setting up a Python virtual environment</b>")
    assert "<b>1. Create it</b>" in lists and "• <code>pip install requests</code>" in lists
    assert "   - <b>Linux/macOS:</b> <code>source .venv/bin/activate</code>" in lists
    quotes = convert("08_blockquote.md")
    assert "<blockquote>The event loop is the core of every asyncio application.\nIt runs <b>tasks</b>" in quotes
    assert "<blockquote>Nested:\nquoted twice</blockquote>" in quotes  # Telegram has no nesting


def test_emoji_and_other_scripts_pass_through():
    out = convert("09_emoji_unicode.md")
    assert "- 🇩🇪 <b>Berlin</b> — 3.6M people" in out
    assert "👩‍👩‍👧 family emoji" in out and "Привет, мир! 你好，世界！ <code>код</code>" in out
