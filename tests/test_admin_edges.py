"""`restore` and `profiles restore` of a file that is not an archive say so in one sentence;
`profiles export -o DIR/` creates the directory and writes the archive into it."""

from __future__ import annotations

import asyncio
import tarfile

import pytest

from gateway.build import build_gateway
from gateway.cli import main as cli_main
from tests.conftest import RecordingAdapter, dm, say
from tests.test_ops_admin import write_config


@pytest.mark.parametrize("command", [["restore"], ["profiles", "restore"]])
@pytest.mark.parametrize("content", [b"just some notes\n", b"\x1f\x8b\x08\x00broken gzip", b""])
def test_restoring_a_file_that_is_not_an_archive_is_one_sentence(config_for, tmp_path, capsys, command, content):
    cfg = config_for()
    conf = write_config(tmp_path / "hermes.yaml", cfg)
    notes = tmp_path / "notes.tar.gz"
    notes.write_bytes(content)
    capsys.readouterr()
    assert cli_main([*command, str(notes), "-c", str(conf)]) == 1  # `restore` goes into the empty data_dir
    err = capsys.readouterr().err
    assert err.strip().count("\n") == 0, err
    assert f"{notes}: not a readable archive" in err and "`profiles export` or `backup`" in err


async def test_export_to_a_new_directory_creates_it(config_for, tmp_path):
    cfg = config_for()
    conf = write_config(tmp_path / "hermes.yaml", cfg)
    adapter = RecordingAdapter("telegram")
    app = build_gateway(cfg, [adapter])
    await app.start()
    try:
        await say(app, adapter, dm("zoe", "hello", platform="telegram"))
    finally:
        await app.stop()
    dest = tmp_path / "exports" / "zoe"
    code = await asyncio.to_thread(cli_main, ["profiles", "export", "telegram:zoe", "-o", f"{dest}/", "-c", str(conf)])
    assert code == 0 and dest.is_dir()
    archives = list(dest.glob("hermes-export-*.tar.gz"))
    assert len(archives) == 1 and tarfile.is_tarfile(archives[0])
