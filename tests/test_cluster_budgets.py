"""Budgets in cluster mode (docs/cluster.md#budgets): the counts live in PostgreSQL, each
reservation atomic across nodes; the refusal, `budget show|reset` and `profiles delete`
work on them there."""

from __future__ import annotations

import asyncio
import json
import secrets

from agent.ledger import Totals
from gateway.cli import main as cli_main
from gateway.cluster.budgets import PgLedger
from tests.pg import pool, schema, second_pool  # noqa: F401 (fixtures)
from tests.test_cluster_node import DSN_ENV, node_config, post, settled, started, texts, tg  # noqa: F401 (fixtures)

DAY, MONTH = "2026-12-02", "2026-12"
CAP = {"tokens_per_day": 100}


async def test_a_reservation_counts_the_estimate_and_the_settle_replaces_it(pool):  # noqa: F811
    ledger = PgLedger(pool, "telegram-1")
    before, ok = await ledger.reserve("c1", DAY, MONTH, 80, 5, CAP)
    assert ok and before == Totals()
    assert await ledger.totals(DAY, MONTH) == Totals(80, 5, 80, 5)
    await ledger.settle("c1", DAY, MONTH, 30, 2)
    assert await ledger.totals(DAY, MONTH) == Totals(30, 2, 30, 2)
    await ledger.settle("c1", DAY, MONTH, 10, 0)  # settled twice: the estimate is gone, all of it counts
    assert await ledger.totals(DAY, MONTH) == Totals(40, 2, 40, 2)
    assert await PgLedger(pool, "telegram-2").totals(DAY, MONTH) == Totals()  # another tenant's counts
    assert await ledger.mark_once("refused:" + DAY) and not await ledger.mark_once("refused:" + DAY)
    await ledger.reset()
    assert await ledger.totals(DAY, MONTH) == Totals()
    assert await ledger.mark_once("refused:" + DAY)


async def test_two_nodes_never_both_pass_a_cap_with_one_call_left(pool, schema):  # noqa: F811
    other = await second_pool(schema)
    try:
        first, second = PgLedger(pool, "telegram-1"), PgLedger(other, "telegram-1")
        await first.reserve("seed", DAY, MONTH, 90, 0, CAP)  # 10 tokens left under the cap
        results = await asyncio.gather(
            *((first if i % 2 else second).reserve(secrets.token_hex(4), DAY, MONTH, 20, 0, CAP) for i in range(8))
        )
        assert sum(ok for _, ok in results) == 1, results
        assert (await first.totals(DAY, MONTH)).day_tokens == 110
    finally:
        await other.close()


async def test_a_capped_person_is_refused_on_any_node_and_budget_reset_lifts_it(
    node_config,  # noqa: F811
    tg,  # noqa: F811
    fake_llm,
    tmp_path,
    monkeypatch,
    capsys,
):
    sections = {"budgets": {"per_person": CAP}}
    async with started(node_config("n1", **sections)) as one, started(node_config("n2", **sections)) as two:
        assert await post(tg, tg.push_private(777, "hello"), one) == 200
        await settled([one, two])
        assert "ok: hello" in texts(tg, 777)  # with the warning of crossing warn_at
        said = len(texts(tg, 777))
        calls = len(fake_llm.requests)
        assert sum(u["prompt_tokens"] + u["completion_tokens"] for u in fake_llm.usage_sent) >= 100
        assert one.app.node is not None
        async with one.app.node.pool.connection() as conn:
            rows = await (
                await conn.execute("SELECT tenant, period, tokens FROM budget_usage ORDER BY period")
            ).fetchall()
        assert {r["tenant"] for r in rows} == {"telegram-777"} and all(r["tokens"] >= 100 for r in rows)
        assert await post(tg, tg.push_private(777, "again"), two) == 200  # the other node knows
        await settled([one, two])
        assert len(fake_llm.requests) == calls
        assert len(texts(tg, 777)) == said + 1 and "so I can't answer" in texts(tg, 777)[-1]
        conf = tmp_path / "cluster.yaml"
        cfg = one.app.cfg
        conf.write_text(
            json.dumps(
                {
                    "data_dir": str(cfg.data_dir),
                    "llm": {"base_url": cfg.llm.base_url, "model": "fake-model"},
                    "cluster": {"postgres_dsn_env": DSN_ENV, "node_id": "cli"},
                    "budgets": {"per_person": CAP},
                }
            ),
            encoding="utf-8",
        )
        capsys.readouterr()
        assert await asyncio.to_thread(cli_main, ["-c", str(conf), "budget", "show", "telegram:777", "--json"]) == 0
        shown = json.loads(capsys.readouterr().out)
        assert shown["used"]["tokens_today"] == sum(r["tokens"] for r in rows if r["period"].startswith("d:"))
        assert await asyncio.to_thread(cli_main, ["-c", str(conf), "budget", "reset", "telegram:777"]) == 0
        assert await post(tg, tg.push_private(777, "after the reset"), two) == 200
        await settled([one, two])
        assert len(fake_llm.requests) == calls + 1
