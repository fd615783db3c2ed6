"""`hermes-gateway doctor` for Discord: the bot token (GET /users/@me), the application's
Message Content intent (GET /oauth2/applications/@me flags) and the invite link."""

from __future__ import annotations

import os
from typing import Any

import aiohttp

from adapters.discord_bot.client import PORTAL_URL, resolve_api_base
from core.settings import DiscordConfig

# Application flags (GET /oauth2/applications/@me `flags`)
APP_FLAG_GATEWAY_MESSAGE_CONTENT = 1 << 18
APP_FLAG_GATEWAY_MESSAGE_CONTENT_LIMITED = 1 << 19

# Invite permissions: View Channels, Send Messages, Read Message History, Send Messages in Threads
INVITE_PERMISSIONS = (1 << 10) | (1 << 11) | (1 << 16) | (1 << 38)
INVITE_SCOPES = "bot+applications.commands"


def invite_url(application_id: int | str) -> str:
    return (
        f"https://discord.com/oauth2/authorize?client_id={application_id}"
        f"&scope={INVITE_SCOPES}&permissions={INVITE_PERMISSIONS}"
    )


async def doctor(cfg: DiscordConfig, *, token: str | None = None, timeout: float = 15.0) -> tuple[bool, str]:
    """Check the bot token (GET /users/@me) and the application's Message Content intent
    (GET /oauth2/applications/@me flags). Returns (ok, human-readable report). Never
    includes the token."""
    token = (token if token is not None else os.environ.get(cfg.token_env, "")).strip()
    if not token:
        return False, f"${cfg.token_env} is not set (put the bot token from {PORTAL_URL} → your app → Bot there)"
    api = resolve_api_base(cfg.api_base)
    headers = {"Authorization": f"Bot {token}", "User-Agent": "DiscordBot (hermes-gateway doctor, 1.0)"}
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as http:
            async with http.get(f"{api}/users/@me", headers=headers) as r:
                if r.status == 401:
                    return False, (
                        f"token rejected (401) — the token in ${cfg.token_env} is wrong or was reset; "
                        f"copy a fresh one from {PORTAL_URL} → your app → Bot → Reset Token"
                    )
                if r.status != 200:
                    return False, f"GET /users/@me answered HTTP {r.status}"
                me = await r.json()
            app: dict[str, Any] | None = None
            async with http.get(f"{api}/oauth2/applications/@me", headers=headers) as r:
                if r.status == 200:
                    app = await r.json()
    except (TimeoutError, aiohttp.ClientError, OSError) as exc:
        return False, f"cannot reach {api}: {type(exc).__name__}: {str(exc).replace(token, '<redacted>')}"

    name = me.get("username", "?")
    lines = [f"token OK — bot @{name} (id {me.get('id')})"]
    if app is None:
        lines.append("could not read the application's settings; cannot check the Message Content intent")
        return True, "\n    ".join(lines)
    flags = int(app.get("flags") or 0)
    if flags & (APP_FLAG_GATEWAY_MESSAGE_CONTENT | APP_FLAG_GATEWAY_MESSAGE_CONTENT_LIMITED):
        lines.append("MESSAGE CONTENT INTENT is on")
        ok = True
    else:
        lines.append(
            f"MESSAGE CONTENT INTENT is OFF — open {PORTAL_URL} → your app → Bot → "
            "Privileged Gateway Intents and turn on MESSAGE CONTENT INTENT (Discord will refuse the connection otherwise)"
        )
        ok = False
    if app.get("id"):
        lines.append(f"invite link: {invite_url(app['id'])}")
    return ok, "\n    ".join(lines)
