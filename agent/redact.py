"""Redaction of tokens and keys in text that leaves the conversation (summaries, reviews).

`redact_secrets` replaces anything that looks like a credential (provider API keys, GitHub,
Slack, AWS and Google tokens, bot tokens, bearer headers, JWTs, private key blocks and
`key=value` credential assignments) with `[REDACTED]`. Pure function, no state.
"""

from __future__ import annotations

import re

REDACTED = "[REDACTED]"

_PATTERNS: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----[\s\S]*?(?:-----END [A-Z ]*PRIVATE KEY-----|$)"), REDACTED),
    (re.compile(r"\b(?:sk|rk|pk)-(?:[A-Za-z0-9]+-)?[A-Za-z0-9_-]{16,}"), REDACTED),
    (re.compile(r"\b(?:ghp|gho|ghu|ghs|ghr)_[A-Za-z0-9]{20,}|\bgithub_pat_\w{20,}"), REDACTED),
    (re.compile(r"\bxox[abprs]-[A-Za-z0-9-]{10,}"), REDACTED),
    (re.compile(r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b"), REDACTED),
    (re.compile(r"\bAIza[0-9A-Za-z_-]{30,}"), REDACTED),
    (re.compile(r"\beyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}"), REDACTED),
    (re.compile(r"\b\d{6,}:[A-Za-z0-9_-]{30,}"), REDACTED),  # Telegram bot token
    (re.compile(r"[A-Za-z0-9_-]{23,28}\.[A-Za-z0-9_-]{6,7}\.[A-Za-z0-9_-]{27,}"), REDACTED),  # Discord
    (re.compile(r"(?i)\b(bearer|basic)\s+[A-Za-z0-9._~+/=-]{8,}"), r"\1 " + REDACTED),
    (
        re.compile(
            r"(?i)\b((?:[a-z0-9]+[_-])*(?:api[_-]?key|secret[_-]?key|access[_-]?key|access[_-]?token|auth[_-]?token"
            r"|refresh[_-]?token|client[_-]?secret|private[_-]?key|password|passwd|secret|token))"
            r"(\s*[:=]\s*[\"']?)([^\s\"',;&]{6,})"
        ),
        r"\1\2" + REDACTED,
    ),
)


def redact_secrets(text: str) -> str:
    """`text` with every credential-looking span replaced by [REDACTED]."""
    if not text:
        return text
    for pattern, replacement in _PATTERNS:
        text = pattern.sub(replacement, text)
    return text


__all__ = ["REDACTED", "redact_secrets"]
