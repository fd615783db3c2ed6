"""The kill storm, short: the real `hermes-gateway run` against the fake Telegram, fake
Discord and fake model, SIGKILLed 12 times under steady traffic from 10 people, most kills
aimed at the moment a replayed answer is stored and not yet recorded for delivery. Every
input's answer reaches the platform (the model names the messages it answers), nothing is
answered twice outside the documented Telegram window, nothing out of order, journals equal
SQLite, every database passes integrity_check. (100 cycles: `python -m bench.killstorm`,
figures in BENCHMARKS.md.)"""

from __future__ import annotations

from bench.killstorm import storm


async def test_sigkills_aimed_at_stored_but_unsent_answers_lose_nothing_and_answer_once(tmp_path):
    r = await storm(tmp_path, cycles=12, people=10, seed=7, max_up=1.5, aim=0.8, aim_ms=2, say=lambda _: None)
    assert r.inputs_telegram > 0 and r.inputs_discord > 0
    assert r.aimed_kills > 0, "no kill landed in the answer window"
    assert r.lost == 0, r.details
    assert r.dup_other == 0, r.details
    assert r.dup_window_discord == 0  # the nonce closes the window on Discord
    assert r.order_violations == 0, r.details
    assert r.journal_mismatches == 0 and r.integrity_failures == 0, r.details
