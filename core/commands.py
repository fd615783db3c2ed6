"""The chat commands' names and one-line descriptions: shown by /help and registered
with each platform's command menu (Telegram setMyCommands, Discord slash commands)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CommandSpec:
    name: str
    description: str
    takes_args: bool = False
    admin_only: bool = False
    aliases: tuple[str, ...] = ()
    #: answered only to the asker where the platform can (a Discord slash command used in
    #: a server answers ephemerally), because the answer is about the asker
    ephemeral: bool = False


COMMAND_SPECS: tuple[CommandSpec, ...] = (
    CommandSpec("help", "What I can do and the commands"),
    CommandSpec("new", "Start a fresh conversation (memory is kept)", aliases=("reset",)),
    CommandSpec("stop", "Stop the answer I'm writing now"),
    CommandSpec("status", "This conversation: session, messages, model", ephemeral=True),
    CommandSpec("usage", "Tokens used and how full the context is", ephemeral=True),
    CommandSpec("compress", "Summarise this conversation now (optional: focus <topic>)", takes_args=True),
    CommandSpec(
        "memory",
        "Show what I remember about you (share N / unshare N; pending, approve N, reject N)",
        takes_args=True,
        ephemeral=True,
    ),
    CommandSpec("forget", "Erase what I remember about you (N, or memory or user or all)", takes_args=True),
    CommandSpec("reminders", "Your reminders here (or: cancel N)", takes_args=True),
    CommandSpec("model", "Which model answers you: list, or choose one (NAME, default)", takes_args=True),
    CommandSpec("persona", "How I answer: a persona (NAME, off, or custom TEXT in private)", takes_args=True),
    CommandSpec("tools", "The tools I can use for you here", ephemeral=True),
    CommandSpec("why", "What went into my last reply (or N replies back)", takes_args=True, ephemeral=True),
    CommandSpec("undo", "Take back your last message and my answer"),
    CommandSpec("more", "The next part of my last answer, when it was too long for one reply"),
    CommandSpec("export", "Get a copy of your conversations and memory"),
    CommandSpec("whoami", "Your ids and which profile you're in", ephemeral=True),
    CommandSpec("link", "Join your accounts on two platforms into one memory", takes_args=True),
    CommandSpec("unlink", "Separate this (or another) account from your linked identity", takes_args=True),
    CommandSpec("start", "Say hello (or start pairing)", takes_args=True),
    CommandSpec("pair", "Admin: approve a pairing code", takes_args=True, admin_only=True),
)


def find_command(name: str) -> CommandSpec | None:
    """The spec for a command name or alias (case-insensitive), or None."""
    name = name.lower()
    for spec in COMMAND_SPECS:
        if spec.name == name or name in spec.aliases:
            return spec
    return None
