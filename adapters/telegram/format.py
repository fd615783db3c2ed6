"""Markdown-ish model output -> Telegram HTML (parse_mode="HTML").

Telegram's HTML mode needs only `&`, `<` and `>` escaped, and supports b, i, s, u, code,
pre (with `<code class="language-x">`), a, blockquote and tg-spoiler. The conversion never
adds visible characters (markers are removed, escapes count as one character once
parsed), so a chunk that fits in 4096 UTF-16 units as Markdown still fits as HTML.

Why our own converter: on the corpus in tests/data/model_replies/ (real model replies)
none of the maintained ones fits. chatgpt-md-converter emits HTML but turns `~~~` fences
into strikethrough and loses the `)` of `[x](https://w.org/a_(b))` too; telegramify-markdown
emits entities instead of HTML, adds visible characters (heading emoji, padded tables) so a
chunk can outgrow the limit, and drops literal `<tags>` and the `*` of `a*b + c*d`; sulguk
only converts HTML (it would need a Markdown renderer in front) and rejects tables.

It is a best effort: anything it does not recognise stays literal text, every tag it
emits is balanced (tests check the corpus and random input against Telegram's rules), and
the adapter resends the original text without parse_mode if Telegram still rejects it.
"""

from __future__ import annotations

import html
import re
from collections.abc import Callable

_LANG_RE = re.compile(r"^[A-Za-z0-9_+#.\-]{1,32}$")
_FENCE_OPEN_RE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*(.*?)\s*$")
_HEADING_RE = re.compile(r"^\s{0,3}#{1,6}\s+(.+?)\s*#*\s*$")
_BULLET_RE = re.compile(r"^(\s*)\* (?=\S)")
_QUOTE_RE = re.compile(r"^\s{0,3}>")
_QUOTE_MARKS_RE = re.compile(r"^(?:\s{0,3}> ?)+")  # Telegram has no nested quotes: flatten
_TABLE_RULE_RE = re.compile(r"^\s*\|?\s*:?-{3,}:?\s*(?:\|\s*:?-{3,}:?\s*)+\|?\s*$")
_INLINE_CODE_RE = re.compile(r"`([^`\n]+)`")
# the URL may contain one level of balanced parentheses: [x](https://w.org/a_(b))
_LINK_RE = re.compile(r"\[([^\]\n]+)\]\(((?:https?|tg)://(?:[^\s()]|\([^\s()]*\))+)\)")
_BOLD_ITALIC_RE = re.compile(r"(?<![\w*])\*\*\*(?=\S)(.+?)(?<=\S)\*\*\*(?![\w*])")
_BOLD_STAR_RE = re.compile(r"\*\*(?=\S)(.+?)(?<=\S)\*\*")
_BOLD_UNDER_RE = re.compile(r"(?<![\w_])__(?=\S)(.+?)(?<=\S)__(?![\w_])")
_STRIKE_RE = re.compile(r"~~(?=\S)(.+?)(?<=\S)~~")
_SPOILER_RE = re.compile(r"\|\|(?=\S)([^|]+?)(?<=\S)\|\|")
_ITALIC_STAR_RE = re.compile(r"(?<![\w*])\*(?=[^\s*])([^*]+?)(?<=[^\s*])\*(?![\w*])")
_ITALIC_UNDER_RE = re.compile(r"(?<![\w_])_(?=[^\s_])([^_]+?)(?<=[^\s_])_(?![\w_])")
_OUR_TAG_RE = re.compile(r"<(/?)(b|i|s|tg-spoiler)>")
_PLACEHOLDER_RE = re.compile("\x00(\\d+)\x00")


def _escape(text: str) -> str:
    return html.escape(text, quote=False)


def _balanced(fragment: str) -> bool:
    """True if the tags this module emitted inside `fragment` open and close in order."""
    stack: list[str] = []
    for m in _OUR_TAG_RE.finditer(fragment):
        if not m.group(1):
            stack.append(m.group(2))
        elif not stack or stack.pop() != m.group(2):
            return False
    return not stack


def _wrapper(pattern: re.Pattern[str], open_tags: str, close_tags: str) -> Callable[[str], str]:
    """A substitution that wraps each match's content in tags, unless that would cross a
    tag emitted earlier (then the markers stay literal text)."""

    def wrap(m: re.Match[str]) -> str:
        inner = m.group(1)
        return f"{open_tags}{inner}{close_tags}" if _balanced(inner) else m.group(0)

    return lambda text: pattern.sub(wrap, text)


