"""Cluster mode with real processes: three `hermes-gateway run` nodes over one shared data
dir and one PostgreSQL schema (fresh per test, dropped afterwards), the fake Telegram Bot
API delivering webhooks round-robin through the harness's load balancer, the fake Discord
(its shards spread over the nodes by the ingress election), a fake model with random latency. Small versions of `python -m bench.cluster_storm` (2,000 messages from 200
people, figures in BENCHMARKS.md).

The first tests check the harness's own audit on made-up evidence, so that a broken audit
cannot pass a broken cluster. The scenario tests need the local PostgreSQL and a gateway
whose `run` works in cluster mode; without them they skip, saying which is missing.

`test_RESTARTS_POSTGRESQL_…` restarts the one local server, as
tests/test_cluster_pg.py's restart test does: the two must never run at the same time.
pytest runs test files one after the other (this suite does not use pytest-xdist); a
parallel runner would have to keep both in one worker.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

import pytest

from bench.cluster_storm import (
    BASE_DSN,
    BIN,
    Copy,
    Life,
    classify_duplicates,
    cluster_storm,
    find_overlaps,
    parse_ts,
    pg_cluster,
    pg_reachable,
    profile_intervals,
    summary,
)
from bench.storm_audit import order_violations
from tests.fakes.discord_api import FakeDiscord

ROOT = Path(__file__).resolve().parents[1]


# --- the audit itself, on made-up evidence ------------------------------------------------


def _life(tmp_path: Path, node: str, index: int, records: list[dict], **kw) -> Life:
    log = tmp_path / f"{node}.{index}.log"
    log.write_text("\n".join(json.dumps(r) for r in records) + "\nTraceback (most recent call last): not json\n{half")
    return Life(node, index, log, started=kw.pop("started", 0.0), **kw)


def _open(tenant: str, epoch: int, ts: float, node: str) -> dict:
    return {"event": "profile_open", "tenant": tenant, "epoch": epoch, "ts": ts, "node": node}


def _close(tenant: str, epoch: int, ts: float, node: str) -> dict:
    return {"event": "profile_close", "tenant": tenant, "epoch": epoch, "ts": ts, "node": node, "reason": "stop"}


def test_the_audit_finds_a_profile_open_on_two_nodes_at_once(tmp_path):
    a = _life(tmp_path, "n1", 1, [_open("t1", 1, 10.0, "n1"), _close("t1", 1, 20.0, "n1")], ended=30.0)
    b = _life(tmp_path, "n2", 1, [_open("t1", 2, 19.5, "n2"), _close("t1", 2, 25.0, "n2")], ended=30.0)
    intervals, anomalies = profile_intervals([a, b])
    assert anomalies == []
    bad, paused = find_overlaps(intervals, [a, b])
    assert len(bad) == 1 and paused == []
    assert "n1#1 epoch 1" in bad[0] and "n2#1 epoch 2" in bad[0]


def test_a_killed_nodes_profile_counts_as_closed_at_the_kill_and_not_later(tmp_path):
    # n1 opened t1 and was SIGKILLed at 15 (no close record); n2 took over at 18
    a = _life(tmp_path, "n1", 1, [_open("t1", 1, 10.0, "n1")], ended=15.0, killed=True)
    b = _life(tmp_path, "n2", 1, [_open("t1", 2, 18.0, "n2"), _close("t1", 2, 19.0, "n2")], ended=30.0)
    intervals, _ = profile_intervals([a, b])
    assert find_overlaps(intervals, [a, b]) == ([], [])
    assert next(iv for iv in intervals if iv.node == "n1").ended_by == "kill"
    # had the kill come after n2's open, it would be an overlap
    a.ended = 18.5
    intervals, _ = profile_intervals([a, b])
    assert len(find_overlaps(intervals, [a, b])[0]) == 1


def test_an_overlap_with_a_frozen_holder_is_counted_apart(tmp_path):
    a = _life(tmp_path, "n1", 1, [_open("t1", 1, 10.0, "n1"), _close("t1", 1, 26.0, "n1")], ended=40.0)
    a.stops.append((12.0, 25.0))
    b = _life(tmp_path, "n2", 1, [_open("t1", 2, 18.0, "n2"), _close("t1", 2, 30.0, "n2")], ended=40.0)
    intervals, _ = profile_intervals([a, b])
    bad, paused = find_overlaps(intervals, [a, b])
    assert bad == [] and len(paused) == 1 and "frozen 12.000-25.000" in paused[0]
    assert "closed 1.000 s after SIGCONT" in paused[0]
    # another node opening it just after SIGCONT, before the resumed holder got to close it
    c = _life(tmp_path, "n3", 1, [_open("t1", 3, 25.5, "n3"), _close("t1", 3, 27.0, "n3")], ended=40.0)
    intervals, _ = profile_intervals([a, c])
    bad, paused = find_overlaps(intervals, [a, c])
    assert bad == [] and len(paused) == 1
    # a holder that kept it open long after its SIGCONT is not excused by the freeze
    late = _life(tmp_path, "n1", 2, [_open("t1", 1, 10.0, "n1"), _close("t1", 1, 29.0, "n1")], ended=40.0)
    late.stops.append((12.0, 25.0))
    intervals, _ = profile_intervals([late, c])
    assert len(find_overlaps(intervals, [late, c])[0]) == 1
    # the same overlap without a freeze is a violation
    a.stops.clear()
    intervals, _ = profile_intervals([a, c])
    assert len(find_overlaps(intervals, [a, c])[0]) == 1


def test_the_audit_reports_opens_without_close_and_closes_without_open(tmp_path):
    a = _life(tmp_path, "n1", 1, [_open("t1", 1, 1.0, "n1"), _open("t1", 1, 2.0, "n1"), _close("t2", 1, 3.0, "n1")])
    _, anomalies = profile_intervals([a])
    assert any("opened again while open" in x for x in anomalies)
    assert any("t2 closed but never opened" in x for x in anomalies)


def test_log_times_are_read_as_epoch_seconds_or_iso():
    assert parse_ts(1764547200.25) == 1764547200.25
    assert parse_ts("2025-12-01T00:00:00.250Z") == 1764547200.25
    assert parse_ts("yesterday") is None and parse_ts(None) is None


def test_duplicates_are_classified_by_what_separates_the_copies():
    copies = {
        "tk1x0": [Copy("n1-1", 1.0), Copy("n2-1", 3.0)],  # n1's first life killed at 2.0: the send window
        "tk7x0": [Copy("n3-1", 5.2), Copy("n2-1", 8.0)],  # killed at 5.19, the request already on its way
        "tk2x0": [Copy("n2-1", 1.0), Copy("n3-2", 3.0)],  # n2 frozen at 1.5
        "tk3x0": [Copy("n3-2", 10.0), Copy("n1-2", 11.0)],  # PostgreSQL restarting 9.5-10.5
        "tk4x0": [Copy("n1-2", 20.0), Copy("n1-2", 20.5)],  # nothing between: a bug
        "tk6x0": [Copy("n1-2", 40.0), Copy("n2-1", 45.0)],  # a late send from n2 after its pause: a bug too
        "tk5x0": [Copy("n3-2", 5.0)],
        "tk8x0": [Copy("n2-1", 50.0), Copy("n1-2", 70.0)],  # n2's life killed 15 s after it sent: no excuse
    }
    kills = {"n1-1": 2.0, "n3-1": 5.19, "n2-1": 65.0}
    d = classify_duplicates(copies, kills, {"n2-1": [1.5, 38.0]}, [(9.5, 10.5)])
    assert (d.window_kill, d.window_pause, d.window_pg, d.other) == (2, 1, 1, 3)
    assert d.window_ms == [1000.0, 0.0]
    assert any("tk4x0 by n1-2 then n1-2" in x for x in d.details)
    assert any("tk6x0 by n1-2 then n2-1" in x and "n2-1 had been frozen (SIGSTOP) 7.0 s before" in x for x in d.details)


def test_a_kill_of_another_process_does_not_excuse_a_duplicate():
    copies = {"tk1x0": [Copy("n1-2", 1.0), Copy("n2-1", 3.0)]}
    d = classify_duplicates(copies, {"n2-1": 2.0, "n1-1": 0.5}, {}, [])  # n1's earlier life is not the sender
    assert d.other == 1 and d.window_kill == 0
    assert Copy("n1-2", 0.0).node == "n1"


def test_order_is_per_person_and_chat():
    pushed = {
        "tk1x0": ("tg", "tg:1", "1", 0),
        "tk2x1": ("tg", "tg:1", "1", 1),
        "tk3x0": ("tg", "tg:-5", "2", 0),
    }
    assert order_violations(["tk3x0", "tk1x0", "tk2x1"], pushed)[0] == 0
    bad, details = order_violations(["tk2x1", "tk1x0", "tk1x0"], pushed)
    assert bad == 1 and "('tg:1', '1') answered [1, 0]" in details[0]


async def _identify(fake: FakeDiscord, label: str, shard: int):
    import aiohttp

    session = aiohttp.ClientSession()
    ws = await session.ws_connect(fake.gateway_url_for(label))
    await ws.receive_json()  # HELLO
    await ws.send_json({"op": 2, "d": {"token": fake.token, "intents": 0, "properties": {}, "shard": [shard, 2]}})
    assert (await ws.receive_json())["t"] == "READY"
    return session, ws


async def test_the_fake_discord_records_a_shard_taken_over_while_another_node_held_it():
    async with FakeDiscord() as fake:
        s1, ws1 = await _identify(fake, "n1-1", 1)
        s2, ws2 = await _identify(fake, "n2-1", 1)  # n1-1 still connected: two receivers at once
        await ws1.close()
        await s1.close()
        await ws2.close()
        await s2.close()
        s3, ws3 = await _identify(fake, "n3-1", 1)  # after n2-1 closed: a clean hand-over
        await ws3.close()
        await s3.close()
    first, second, third = fake.shard_sessions
    assert (first["via"], first["shard"], first.get("preempted_by")) == ("n1-1", 1, "n2-1")
    assert second["via"] == "n2-1" and "preempted_by" not in second and second["end"] is not None
    assert third["via"] == "n3-1" and "preempted_by" not in third


# --- the scenarios, with real processes ------------------------------------------------------


def _cluster_runtime_missing() -> str | None:
    why = pg_reachable()
    if why is not None:
        if os.environ.get("CI"):
            raise RuntimeError(f"CI is set but PostgreSQL at {BASE_DSN} is unreachable: {why}")
        return f"PostgreSQL at {BASE_DSN} is unreachable ({why})"
    with tempfile.TemporaryDirectory() as tmp:  # does `run` take a cluster config? (the DSN is unset: it stops)
        cfg = Path(tmp) / "probe.yaml"
        cfg.write_text(f"data_dir: {tmp}/data\ncluster:\n  postgres_dsn_env: HERMES_PROBE_UNSET_DSN\n")
        env = {k: v for k, v in os.environ.items() if k != "HERMES_PROBE_UNSET_DSN"}
        try:
            out = subprocess.run([str(BIN), "-c", str(cfg), "run"], capture_output=True, text=True, timeout=30, env=env)
        except subprocess.TimeoutExpired:
            return None
    if "cluster mode is not available" in out.stderr:
        return "`hermes-gateway run` still refuses cluster configs (the cluster run loop is missing)"
    return None


_missing = _cluster_runtime_missing()
needs_cluster = pytest.mark.skipif(_missing is not None, reason=_missing or "")
# 20-45 s each alone; the whole suite on two cores runs them several times slower, and a
# storm's own waits (nodes up, settling, stopping) add up: the global 120 s is too little
STORM_TIMEOUT_S = 480


def _quiet(_: str) -> None:
    pass


@pytest.mark.slow
@pytest.mark.timeout(STORM_TIMEOUT_S)
@needs_cluster
async def test_three_nodes_under_sigkills_answer_every_message_once_in_order(tmp_path):
    r = await cluster_storm(
        tmp_path,
        messages=200,
        people=20,
        seed=5,
        interval=0.04,
        kill_every=(2.0, 3.0),
        down_for=(3.0, 4.0),  # past the lease: a killed node's Discord shard goes to another node
        lease_ttl_s=3.0,
        discord_share=0.2,
        shards=3,
        say=_quiet,
    )
    assert r.kills >= 2, r
    assert r.lost == 0 and r.ingress_failed == 0, r.details
    assert r.dup_other == 0, r.details
    assert r.order_violations == 0, r.details
    assert r.journal_mismatches == 0 and r.integrity_failures == 0, r.details
    assert r.audit_records > 0, "no profile_open/profile_close records in the nodes' logs"
    assert r.overlaps == 0, r.details
    assert not r.nodes_crashed, r.nodes_crashed
    assert len([n for n, count in r.answers_by_node.items() if count]) >= 2  # the work was spread
    # Discord: what a node took in is answered once (the nonce closes the send window), each
    # shard on one node at a time, a killed node's shards taken over and heard again
    assert r.dc_recorded > 0 and r.dc_lost == 0, r.details
    assert r.dc_dup_other == 0 and r.dc_order_violations == 0, r.details
    assert r.shard_sessions >= 3 and r.shard_preempted == 0, r.details
    assert r.shard_takeovers >= 1 and r.takeovers_unproven == 0, (summary(r), r.details)
    assert len([n for n, count in r.dc_answers_by_node.items() if count]) >= 2


@pytest.mark.slow
@pytest.mark.timeout(STORM_TIMEOUT_S)
@needs_cluster
async def test_streamed_answers_across_sigkills_of_the_streaming_node_arrive_once_and_final(tmp_path):
    r = await cluster_storm(
        tmp_path,
        messages=150,  # ~15 s of traffic: five or six kills, most of them cutting streams
        people=12,
        seed=9,
        interval=0.1,
        kill_every=(2.0, 3.0),
        down_for=(1.0, 2.0),
        lease_ttl_s=3.0,
        discord_share=0.2,
        shards=2,
        streaming=True,
        stream_s=2.5,
        say=_quiet,
    )
    assert r.kills >= 3, r
    assert r.streamed_finals > 0, (summary(r), r.details)  # answers were streamed: drafts replaced by the final
    # a node was SIGKILLed mid-stream and another node finished that answer
    assert r.streams_taken_over >= 1, (summary(r), r.details)
    assert r.finals_lost == 0 and r.finals_doubled == 0, (summary(r), r.details)
    # a draft is left stale only by a node killed in the window after the platform took it
    assert r.stale_drafts == r.stale_drafts_by_killed, (summary(r), r.details)
    assert r.lost == 0 and r.dc_lost == 0 and r.ingress_failed == 0, r.details
    assert r.dup_other == 0 and r.dc_dup_other == 0 and r.order_violations == 0, r.details
    assert r.journal_mismatches == 0 and r.integrity_failures == 0, r.details
    assert r.overlaps == 0, r.details
    assert not r.nodes_crashed, r.nodes_crashed


@pytest.mark.slow
@pytest.mark.timeout(STORM_TIMEOUT_S)
@needs_cluster
async def test_a_node_paused_past_its_lease_is_fenced_out_and_nothing_is_duplicated(tmp_path):
    r = await cluster_storm(
        tmp_path,
        messages=60,
        people=10,
        seed=6,
        interval=0.05,
        kill_every=None,
        pause=True,
        lease_ttl_s=3.0,
        say=_quiet,
    )
    assert r.pauses == 1, r.details
    assert r.lost == 0 and r.ingress_failed == 0, r.details
    assert r.paused_message_answers == 1, r.details  # the held turn: answered once, by another node
    assert r.paused_message_by != [r.paused_node], r.details
    assert r.dup_other == 0 and r.dup_window_pause == 0, r.details
    assert r.paused_turns_fenced >= 1, r.details  # the held turn's late writes were refused: turn stopped
    assert r.overlaps == 0, r.details
    assert r.journal_mismatches == 0 and r.integrity_failures == 0, r.details
    assert not r.nodes_crashed, r.nodes_crashed


@pytest.mark.slow
@pytest.mark.timeout(STORM_TIMEOUT_S)
@needs_cluster
@pytest.mark.skipif(pg_cluster() is None, reason="needs pg_ctlcluster to restart the local PostgreSQL")
async def test_RESTARTS_POSTGRESQL_nodes_wait_reconnect_and_lose_nothing(tmp_path):
    r = await cluster_storm(
        tmp_path,
        messages=90,
        people=12,
        seed=8,
        interval=0.05,
        kill_every=None,
        pg_restart=True,
        lease_ttl_s=3.0,
        say=_quiet,
    )
    assert r.pg_restarts == 1, r.details
    assert r.lost == 0 and r.ingress_failed == 0, r.details
    assert r.dup_other == 0, r.details
    assert r.order_violations == 0, r.details
    assert r.journal_mismatches == 0 and r.integrity_failures == 0, r.details
    assert r.overlaps == 0, r.details
    assert not r.nodes_crashed, r.nodes_crashed  # they waited for the database instead of exiting


@pytest.mark.slow
@pytest.mark.timeout(STORM_TIMEOUT_S)
@needs_cluster
async def test_a_reminder_due_while_its_node_is_killed_is_delivered_once_by_another_node(tmp_path):
    """docs/cluster.md#reminders: reminders set during traffic are each delivered once; the
    node holding one's tenant is SIGKILLed before it is due and another node delivers it, on
    time enough not to say it is late; one found 10 minutes overdue says it is late."""
    r = await cluster_storm(
        tmp_path,
        messages=80,
        people=10,
        seed=9,
        interval=0.05,
        kill_every=None,
        lease_ttl_s=3.0,
        discord_share=0,
        reminders=4,
        reminder_due_s=2.0,
        reminder_takeover=True,
        say=_quiet,
    )
    assert r.kills == 1 and r.takeover_killed, r.details
    assert r.reminders_set == 6 and r.reminders_lost == 0, (summary(r), r.details)
    assert r.reminders_dup_other == 0 and r.reminders_dup_window_kill == 0, r.details
    assert r.takeover_fired_by and all(not v.startswith(r.takeover_killed) for v in r.takeover_fired_by)
    assert len(r.takeover_fired_by) == 1, r.takeover_fired_by  # once
    assert 0 < r.takeover_late_s < 120, r.takeover_late_s  # after the lease lapsed, yet not "late"
    assert r.overdue_said_late and r.reminders_late_wrong == 0 and r.reminders_unrecorded == 0, r.details
    assert r.lost == 0 and r.dup_other == 0 and r.order_violations == 0, r.details
    assert r.overlaps == 0 and r.journal_mismatches == 0 and r.integrity_failures == 0, r.details
    assert not r.nodes_crashed, r.nodes_crashed
