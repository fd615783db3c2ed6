"""`hermes-gateway doctor` for Telegram: the token's shape, getMe, the webhook secret and
what getWebhookInfo says, in one sentence."""

from __future__ import annotations

import os
import re

from telegram.error import InvalidToken, NetworkError, TelegramError, TimedOut

from adapters.telegram.client import _SECRET_TOKEN_RE, _make_bot, _register_secret, _shutdown_bot
from core.settings import TelegramConfig

_TOKEN_SHAPE_RE = re.compile(r"^\d+:[A-Za-z0-9_-]+$")


async def doctor(cfg: TelegramConfig) -> tuple[bool, str]:
    """Check the Telegram setup with getMe; (ok, one sentence saying what is wrong or fine)."""
    token = os.environ.get(cfg.token_env, "").strip()
    if not token:
        return False, (f"environment variable {cfg.token_env} is not set; put the token @BotFather gave you there")
    _register_secret(token)
    if not _TOKEN_SHAPE_RE.match(token):
        return False, (
            f"the value of {cfg.token_env} does not look like a bot token "
            "(expected <digits>:<letters>, as @BotFather prints it)"
        )
    where = cfg.base_url.replace(token, "<token>")
    if cfg.mode == "webhook":
        env = cfg.webhook.secret_token_env
        if not env:
            return False, "webhook mode needs platforms.telegram.webhook.secret_token_env"
        secret = os.environ.get(env, "").strip()
        if not secret:
            return False, f"environment variable {env} (the webhook secret token) is not set"
        if not _SECRET_TOKEN_RE.match(secret):
            return False, f"the value of {env} must be 1-256 characters of A-Z a-z 0-9 _ -"
        _register_secret(secret)
    bot, polling = _make_bot(cfg, token, send_timeout_s=15.0)
    try:
        try:
            me = await bot.get_me()
        except InvalidToken:
            return False, (
                f"Telegram rejected the token in {cfg.token_env} (401 Unauthorized); "
                "it was mistyped or revoked: get the current one from @BotFather (/token)"
            )
        except (TimedOut, NetworkError) as exc:
            return (
                False,
                f"can't reach the Bot API at {where} ({type(exc).__name__}); check the network, proxy or base_url",
            )
        except TelegramError as exc:
            return False, f"getMe failed at {where}: {str(exc).replace(token, '<token>')}"
        notes: list[str] = []
        if me.can_read_all_group_messages:
            notes.append("privacy mode is off (the bot receives every group message; the gateway still filters)")
        else:
            notes.append("privacy mode is on (in groups the bot sees mentions, replies to it and commands)")
        if not me.can_join_groups:
            notes.append("joining groups is disabled in @BotFather (/setjoingroups)")
        try:
            info = await bot.get_webhook_info()
            if cfg.mode == "polling" and info.url:
                notes.append("a webhook is set; polling mode removes it at start")
            if cfg.mode == "webhook" and cfg.webhook.public_url and not info.url:
                notes.append("no webhook registered yet; it is set when the gateway starts")
            if info.last_error_message:
                notes.append(f"Telegram's last webhook error: {info.last_error_message}")
        except TelegramError:
            pass
        return True, f"ok: @{me.username} (id {me.id}); " + "; ".join(notes)
    finally:
        await _shutdown_bot(bot, polling)
