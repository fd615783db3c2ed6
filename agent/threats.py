"""Threat scan for text that would enter the system prompt (memory entries).

`first_threat` returns a short human reason when the text looks like a prompt
injection, a secret-exfiltration command, an SSH persistence path or carries
invisible/bidi unicode; otherwise None. Pure function, no state.
"""

from __future__ import annotations

import re
import unicodedata

MAX_SCAN_CHARS = 65_536

# Zero-width, word joiner & invisible operators, BOM, bidi embeddings/overrides/isolates, tags.
_INVISIBLE_RANGES: tuple[tuple[int, int], ...] = (
    (0x200B, 0x200F),
    (0x202A, 0x202E),
    (0x2060, 0x2064),
    (0x2066, 0x2069),
    (0xFEFF, 0xFEFF),
    (0xE0000, 0xE007F),
)

# Legitimate uses of otherwise-invisible code points, removed before the check:
# ZWJ between pictographs (family/profession emoji) and the three RGI subdivision flags.
_EMOJI = r"[\u2600-\u27BF\u2B00-\u2BFF\U0001F000-\U0001FAFF]"
_EMOJI_MOD = r"[\uFE0F\U0001F3FB-\U0001F3FF]*"
_BENIGN_INVISIBLE = re.compile(
    rf"(?<={_EMOJI}){_EMOJI_MOD}\u200D(?={_EMOJI})"
    r"|\U0001F3F4(?:\U000E0067\U000E0062(?:\U000E0065\U000E006E\U000E0067"
    r"|\U000E0073\U000E0063\U000E0074|\U000E0077\U000E006C\U000E0073))\U000E007F"
)

_W = r"(?:[\w'-]+\s+)"  # one filler word
_SECRET_VAR = r"\$\{?\w*(?:KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIALS?|AUTH)S?\b"
_SECRET_PATH = (
    r"(?:\.ssh\b|id_(?:rsa|dsa|ecdsa|ed25519)\b|\.env\b|\.netrc\b|\.pgpass\b"
    r"|\.aws/credentials|\.git-credentials|/etc/(?:shadow|passwd)\b)"
)
_NET = r"\b(?:curl|wget|nc|ncat|netcat|socat|telnet|scp|rsync)\b"

