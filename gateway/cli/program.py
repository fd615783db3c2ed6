"""The parser of every verb and the dispatch: every failure a person can cause ends in one
message and a non-zero exit (2 for a config problem, 1 for a refusal, 130 after Ctrl-C)."""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import sys

from agent.vault import VaultError
from core.settings import ConfigError, load_config
from gateway.cli import budget, cluster, doctor, init, keys, profiles, run
from gateway.cli.common import CONFIG_HELP, DEFAULT_CONFIG, setup_logging
from gateway.faults import StartupError
from gateway.runlock import AdminError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hermes-gateway", description="One LLM agent on Discord and Telegram, one memory per person."
    )
    parser.add_argument(
        "-c", "--config", default=os.environ.get("HERMES_GATEWAY_CONFIG", DEFAULT_CONFIG), help=CONFIG_HELP
    )
    parser.add_argument("--version", action="version", version=f"hermes-gateway {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    run.register_run(sub)
    run.register_chat(sub)
    doctor.register_doctor(sub)
    init.register(sub)
    profiles.register(sub)  # profiles, backup, restore
    budget.register(sub)
    keys.register(sub)
    doctor.register_health(sub)
    cluster.register(sub)
    # the global -c may also come after the subcommand
    for p in sub.choices.values():
        p.add_argument("-c", "--config", dest="config", default=argparse.SUPPRESS, help=CONFIG_HELP)
    return parser


def _version() -> str:
    try:
        return importlib.metadata.version("hermes-gateway")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "(not installed)"


def run_cli(argv: list[str] | None = None) -> int:
    """The command line (`gateway.cli.main` after the imports)."""
    os.umask(0o077)  # belt and braces: every file the gateway creates is owner-only anyway
    try:
        code = _dispatch(build_parser().parse_args(argv))
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's exit
        return code
    except ConfigError as err:
        print(err, file=sys.stderr)
        return 2
    except (AdminError, StartupError, VaultError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `... | head` closed our stdout: stop quietly
        _silence_stdout()
        return 141
    except OSError as err:
        where = f"{err.filename}: " if err.filename else ""
        print(f"error: {where}{err.strerror or err}", file=sys.stderr)
        return 1


def _silence_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush cannot fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "init":
        return init.cmd_init(args)
    if args.command == "keys" and args.keys_command == "new":  # before any config exists
        return keys.cmd_keys_new(None, args)
    cfg = load_config(args.config)
    if cfg.cluster.enabled or args.command == "cluster":
        from gateway.cluster import require_driver

        require_driver()
    if args.command == "doctor":
        return doctor.cmd_doctor(cfg, args)
    if args.command == "chat":
        return run.cmd_chat(cfg, args)
    if args.command == "run":
        return run.cmd_run(cfg, args)
    handler = getattr(args, "handler", None)
    if handler is not None:
        setup_logging(cfg, quiet=True)
        return handler(cfg, args)
    raise ConfigError(f"unknown command {args.command}")
