"""Operations: `profiles list|show|export|delete|restore`, `backup` / `restore` while the
gateway runs, and the one-gateway-per-data-directory lock."""

from __future__ import annotations

import asyncio
import json
import random
import tarfile
from pathlib import Path

import pytest

from agent.sessions import SessionStore
from gateway.backup import backup_data_dir
from gateway.build import build_gateway
from gateway.cli import main as cli_main
from gateway.runlock import AdminError, RunLock, gateway_running
from tenancy.keys import tenant_dir
from tests.conftest import RecordingAdapter, dm, say
from tests.fakes.llm import memory_saving_responder
from tests.statedb import integrity_of

ALICE = "alice-u9f3k2"
SECRET = "alice's vault combination is 31-41-59"


def write_config(path: Path, cfg) -> Path:
    path.write_text(
        json.dumps(
            {
                "data_dir": str(cfg.data_dir),
                "llm": {"base_url": cfg.llm.base_url, "model": "fake-model"},
                "memory": {"provider": cfg.memory.provider},
                "storage": {"fsync": "never"},
            }
        ),
        encoding="utf-8",
    )
    return path


def cli(*args: str) -> int:
    return cli_main(list(args))


def files_containing(root: Path, needles: list[str]) -> list[tuple[str, str]]:
    hits = []
    for path in root.rglob("*"):
        if path.is_file():
            raw = path.read_bytes()
            for needle in needles:
                if needle.encode() in raw:
                    hits.append((str(path.relative_to(root)), needle))
        for needle in needles:
            if needle in path.name:
                hits.append((str(path.relative_to(root)), f"name:{needle}"))
    return hits


async def test_export_delete_leaves_nothing_then_restore_brings_it_back(config_for, fake_llm, tmp_path, capsys):
    fake_llm.responder = memory_saving_responder
    cfg = config_for(memory={"provider": "local"}, limits={"rate_limit_per_minute": 100})
    conf = write_config(tmp_path / "hermes.yaml", cfg)
    data = cfg.data_dir
    adapter = RecordingAdapter("telegram")
    app = build_gateway(cfg, [adapter])
    await app.start()
    try:
        await say(app, adapter, dm(ALICE, f"remember that {SECRET}", platform="telegram"))
        await say(app, adapter, dm(ALICE, "what else is new in the garden", platform="telegram"))
        await say(app, adapter, dm(ALICE, "/export", platform="telegram"))
        await say(app, adapter, dm(ALICE, "/link", platform="telegram"))  # a live link code in gateway.db
        await app.inbox.put(f"paired:telegram:{ALICE}", "1")
        await say(app, adapter, dm("bob", "remember that bob likes tea", platform="telegram"))
        alice_dir = tenant_dir(data, f"telegram-{ALICE}")
        route_before = await app.profiles._open[f"telegram-{ALICE}"].sessions.route(
            f"agent:main:telegram:dm:dm-{ALICE}"
        )

        # export works while the gateway runs
        assert (
            await asyncio.to_thread(
                cli, "profiles", "export", f"telegram:{ALICE}", "-o", str(tmp_path), "-c", str(conf)
            )
            == 0
        )
        archive = next(tmp_path.glob("hermes-export-*.tar.gz"))
        assert archive.stat().st_mode & 0o077 == 0
        # delete does not (the gateway holds the data directory)
        capsys.readouterr()
        assert await asyncio.to_thread(cli, "profiles", "delete", f"telegram-{ALICE}", "--yes", "-c", str(conf)) == 1
        assert "Stop the gateway first" in capsys.readouterr().err
        assert alice_dir.is_dir()
    finally:
        await app.stop()

    with tarfile.open(archive) as tar:
        names = set(tar.getnames())
        manifest = json.load(tar.extractfile("EXPORT.json"))
        dump = tar.extractfile("profile/state.sql").read().decode()
    assert {
        "EXPORT.json",
        "profile/tenant.json",
        "profile/memories/MEMORY.md",
        "profile/state.db",
        "profile/state.sql",
        "profile/provider/notes.jsonl",
    } <= names
    assert any(n.startswith("profile/sessions/") and n.endswith(".jsonl") for n in names)
    assert any(n.startswith("profile/exports/") for n in names)
    assert manifest["tenant_id"] == f"telegram-{ALICE}" and manifest["paired"] == [f"telegram:{ALICE}"]
    assert "garden" in dump and "CREATE TABLE" in dump

    # delete (gateway stopped): nothing of alice's is anywhere under the data directory
    assert cli("profiles", "delete", f"telegram:{ALICE}", "-c", str(conf)) == 1  # no terminal, no --yes
    assert alice_dir.is_dir()
    assert cli("profiles", "delete", f"telegram:{ALICE}", "--yes", "-c", str(conf)) == 0
    leftovers = files_containing(data, [ALICE, SECRET, "31-41-59", "garden"])
    assert leftovers == [], leftovers
    assert "bob likes tea" in (tenant_dir(data, "telegram-bob") / "memories" / "MEMORY.md").read_text()
    for db in data.rglob("*.db"):
        assert integrity_of(db) == "ok", db

    # restore from the archive brings it back, and the conversation goes on where it was
    assert cli("profiles", "restore", str(archive), "-c", str(conf)) == 0
    assert cli("profiles", "restore", str(archive), "-c", str(conf)) == 1  # exists: needs --force
    assert SECRET in (alice_dir / "memories" / "MEMORY.md").read_text()
    async with SessionStore(alice_dir) as store:
        assert await store.route(f"agent:main:telegram:dm:dm-{ALICE}") == route_before
        assert (await store.stats())["messages"] >= 6
    assert (alice_dir / "provider" / "notes.jsonl").exists()
    adapter = RecordingAdapter("telegram")
    app = build_gateway(cfg, [adapter])
    await app.start()
    try:
        assert await app.access.is_allowed(f"telegram:{ALICE}")
        assert await app.inbox.get(f"paired:telegram:{ALICE}") is not None
        mem = await say(app, adapter, dm(ALICE, "/memory", platform="telegram"))
        assert SECRET in mem[0]
    finally:
        await app.stop()


