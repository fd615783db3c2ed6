"""The python-telegram-bot client every part of the adapter shares: building the `Bot`
(and the separate connection its long polls use), closing it, keeping bot tokens and PTB's
call payloads out of the logs, and the PTB warnings our choices cause.
"""

from __future__ import annotations

import datetime as dtm
import logging
import re
import warnings
from typing import cast

from telegram import Bot
from telegram.error import RetryAfter
from telegram.request import HTTPXRequest
from telegram.warnings import PTBDeprecationWarning, PTBUserWarning

from core.redact import RedactingFilter, Redactor
from core.settings import TelegramConfig

# One logger for every module of the package, under the name the adapter has always logged
# as: logging settings that name it keep working, and the redacting filter below, attached
# per logger (a filter on a parent does not see its children's records), covers all parts.
log = logging.getLogger("adapters.telegram")

DEFAULT_BASE_URL = "https://api.telegram.org/bot"
DEFAULT_BASE_FILE_URL = "https://api.telegram.org/file/bot"
_SECRET_TOKEN_RE = re.compile(r"^[A-Za-z0-9_-]{1,256}$")


# --------------------------------------------------------------------------- logging


def _shorten_bot_calls(record: logging.LogRecord) -> bool:
    """PTB's telegram.Bot logs every call's parameters and results at DEBUG: keep only the
    endpoint name, so message payloads never reach the logs."""
    try:
        if record.name == "telegram.Bot" and isinstance(record.msg, str) and record.args:
            # PTB's telegram.Bot logs with positional args (a tuple); a mapping would raise
            # on [0] and be caught below, exactly as without the cast
            args = cast(tuple[object, ...], record.args)
            if record.msg.startswith("Calling Bot API endpoint"):
                record.msg, record.args = "Calling Bot API endpoint `%s`", (args[0],)
            elif record.msg.startswith("Call to Bot API endpoint"):
                record.msg, record.args = "Call to Bot API endpoint `%s` finished", (args[0],)
    except Exception:  # noqa: S110 (a filter must never break logging)
        pass
    return True


# bot tokens: PTB and httpx log URLs containing `/bot<token>/`
_REDACTOR = RedactingFilter("telegram-redactor", Redactor(mark="<redacted>", patterns=False, min_len=1))
_REDACTED_LOGGERS = (
    "adapters.telegram",
    "httpx",
    "httpcore",
    "telegram",
    "telegram.Bot",
    "telegram.request.BaseRequest",
    "telegram.request.HTTPXRequest",
)


def _register_secret(secret: str | None) -> None:
    if not secret:
        return
    _REDACTOR.redactor.add(secret)
    for name in _REDACTED_LOGGERS:
        logger = logging.getLogger(name)
        if _shorten_bot_calls not in logger.filters:
            logger.addFilter(_shorten_bot_calls)
    _REDACTOR.attach(_REDACTED_LOGGERS)


# --------------------------------------------------------------------------- client


def _retry_after_seconds(exc: RetryAfter) -> float:
    raw = exc.retry_after  # int today; a timedelta once PTB makes that the default
    seconds = raw.total_seconds() if isinstance(raw, dtm.timedelta) else float(raw)
    return max(seconds, 0.0)


def _quiet_expected_ptb_warnings() -> None:
    """Silence the two PTB warnings our deliberate choices cause, and nothing else.

    - `RetryAfter.__init__` reads its own `retry_after`, which (PTB >= 22.2) warns about the
      coming int -> timedelta change on every 429 unless PTB_TIMEDELTA is set process-wide;
      `_retry_after_seconds` accepts both forms, so the warning says nothing to us.
    - `do_api_request("getUpdates")` suggests `Bot.get_updates`, which parses a whole batch
      and fails it as a whole; we want the raw JSON to skip one malformed update alone.
    Idempotent (warnings.filterwarnings replaces an identical filter).
    """
    warnings.filterwarnings(
        "ignore", message=r".*In a future major version attribute `retry_after`", category=PTBDeprecationWarning
    )
    warnings.filterwarnings("ignore", message=r"Please use 'Bot\.getUpdates' instead", category=PTBUserWarning)


def _derive_file_url(base_url: str) -> str:
    if base_url.rstrip("/").endswith("/bot"):
        return base_url.rstrip("/")[: -len("bot")] + "file/bot"
    return DEFAULT_BASE_FILE_URL


def _make_bot(cfg: TelegramConfig, token: str, *, send_timeout_s: float) -> tuple[Bot, HTTPXRequest]:
    """The Bot, and the connection its getUpdates calls use (we close it on its own at stop)."""
    _quiet_expected_ptb_warnings()
    request = HTTPXRequest(
        connection_pool_size=64,
        read_timeout=send_timeout_s,
        write_timeout=send_timeout_s,
        connect_timeout=10.0,
        pool_timeout=30.0,
    )
    polling = HTTPXRequest(
        connection_pool_size=2, read_timeout=10.0, write_timeout=10.0, connect_timeout=10.0, pool_timeout=10.0
    )
    bot = Bot(
        token,
        base_url=cfg.base_url,
        base_file_url=cfg.base_file_url or _derive_file_url(cfg.base_url),
        request=request,
        get_updates_request=polling,
    )
    return bot, polling


async def _shutdown_bot(bot: Bot, polling: HTTPXRequest) -> None:
    """Close both HTTP clients (Bot.shutdown skips them if getMe never succeeded)."""
    for request in (polling, bot.request):
        try:
            await request.shutdown()
        except Exception:  # pragma: no cover
            log.debug("closing a Bot API connection failed", exc_info=True)


# --------------------------------------------------------------------------- confirmation buttons

#: Telegram's limit for an inline button's callback_data, in bytes
CALLBACK_DATA_MAX_BYTES = 64
