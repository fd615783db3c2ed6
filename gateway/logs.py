"""Structured logging: plain text or one JSON object a line, always redacted.

- `configure_logging(cfg)` installs one stderr handler on the root logger with a text or
  JSON formatter (`logging.format`). Both formatters redact, after formatting, anything
  that looks like a Telegram bot token, a Discord bot token, an `sk-...` API key or a
  `Bearer ...` credential, plus the exact values of every secret environment variable the
  config names (`*_env`).
- A turn's log lines carry `turn_id`, `platform` and `tenant` through a `LoggerAdapter`
  built per turn (`turn_logger`), passed explicitly: no context variable, no module state,
  so concurrent turns can never log each other's ids.
- Message text is never logged unless `logging.include_text: true` (`log_text`), and even
  then the code of `/link CODE` and `/pair CODE` is replaced by `[code]`.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import time
from typing import TYPE_CHECKING, Any

from core.redact import Redactor

if TYPE_CHECKING:  # pragma: no cover
    from core.settings import Config

_CODE_COMMAND = re.compile(r"(?i)^(\s*/(?:link|pair|start)(?:@\S+)?\s+)\S.*$", re.S)

# LogRecord attributes that are not "extra" fields
_STANDARD = frozenset(vars(logging.LogRecord("x", 0, "x", 0, "", (), None))) | {"message", "asctime", "taskName"}
CONTEXT_FIELDS = ("turn_id", "platform", "tenant")
_HANDLER_MARK = "_hermes_gateway_handler"


def secrets_from_config(cfg: Config | None) -> list[str]:
    """The values of every environment variable the config names as holding a secret."""
    if cfg is None:
        return []
    names = [
        cfg.llm.api_key_env,
        cfg.auxiliary.compression.api_key_env,
        cfg.auxiliary.review.api_key_env,
        cfg.platforms.telegram.token_env,
        cfg.platforms.telegram.webhook.secret_token_env,
        cfg.platforms.discord.token_env,
        cfg.transcription.api_key_env,
        cfg.tools.web_search.api_key_env,
        *(offer.api_key_env for offer in cfg.llm.models.values()),
        *(var for server in cfg.tools.mcp.servers.values() for var in server.secret_envs()),
    ]
    return [os.environ[n] for n in names if n and os.environ.get(n)]


def redact_commands(text: str) -> str:
    """`/link ABCD-EFGH` -> `/link [code]` (likewise /pair and /start payloads)."""
    return _CODE_COMMAND.sub(lambda m: m.group(1) + "[code]", text)


def _context_suffix(record: logging.LogRecord) -> str:
    parts = [f"{k}={getattr(record, k)}" for k in CONTEXT_FIELDS if getattr(record, k, None) is not None]
    return f" [{' '.join(parts)}]" if parts else ""


class TextFormatter(logging.Formatter):
    """`time level logger: message [turn_id=.. platform=.. tenant=..]`, redacted."""

    def __init__(self, redactor: Redactor) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")
        self.redactor = redactor

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        head, sep, tail = text.partition("\n")  # context goes on the first line
        return self.redactor(head + _context_suffix(record) + sep + tail)


class JsonFormatter(logging.Formatter):
    """One JSON object a line: ts, level, logger, msg, turn_id/platform/tenant when set,
    other `extra=` fields, and `exc` for tracebacks. Every string is redacted."""

    def __init__(self, redactor: Redactor) -> None:
        super().__init__()
        self.redactor = redactor

    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"
        out: dict[str, Any] = {
            "ts": ts,
            "level": record.levelname,
            "logger": record.name,
            "msg": self.redactor(record.getMessage()),
        }
        for key, value in record.__dict__.items():
            if key in _STANDARD or key.startswith("_"):
                continue
            out[key] = self._clean(value)
        if record.exc_info:
            out["exc"] = self.redactor(self.formatException(record.exc_info))
        elif record.exc_text:
            out["exc"] = self.redactor(record.exc_text)
        if record.stack_info:
            out["stack"] = self.redactor(self.formatStack(record.stack_info))
        return json.dumps(out, ensure_ascii=False, default=str)

    def _clean(self, value: Any) -> Any:
        if value is None or isinstance(value, (bool, int, float)):
            return value
        return self.redactor(str(value))


def configure_logging(cfg: Config | None, *, quiet: bool = False, stream: Any = None) -> logging.Handler:
    """Install the gateway's stderr handler on the root logger (replacing one installed
    earlier by this function); returns it."""
    level = "WARNING" if quiet else (cfg.logging.level if cfg else "INFO")
    fmt = cfg.logging.format if cfg else "text"
    redactor = Redactor(secrets_from_config(cfg))
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter(redactor) if fmt == "json" else TextFormatter(redactor))
    setattr(handler, _HANDLER_MARK, True)
    root = logging.getLogger()
    for old in list(root.handlers):
        if getattr(old, _HANDLER_MARK, False):
            root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
    for noisy in ("httpx", "httpcore", "aiosqlite", "discord", "telegram", "aiohttp.access"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
    return handler


class TurnLogger(logging.LoggerAdapter):
    """A logger for one turn: every record carries its turn id, platform and tenant."""

    def process(self, msg: Any, kwargs: Any) -> tuple[Any, Any]:
        extra = dict(self.extra or {})
        extra.update(kwargs.get("extra") or {})
        kwargs["extra"] = extra
        return msg, kwargs


def turn_logger(logger: logging.Logger, *, turn_id: str, platform: str, tenant: str) -> TurnLogger:
    return TurnLogger(logger, {"turn_id": turn_id, "platform": platform, "tenant": tenant})


def log_text(logger: logging.Logger | logging.LoggerAdapter, include_text: bool, what: str, text: str) -> None:
    """Log message text only when `logging.include_text` is on (codes in commands hidden)."""
    if include_text:
        logger.info("%s: %s", what, redact_commands(text))
