"""The one redactor: credentials out of logs, summaries, reviews and error text.

- `redact_secrets(text)` replaces anything that looks like a credential (provider API keys,
  GitHub, Slack, AWS and Google tokens, bot tokens, bearer headers, JWTs, private key
  blocks and `key=value` credential assignments) with `[REDACTED]`. Pure, no state.
- `Redactor(secrets)` removes known secret values (and their URL-encoded form) first, then
  optionally the patterns: the log formatters use it with the config's `*_env` values.
- `RedactingFilter` runs a `Redactor` over log records of named loggers (the platform
  libraries log request URLs that carry the bot token).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable

REDACTED = "[REDACTED]"

_PATTERNS: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----[\s\S]*?(?:-----END [A-Z ]*PRIVATE KEY-----|$)"), REDACTED),
    (re.compile(r"\b(?:sk|rk|pk)-(?:[A-Za-z0-9]+-)?[A-Za-z0-9_-]{16,}"), REDACTED),
    (re.compile(r"sk-[A-Za-z0-9_-]{16,}"), REDACTED),  # glued to other text (no word boundary)
    (re.compile(r"\b(?:ghp|gho|ghu|ghs|ghr)_[A-Za-z0-9]{20,}|\bgithub_pat_\w{20,}"), REDACTED),
    (re.compile(r"\bxox[abprs]-[A-Za-z0-9-]{10,}"), REDACTED),
    (re.compile(r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b"), REDACTED),
    (re.compile(r"\bAIza[0-9A-Za-z_-]{30,}"), REDACTED),
    (re.compile(r"\beyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}"), REDACTED),
    (re.compile(r"\d+:[A-Za-z0-9_-]{30,}"), REDACTED),  # Telegram bot token
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
    (re.compile(r"(?i)\b(api[_-]?key|token|secret|password)=([^\s&\"']{6,})"), r"\1=" + REDACTED),
)


def redact_secrets(text: str) -> str:
    """`text` with every credential-looking span replaced by [REDACTED]."""
    if not text:
        return text
    for pattern, replacement in _PATTERNS:
        text = pattern.sub(replacement, text)
    return text


class Redactor:
    """Replaces known secret values (longest first, so a secret containing another goes
    whole; also `:` written `%3A` as in URLs) with `mark`, then, with `patterns`, anything
    `redact_secrets` recognises."""

    def __init__(
        self, secrets: Iterable[str] = (), *, mark: str = REDACTED, patterns: bool = True, min_len: int = 6
    ) -> None:
        self.mark = mark
        self.patterns = patterns
        self.min_len = min_len
        self.secrets: list[str] = []
        for secret in secrets:
            self.add(secret)

    def add(self, secret: str | None) -> None:
        if secret and len(secret) >= self.min_len and secret not in self.secrets:
            self.secrets = sorted([*self.secrets, secret], key=len, reverse=True)

    def __call__(self, text: str) -> str:
        for secret in self.secrets:
            if secret in text:
                text = text.replace(secret, self.mark)
            if ":" in secret:
                text = text.replace(secret.replace(":", "%3A"), self.mark)
        return redact_secrets(text) if self.patterns else text


class RedactingFilter(logging.Filter):
    """A log filter that rewrites each record's message through `redactor` (and `extra`, a
    platform's own rewrite). Logger filters are not inherited: `attach` adds it to each
    named logger. A filter never breaks logging: a record it cannot format passes as is."""

    def __init__(self, name: str, redactor: Redactor, extra: Callable[[str], str] | None = None) -> None:
        super().__init__(name)
        self.redactor = redactor
        self.extra = extra

    def attach(self, names: Iterable[str]) -> None:
        for name in names:
            logger = logging.getLogger(name)
            if self not in logger.filters:
                logger.addFilter(self)

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a broken record: leave it to the handler
            return True
        clean = self.redactor(message)
        if self.extra is not None:
            clean = self.extra(clean)  # noqa: S610 (not Django)
        if clean != message:
            record.msg, record.args = clean, None
        return True


__all__ = ["REDACTED", "RedactingFilter", "Redactor", "redact_secrets"]
