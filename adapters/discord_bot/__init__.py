"""Discord: one bot through discord.py 2.x (see `adapter.py`). The package is not called
`discord` so it never shadows the discord.py library."""

from adapters.discord_bot.adapter import EPHEMERAL_IN_SERVERS, INTENT_HINT, DiscordAdapter, doctor, resolve_api_base

__all__ = ["EPHEMERAL_IN_SERVERS", "INTENT_HINT", "DiscordAdapter", "doctor", "resolve_api_base"]
