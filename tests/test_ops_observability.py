"""Operations: /healthz and /metrics served by the running gateway and parsed, the
`health` command, and structured, redacted logs with turn ids."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import re

import httpx
import pytest

from core.redact import Redactor
from core.settings import parse_listen
from gateway.build import build_gateway
from gateway.cli import main as cli_main
from gateway.logs import JsonFormatter, TextFormatter, configure_logging, redact_commands
from gateway.metrics import ALLOWED_LABELS, Metrics, label_value
from gateway.observability import adapter_state, local_url
from tests.conftest import RecordingAdapter, dm, say
from tests.fakes.llm import error

# ----- a strict parser of the Prometheus text format -----------------------------------------

_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_SAMPLE = re.compile(rf"^({_NAME})(?:\{{(.*)\}})? (-?(?:[0-9.]+(?:e[+-]?[0-9]+)?|\+Inf|-Inf|NaN))$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\\n]|\\.)*)"(?:,|$)')


def parse_prometheus(text: str) -> tuple[dict[str, str], dict[tuple[str, frozenset], float]]:
    """(types by family, samples by (name, labels)); asserts every line is well formed."""
    assert text.endswith("\n")
    types: dict[str, str] = {}
    samples: dict[tuple[str, frozenset], float] = {}
    for line in text.splitlines():
        if line.startswith("# HELP "):
            continue
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            assert kind in ("counter", "gauge", "histogram", "summary", "untyped")
            assert name not in types, f"duplicate TYPE for {name}"
            types[name] = kind
            continue
        m = _SAMPLE.match(line)
        assert m, f"bad sample line: {line!r}"
        name, raw_labels, value = m.groups()
        labels = {}
        if raw_labels:
            consumed = "".join(x.group(0) for x in _LABEL.finditer(raw_labels))
            assert consumed == raw_labels, f"bad labels: {raw_labels!r}"
            labels = dict(_LABEL.findall(raw_labels))
        family = (
            re.sub(r"_(bucket|sum|count)$", "", name) if re.sub(r"_(bucket|sum|count)$", "", name) in types else name
        )
        assert family in types, f"sample {name} before its TYPE line"
        key = (name, frozenset(labels.items()))
        assert key not in samples, f"duplicate sample {line!r}"
        samples[key] = float(value)
    for (name, labels), _ in samples.items():
        if name.endswith("_bucket"):
            assert "le" in dict(labels)
    return types, samples


def value(samples, name: str, **labels) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


class StatusAdapter(RecordingAdapter):
    """A recording adapter that reports its connection like the real adapters do."""

    def __init__(self, platform: str, status: str = "connected") -> None:
        super().__init__(platform)
        self.status = status


async def test_healthz_and_metrics_are_served_and_parse(config_for, fake_llm):
    cfg = config_for(
        observability={"listen": "127.0.0.1:0", "unhealthy_after_s": 0},
        limits={"rate_limit_per_minute": 3},
        delivery={"retry_initial_s": 0.05, "retry_max_s": 0.2},
    )
    tg, dc = RecordingAdapter("telegram"), StatusAdapter("discord")
    app = build_gateway(cfg, [tg, dc])
    await app.start()
    try:
        base = app.observability.url
        for i in range(3):
            await say(app, tg, dm("u-5550001", f"hello {i}", platform="telegram"))
        out = await say(app, tg, dm("u-5550001", "one too many", platform="telegram"))
        assert "faster than I can answer" in out[0]
        await app.drain()
        refused = error(400, {"error": {"message": "not allowed"}})  # finished: the message's own fault
        fake_llm.script(refused, refused)  # the streaming request, then the plain one
        await say(app, dc, dm("u-7770002", "this one fails", platform="discord"))
        await say(app, dc, dm("u-7770002", "/status", platform="discord"))

        async with httpx.AsyncClient(timeout=10) as client:
            resp = await client.get(f"{base}/metrics")
            assert resp.status_code == 200
            assert resp.headers["content-type"].startswith("text/plain; version=0.0.4")
            types, samples = parse_prometheus(resp.text)

            health = await client.get(f"{base}/healthz")
        # --- metrics ---
        assert types["hermes_turns_total"] == "counter"
        assert types["hermes_turn_duration_seconds"] == "histogram"
        assert value(samples, "hermes_turns_total", platform="telegram", kind="turn", outcome="replied") == 3
        assert value(samples, "hermes_turns_total", platform="discord", kind="turn", outcome="llm_error") == 1
        assert value(samples, "hermes_turns_total", platform="discord", kind="command", outcome="replied") == 1
        assert value(samples, "hermes_turn_duration_seconds_count", platform="telegram") == 3
        assert value(samples, "hermes_turn_duration_seconds_bucket", platform="telegram", le="+Inf") == 3
        buckets = sorted(
            (float(dict(labels)["le"]), v)
            for (n, labels), v in samples.items()
            if n == "hermes_turn_duration_seconds_bucket" and dict(labels)["platform"] == "telegram"
        )
        assert [v for _, v in buckets] == sorted(v for _, v in buckets), "buckets must be cumulative"
        assert value(samples, "hermes_llm_errors_total", kind="bad_request") == 1
        assert value(samples, "hermes_llm_requests_total", outcome="ok") == 3
        assert value(samples, "hermes_rate_limit_refusals_total", platform="telegram") == 1
        assert value(samples, "hermes_refusals_total", platform="telegram", kind="rate_limited") == 1
        assert types["hermes_compressions_total"] == "counter"
        assert value(samples, "hermes_open_profiles") == 2
        assert ("hermes_queue_depth", frozenset({("platform", "telegram")})) in samples
        assert ("hermes_queue_depth", frozenset({("platform", "discord")})) in samples
        assert value(samples, "hermes_adapter_connected", platform="discord") == 1
        assert ("hermes_adapter_connected", frozenset({("platform", "telegram")})) not in samples  # unknown
        # labels never carry user or chat ids
        for (name, labels), _ in samples.items():
            assert {k for k, _ in labels} <= ALLOWED_LABELS | {"le"}, name
        for secret_id in ("5550001", "7770002", "u-555", "dm-u"):
            assert secret_id not in resp.text
        # --- health ---
        assert health.status_code == 200  # a refused conversation says nothing about the model's health
        fake_llm.set_api_key("sk-nobody-has")  # from now on our key is refused: the model is down for us
        await dc.sink(dm("u-7770002", "this one waits", platform="discord"))
        for _ in range(500):  # until the turn was held: the person is told the answer waits
            if any("I'll answer as soon as it is back" in t for t in dc.texts()):
                break
            await asyncio.sleep(0.02)
        async with httpx.AsyncClient(timeout=10) as client:
            health = await client.get(f"{base}/healthz")
        assert health.status_code == 503  # the last LLM call failed with a bad key
        body = health.json()
        assert body["checks"]["llm"]["reachable"] is False
        assert body["checks"]["data_dir"]["writable"] is True
        assert body["checks"]["adapters"]["discord"] == {"ok": True, "connected": True, "status": "connected"}
        assert body["checks"]["adapters"]["telegram"]["status"] == "unknown"

        fake_llm.set_api_key(None)  # the key works again: the held message is answered
        assert await app.drain(20)
        assert dc.texts()[-1].endswith("this one waits")  # (with the refused one before it, kept in history)
        await say(app, dc, dm("u-7770002", "works again", platform="discord"))
        async with httpx.AsyncClient(timeout=10) as client:
            health = await client.get(f"{base}/healthz")
            assert health.status_code == 200, health.text
            assert health.json()["status"] == "ok"
            dc.status = "connecting"
            health = await client.get(f"{base}/healthz")
            assert health.status_code == 503
            assert health.json()["checks"]["adapters"]["discord"]["connected"] is False
            dc.status = "connected"
            # the `health` command (the container's HEALTHCHECK) agrees
            listen = f"127.0.0.1:{app.observability.bound_port}"
            rc = await asyncio.to_thread(cli_main, ["health", "--quiet", "--listen", listen, "-c", "/nonexistent"])
            assert rc == 2  # no config file: refused before asking
    finally:
        await app.stop()


async def test_health_command_exit_status(config_for, fake_llm, tmp_path):
    cfg = config_for(observability={"listen": "127.0.0.1:0"})
    app = build_gateway(cfg, [StatusAdapter("discord")])
    await app.start()
    conf = tmp_path / "hermes.yaml"
    try:
        listen = f"127.0.0.1:{app.observability.bound_port}"
        conf.write_text(
            json.dumps(
                {
                    "data_dir": str(cfg.data_dir),
                    "llm": {"base_url": fake_llm.base_url},
                    "observability": {"listen": listen},
                }
            )
        )
        assert await asyncio.to_thread(cli_main, ["health", "-q", "-c", str(conf)]) == 0
        app.adapters["discord"].status = "failed: bad token"
        assert await asyncio.to_thread(cli_main, ["health", "-q", "-c", str(conf)]) == 1
    finally:
        await app.stop()
    # nothing listening any more
    assert await asyncio.to_thread(cli_main, ["health", "-q", "-c", str(conf)]) == 1


def test_listen_parsing_and_adapter_state():
    assert parse_listen("127.0.0.1:9464") == ("127.0.0.1", 9464)
    assert parse_listen(":9464") == ("0.0.0.0", 9464)
    assert parse_listen("[::1]:9") == ("::1", 9)
    with pytest.raises(ValueError):
        parse_listen("localhost")
    assert local_url("0.0.0.0:9464") == "http://127.0.0.1:9464/healthz"

    class Broken:
        @property
        def status(self):
            raise RuntimeError("boom")

    class Flag:
        is_connected = False

    assert adapter_state(object()) == (None, "unknown")
    assert adapter_state(Flag()) == (False, "disconnected")
    assert adapter_state(Broken())[0] is False
    assert adapter_state(StatusAdapter("x", "connected (3 guilds)"))[0] is True


def test_metric_labels_cannot_carry_ids():
    assert label_value("telegram") == "telegram"
    assert label_value("123456789") == "other"
    assert label_value("dm-alice:1") == "other"
    assert label_value("x" * 40) == "other"
    m = Metrics()
    with pytest.raises(ValueError):
        m.turns.inc(platform="telegram", kind="turn", outcome="ok", user="42")
    from gateway.metrics import Counter

    with pytest.raises(ValueError):
        Counter("bad_total", "h", ["chat_id"])
    m.refused("123456", "rate_limited")
    assert 'platform="other"' in m.render()


# ----- logs ------------------------------------------------------------------------------------


def _record(msg: str, *args, **extra) -> logging.LogRecord:
    rec = logging.LogRecord("hermes.test", logging.INFO, __file__, 1, msg, args, None)
    for k, v in extra.items():
        setattr(rec, k, v)
    return rec


def test_redaction_of_tokens_and_secrets(monkeypatch):
    tg_token = "123456789:AAH" + "x" * 32
    discord_token = "MTA" + "a" * 23 + ".Gabcde." + "b" * 30
    monkeypatch.setenv("MY_LLM_KEY", "s3cret-value-without-pattern")
    from core.settings import parse_config
    from gateway.logs import secrets_from_config

    cfg = parse_config({"llm": {"api_key_env": "MY_LLM_KEY"}})
    red = Redactor(secrets_from_config(cfg))
    text = (
        f"GET https://api.telegram.org/bot{tg_token}/getUpdates Authorization: Bearer abc.def-ghi_123456 "
        f"discord {discord_token} key sk-proj-ABCDEFGHIJKLMNOPQRSTUV and s3cret-value-without-pattern "
        "url?api_key=hunter22hunter"
    )
    out = red(text)
    for secret in (
        tg_token,
        discord_token,
        "abc.def-ghi_123456",
        "sk-proj-ABCDEFGHIJKLMNOPQRSTUV",
        "s3cret-value-without-pattern",
        "hunter22hunter",
    ):
        assert secret not in out, secret
    assert "getUpdates" in out and "Bearer [REDACTED]" in out
    # both formatters redact, including tracebacks
    for formatter in (TextFormatter(red), JsonFormatter(red)):
        try:
            raise RuntimeError(f"token was {tg_token}")
        except RuntimeError:
            import sys

            rec = _record("failed with %s", tg_token)
            rec.exc_info = sys.exc_info()
        line = formatter.format(rec)
        assert tg_token not in line and "[REDACTED]" in line
    assert redact_commands("/link ABCDE-FGHJK") == "/link [code]"
    assert redact_commands("/pair@hermesbot QWERTY12") == "/pair@hermesbot [code]"
    assert redact_commands("hello /link X") == "hello /link X"


def test_json_lines_carry_turn_fields():
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter(Redactor()))
    logger = logging.getLogger("hermes.test.json")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        from gateway.logs import turn_logger

        tlog = turn_logger(logger, turn_id="t1", platform="telegram", tenant="telegram-1")
        logger.setLevel(logging.INFO)
        tlog.info("turn %s in %d ms", "replied", 12, extra={"outcome": "replied"})
    finally:
        logger.removeHandler(handler)
    obj = json.loads(stream.getvalue())
    assert obj["msg"] == "turn replied in 12 ms"
    assert (obj["turn_id"], obj["platform"], obj["tenant"], obj["outcome"]) == (
        "t1",
        "telegram",
        "telegram-1",
        "replied",
    )
    assert obj["level"] == "INFO" and obj["ts"].endswith("Z")


@pytest.mark.parametrize("include_text", [False, True])
async def test_gateway_logs_json_with_ids_and_text_only_when_allowed(config_for, fake_llm, include_text):
    cfg = config_for(
        logging={"format": "json", "include_text": include_text, "level": "INFO"}, limits={"rate_limit_per_minute": 100}
    )
    stream = io.StringIO()
    handler = configure_logging(cfg, stream=stream)
    adapter = RecordingAdapter("telegram")
    app = build_gateway(cfg, [adapter])
    await app.start()
    people = [f"p{i}" for i in range(8)]
    try:
        await asyncio.gather(*(adapter.sink(dm(p, f"private words of {p}", platform="telegram")) for p in people))
        assert await app.drain(30)
        await say(app, adapter, dm("p0", "/link ABCDE-FGHJK", platform="telegram"))
    finally:
        await app.stop()
        logging.getLogger().removeHandler(handler)
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    turns = [r for r in lines if r.get("turn_id") and r["msg"].startswith("turn ")]
    assert len(turns) == len(people)
    assert len({t["turn_id"] for t in turns}) == len(people)
    for t in turns:
        assert t["platform"] == "telegram" and t["tenant"].startswith("telegram-p")
    blob = stream.getvalue()
    assert "ABCDE-FGHJK" not in blob and "ABCDEFGHJK" not in blob  # codes are never logged
    if include_text:
        texts = [r for r in lines if r["msg"].startswith("inbound text: private words")]
        assert len(texts) == len(people)
        for r in texts:  # each text is logged under its own sender's tenant (no crossed ids)
            who = r["msg"].rsplit(" ", 1)[1]
            assert r["tenant"] == f"telegram-{who}"
        assert "/link [code]" in blob
    else:
        assert "private words" not in blob


async def test_compression_outcomes_are_counted(config_for, fake_llm):
    app = build_gateway(config_for(), [RecordingAdapter("telegram")])
    compressor = app.agent.compression
    assert compressor.on_outcome == app.metrics.compression, "the gateway wires compression outcomes to /metrics"
    compressor.on_outcome("ok")
    compressor.on_outcome("fallback")
    _, samples = parse_prometheus(app.metrics.render())
    assert value(samples, "hermes_compressions_total", outcome="ok") == 1
    assert value(samples, "hermes_compressions_total", outcome="fallback") == 1
    await app.stop()
