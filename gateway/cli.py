"""The `hermes-gateway` command line: run, chat, doctor, init (and the admin commands of gateway/admin.py)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import shutil
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from core.settings import Config, ConfigError, load_config
from gateway.admin import CONFIG_HELP, AdminError
from gateway.faults import StartupError

if TYPE_CHECKING:
    from agent.llm import LLMError
    from core.protocols import Adapter

DEFAULT_CONFIG = "hermes-gateway.yaml"


def setup_logging(cfg: Config | None, *, quiet: bool = False) -> None:
    """stderr logging as `logging.format` says (text or JSON lines), with secrets redacted."""
    from gateway.logs import configure_logging

    configure_logging(cfg, quiet=quiet)


def build_adapters(cfg: Config) -> list:
    """The adapters of every enabled platform (import errors and missing tokens say so)."""
    adapters: list[Adapter] = []
    if cfg.platforms.telegram.enabled:
        from adapters.telegram import TelegramAdapter

        # cluster mode: the node's ingress election decides who polls (or sets the webhook)
        adapters.append(TelegramAdapter.from_config(cfg.platforms.telegram, elected=cfg.cluster.enabled))
    if cfg.platforms.discord.enabled:
        from adapters.discord_bot import DiscordAdapter

        adapters.append(DiscordAdapter.from_config(cfg.platforms.discord, elected=cfg.cluster.enabled))
    return adapters


async def _run(cfg: Config) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    drain = cfg.delivery.drain_timeout_s

    def stopping() -> None:
        # from the first signal on, the process ends within the drain plus STOP_GRACE_S
        # whatever is stuck, and a second signal ends it at once (README "Stopping")
        stop.set()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
            signal.signal(sig, _stop_now)
        _exit_after(drain + STOP_GRACE_S)

    for sig in (signal.SIGINT, signal.SIGTERM):  # first: a Ctrl-C while starting stops cleanly too
        loop.add_signal_handler(sig, stopping)
    await _take_early_interrupt(stopping)
    adapters = build_adapters(cfg)
    if not adapters:
        print(
            "No platform is enabled (platforms.telegram.enabled / platforms.discord.enabled). "
            f"Try `{command_name()} chat` for the console.",
            file=sys.stderr,
        )
        return 2
    if cfg.cluster.enabled:
        from gateway.cluster.build import build_cluster_gateway as build
    else:
        from gateway.build import build_gateway as build
    app = build(cfg, adapters)
    log = logging.getLogger("hermes.gateway")
    await app.start()  # nothing to serve: StartupError (one sentence, see main), all closed again
    states = app.platform_states()
    up = [p for p, (connected, _) in states.items() if connected is not False]
    if up:  # "running" only for what is up; the others say why they are not
        log.info("running: %s", ", ".join(up))
    for platform, (connected, status) in states.items():
        if connected is False and not status.startswith("failed"):
            log.warning("%s: not connected yet (%s); still trying", platform, status)
    stopped = asyncio.ensure_future(stop.wait())
    gone = asyncio.ensure_future(app.wait_nothing_to_serve())
    await asyncio.wait({stopped, gone}, return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    gone.cancel()
    log.info("stopping")
    await app.stop(drain, hint="; Ctrl-C again to stop now")
    if not stop.is_set() and gone.done() and not gone.cancelled():
        print(f"error: {gone.result()}", file=sys.stderr)
        return 1
    return 0


async def _take_early_interrupt(stopping: Callable[[], None]) -> None:
    """A Ctrl-C that came before our handlers made asyncio cancel this task at its next
    await: take that as the first stop signal instead of a traceback."""
    task = asyncio.current_task()
    if task is None or not task.cancelling():
        return
    try:
        await asyncio.sleep(0)
    except asyncio.CancelledError:
        task.uncancel()
        stopping()


STOP_GRACE_S = 5.0  # past the drain timeout, the most a stop may take before the process exits anyway
_UNRECORDED = "what was not recorded stays unacknowledged at the platform and comes again on the next start"


def _stop_now(signum: int, frame: object) -> None:
    """A second SIGINT/SIGTERM while stopping: exit at once (pending messages stay pending)."""
    _hard_exit(130 if signum == signal.SIGINT else 143, f"stopped at once; {_UNRECORDED}.")


def _exit_after(seconds: float) -> None:
    """Exit the process after `seconds` unless it ended by itself: a thread, so neither a
    blocked event loop nor a stuck worker thread can hold the stop up."""
    import threading

    def expire() -> None:
        _hard_exit(1, f"the stop did not finish within {seconds:g} s; exiting now; {_UNRECORDED}.")

    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()


def _hard_exit(code: int, sentence: str) -> None:
    """One line on stderr, then the process ends without waiting for anything: every
    store is crash-safe, so whatever was recorded is found again on the next start."""
    with contextlib.suppress(OSError):
        os.write(2, f"hermes-gateway: {sentence}\n".encode())
    os._exit(code)


def _run_node(cfg: Config) -> int:
    """`run` as a cluster node: a database that cannot be reached is one line, not a traceback."""
    import psycopg

    from gateway.cluster.db import ClusterError, one_line

    try:
        return asyncio.run(_run(cfg))
    except ClusterError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except psycopg.Error as err:
        print(f"error: PostgreSQL: {one_line(err)}", file=sys.stderr)
        return 1


async def _chat(cfg: Config, user: str, room: str | None, config_path: str) -> int:
    from adapters.console import ConsoleAdapter
    from gateway.build import build_gateway
    from gateway.runtime import GatewayApp

    app_box: list[GatewayApp] = []
    explained: list[object] = [None]

    def explain() -> str | None:
        err = app_box[0].llm_monitor.last_error
        if err is None or err is explained[0]:
            return None
        explained[0] = err
        return _explain_llm_error(err, config_path)

    console = ConsoleAdapter(
        user, room, agent_name=cfg.agent_name, after_line=lambda: app_box[0].drain(timeout=None), explain_error=explain
    )
    app = build_gateway(cfg, [console])
    app_box.append(app)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, console.interrupt)
    try:
        if console.interactive:  # before start: the console's prompt is drawn once it starts
            print(_banner(cfg, user, room), flush=True)
        await app.start()
        await console.finished.wait()
    finally:
        # after Ctrl-C do not wait for the reply: the turn is cancelled and its message stays
        # pending in gateway.db, answered the next time the chat (or the gateway) starts
        busy = app.lanes.depth() > 0
        await app.stop(drain_timeout=0 if console.interrupted else 30.0)
    if console.interrupted:
        if busy:
            print(
                "Interrupted; your message is kept and will be answered the next time the chat starts.",
                file=sys.stderr,
                flush=True,
            )
        return 130
    if console.errors and not console.interactive:  # a script must see that something failed
        return 1
    return 0


def _banner(cfg: Config, user: str, room: str | None) -> str:
    where = f"in group room {room!r}" if room else "in a private chat"
    return (
        f"hermes-gateway console: {user} {where} with {cfg.agent_name}\n"
        f"  model {cfg.llm.model} at {cfg.llm.base_url}\n"
        f"  data in {cfg.data_dir}\n"
        f"  /help lists the commands; Ctrl-D or Ctrl-C quits."
    )


def _explain_llm_error(err: LLMError, config_path: str) -> str:
    """For the console, where the operator is the person chatting: what failed, where it
    is configured and how to check it."""
    return (
        f"({err.detail} — llm.base_url and llm.model are in {config_path}; "
        f"check them with `{command_name()} doctor -c {config_path}`)"
    )


def command_name() -> str:
    """How to run this program again from the current directory; it may not be on PATH
    (after `make install` it is `.venv/bin/hermes-gateway`)."""
    candidates = [Path(sys.argv[0])] if Path(sys.argv[0]).name == "hermes-gateway" else []
    candidates.append(Path(sys.prefix) / "bin" / "hermes-gateway")
    on_path = shutil.which("hermes-gateway")
    for exe in candidates:
        if not exe.exists():
            continue
        if on_path and Path(on_path).resolve() == exe.resolve():
            return "hermes-gateway"
        rel = os.path.relpath(exe)
        return rel if not rel.startswith("..") else str(exe)
    return "hermes-gateway"


def cmd_init(args: argparse.Namespace) -> int:
    from gateway.starter import STARTER_CONFIG

    path = Path(args.config)
    if path.is_dir():
        raise ConfigError(f"{path} is a directory; give init the config file to write, e.g. -c {path / DEFAULT_CONFIG}")
    if path.exists() and not args.force:
        print(f"{path} already exists (use --force to overwrite).", file=sys.stderr)
        return 1
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(STARTER_CONFIG, encoding="utf-8")
    cmd = command_name()
    make = " (or `make run`)" if str(path) == DEFAULT_CONFIG and Path("Makefile").is_file() else ""
    print(
        f"Wrote {path}. Edit llm.base_url and llm.model in it, check them with "
        f"`{cmd} doctor -c {path}`, then chat with `{cmd} chat -c {path} --user you`{make}."
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hermes-gateway", description="One LLM agent on Discord and Telegram, one memory per person."
    )
    parser.add_argument(
        "-c", "--config", default=os.environ.get("HERMES_GATEWAY_CONFIG", DEFAULT_CONFIG), help=CONFIG_HELP
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("run", help="run every enabled platform until SIGINT/SIGTERM")
    chat = sub.add_parser("chat", help="talk to the agent on the console (works with piped stdin)")
    chat.add_argument("--user", default=os.environ.get("USER", "me"), help="who is speaking (default: $USER)")
    chat.add_argument("--group", default=None, metavar="ROOM", help="speak in a group room instead of a DM")
    doctor = sub.add_parser("doctor", help="check the config, the data directory, the model and the platforms")
    doctor.add_argument("--deep", action="store_true", help="also run integrity_check on every profile's state.db")
    init = sub.add_parser("init", help="write a commented starter config (parent directories are created)")
    init.add_argument("--force", action="store_true", help="overwrite an existing file")
    for extra in _EXTRA_COMMANDS:
        extra(sub)
    # the global -c may also come after the subcommand
    for p in sub.choices.values():
        p.add_argument("-c", "--config", dest="config", default=argparse.SUPPRESS, help=CONFIG_HELP)
    return parser


def main(argv: list[str] | None = None) -> int:
    """The command line; every failure a person can cause ends in one message and a
    non-zero exit: 2 for a config problem, 1 for a refusal, 130 after Ctrl-C."""
    os.umask(0o077)  # belt and braces: every file the gateway creates is owner-only anyway
    try:
        code = _dispatch(build_parser().parse_args(argv))
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's exit
        return code
    except ConfigError as err:
        print(err, file=sys.stderr)
        return 2
    except (AdminError, StartupError) as err:
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
        return cmd_init(args)
    cfg = load_config(args.config)
    if args.command == "doctor":
        from gateway.doctor import run_doctor

        setup_logging(cfg, quiet=True)
        return asyncio.run(run_doctor(cfg, deep=args.deep))
    if args.command == "chat" and cfg.cluster.enabled:
        raise ConfigError(
            f"{args.config}: cluster.postgres_dsn_env is set; `chat` is single-node only "
            "(use a config without the cluster section for the console)"
        )
    if args.command == "chat":
        setup_logging(cfg, quiet=True)
        # the conversation is on stdout; retries and warnings would only clutter the terminal
        logging.getLogger().setLevel(logging.ERROR)
        return asyncio.run(_chat(cfg, args.user, args.group, args.config))
    if args.command == "run":
        setup_logging(cfg)
        if cfg.cluster.enabled:
            return _run_node(cfg)
        return asyncio.run(_run(cfg))
    handler = getattr(args, "handler", None)
    if handler is not None:
        setup_logging(cfg, quiet=True)
        return handler(cfg, args)
    raise ConfigError(f"unknown command {args.command}")


# Extra subcommands register here (e.g. `profiles`, `backup`): callables taking the
# subparsers object and setting `handler=fn(cfg, args) -> int` on their parser.
_EXTRA_COMMANDS: list = []


def _register_admin(sub) -> None:
    from gateway.admin import register

    register(sub)


_EXTRA_COMMANDS.append(_register_admin)


def _register_cluster(sub) -> None:
    from gateway.cluster.cli import register

    register(sub)


_EXTRA_COMMANDS.append(_register_cluster)

if __name__ == "__main__":
    sys.exit(main())
