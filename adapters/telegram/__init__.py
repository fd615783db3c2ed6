"""Telegram: one bot account through python-telegram-bot's `Bot` (see `adapter.py`)."""

from adapters.telegram.adapter import TelegramAdapter, doctor, telegram_commands

__all__ = ["TelegramAdapter", "doctor", "telegram_commands"]
