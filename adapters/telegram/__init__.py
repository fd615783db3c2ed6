"""Telegram: one bot account through python-telegram-bot's `Bot`.

`TelegramAdapter` (adapter.py) is composed of receive.py (polling, webhook), normalise.py
(update -> InboundMessage), send.py (send, edit, typing, download); doctor.py holds the
checks `hermes-gateway doctor` runs, format.py and flood.py the Markdown converter and the
flood limiter.
"""

from adapters.telegram.adapter import TelegramAdapter, telegram_commands
from adapters.telegram.doctor import doctor
from adapters.telegram.flood import FloodLimits

__all__ = ["FloodLimits", "TelegramAdapter", "doctor", "telegram_commands"]
