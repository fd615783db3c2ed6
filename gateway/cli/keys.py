"""`keys new` (print a fresh master key) and `keys rotate` (re-wrap every tenant's data key
under a new master key without rewriting data) (docs/privacy.md#keys)."""

from __future__ import annotations

import argparse
from pathlib import Path

from agent.vault import load_master_key, new_master_key
from core.settings import Config
from gateway.cli.common import CONFIG_HELP, admin_keyring, guard
from gateway.runlock import AdminError, RunLock
from gateway.tenants import scan_profiles


def cmd_keys_new(cfg: Config | None, args: argparse.Namespace) -> int:
    """Print a fresh master key (no config needed: it comes before one)."""
    print(new_master_key())
    return 0


def cmd_keys_rotate(cfg: Config, args: argparse.Namespace) -> int:
    """Every data key re-wrapped and every slot re-sealed under the new master key, the
    gateway stopped (the run lock held); a rotation cut short is finished by running it again."""
    keyring = admin_keyring(cfg)
    if keyring is None:
        raise AdminError("storage.encryption is off: there are no keys to rotate")
    if args.new_key_env is None and args.new_key_file is None:
        raise AdminError("give the new master key with --new-key-env NAME or --new-key-file PATH")
    new = load_master_key(args.new_key_env, Path(args.new_key_file) if args.new_key_file else None)
    if new == keyring.master:
        raise AdminError("the new master key is the one in use; make one with `hermes-gateway keys new`")
    with RunLock(cfg.data_dir).acquire("`keys rotate`"):
        profiles = [(info.tenant_id, info.path) for info in scan_profiles(cfg.data_dir)]
        done = keyring.rotate(new, profiles)
    where = (
        f"storage.master_key_env: {args.new_key_env}"
        if args.new_key_env
        else f"storage.master_key_file: {args.new_key_file}"
    )
    print(
        f"re-wrapped {done} data key{'' if done == 1 else 's'} under the new master key (no data rewritten). "
        f"Now set {where} in the config (or put the new key where the current setting points) before the "
        f"next start: the old master key no longer opens {keyring.directory}"
    )
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add `keys new` and `keys rotate` to the command line."""
    keys = sub.add_parser("keys", help="make a master key, or rotate the master key of an encrypted data directory")
    ksub = keys.add_subparsers(dest="keys_command", required=True)
    p = ksub.add_parser("new", help="print a new random master key (32 random bytes, base64)")
    p.set_defaults(handler=guard(cmd_keys_new))
    p = ksub.add_parser("rotate", help="re-wrap every data key under a new master key (gateway stopped)")
    new = p.add_mutually_exclusive_group()
    new.add_argument("--new-key-env", default=None, metavar="NAME", help="the variable holding the new master key")
    new.add_argument("--new-key-file", default=None, metavar="PATH", help="the file holding the new master key")
    p.set_defaults(handler=guard(cmd_keys_rotate))
    for p in ksub.choices.values():
        p.add_argument("-c", "--config", dest="config", default=argparse.SUPPRESS, help=CONFIG_HELP)
