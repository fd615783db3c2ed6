"""The layers of docs/development.md#layers that import-linter cannot state: it forbids
only whole external packages, and the agent's LLM transport uses aiohttp's client."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _imports(directory: Path) -> list[tuple[str, str]]:
    """(file, imported module) for every import under `directory`, lazy ones included."""
    out = []
    for path in sorted(directory.rglob("*.py")):
        name = path.name if directory != ROOT / directory.name else str(path.relative_to(ROOT))
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                out += [(name, a.name) for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                out += [(name, node.module)]
                out += [(name, f"{node.module}.{a.name}") for a in node.names]
    return out


def _under(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_the_agent_never_imports_a_web_server_or_a_platform_library():
    bad = [
        (f, m)
        for package in ("core", "agent", "tenancy")
        for f, m in _imports(ROOT / package)
        if any(_under(m, p) for p in ("aiohttp.web", "telegram", "discord", "psycopg"))
    ]
    assert not bad, f"imports below the gateway layer that only the gateway or adapters may make: {bad}"


def test_the_scan_sees_imports_inside_functions(tmp_path):
    (tmp_path / "lazy.py").write_text("def f():\n    from aiohttp import web\n    import discord.http\n")
    found = _imports(tmp_path)
    assert ("lazy.py", "aiohttp.web") in found and ("lazy.py", "discord.http") in found