_PATTERNS: tuple[tuple[re.Pattern[str], str], ...] = tuple(
    (re.compile(rx, re.IGNORECASE | re.MULTILINE), reason)
    for rx, reason in (
        # -- prompt injection --------------------------------------------------
        (
            rf"\b(?:ignore|forget|disregard|discard|override)\s+{_W}{{0,3}}"
            rf"(?:previous|prior|above|earlier|preceding|former|original)\s+{_W}{{0,2}}"
            r"(?:instructions?|prompts?|directives?|rules|guidelines|messages|context)\b",
            "prompt injection: asks to ignore previous instructions",
        ),
        (
            r"\b(?:ignore|forget|disregard|discard)\s+(?:all|any|every)\s+(?:other\s+)?"
            r"(?:of\s+)?(?:the\s+|your\s+)?instructions\b",
            "prompt injection: asks to ignore all instructions",
        ),
        (
            r"\b(?:ignore|forget|disregard|discard|override|bypass)\s+(?:all\s+)?(?:of\s+)?"
            rf"(?:(?:your|its)\s+{_W}{{0,2}}(?:system\s+prompt|instructions|guidelines|rules"
            r"|guardrails|programming|training)|the\s+system\s+prompt)\b",
            "prompt injection: asks to disregard the system prompt",
        ),
        (
            r"\byou\s+are\s+now\s+(?:a|an|the|my|in|no\s+longer|free|unrestricted|jailbroken|dan)\b",
            "prompt injection: role hijack ('you are now ...')",
        ),
        (
            r"\b(?:respond|answer|reply|act)\s+without\s+(?:any\s+)?"
            r"(?:restrictions|limitations|filters|safety|censorship|guardrails)\b",
            "prompt injection: asks to drop safety rules",
        ),
        (
            r"\bnew\s+(?:system\s+)?instructions?\s*:",
            "prompt injection: fake 'new instructions:' header",
        ),
        (
            r"\bsystem\s+prompt\s*(?::|override\b)"
            r"|^\s*(?:#{1,6}\s*)?(?:system|developer)\s+(?:message|instructions?)\s*:",
            "prompt injection: fake system-prompt header",
        ),
        (
            r"<\|[\w.-]{1,40}\|>|<<\s*/?\s*sys\s*>>|\[/?inst\]|</?\s*(?:system|developer)\s*>",
            "prompt injection: chat-template control tokens",
        ),
        (
            r"\b(?:act|behave|respond|answer|reply)\s+as\s+(?:if|though)\s+(?:you\s+)?"
            r"(?:(?:have|had)\s+no|(?:are|were)\s+(?:not\s+bound\s+by|free\s+of|without))\s+"
            r"(?:any\s+)?(?:\w+\s+)?(?:restrictions|limitations|limits|rules|filters|guidelines"
            r"|guardrails|safety|censorship|constraints)\b"
            r"|\b(?:act|behave)\s+as\s+(?:if|though)\s+you\s+(?:are|were)\s+"
            r"(?:unrestricted|unfiltered|uncensored|jailbroken)\b",
            "prompt injection: asks to act without restrictions",
        ),
        (
            r"\bpretend\s+(?:that\s+)?you\s*(?:are|were|'re)\b"
            r"|\bpretend\s+to\s+be\s+(?:an?\s+)?(?:unrestricted|unfiltered|jailbroken|evil|different|another)\b",
            "prompt injection: role hijack ('pretend you are ...')",
        ),
        (
            r"\b(?:output|share|reveal|print|show|repeat|dump|leak|disclose|send|display|expose)\s+"
            r"(?:me\s+|us\s+)?(?:your\s+(?:(?:entire|full|whole|complete|original|hidden|initial)\s+)?"
            r"|(?:the\s+)?(?:entire|full|whole|complete|original|hidden|initial)\s+)?"
            r"(?:system\s+prompt|context\s+window)\b"
            r"|\b(?:output|share|reveal|print|show|repeat|dump|leak|disclose|send|display|expose)\s+"
            r"(?:me\s+|us\s+)?your\s+(?:entire|full|whole|complete)\s+"
            r"(?:context|conversation|chat|instructions|history)\b"
            r"|\b(?:output|share|reveal|print|show|repeat|dump|leak|disclose|send|display|expose)\s+"
            r"(?:me\s+|us\s+)?your\s+(?:conversation\s+history|chat\s+history|instructions|context)\b",
            "prompt injection: asks to reveal the system prompt or context",
        ),
        (
            # upstream Hermes' context_exfil: handing over the conversation or the whole context
            # ("the full context of the project" is a project's context, not this one)
            r"\b(?:include|output|print|share)\s+(?:\w+\s+){0,8}?(?:conversation|chat\s+history"
            r"|previous\s+messages|(?:full|entire)\s+context(?!\s+of\b))\b",
            "secret exfiltration: asks to hand over the conversation or context",
        ),
        (
            r"\byou\s*(?:have|'ve)\s+been\s+(?:updated|upgraded|reprogrammed|reconfigured|patched|modified)\s+"
            r"(?:to|with|so)\b|\byou\s+were\s+(?:updated|upgraded|reprogrammed|reconfigured)\s+(?:to|with|so)\b",
            "prompt injection: fake update ('you have been updated to ...')",
        ),
        (
            r"\btranslate\b[^\n]{0,200}?\b(?:and|then)\s+(?:execute|eval(?:uate)?|obey"
            r"|(?:run|follow)\s+(?:it|them|those|these|the\s+(?:result|instructions?|commands?|output)))\b",
            "prompt injection: asks to translate and execute",
        ),
        (
            # whole words only: a word that merely contains one ("ecosystem") is no marker
            r"<!--[^>]{0,500}?(?<![a-z])(?:ignore|disregard|override|system|instructions?|prompts?|assistant"
            r"|secrets?|passwords?|do\s+not|don't|execute|send|you\s+(?:are|must|should))(?![a-z])",
            "prompt injection: instructions hidden in an HTML comment",
        ),
        (
            r"<[a-z][^>]{0,300}?(?:display\s*:\s*none|visibility\s*:\s*hidden|font-size\s*:\s*0(?![.\d]*[1-9]))",
            "prompt injection: hidden HTML block",
        ),
        (
            r"\b(?:do\s+not|don't|never)\s+(?:tell|inform|notify|alert|warn)\s+the\s+(?:user|person|human|owner)\b(?!['\u2019])"
            r"|\b(?:without|never)\s+(?:telling|informing|notifying)\s+the\s+(?:user|person|human|owner)\b(?!['\u2019])"
            r"|\b(?:keep|hide)\s+(?:this|it)\s+(?:secret\s+|hidden\s+)?from\s+the\s+(?:user|person|human|owner)\b(?!['\u2019])",
            "prompt injection: asks to hide things from the user",
        ),
        (
            r"\b(?:send|post|upload|forward|transmit|exfiltrate|leak|report)\s+"
            r"(?:(?:all|the|your|any|every|this|these|those|my|of)\s+)*"
            r"(?:results?|data|output|contents?|conversations?|memory|memories|history|everything|info(?:rmation)?"
            r"|keys?|credentials|secrets?|tokens?|messages|files|logs|answers?|responses?|it|them)\s+"
            r"(?:[\w'-]+\s+){0,3}?to\s+(?:https?|ftp)://",
            "secret exfiltration: asks to send data to a URL",
        ),
        # -- secret exfiltration ----------------------------------------------
        (
            rf"\b(?:curl|wget|invoke-webrequest|iwr)\b[^\n]{{0,300}}{_SECRET_VAR}",
            "secret exfiltration: network command with a secret variable",
        ),
        (
            r"\b(?:printenv|env|set|export\s+-p)\s*\|[^\n]{0,100}?"
            + _NET
            + r"|\b(?:curl|wget)\b[^\n]{0,300}(?:\$\(|`)\s*(?:printenv|env|cat)\b",
            "secret exfiltration: environment sent over the network",
        ),
        (
            rf"{_NET}[^\n]{{0,300}}{_SECRET_PATH}",
            "secret exfiltration: network command touching credential files",
        ),
        (
            rf"\b(?:cat|xxd)\s+[^\n|;]{{0,200}}{_SECRET_PATH}",
            "secret exfiltration: reads SSH keys or credential files",
        ),
        (
            rf"\bbase64\b[^\n]{{0,200}}(?:{_SECRET_PATH}|\.pem\b|\.key\b|private[_ ]key)"
            rf"|(?:{_SECRET_PATH}|\.pem\b|\.key\b)[^\n]{{0,100}}\|\s*base64\b",
            "secret exfiltration: base64 of key material",
        ),
        (
            r"\bn(?:c|cat|etcat)\b[^\n]{0,100}\s-[a-z]*e\b|/dev/tcp/|\bbash\s+-i\s+>&",
            "secret exfiltration: reverse shell command",
        ),
        (
            r"\b(?:api[_-]?key|secret[_-]?key|access[_-]?key|access[_-]?token|auth[_-]?token|client[_-]?secret"
            r"|password|passwd|secret|token)\s*[:=]\s*[\"']?[A-Za-z0-9_\-./+]{12,}"
            r"|\b(?:sk-[A-Za-z0-9_-]{16,}|ghp_[A-Za-z0-9]{20,}|gho_[A-Za-z0-9]{20,}|github_pat_\w{20,}"
            r"|xox[abpr]-[A-Za-z0-9-]{10,}|AKIA[0-9A-Z]{16}|AIza[0-9A-Za-z_-]{30,})",
            "secret material: a credential or API key",
        ),
        (
            r"-----BEGIN [A-Z ]*PRIVATE KEY-----",
            "secret material: private key",
        ),
        # -- SSH persistence ----------------------------------------------------
        (r"authorized_keys", "SSH persistence: references authorized_keys"),
        (r"(?<![\w-])\.ssh(?![\w-])", "SSH access: references an .ssh path"),
    )
)


def _invisible(text: str) -> str | None:
    """The first forbidden invisible/bidi code point as U+XXXX, or None."""
    for ch in _BENIGN_INVISIBLE.sub("", text):
        cp = ord(ch)
        if any(lo <= cp <= hi for lo, hi in _INVISIBLE_RANGES):
            return f"U+{cp:04X}"
    return None


def first_threat(content: str) -> str | None:
    """A short reason why `content` must not be stored in memory, or None if it is fine."""
    if not isinstance(content, str):
        return "content is not text"
    if len(content) > MAX_SCAN_CHARS:
        return f"content too large to scan ({len(content):,} chars)"
    if (cp := _invisible(content)) is not None:
        return f"invisible or bidi unicode character {cp}"
    # NFKC folds full-width and compatibility forms (ｉｇｎｏｒｅ -> ignore).
    text = unicodedata.normalize("NFKC", content)
    for pattern, reason in _PATTERNS:
        if pattern.search(text):
            return reason
    return None


__all__ = ["MAX_SCAN_CHARS", "first_threat"]
