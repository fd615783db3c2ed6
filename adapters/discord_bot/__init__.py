"""Discord: one bot through discord.py 2.x. The package is not called `discord` so it never
shadows the discord.py library.

`DiscordAdapter` (adapter.py) is composed of receive.py (gateway connection, shards, the
event parse guard), commands.py (slash commands), normalise.py (message ->
InboundMessage) and send.py (send, edit, typing, download); doctor.py holds the checks
`hermes-gateway doctor` runs.
"""

from adapters.discord_bot.adapter import DiscordAdapter
from adapters.discord_bot.client import INTENT_HINT, resolve_api_base
from adapters.discord_bot.commands import EPHEMERAL_IN_SERVERS
from adapters.discord_bot.doctor import doctor

__all__ = ["EPHEMERAL_IN_SERVERS", "INTENT_HINT", "DiscordAdapter", "doctor", "resolve_api_base"]
