"""Models a tenant chooses (docs/concepts.md#models): the model chosen is the model
requested, at its own endpoint, with its own window and prices; kept in the profile."""

from __future__ import annotations

import re

import pytest
import yaml

from agent.model_choice import FILE, ModelChoice, read_model, write_model
from core.settings import ConfigError, parse_config
from gateway.build import build_gateway
from gateway.cli import main as cli_main
from gateway.observability import Observability
from tenancy.keys import tenant_dir
from tenancy.merge import merge_models
from tests.conftest import RecordingAdapter, dm, group, make_config, say
from tests.fakes.llm import FakeLLM

LIMITS = {"rate_limit_per_minute": 1000}


def offers(other_url: str) -> dict:
    return {
        "models": {
            "big": {"model": "big-model", "context_length": 131072, "price_in_per_mtok": 2000.0},
            "elsewhere": {"model": "far-model", "base_url": other_url},
        }
    }


async def test_the_model_chosen_is_the_model_requested_and_survives_a_restart(tmp_path, fake_llm):
    with FakeLLM() as other:
        cfg = make_config(tmp_path / "data", fake_llm.base_url, llm=offers(other.base_url), limits=LIMITS)
        adapter = RecordingAdapter()
        app = build_gateway(cfg, [adapter])
        await app.start()
        try:
            listed = (await say(app, adapter, dm("ann", "/model")))[0]
            assert "big (big-model)" in listed and "elsewhere (far-model)" in listed
            assert "Current: the default, fake-model." in listed
            assert (await say(app, adapter, dm("ann", "/model big")))[0].startswith("Model set: big (big-model)")
            await say(app, adapter, dm("ann", "hello"))
            assert fake_llm.last_request["model"] == "big-model"
            assert "Model: big-model (big)" in (await say(app, adapter, dm("ann", "/status")))[0]
            usage = (await say(app, adapter, dm("ann", "/usage")))[0]
            assert "of 131,072 tokens" in usage  # the window and threshold follow the model
            await say(app, adapter, dm("bob", "hi"))  # another person keeps the default
            assert fake_llm.last_request["model"] == "fake-model"
            assert "of 32,768 tokens" in (await say(app, adapter, dm("bob", "/usage")))[0]
            assert "no model named 'huge'" in (await say(app, adapter, dm("ann", "/model huge")))[0]
        finally:
            await app.stop()
        adapter = RecordingAdapter()
        app = build_gateway(cfg, [adapter])
        await app.start()
        try:
            await say(app, adapter, dm("ann", "still big?"))
            assert fake_llm.last_request["model"] == "big-model"
            # an offer with its own endpoint is called there, not at llm.base_url
            calls = len(fake_llm.requests)
            await say(app, adapter, dm("ann", "/model elsewhere"))
            assert (await say(app, adapter, dm("ann", "over there")))[0].startswith("ok")
            assert len(fake_llm.requests) == calls and other.last_request["model"] == "far-model"
            await say(app, adapter, dm("ann", "/model default"))
            await say(app, adapter, dm("ann", "home again"))
            assert fake_llm.last_request["model"] == "fake-model"
        finally:
            await app.stop()
        assert not (tenant_dir(cfg.data_dir, "testchat-ann") / FILE).exists()


async def test_a_shared_lanes_model_is_chosen_by_chat_admins_and_a_persons_in_private(tmp_path, fake_llm):
    cfg = make_config(
        tmp_path / "data",
        fake_llm.base_url,
        llm=offers("http://127.0.0.1:9/v1"),
        tenancy={"group_sessions_per_user": False},
        limits=LIMITS,
    )
    adapter = RecordingAdapter()
    adapter.chat_admins.add(("g1", "mod"))
    app = build_gateway(cfg, [adapter])
    await app.start()
    try:
        assert "admins" in (await say(app, adapter, group("g1", "bob", "/model big")))[0]
        await say(app, adapter, group("g1", "bob", "which model?"))
        assert fake_llm.last_request["model"] == "fake-model"
        assert (await say(app, adapter, group("g1", "mod", "/model big")))[0].startswith("Model set: big")
        await say(app, adapter, group("g1", "bob", "and now?"))
        assert fake_llm.last_request["model"] == "big-model"
        await say(app, adapter, dm("bob", "in private"))  # the chat's choice is the chat's
        assert fake_llm.last_request["model"] == "fake-model"
    finally:
        await app.stop()
    cfg = make_config(tmp_path / "data2", fake_llm.base_url, llm=offers("http://127.0.0.1:9/v1"), limits=LIMITS)
    adapter = RecordingAdapter()
    app = build_gateway(cfg, [adapter])
    await app.start()
    try:  # a person's own lane in a group: their model is chosen in private
        assert "private chat" in (await say(app, adapter, group("g2", "ann", "/model big")))[0]
    finally:
        await app.stop()


