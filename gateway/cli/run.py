"""`run` (every enabled platform, until SIGINT/SIGTERM) and `chat` (the console).

Stopping always stops (docs/operator-guide.md#stopping): from the first signal on, the
process ends within the drain timeout plus `STOP_GRACE_S` whatever is stuck, and a second
signal ends it at once; every store is crash-safe, so what was recorded comes again.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING

from core.settings import Config, ConfigError
from gateway.cli.common import command_name, setup_logging

if TYPE_CHECKING:
    from agent.llm import LLMError
    from core.protocols import Adapter, SendPacer
    from gateway.runtime import GatewayApp


def register_run(sub: argparse._SubParsersAction) -> None:
    sub.add_parser("run", help="run every enabled platform until SIGINT/SIGTERM")


def register_chat(sub: argparse._SubParsersAction) -> None:
    chat = sub.add_parser("chat", help="talk to the agent on the console (works with piped stdin)")
    chat.add_argument("--user", default=os.environ.get("USER", "me"), help="who is speaking (default: $USER)")
    chat.add_argument("--group", default=None, metavar="ROOM", help="speak in a group room instead of a DM")


def cmd_run(cfg: Config, args: argparse.Namespace) -> int:
    setup_logging(cfg)
    if cfg.cluster.enabled:
        return _run_node(cfg)
    return asyncio.run(_run(cfg))


def cmd_chat(cfg: Config, args: argparse.Namespace) -> int:
    if cfg.cluster.enabled:
        raise ConfigError(
            f"{args.config}: cluster.postgres_dsn_env is set; `chat` is single-node only "
            "(use a config without the cluster section for the console)"
        )
    setup_logging(cfg, quiet=True)
    # the conversation is on stdout; retries and warnings would only clutter the terminal
    logging.getLogger().setLevel(logging.ERROR)
    return asyncio.run(_chat(cfg, args.user, args.group, args.config))


def build_adapters(cfg: Config, telegram_flood: SendPacer | None = None) -> list:
    """The adapters of every enabled platform (import errors and missing tokens say so);
    `telegram_flood` is the send pacer the nodes of a cluster share (else the adapter's own)."""
    adapters: list[Adapter] = []
    if cfg.platforms.telegram.enabled:
        from adapters.telegram import TelegramAdapter

        # cluster mode: the node's ingress election decides who polls (or sets the webhook)
        adapters.append(
            TelegramAdapter.from_config(cfg.platforms.telegram, elected=cfg.cluster.enabled, flood_gate=telegram_flood)
        )
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
        # whatever is stuck, and a second signal ends it at once (docs/operator-guide.md#stopping)
        stop.set()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
            signal.signal(sig, _stop_now)
        _exit_after(drain + STOP_GRACE_S)

    for sig in (signal.SIGINT, signal.SIGTERM):  # first: a Ctrl-C while starting stops cleanly too
        loop.add_signal_handler(sig, stopping)
    await _take_early_interrupt(stopping)
    if not (cfg.platforms.telegram.enabled or cfg.platforms.discord.enabled):
        print(
            "No platform is enabled (platforms.telegram.enabled / platforms.discord.enabled). "
            f"Try `{command_name()} chat` for the console.",
            file=sys.stderr,
        )
        return 2
    app: GatewayApp
    if cfg.cluster.enabled:
        from gateway.cluster.build import build_cluster_gateway

        # the adapters are built around the parts the nodes share (the Telegram pacer)
        app = build_cluster_gateway(cfg, adapters_for=partial(build_adapters, cfg))
    else:
        from gateway.build import build_gateway

        app = build_gateway(cfg, build_adapters(cfg))
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


def _stop_now(signum: int, _frame: object) -> None:
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
