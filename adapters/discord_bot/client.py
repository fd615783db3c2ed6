"""What every part of the Discord adapter shares about discord.py: the endpoints (Discord's
own, or `api_base` resolved to a REST root), the mentions policy every send carries, and
keeping the bot token and interaction/webhook tokens out of the logs.
"""

from __future__ import annotations

import logging
import re

import discord
from discord.gateway import DiscordWebSocket
from discord.http import Route

from core.redact import RedactingFilter, Redactor

# One logger for every module of the package, under the name the adapter has always logged
# as: logging settings that name it keep working, and the redacting filter below, attached
# per logger (a filter on a parent does not see its children's records), covers all parts.
log = logging.getLogger("adapters.discord_bot")

DISCORD_API = "https://discord.com/api/v10"
DISCORD_GATEWAY = "wss://gateway.discord.gg/"
_ORIGINAL_ROUTE_BASE = Route.BASE
_ORIGINAL_DEFAULT_GATEWAY = DiscordWebSocket.DEFAULT_GATEWAY

PORTAL_URL = "https://discord.com/developers/applications"
INTENT_HINT = (
    "Discord refused the Message Content intent: open "
    f"{PORTAL_URL} → your app → Bot → Privileged Gateway Intents "
    "and turn on MESSAGE CONTENT INTENT"
)

NO_PINGS = discord.AllowedMentions.none()


def resolve_api_base(api_base: str | None) -> str:
    """`api_base` as a full REST root: `http://host:port` -> `http://host:port/api/v10`,
    `.../api` -> `.../api/v10`, `.../api/v9` kept as is; None -> Discord's."""
    if not api_base:
        return DISCORD_API
    base = api_base.rstrip("/")
    if re.search(r"/api/v\d+$", base):
        return base
    if base.endswith("/api"):
        return base + "/v10"
    return base + "/api/v10"


def _redact_url_tokens(text: str) -> str:
    text = re.sub(r"(/(?:webhooks|interactions)/\d+/)[^/\s?'\"]+", r"\1<redacted>", text)
    # interaction tokens inside logged gateway payloads ({'token': '...'})
    return re.sub(r"""(['"]token['"]\s*:\s*['"])[^'"]+""", r"\1<redacted>", text)


# the bot token, and interaction/webhook tokens in URLs and logged gateway payloads
_REDACTOR = RedactingFilter(
    "hermes-discord-redact", Redactor(mark="<redacted>", patterns=False, min_len=1), extra=_redact_url_tokens
)


def _voice_unused(record: logging.LogRecord) -> bool:
    """discord.py warns at the first client that PyNaCl and davey are missing, so "voice will
    NOT be supported": the gateway never joins voice, so the warning says nothing true here."""
    return not (isinstance(record.msg, str) and record.msg.endswith("voice will NOT be supported"))


def _install_redactor(token: str) -> None:
    """Attach the redacting filter to every discord.py logger and ours (logger filters
    are not inherited, so each existing logger gets it)."""
    _REDACTOR.redactor.add(token)
    names = [n for n in logging.root.manager.loggerDict if n == "discord" or n.startswith("discord.")]
    _REDACTOR.attach([*names, "discord", log.name])
    client_log = logging.getLogger("discord.client")
    if _voice_unused not in client_log.filters:
        client_log.addFilter(_voice_unused)


# --------------------------------------------------------------------------- confirmation buttons

#: Discord's limit for a component's custom_id, in characters
CUSTOM_ID_MAX_CHARS = 100