async def test_backup_during_a_burst_is_consistent_and_restores(config_for, fake_llm, tmp_path):
    rng = random.Random(3)

    async def responder(request):
        await asyncio.sleep(rng.random() * 0.02)
        return memory_saving_responder(request)

    fake_llm.responder = responder
    cfg = config_for(limits={"rate_limit_per_minute": 1000, "max_queued_turns": 50})
    adapter = RecordingAdapter("telegram")
    app = build_gateway(cfg, [adapter])
    await app.start()
    people = [f"u{i:02d}" for i in range(12)]
    backups: list[Path] = []
    busy_at_backup: list[int] = []
    try:
        await asyncio.gather(
            *(say(app, adapter, dm(p, f"remember that {p} is here", platform="telegram")) for p in people[:1])
        )

        async def burst():
            for round_ in range(6):
                await asyncio.gather(
                    *(adapter.sink(dm(p, f"message {round_} from {p}", platform="telegram")) for p in people)
                )
                await asyncio.sleep(0.01)

        async def take_backups():
            for _i in range(3):
                await asyncio.sleep(0.05)
                busy_at_backup.append(app.lanes.depth())
                backups.append(await asyncio.to_thread(backup_data_dir, cfg.data_dir, tmp_path / "backups"))

        await asyncio.gather(burst(), take_backups())
        assert await app.drain(60)
    finally:
        await app.stop()

    assert len(backups) == 3
    assert max(busy_at_backup) > 0, "the backups should run while turns are in flight"
    for i, backup in enumerate(backups):
        target = tmp_path / f"restored{i}"
        assert (
            await asyncio.to_thread(
                cli,
                "restore",
                str(backup),
                "-c",
                str(write_config(tmp_path / f"r{i}.yaml", cfg.model_copy(update={"data_dir": target}))),
            )
            == 0
        )
        dbs = sorted(target.rglob("*.db"))
        assert target / "gateway.db" in dbs and len(dbs) >= 2
        for db in dbs:
            assert integrity_of(db) == "ok", db
        total = 0
        for profile in (target / "profiles").iterdir():
            async with SessionStore(profile) as store:  # journals and state.db reconcile cleanly
                total += (await store.stats())["messages"]
                for session in await store.list_sessions():
                    history = await store.history(session["id"], include_inactive=True)
                    assert len(history) == session["message_count"]
        assert total > 0
    # the last backup, restored, runs as a gateway
    restored = tmp_path / "restored2"
    cfg2 = cfg.model_copy(update={"data_dir": restored})
    adapter = RecordingAdapter("telegram")
    app = build_gateway(cfg2, [adapter])
    await app.start()
    try:
        assert await app.drain(60)
        mem = await say(app, adapter, dm("u00", "/memory", platform="telegram"))
        assert "u00 is here" in mem[0]
    finally:
        await app.stop()
    # restore refuses a data directory that isn't empty
    assert cli("restore", str(backups[0]), "-c", str(tmp_path / "r2.yaml")) == 1


