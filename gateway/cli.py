"""The `hermes-gateway` command line: run, chat, doctor, init."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from pathlib import Path

from gateway.admin import AdminError
from gateway.config import Config, ConfigError, load_config

DEFAULT_CONFIG = "hermes-gateway.yaml"


def setup_logging(cfg: Config | None, *, quiet: bool = False) -> None:
    """stderr logging as `logging.format` says (text or JSON lines), with secrets redacted."""
    from gateway.logs import configure_logging

    configure_logging(cfg, quiet=quiet)


def build_adapters(cfg: Config) -> list:
    """The adapters of every enabled platform (import errors and missing tokens say so)."""
    adapters = []
    if cfg.platforms.telegram.enabled:
        from adapters.telegram import TelegramAdapter
        adapters.append(TelegramAdapter.from_config(cfg.platforms.telegram))
    if cfg.platforms.discord.enabled:
        from adapters.discord_bot import DiscordAdapter
        adapters.append(DiscordAdapter.from_config(cfg.platforms.discord))
    return adapters


async def _run(cfg: Config) -> int:
    from gateway.app import GatewayApp

    adapters = build_adapters(cfg)
    if not adapters:
        print("No platform is enabled (platforms.telegram.enabled / platforms.discord.enabled). "
              "Try `hermes-gateway chat` for the console.", file=sys.stderr)
        return 2
    app = GatewayApp(cfg, adapters)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await app.start()
    logging.getLogger("hermes.gateway").info("running: %s", ", ".join(a.platform for a in adapters))
    await stop.wait()
    logging.getLogger("hermes.gateway").info("stopping")
    await app.stop()
    return 0


async def _chat(cfg: Config, user: str, room: str | None) -> int:
    from adapters.console import ConsoleAdapter
    from gateway.app import GatewayApp

    app_box: list[GatewayApp] = []
    console = ConsoleAdapter(user, room, agent_name=cfg.agent_name,
                             after_line=lambda: app_box[0].drain(timeout=None))
    app = GatewayApp(cfg, [console])
    app_box.append(app)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, console.finished.set)
    await app.start()
    await console.finished.wait()
    await app.stop()
    return 0


def cmd_init(args: argparse.Namespace) -> int:
    from gateway.starter import STARTER_CONFIG

    path = Path(args.config)
    if path.exists() and not args.force:
        print(f"{path} already exists (use --force to overwrite).", file=sys.stderr)
        return 1
    path.write_text(STARTER_CONFIG, encoding="utf-8")
    print(f"Wrote {path}. Edit llm.base_url/model, then: hermes-gateway chat -c {path} --user you")
    return 0


def main(argv: list[str] | None = None) -> int:
    os.umask(0o077)  # belt and braces: every file the gateway creates is owner-only anyway
    parser = argparse.ArgumentParser(prog="hermes-gateway",
                                     description="One LLM agent on Discord and Telegram, one memory per person.")
    parser.add_argument("-c", "--config", default=os.environ.get("HERMES_GATEWAY_CONFIG", DEFAULT_CONFIG))
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("run", help="run every enabled platform until SIGINT/SIGTERM")
    chat = sub.add_parser("chat", help="talk to the agent on the console (works with piped stdin)")
    chat.add_argument("--user", default=os.environ.get("USER", "me"), help="who is speaking")
    chat.add_argument("--group", default=None, metavar="ROOM", help="speak in a group room instead of a DM")
    sub.add_parser("doctor", help="check the config, the data directory, the model and the platforms")
    init = sub.add_parser("init", help="write a commented starter config")
    init.add_argument("--force", action="store_true")
    for extra in _EXTRA_COMMANDS:
        extra(sub)
    # the global -c may also come after the subcommand
    for p in sub.choices.values():
        p.add_argument("-c", "--config", dest="config", default=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.command == "init":
        return cmd_init(args)
    try:
        cfg = load_config(args.config)
    except ConfigError as err:
        print(err, file=sys.stderr)
        return 2
    if args.command == "doctor":
        from gateway.doctor import run_doctor
        setup_logging(cfg, quiet=True)
        return asyncio.run(run_doctor(cfg))
    if args.command == "chat":
        setup_logging(cfg, quiet=True)
        # the conversation is on stdout; retries and warnings would only clutter the terminal
        logging.getLogger().setLevel(logging.ERROR)
        try:
            return asyncio.run(_chat(cfg, args.user, args.group))
        except KeyboardInterrupt:
            return 130
    if args.command == "run":
        setup_logging(cfg)
        try:
            return asyncio.run(_run(cfg))
        except ConfigError as err:
            print(err, file=sys.stderr)
            return 2
        except AdminError as err:  # another gateway holds the data directory
            print(f"error: {err}", file=sys.stderr)
            return 1
    handler = getattr(args, "handler", None)
    if handler is not None:
        setup_logging(cfg, quiet=True)
        return handler(cfg, args)
    parser.error(f"unknown command {args.command}")
    return 2


# Extra subcommands register here (e.g. `profiles`, `backup`): callables taking the
# subparsers object and setting `handler=fn(cfg, args) -> int` on their parser.
_EXTRA_COMMANDS: list = []


def _register_admin(sub) -> None:
    from gateway.admin import register

    register(sub)


_EXTRA_COMMANDS.append(_register_admin)

if __name__ == "__main__":
    sys.exit(main())