_EMPHASIS = [  # order matters: *** before ** before *
    _wrapper(_BOLD_ITALIC_RE, "<b><i>", "</i></b>"),
    _wrapper(_BOLD_STAR_RE, "<b>", "</b>"),
    _wrapper(_BOLD_UNDER_RE, "<b>", "</b>"),
    _wrapper(_STRIKE_RE, "<s>", "</s>"),
    _wrapper(_SPOILER_RE, "<tg-spoiler>", "</tg-spoiler>"),
    _wrapper(_ITALIC_STAR_RE, "<i>", "</i>"),
    _wrapper(_ITALIC_UNDER_RE, "<i>", "</i>"),
]


def _inline(text: str) -> str:
    """Escape one line's worth of text and turn inline Markdown into tags."""
    text = text.replace("\x00", "")
    slots: list[str] = []

    def keep(fragment: str) -> str:
        slots.append(fragment)
        return f"\x00{len(slots) - 1}\x00"

    text = _INLINE_CODE_RE.sub(lambda m: keep(f"<code>{_escape(m.group(1))}</code>"), text)
    text = _LINK_RE.sub(
        lambda m: keep(f'<a href="{html.escape(m.group(2), quote=True)}">{_escape(m.group(1))}</a>'),
        text,
    )
    text = _escape(text)
    for emphasis in _EMPHASIS:
        text = emphasis(text)
    return _PLACEHOLDER_RE.sub(lambda m: slots[int(m.group(1))], text)


def _is_table_at(lines: list[str], i: int) -> bool:
    return "|" in lines[i] and i + 1 < len(lines) and bool(_TABLE_RULE_RE.match(lines[i + 1]))


def _text_block(lines: list[str]) -> str:
    out: list[str] = []
    quote: list[str] = []

    def flush_quote() -> None:
        if quote:
            out.append("<blockquote>" + "\n".join(quote) + "</blockquote>")
            quote.clear()

    i = 0
    while i < len(lines):
        line = lines[i]
        if _QUOTE_RE.match(line):
            quote.append(_inline(_QUOTE_MARKS_RE.sub("", line)))
            i += 1
            continue
        flush_quote()
        if _is_table_at(lines, i):
            # Telegram has no tables: keep the source in monospace so the columns line up
            end = i + 2
            while end < len(lines) and "|" in lines[end] and lines[end].strip():
                end += 1
            out.append(f"<pre>{_escape(chr(10).join(lines[i:end]))}</pre>")
            i = end
            continue
        heading = _HEADING_RE.match(line)
        if heading:
            out.append(f"<b>{_inline(heading.group(1).replace('**', ''))}</b>")
        else:
            out.append(_inline(_BULLET_RE.sub(lambda m: f"{m.group(1)}• ", line)))
        i += 1
    flush_quote()
    return "\n".join(out)


def _code_block(lang: str, lines: list[str]) -> str:
    body = _escape("\n".join(lines))
    if lang and _LANG_RE.match(lang):
        return f'<pre><code class="language-{html.escape(lang, quote=True)}">{body}</code></pre>'
    return f"<pre>{body}</pre>"


def _dedent(line: str, indent: int) -> str:
    """Remove up to `indent` leading spaces (a fence indented in a list item)."""
    stripped = line.lstrip(" ")
    return line[min(indent, len(line) - len(stripped)) :]


def markdown_to_telegram_html(text: str) -> str:
    """Convert Markdown-ish text to Telegram HTML; ``` and ~~~ fences become <pre> blocks.

    A fence is closed by a line of the same character at least as long as its opener, so
    a ``` line inside a ~~~ block is code. A fence left open at the end (which the
    gateway's splitter never produces, but a model might) is closed at the end of the text.
    """
    parts: list[str] = []
    plain: list[str] = []
    code: list[str] | None = None
    fence = ""
    indent = 0
    lang = ""
    for line in text.split("\n"):
        if code is None:
            opener = _FENCE_OPEN_RE.match(line)
            if opener and not (opener.group(2)[0] == "`" and "`" in opener.group(3)):
                if plain:
                    parts.append(_text_block(plain))
                    plain = []
                indent, fence = len(opener.group(1)), opener.group(2)
                info = opener.group(3).split()
                lang = info[0] if info else ""
                code = []
            else:
                plain.append(line)
        elif line.strip() and set(line.strip()) == {fence[0]} and len(line.strip()) >= len(fence):
            parts.append(_code_block(lang, code))
            code = None
        else:
            code.append(_dedent(line, indent))
    if code is not None:
        parts.append(_code_block(lang, code))
    if plain:
        parts.append(_text_block(plain))
    return "\n".join(parts)