async def test_profiles_list_and_show(config_for, fake_llm, tmp_path, capsys):
    fake_llm.responder = memory_saving_responder
    cfg = config_for()
    conf = write_config(tmp_path / "hermes.yaml", cfg)
    adapter = RecordingAdapter("telegram")
    app = build_gateway(cfg, [adapter])
    await app.start()
    try:
        await say(app, adapter, dm("111", "remember that I like maps", platform="telegram"))
        await say(app, adapter, dm("222", "hello", platform="telegram"))
        capsys.readouterr()
        # reads work while the gateway runs
        assert await asyncio.to_thread(cli, "profiles", "list", "--json", "-c", str(conf)) == 0
        rows = {r["tenant"]: r for r in json.loads(capsys.readouterr().out)}
        assert set(rows) == {"telegram-111", "telegram-222"}
        row = rows["telegram-111"]
        assert row["principals"] == ["telegram:111"] and row["sessions"] == 1 and row["messages"] >= 4
        assert row["disk_bytes"] > 0 and row["last_activity"] > 0
        assert await asyncio.to_thread(cli, "profiles", "list", "-c", str(conf)) == 0
        table = capsys.readouterr().out
        assert "TENANT" in table and "telegram-222" in table and "telegram:111" in table
        assert await asyncio.to_thread(cli, "profiles", "show", "telegram:111", "-c", str(conf)) == 0
        shown = capsys.readouterr().out
        assert "telegram-111" in shown and "MEMORY.md 1 entries" in shown and "agent:main:telegram:dm:dm-111" in shown
        assert await asyncio.to_thread(cli, "profiles", "show", "nobody", "-c", str(conf)) == 1
        assert "no profile found" in capsys.readouterr().err
    finally:
        await app.stop()


async def test_one_gateway_per_data_directory(config_for, fake_llm):
    cfg = config_for()
    app = build_gateway(cfg, [RecordingAdapter()])
    await app.start()
    try:
        assert gateway_running(cfg.data_dir)
        second = build_gateway(cfg, [RecordingAdapter()])
        with pytest.raises(AdminError, match="Stop the gateway first"):
            await second.start()
        await second.stop()
    finally:
        await app.stop()
    assert not gateway_running(cfg.data_dir)
    with RunLock(cfg.data_dir):
        assert gateway_running(cfg.data_dir)


async def test_deleting_a_linked_tenant_removes_every_account_trace(config_for, fake_llm, tmp_path):
    from tests.test_linking import link

    fake_llm.responder = memory_saving_responder
    cfg = config_for(limits={"rate_limit_per_minute": 100})
    conf = write_config(tmp_path / "hermes.yaml", cfg)
    tg, dc = RecordingAdapter("telegram"), RecordingAdapter("discord")
    app = build_gateway(cfg, [tg, dc])
    await app.start()
    try:
        await say(app, tg, dm("tg-80417", f"remember that {SECRET}", platform="telegram"))
        await say(app, dc, dm("dc-90521", "remember that the dog is Rex", platform="discord"))
        await link(app, tg, dc, tg_user="tg-80417", dc_user="dc-90521")
        await say(app, dc, dm("dc-90521", "/link", platform="discord"))  # a live code naming the account
        await say(app, tg, dm("other", "remember that other is fine", platform="telegram"))
        tenant = app.links.tenant_for("telegram:tg-80417")
    finally:
        await app.stop()
    archive = tmp_path / "linked.tar.gz"
    assert cli("profiles", "export", tenant, "-o", str(archive), "-c", str(conf)) == 0
    assert cli("profiles", "delete", "discord:dc-90521", "--yes", "-c", str(conf)) == 0
    leftovers = files_containing(cfg.data_dir, ["tg-80417", "dc-90521", tenant, SECRET, "Rex"])
    assert leftovers == [], leftovers
    assert "other is fine" in (tenant_dir(cfg.data_dir, "telegram-other") / "memories" / "MEMORY.md").read_text()
    # the archive brings back the profile and the link of both accounts
    assert cli("profiles", "restore", str(archive), "-c", str(conf)) == 0
    links = json.loads((cfg.data_dir / "links.json").read_text())["links"]
    assert [sorted(v) for v in links.values()] == [["discord:dc-90521", "telegram:tg-80417"]]
    memory = (tenant_dir(cfg.data_dir, tenant) / "memories" / "MEMORY.md").read_text()
    assert SECRET in memory and "Rex" in memory


