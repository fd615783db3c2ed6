"""The external memory provider: one instance per tenant, namespaced in its profile."""

from __future__ import annotations

import json

from gateway.build import build_gateway
from tenancy.keys import tenant_dir
from tests.conftest import RecordingAdapter, dm, say
from tests.fakes.llm import memory_saving_responder


async def test_local_provider_is_per_tenant_and_sees_turns_and_memory_writes(config_for, fake_llm):
    fake_llm.responder = memory_saving_responder
    cfg = config_for(memory={"provider": "local"})
    adapter = RecordingAdapter()
    app = build_gateway(cfg, [adapter])
    await app.start()
    try:
        await say(app, adapter, dm("ann", "remember I play the oboe"))
        await say(app, adapter, dm("ben", "hello"))
        async with app.profiles.use("testchat-ann") as ann, app.profiles.use("testchat-ben") as ben:
            assert ann.provider is not ben.provider
            assert ann.provider.namespace == "testchat-ann"
    finally:
        await app.stop()
    ann_notes = (tenant_dir(cfg.data_dir, "testchat-ann") / "provider" / "notes.jsonl").read_text()
    ben_notes = (tenant_dir(cfg.data_dir, "testchat-ben") / "provider" / "notes.jsonl").read_text()
    kinds = [json.loads(line)["kind"] for line in ann_notes.splitlines()]
    assert "memory_write" in kinds and "turn" in kinds
    assert "oboe" in ann_notes and "oboe" not in ben_notes


def test_unknown_provider_is_a_clear_error(config_for):
    import pytest

    from core.settings import ConfigError

    with pytest.raises(ConfigError, match=r"memory\.provider: unknown memory provider 'nope'"):
        config_for(memory={"provider": "nope"})  # refused in the config model, before anything starts
