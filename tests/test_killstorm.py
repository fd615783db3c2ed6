"""The kill storm, short: the real `hermes-gateway run` against the fake Telegram, fake
Discord and fake model, SIGKILLed 10 times at random moments under steady traffic from 20
people. Nothing lost, nothing answered twice outside the documented Telegram window,
nothing out of order, journals equal SQLite, every database passes integrity_check.
(100 cycles: `python -m bench.killstorm`, figures in BENCHMARKS.md.)"""

from __future__ import annotations

from bench.killstorm import storm


async def test_ten_sigkills_under_traffic_lose_nothing_and_answer_once(tmp_path):
    r = await storm(tmp_path, cycles=10, people=20, seed=7, max_up=1.5, say=lambda _: None)
    assert r.inputs_telegram > 0 and r.inputs_discord > 0
    assert r.lost == 0, r.details
    assert r.dup_other == 0, r.details
    assert r.dup_window_discord == 0  # the nonce closes the window on Discord
    assert r.order_violations == 0, r.details
    assert r.journal_mismatches == 0 and r.integrity_failures == 0, r.details
