"""The console script's first code: Ctrl-C while the program is still loading ends it with
130 and no traceback (the imports of `gateway.cli` take most of a second)."""

from __future__ import annotations


def main() -> int:
    """Import the command line, then run it (`gateway.cli.main`)."""
    try:
        from gateway.cli import main as cli_main
    except KeyboardInterrupt:
        return 130
    return cli_main()
