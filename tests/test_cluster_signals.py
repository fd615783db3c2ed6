"""A cluster is the same product as one node: a `/stop` sent through any node stops the turn
on the node that runs it (docs/cluster.md#stop-and-confirmations-across-nodes).

Two in-process nodes on the real PostgreSQL with the real Telegram adapter in webhook mode
against the fake Bot API (a webhook can be posted to either node), and the fake model; the
signal listener is also checked on its own."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import psycopg

from agent.turn import STOPPED_MARKER
from core.backoff import Backoff
from gateway.cluster.signals import APPLICATION_NAME, NodeSignals, StopPublisher, notify
from tests.fakes.llm import hang
from tests.pg import DSN, pool, require_postgres, schema, second_pool  # noqa: F401 (fixtures)
from tests.test_cluster_node import SECRET, Node, cluster, node_config, post, settled, texts, tg  # noqa: F401 (fixtures)
from tests.test_stop_busy import stored

require_postgres()

NOTHING = "There's nothing to stop right now."


def ids() -> tuple[str, str]:
    """Node ids no other test's listener has (the listeners are found by application_name)."""
    tag = uuid.uuid4().hex[:6]
    return f"a-{tag}", f"b-{tag}"


async def until(cond: Any, timeout: float = 15.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"{what} not reached within {timeout} s"
        await asyncio.sleep(0.01)


async def turn_running(nodes: list[Node], asked: int = 1) -> tuple[Node, Node, str, asyncio.Event]:
    """Once a lane's turn waits for the model on some node: (that node, the other node,
    the lane key, the turn's stop event)."""
    found: list[tuple[Node, str, asyncio.Event]] = []

    def look() -> bool:
        for node in nodes:
            for lane in node.app.claims.running:
                stop = node.app.ingress.running.get(lane)
                if stop is not None:
                    found.append((node, lane, stop))
                    return True
        return False

    await until(look, what="a running turn")
    runner, lane, stop = found[0]
    other = next(n for n in nodes if n is not runner)
    return runner, other, lane, stop


def signals(node: Node) -> NodeSignals:
    assert node.app.cluster is not None
    return node.app.cluster.signals  # type: ignore[attr-defined]


async def cut_listeners(node_ids: tuple[str, ...]) -> int:
    """The server ends the signal listeners' connections (as a restart would); how many."""
    names = [f"{APPLICATION_NAME} {n}" for n in node_ids]
    async with await psycopg.AsyncConnection.connect(DSN, autocommit=True) as conn:
        cur = await conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = ANY(%s)", (names,)
        )
        return len(await cur.fetchall())


# --- /stop across nodes -----------------------------------------------------------------------


async def test_a_stop_through_one_node_stops_the_turn_another_node_runs_within_a_second(tg, fake_llm, node_config):  # noqa: F811
    fake_llm.script(hang(60, "too late"))
    async with cluster(node_config, *ids()) as nodes:
        for n in nodes:
            await signals(n).wait_listening(5)
        assert await post(tg, tg.push_private(301, "write me an epic"), nodes[0]) == 200
        runner, other, lane, stop = await turn_running(nodes)
        await until(lambda: len(fake_llm.requests) == 1, what="the model asked")
        started = time.monotonic()
        assert await post(tg, tg.push_private(301, "/stop"), other) == 200
        await until(stop.is_set, timeout=5, what="the turn's stop")
        took = time.monotonic() - started
        assert took < 1.0, f"the stop reached the running node after {took:.2f} s"
        await until(lambda: runner.app.ingress.running.get(lane) is None, timeout=5, what="the turn's end")
        await settled(nodes)
        await asyncio.sleep(0.3)  # nothing more is said
        assert texts(tg, 301) == ["Stopped."]
        cfg = runner.app.cfg
    msgs = await stored(cfg, "telegram-301")
    assert [m.content for m in msgs if m.role == "user"] == ["write me an epic"]
    assert [(m.content, m.meta.get("interrupted")) for m in msgs if m.role == "assistant"] == [(STOPPED_MARKER, True)]
    assert len(fake_llm.requests) == 1


