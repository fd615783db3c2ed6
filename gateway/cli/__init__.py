"""The `hermes-gateway` command line (docs/operator-guide.md#the-command-line).

One module per verb group: `run` (run, chat), `doctor` (doctor, health), `profiles`
(profiles, backup, restore), `cluster`, `init`; `program` builds the parser and dispatches.
This module stays light: Ctrl-C while the program is still loading (importing the rest
takes most of a second) ends it with 130 and no traceback.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import argparse

__all__ = ["build_parser", "main"]


def main(argv: list[str] | None = None) -> int:
    """The console script `hermes-gateway`: import the command line, then run it."""
    try:
        from gateway.cli.program import run_cli
    except KeyboardInterrupt:
        return 130
    return run_cli(argv)


def build_parser() -> argparse.ArgumentParser:
    """Every verb and option of the command line."""
    from gateway.cli.program import build_parser as build

    return build()
