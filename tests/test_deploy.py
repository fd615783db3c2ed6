"""deploy/: the Dockerfile and compose file parse and say what they must (docker itself may
be absent), the example config is valid, and the systemd units pass `systemd-analyze verify`."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from core.settings import load_config
from gateway.cli import main as cli_main

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
DATA_DIR = "/var/lib/hermes-gateway"
CONFIG_PATH = "/etc/hermes-gateway/hermes-gateway.yaml"


def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with comments dropped and continuation lines joined."""
    out: list[tuple[str, str]] = []
    buf = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        word, _, rest = buf.partition(" ")
        assert word.isalpha() and word.isupper(), f"not an instruction: {buf!r}"
        out.append((word, " ".join(rest.split())))
        buf = ""
    assert not buf, "dangling line continuation"
    return out


def test_dockerfile():
    instr = dockerfile_instructions((DEPLOY / "Dockerfile").read_text())
    names = [i for i, _ in instr]
    assert names[0] == "FROM"
    base = instr[0][1]
    assert re.fullmatch(r"python:3\.1[1-9]-slim(-[a-z]+)?", base), base
    known = {
        "FROM",
        "ENV",
        "RUN",
        "WORKDIR",
        "COPY",
        "VOLUME",
        "USER",
        "EXPOSE",
        "HEALTHCHECK",
        "STOPSIGNAL",
        "ENTRYPOINT",
        "CMD",
        "ARG",
        "LABEL",
    }
    assert set(names) <= known, set(names) - known
    users = [a for i, a in instr if i == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0"), "must run as a non-root user"
    assert names.index("USER") > max(j for j, n in enumerate(names) if n == "RUN"), "USER after the last RUN"
    volumes = " ".join(a for i, a in instr if i == "VOLUME")
    assert DATA_DIR in volumes
    health = [a for i, a in instr if i == "HEALTHCHECK"]
    assert len(health) == 1 and "CMD" in health[0] and "hermes-gateway" in health[0] and "health" in health[0]
    env = " ".join(a for i, a in instr if i == "ENV")
    assert f"HERMES_GATEWAY_CONFIG={CONFIG_PATH}" in env
    assert any(i == "ENTRYPOINT" and "hermes-gateway" in a for i, a in instr)
    for i, args in instr:  # every COPY source exists in the build context (the repo root)
        if i == "COPY":
            for src in args.split()[:-1]:
                if not src.startswith("--"):
                    assert (ROOT / src).exists(), f"COPY source {src} missing"
    ignore = (DEPLOY / "Dockerfile.dockerignore").read_text().split()
    assert ".venv" in ignore and ".git" in ignore


def test_healthcheck_command_parses():
    """The image's HEALTHCHECK command line is accepted by the CLI (exit 0/1, not a usage error)."""
    instr = dockerfile_instructions((DEPLOY / "Dockerfile").read_text())
    health = next(a for i, a in instr if i == "HEALTHCHECK")
    argv = re.findall(r'"([^"]+)"', health.split("CMD", 1)[1])
    assert argv[0] == "hermes-gateway"
    rc = cli_main(
        [*argv[1:], "--listen", "127.0.0.1:9", "--timeout", "1", "-c", str(DEPLOY / "hermes-gateway.example.yaml")]
    )
    assert rc == 1  # nothing listens there: unhealthy, not a usage error


def test_compose_file():
    doc = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    svc = doc["services"]["hermes-gateway"]
    build = svc["build"]
    context = (DEPLOY / build["context"]).resolve()
    assert context == ROOT and (context / build["dockerfile"]).is_file()
    assert svc["restart"] in ("unless-stopped", "always", "on-failure")
    volumes = svc["volumes"]
    data = [v for v in volumes if v.split(":")[1] == DATA_DIR]
    assert data and data[0].split(":")[0] in doc["volumes"]
    config = [v for v in volumes if v.split(":")[1] == CONFIG_PATH]
    assert config and config[0].endswith(":ro"), "config must be mounted read-only"
    assert svc["env_file"] and all(not str(f).endswith(".example") for f in svc["env_file"])
    assert svc["healthcheck"]["test"][:3] == ["CMD", "hermes-gateway", "health"]
    assert svc.get("read_only") is True and "ALL" in svc["cap_drop"]
    assert svc["environment"]["HERMES_GATEWAY_CONFIG"] == CONFIG_PATH


def test_cluster_compose_file_runs_three_nodes_on_one_postgres_and_one_data_volume():
    doc = yaml.safe_load((DEPLOY / "compose.cluster.yaml").read_text())
    services = doc["services"]
    pg = services["postgres"]
    assert pg["image"].startswith("postgres:") and pg["healthcheck"]["test"][:2] == ["CMD", "pg_isready"]
    assert any(v.split(":")[0] in doc["volumes"] for v in pg["volumes"])
    assert services["migrate"]["command"] == ["cluster", "migrate"]
    env_example = DEPLOY / "cluster" / "cluster.env.example"
    env_names = set(re.findall(r"^#?\s*([A-Z][A-Z0-9_]+)=", env_example.read_text(), re.M))
    nodes = {name: svc for name, svc in services.items() if name.startswith("hermes-")}
    assert len(nodes) == 3
    configs, ports = {}, set()
    for name, svc in nodes.items():
        assert svc["command"] == ["run"] and svc["restart"] in ("unless-stopped", "always", "on-failure")
        assert svc["depends_on"]["postgres"]["condition"] == "service_healthy"
        assert svc["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
        assert svc["healthcheck"]["test"][:3] == ["CMD", "hermes-gateway", "health"]
        assert svc.get("read_only") is True and "ALL" in svc["cap_drop"]
        assert [f for f in svc["env_file"] if not str(f).endswith(".example")] == svc["env_file"]
        assert (DEPLOY / svc["env_file"][0]).with_suffix(".env.example").name == env_example.name
        data = [v for v in svc["volumes"] if v.split(":")[1] == DATA_DIR]
        assert data == ["hermes-data:" + DATA_DIR], "every node mounts the one shared data volume"
        mount = next(v for v in svc["volumes"] if v.split(":")[1] == CONFIG_PATH)
        assert mount.endswith(":ro") and svc["environment"]["HERMES_GATEWAY_CONFIG"] == CONFIG_PATH
        cfg = load_config(DEPLOY / mount.split(":")[0])
        assert str(cfg.data_dir) == DATA_DIR
        assert cfg.cluster.postgres_dsn_env in env_names and cfg.cluster.node_id
        tg = cfg.platforms.telegram
        assert tg.mode == "webhook" and tg.webhook.listen == "0.0.0.0" and tg.webhook.secret_token_env in env_names
        for key in (cfg.llm.api_key_env, tg.token_env, cfg.platforms.discord.token_env):
            assert key in env_names, key
        assert svc["ports"] == [f"{tg.webhook.port}:{tg.webhook.port}"]
        ports.add(tg.webhook.port)
        configs[name] = cfg
    assert len({c.cluster.node_id for c in configs.values()}) == 3 and len(ports) == 3

    def without_node_fields(cfg):
        data = cfg.model_dump()
        del data["cluster"]["node_id"], data["platforms"]["telegram"]["webhook"]["port"]
        return data

    first, *rest = configs.values()
    assert all(without_node_fields(c) == without_node_fields(first) for c in rest)


def test_example_config_and_env_file_agree():
    cfg = load_config(DEPLOY / "hermes-gateway.example.yaml")
    assert str(cfg.data_dir) == DATA_DIR
    assert cfg.observability.listen and cfg.logging.format == "json" and cfg.logging.include_text is False
    env_names = set(re.findall(r"^#?\s*([A-Z][A-Z0-9_]+)=", (DEPLOY / "hermes-gateway.env.example").read_text(), re.M))
    for name in (cfg.llm.api_key_env, cfg.platforms.telegram.token_env, cfg.platforms.discord.token_env):
        assert name in env_names, name


def unit_settings(path: Path) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    section = ""
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, _, value = line.partition("=")
        out.setdefault(f"{section}.{key}", []).append(value)
    return out


def test_systemd_unit_is_hardened():
    s = unit_settings(DEPLOY / "hermes-gateway.service")
    one = {k: v[-1] for k, v in s.items()}
    assert one["Service.ProtectSystem"] == "strict"
    assert one["Service.User"] not in ("root", "0", "") and one["Service.User"] == one["Service.Group"]
    assert one["Service.Restart"] == "on-failure"
    assert one["Service.EnvironmentFile"].startswith("/etc/hermes-gateway/")
    assert one["Service.ReadWritePaths"].split() == [DATA_DIR]
    assert one["Service.StateDirectory"] == "hermes-gateway"
    assert one["Service.NoNewPrivileges"] == "yes" and one["Service.ProtectHome"] == "yes"
    assert one["Service.CapabilityBoundingSet"] == ""
    assert CONFIG_PATH in one["Service.ExecStart"] and one["Service.ExecStart"].endswith(" run")
    assert one["Install.WantedBy"] == "multi-user.target"
    assert not any("TOKEN" in k or "KEY" in k for k in one)  # no secrets inline
    assert not any(v.startswith(("TELEGRAM", "DISCORD", "OPENAI")) for v in s.get("Service.Environment", []))


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed here")
def test_systemd_units_pass_systemd_analyze_verify(tmp_path):
    stub = tmp_path / "bin" / "hermes-gateway"  # verify checks that ExecStart's binary exists
    stub.parent.mkdir()
    stub.write_text("#!/bin/sh\nexit 0\n")
    stub.chmod(0o755)
    units = ["hermes-gateway.service", "hermes-gateway-backup.service", "hermes-gateway-backup.timer"]
    for name in units:
        text = (DEPLOY / name).read_text().replace("/opt/hermes-gateway/bin/hermes-gateway", str(stub))
        (tmp_path / name).write_text(text)
    env = {**os.environ, "SYSTEMD_LOG_LEVEL": "notice"}
    proc = subprocess.run(
        ["systemd-analyze", "verify", *[str(tmp_path / u) for u in units]],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    for bad in ("Unknown", "ignoring", "Failed", "not executable", "Invalid", "Unsupported"):
        assert bad not in output, output
