"""What every verb group of the command line shares: the config option, how to name this
program back to the person, logging, and the one-sentence refusal of an operator command."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

from agent.vault import Keyring, load_master_key, open_keyring
from core.settings import Config
from gateway.runlock import AdminError
from tenancy.identity import IdentityLinks

DEFAULT_CONFIG = "hermes-gateway.yaml"
CONFIG_HELP = "config file (default: hermes-gateway.yaml, or $HERMES_GATEWAY_CONFIG)"

Handler = Callable[[Config, argparse.Namespace], int]


def setup_logging(cfg: Config | None, *, quiet: bool = False) -> None:
    """stderr logging as `logging.format` says (text or JSON lines), with secrets redacted."""
    from gateway.logs import configure_logging

    configure_logging(cfg, quiet=quiet)


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


def guard(fn: Handler) -> Handler:
    """An operator command's refusal (`AdminError`) as `error: ...` on stderr, exit status 1."""

    def run(cfg: Config, args: argparse.Namespace) -> int:
        try:
            return fn(cfg, args)
        except AdminError as err:
            print(f"error: {err}", file=sys.stderr)
            return 1

    return run


def admin_links(cfg: Config) -> IdentityLinks:
    """The identity links the admin commands follow: links.json on one node, PostgreSQL in
    cluster mode (where the nodes keep the links made at runtime)."""
    if not cfg.cluster.enabled:
        from gateway.tenants import load_links

        return load_links(cfg)
    # psycopg and gateway/cluster are imported only in cluster mode (docs/cluster.md)
    from gateway.cluster.links import load_shared_links

    return load_shared_links(cfg)


def admin_keyring(cfg: Config) -> Keyring | None:
    """The data directory's keyring for an operator command (None while storage.encryption
    is off); a missing or wrong master key is VaultError, one sentence (docs/privacy.md#keys)."""
    return open_keyring(cfg.data_dir, cfg.storage.encryption, cfg.storage.master_key_env, cfg.storage.master_key_file)


def admin_master_key(cfg: Config) -> bytes | None:
    """The master key the config names, without touching the keyring (restore checks it)."""
    if cfg.storage.encryption == "off":
        return None
    return load_master_key(cfg.storage.master_key_env, cfg.storage.master_key_file)