async def test_usage_is_priced_with_the_chosen_models_prices(tmp_path, fake_llm):
    cfg = make_config(tmp_path / "data", fake_llm.base_url, llm=offers("http://127.0.0.1:9/v1"), limits=LIMITS)
    adapter = RecordingAdapter()
    app = build_gateway(cfg, [adapter])
    await app.start()
    try:
        await say(app, adapter, dm("ann", "/model big"))
        await say(app, adapter, dm("ann", "hello"))
        prompt = sum(u["prompt_tokens"] for u in fake_llm.usage_sent)
        used = prompt + sum(u["completion_tokens"] for u in fake_llm.usage_sent)
        usage = (await say(app, adapter, dm("ann", "/usage")))[0]
        m = re.search(r"Today: ([\d,]+) tokens, \$([\d.,]+)", usage)
        assert m is not None, usage
        assert int(m.group(1).replace(",", "")) == used
        assert abs(float(m.group(2).replace(",", "")) - prompt * 2000.0 / 1e6) < 0.006  # big's price, not none
    finally:
        await app.stop()


def test_the_joining_accounts_model_wins_a_merge(tmp_path):
    target, issuer, joiner = (tmp_path / n for n in ("link", "a", "b"))
    for p in (target, issuer, joiner):
        p.mkdir()
    write_model(target, ModelChoice("big"))
    write_model(issuer, ModelChoice("elsewhere"))
    assert merge_models(target, [issuer, joiner]) == issuer  # the joiner chose nothing
    write_model(joiner, ModelChoice("big"))
    assert merge_models(target, [issuer, joiner]) == joiner
    assert read_model(target) == ModelChoice("big")
    (joiner / FILE).write_text("{not json", encoding="utf-8")  # damaged: as if nothing was chosen
    assert read_model(joiner) == ModelChoice()


def test_an_offer_that_does_not_fit_its_own_window_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"llm\.models\.tiny"):
        parse_config({"llm": {"max_tokens": 4000, "models": {"tiny": {"model": "t", "context_length": 1024}}}})
    with pytest.raises(ConfigError, match=r"llm\.models"):
        parse_config({"llm": {"models": {"default": {"model": "x"}}}})


def test_doctor_checks_every_offered_model(tmp_path, capsys):
    with FakeLLM() as llm:
        path = tmp_path / "gw.yaml"
        path.write_text(
            yaml.safe_dump(
                {
                    "data_dir": str(tmp_path / "d"),
                    "llm": {
                        "base_url": llm.base_url,
                        "models": {"down": {"model": "m", "base_url": "http://127.0.0.1:9/v1"}},
                    },
                }
            )
        )
        assert cli_main(["doctor", "-c", str(path)]) == 1
    out = capsys.readouterr().out
    assert "[ok] model endpoint" in out and "[FAIL] model down: cannot reach http://127.0.0.1:9/v1" in out


async def test_an_offered_model_that_is_down_makes_health_degraded_not_unhealthy(tmp_path, fake_llm):
    cfg = make_config(tmp_path / "data", fake_llm.base_url, llm=offers("http://127.0.0.1:9/v1"), limits=LIMITS)
    app = build_gateway(cfg, [RecordingAdapter()])
    await app.start()
    try:
        healthy, body = await Observability(app.observed(), "127.0.0.1:0").health()
        assert healthy and body["status"] == "degraded"
        assert body["checks"]["models"]["big"]["ok"]
        assert not body["checks"]["models"]["elsewhere"]["ok"]
        assert "127.0.0.1:9" in body["checks"]["models"]["elsewhere"]["detail"]
    finally:
        await app.stop()


async def test_a_link_keeps_the_joining_accounts_model_and_says_so(tmp_path, fake_llm):
    from tests.test_linking import link

    cfg = make_config(tmp_path / "data", fake_llm.base_url, llm=offers("http://127.0.0.1:9/v1"), limits=LIMITS)
    tg, dc = RecordingAdapter("telegram"), RecordingAdapter("discord")
    app = build_gateway(cfg, [tg, dc])
    await app.start()
    try:
        await say(app, tg, dm("111", "/model elsewhere", platform="telegram"))
        await say(app, dc, dm("222", "/model big", platform="discord"))  # the account that enters the code
        await link(app, tg, dc)
        told = [t for t in tg.texts() + dc.texts() if t.startswith("Linked:")]
        assert told and all("Your model is big" in t for t in told), told
        await say(app, tg, dm("111", "after the link", platform="telegram"))
        assert fake_llm.last_request["model"] == "big-model"
    finally:
        await app.stop()
