"""Markdown-ish model output -> Telegram HTML (parse_mode="HTML").

Telegram's HTML mode needs only `&`, `<` and `>` escaped, and supports b, i, s, u, code,
pre (with `<code class="language-x">`), a, blockquote and tg-spoiler. The conversion never
adds visible characters (markers are removed, escapes count as one character once
parsed), so a chunk that fits in 4096 UTF-16 units as Markdown still fits as HTML.

It is a best effort: anything it does not recognise stays literal text, and the adapter
resends the original text without parse_mode if Telegram still rejects the markup.
"""

from __future__ import annotations

import html
import re

_LANG_RE = re.compile(r"^[A-Za-z0-9_+#.\-]{1,32}$")
_HEADING_RE = re.compile(r"^\s{0,3}#{1,6}\s+(.+?)\s*#*\s*$")
_BULLET_RE = re.compile(r"^(\s*)\* (?=\S)")
_INLINE_CODE_RE = re.compile(r"`([^`\n]+)`")
_LINK_RE = re.compile(r"\[([^\]\n]+)\]\(((?:https?|tg)://[^\s)]+)\)")
_BOLD_STAR_RE = re.compile(r"\*\*(?=\S)([^\n]+?)(?<=\S)\*\*")
_BOLD_UNDER_RE = re.compile(r"(?<![\w_])__(?=\S)([^\n<]+?)(?<=\S)__(?![\w_])")
_STRIKE_RE = re.compile(r"~~(?=\S)([^\n<]+?)(?<=\S)~~")
_SPOILER_RE = re.compile(r"\|\|(?=\S)([^\n<|]+?)(?<=\S)\|\|")
_ITALIC_STAR_RE = re.compile(r"(?<![\w*])\*(?=[^\s*])([^*\n<]+?)(?<=[^\s*])\*(?![\w*])")
_ITALIC_UNDER_RE = re.compile(r"(?<![\w_])_(?=[^\s_])([^_\n<]+?)(?<=[^\s_])_(?![\w_])")
_PLACEHOLDER_RE = re.compile("\x00(\\d+)\x00")


def _escape(text: str) -> str:
    return html.escape(text, quote=False)


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
    text = _BOLD_STAR_RE.sub(r"<b>\1</b>", text)
    text = _BOLD_UNDER_RE.sub(r"<b>\1</b>", text)
    text = _STRIKE_RE.sub(r"<s>\1</s>", text)
    text = _SPOILER_RE.sub(r"<tg-spoiler>\1</tg-spoiler>", text)
    text = _ITALIC_STAR_RE.sub(r"<i>\1</i>", text)
    text = _ITALIC_UNDER_RE.sub(r"<i>\1</i>", text)
    return _PLACEHOLDER_RE.sub(lambda m: slots[int(m.group(1))], text)


def _text_block(lines: list[str]) -> str:
    out: list[str] = []
    quote: list[str] = []

    def flush_quote() -> None:
        if quote:
            out.append("<blockquote>" + "\n".join(quote) + "</blockquote>")
            quote.clear()

    for line in lines:
        if line.startswith(">"):
            quote.append(_inline(line[1:].removeprefix(" ")))
            continue
        flush_quote()
        heading = _HEADING_RE.match(line)
        if heading:
            out.append(f"<b>{_inline(heading.group(1).replace('**', ''))}</b>")
            continue
        line = _BULLET_RE.sub(lambda m: f"{m.group(1)}• ", line)
        out.append(_inline(line))
    flush_quote()
    return "\n".join(out)


def _code_block(lang: str, lines: list[str]) -> str:
    body = _escape("\n".join(lines))
    if lang and _LANG_RE.match(lang):
        return f'<pre><code class="language-{html.escape(lang, quote=True)}">{body}</code></pre>'
    return f"<pre>{body}</pre>"


def markdown_to_telegram_html(text: str) -> str:
    """Convert Markdown-ish text to Telegram HTML; code fences become <pre> blocks.

    A fence left open at the end (which the gateway's splitter never produces, but a
    model might) is treated as closed at the end of the text.
    """
    parts: list[str] = []
    plain: list[str] = []
    code: list[str] | None = None
    lang = ""
    for line in text.split("\n"):
        stripped = line.strip()
        if code is None:
            if stripped.startswith("```"):
                if plain:
                    parts.append(_text_block(plain))
                    plain = []
                lang = stripped[3:].strip()
                code = []
            else:
                plain.append(line)
        elif stripped.startswith("```"):
            parts.append(_code_block(lang, code))
            code = None
        else:
            code.append(line)
    if code is not None:
        parts.append(_code_block(lang, code))
    if plain:
        parts.append(_text_block(plain))
    return "\n".join(parts)