async def test_a_stop_with_nothing_running_anywhere_says_so(tg, fake_llm, node_config):  # noqa: F811
    async with cluster(node_config, *ids()) as nodes:
        for n in nodes:
            await signals(n).wait_listening(5)
        assert await post(tg, tg.push_private(302, "hello"), nodes[0]) == 200
        await settled(nodes)
        assert await post(tg, tg.push_private(302, "/stop"), nodes[1]) == 200
        await settled(nodes)
        await asyncio.sleep(0.3)
        assert texts(tg, 302) == ["ok: hello", NOTHING]


async def test_a_lost_stop_signal_still_gets_a_truthful_answer_and_the_listeners_reconnect(tg, fake_llm, node_config):  # noqa: F811
    fake_llm.script(hang(4, "the full answer"), hang(60, "too late"))
    names = ids()
    async with cluster(node_config, *names) as nodes:
        for n in nodes:
            await signals(n).wait_listening(5)
        assert await post(tg, tg.push_private(303, "tell me"), nodes[0]) == 200
        runner, other, _, stop = await turn_running(nodes)
        assert await cut_listeners(names) == 2
        await until(lambda: not any(signals(n).listening for n in nodes), timeout=5, what="the listeners noticing")
        assert await post(tg, tg.push_private(303, "/stop"), other) == 200
        # nobody listened when the signal was sent: it is lost for certain
        assert not signals(runner).listening, "the listener came back before the /stop: the test proves nothing"
        await settled(nodes)
        assert not stop.is_set()
        assert texts(tg, 303) == ["the full answer", NOTHING]  # the turn ran on; the /stop says so

        # the listeners reconnect by themselves (core/backoff.py) and the next /stop arrives again
        for n in nodes:
            await signals(n).wait_listening(10)
            assert signals(n).reconnects == 1
        assert await post(tg, tg.push_private(303, "and again"), nodes[0]) == 200
        runner, other, _, stop = await turn_running(nodes)
        assert await post(tg, tg.push_private(303, "/stop"), other) == 200
        await until(stop.is_set, timeout=5, what="the turn's stop after the reconnect")
        await settled(nodes)
        assert texts(tg, 303) == ["the full answer", NOTHING, "Stopped."]


async def test_the_listener_ignores_what_it_cannot_read_and_picks_up_again_after_a_lost_connection(pool, schema):  # noqa: F811
    stops: list[tuple[str, str]] = []
    name = f"solo-{uuid.uuid4().hex[:6]}"
    listener = NodeSignals(
        f"{DSN}?options=-csearch_path%3D{schema}",
        name,
        on_stop=lambda lane, uid: stops.append((lane, uid)),
        backoff=Backoff(1.0, 1.0),  # a window long enough to send into while it reconnects
    )
    listener.start()
    try:
        await listener.wait_listening(5)
        await StopPublisher(pool).publish("lane-1", "in-1")
        async with pool.connection() as conn:
            await notify(conn, {"kind": "from-a-newer-node"})
            await conn.execute("SELECT pg_notify('hermes_signals:' || current_schema(), 'not json')")
        await until(lambda: stops == [("lane-1", "in-1")], timeout=5, what="the signals")
        assert await cut_listeners((name,)) == 1
        await until(lambda: not listener.listening, timeout=5, what="the listener noticing")
        await StopPublisher(pool).publish("lane-2", "in-2")  # sent while nobody listens
        await listener.wait_listening(5)
        await StopPublisher(pool).publish("lane-3", "in-3")
        await until(lambda: len(stops) == 2, timeout=5, what="the signal after the reconnect")
        assert stops == [("lane-1", "in-1"), ("lane-3", "in-3")] and listener.reconnects == 1
    finally:
        await listener.stop()
