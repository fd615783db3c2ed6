"""Fair share (agent/fairshare.py): a gateway-wide bound on model calls, served in turn
across tenants, with no slot lost to a cancelled waiter (docs/concepts.md#fair-share)."""

from __future__ import annotations

import asyncio

from hypothesis import given, settings
from hypothesis import strategies as st

from agent.fairshare import FairShare


async def _hold(fair: FairShare, tenant: str, log: list[str], release: asyncio.Event) -> None:
    async with fair.slot(tenant):
        log.append(tenant)
        await release.wait()


async def test_at_most_max_concurrency_calls_run_at_once():
    fair = FairShare(3)
    running = peak = 0

    async def call(i: int) -> None:
        nonlocal running, peak
        async with fair.slot(f"t{i % 4}"):
            running += 1
            peak = max(peak, running)
            await asyncio.sleep(0.01)
            running -= 1

    await asyncio.gather(*(call(i) for i in range(40)))
    assert peak == 3
    assert fair.active == 0 and fair.waiting == 0


async def test_a_flooder_waits_behind_its_own_calls_not_in_front_of_everyone_elses():
    fair = FairShare(1)
    order: list[str] = []
    gate = asyncio.Event()
    holder = asyncio.create_task(_hold(fair, "flood", order, gate))
    await asyncio.sleep(0)
    floods = [asyncio.create_task(_hold(fair, "flood", order, gate)) for _ in range(10)]
    await asyncio.sleep(0)
    others = [asyncio.create_task(_hold(fair, f"p{i}", order, gate)) for i in range(5)]
    await asyncio.sleep(0)
    gate.set()
    await asyncio.gather(holder, *floods, *others)
    # everyone else comes first (they were never served), in the order they asked
    assert order[:6] == ["flood", "p0", "p1", "p2", "p3", "p4"]
    assert order[6:] == ["flood"] * 10


async def test_waiting_tenants_alternate():
    fair = FairShare(1)
    order: list[str] = []
    gate = asyncio.Event()
    first = asyncio.create_task(_hold(fair, "x", order, gate))
    await asyncio.sleep(0)
    tasks = [asyncio.create_task(_hold(fair, t, order, gate)) for t in ["a"] * 3 + ["b"] * 3]
    await asyncio.sleep(0)
    gate.set()
    await asyncio.gather(first, *tasks)
    assert order == ["x", "a", "b", "a", "b", "a", "b"]


async def test_a_cancelled_waiter_leaks_no_slot():
    fair = FairShare(1)
    gate = asyncio.Event()
    log: list[str] = []
    holder = asyncio.create_task(_hold(fair, "a", log, gate))
    await asyncio.sleep(0)
    queued = asyncio.create_task(_hold(fair, "b", log, gate))
    await asyncio.sleep(0)
    queued.cancel()  # cancelled while waiting
    gate.set()
    await holder
    assert queued.cancelled()
    assert fair.active == 0 and fair.waiting == 0
    # cancelled right after it was handed the slot: the slot goes on
    gate2 = asyncio.Event()
    holder = asyncio.create_task(_hold(fair, "a", log, gate2))
    await asyncio.sleep(0)
    handed = asyncio.create_task(_hold(fair, "b", log, gate2))
    after = asyncio.create_task(_hold(fair, "c", log, gate2))
    await asyncio.sleep(0)
    gate2.set()
    await asyncio.sleep(0)  # the holder releases: "b" is handed the slot but has not run yet
    handed.cancel()
    await asyncio.gather(holder, after, handed, return_exceptions=True)
    assert "c" in log
    assert fair.active == 0 and fair.waiting == 0


@settings(max_examples=60, deadline=None)
@given(
    calls=st.lists(st.tuples(st.sampled_from("abcde"), st.integers(0, 3), st.booleans()), min_size=1, max_size=40),
    slots=st.integers(1, 4),
)
def test_fair_share_property(calls, slots):
    """Any mix of tenants, hold times and cancellations: never more than `slots` at once,
    each tenant's calls start in the order they asked, and nothing is left held."""

    async def scenario() -> None:
        fair = FairShare(slots)
        running = 0
        started: dict[str, list[int]] = {}

        async def call(i: int, tenant: str, ticks: int) -> None:
            nonlocal running
            async with fair.slot(tenant):
                running += 1
                assert running <= slots
                started.setdefault(tenant, []).append(i)
                for _ in range(ticks):
                    await asyncio.sleep(0)
                running -= 1

        tasks = []
        for i, (tenant, ticks, cancel) in enumerate(calls):
            tasks.append((asyncio.create_task(call(i, tenant, ticks)), cancel))
        await asyncio.sleep(0)
        for task, cancel in tasks:
            if cancel:
                task.cancel()
        await asyncio.gather(*(t for t, _ in tasks), return_exceptions=True)
        assert fair.active == 0 and fair.waiting == 0
        assert not fair._running and not fair._last and not fair._queues
        for order in started.values():
            assert order == sorted(order)

    asyncio.run(scenario())