def _edit_archive(src: Path, dst: Path, edit) -> Path:
    """Rewrite an export archive with `edit(export_json, tenant_json)` applied."""
    import io

    with tarfile.open(src) as tar:
        members = [(m, tar.extractfile(m).read() if m.isfile() else None) for m in tar.getmembers()]
    export = json.loads(next(d for m, d in members if m.name == "EXPORT.json"))
    tenant = json.loads(next(d for m, d in members if m.name == "profile/tenant.json"))
    edit(export, tenant)
    with tarfile.open(dst, "w:gz") as tar:
        for m, data in members:
            if m.name == "EXPORT.json":
                data = json.dumps(export).encode()
            elif m.name == "profile/tenant.json":
                data = json.dumps(tenant).encode()
            if data is not None:
                m.size = len(data)
                tar.addfile(m, io.BytesIO(data))
            else:
                tar.addfile(m)
    return dst


async def test_restore_refuses_foreign_links(config_for, fake_llm, tmp_path, capsys):
    from tests.test_linking import link

    fake_llm.responder = memory_saving_responder
    cfg = config_for(limits={"rate_limit_per_minute": 100})
    conf = write_config(tmp_path / "hermes.yaml", cfg)
    tg, dc = RecordingAdapter("telegram"), RecordingAdapter("discord")
    app = build_gateway(cfg, [tg, dc])
    await app.start()
    try:
        await say(app, tg, dm("victim", f"remember that {SECRET}", platform="telegram"))
        await link(app, tg, dc, tg_user="m-tg", dc_user="m-dc")  # mallory's own two accounts
        tenant = app.links.tenant_for("telegram:m-tg")
    finally:
        await app.stop()
    archive = tmp_path / "mallory.tar.gz"
    assert cli("profiles", "export", tenant, "-o", str(archive), "-c", str(conf)) == 0
    assert cli("profiles", "delete", tenant, "--yes", "-c", str(conf)) == 0

    def add_victim_to_link(export, _tenant):
        export["link"]["principals"].append("telegram:victim")
        export["paired"] = ["telegram:victim"]

    def add_victim_everywhere(export, tenant_json):
        add_victim_to_link(export, tenant_json)
        tenant_json["principals"].append("telegram:victim")

    def rename_link(export, _tenant):
        export["link"]["name"] = "someone-else"

    for edit, why in (
        (add_victim_to_link, "not one of the principals its tenant.json lists"),
        (add_victim_everywhere, "telegram:victim belongs to tenant telegram-victim"),
        (rename_link, "is not tenant"),
    ):
        edited = _edit_archive(archive, tmp_path / f"{edit.__name__}.tar.gz", edit)
        capsys.readouterr()
        assert cli("profiles", "restore", str(edited), "-c", str(conf)) == 1
        err = capsys.readouterr().err
        assert "refusing to restore" in err and why in err and "--force" in err
        assert not tenant_dir(cfg.data_dir, tenant).exists()
        links_file = cfg.data_dir / "links.json"
        assert not links_file.exists() or "victim" not in links_file.read_text()

    # the untouched archive restores; the victim stays alone in her own profile
    assert cli("profiles", "restore", str(archive), "-c", str(conf)) == 0
    links = json.loads((cfg.data_dir / "links.json").read_text())["links"]
    assert [sorted(v) for v in links.values()] == [["discord:m-dc", "telegram:m-tg"]]
    # --force overrides the check (the operator vouches for the archive)
    edited = _edit_archive(archive, tmp_path / "forced.tar.gz", add_victim_everywhere)
    assert cli("profiles", "restore", str(edited), "--force", "-c", str(conf)) == 0
    assert "telegram:victim" in (cfg.data_dir / "links.json").read_text()
