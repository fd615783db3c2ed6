"""Claim workers: up to `cluster.max_lanes` lanes of the shared inbox run on this node at once.

A worker claims the free lane whose oldest pending message arrived first, takes the lane's
tenant lease (held by another node: the lane is given back and the worker backs off), runs
the lane through the gateway (`run(claim, held)`), and gives the lane back. Workers wait
for a LISTEN/NOTIFY wakeup between claims and poll every `cluster.poll_interval_s` anyway:
a wakeup is only a hint, the claim query is the truth.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable

from core.backoff import backoff_delay
from core.errors import LeaseLost
from gateway.cluster.inbox import Claim, NotClaimed, claim_lane, release_lane
from gateway.cluster.node import ClusterNode, HeldLease, LeaseBusy
from gateway.cluster.wakeups import InboxWakeups

log = logging.getLogger("hermes.cluster")


class LaneStalled(Exception):
    """A claimed lane's message did not finish; the lane is given back and retried later."""


RunClaim = Callable[[Claim, HeldLease], Awaitable[None]]
CLAIM_BATCH = 100  # pending messages read with a claim (more are read as these are done)


class ClaimWorkers:
    def __init__(self, node: ClusterNode, run: RunClaim, *, workers: int, poll_s: float) -> None:
        self.node, self.run, self.workers, self.poll_s = node, run, workers, poll_s
        self._wake = asyncio.Event()
        self._stopping = False
        self._tasks: list[asyncio.Task] = []
        self._listener: asyncio.Task | None = None
        self.running: set[str] = set()  # lanes being run now
        self._unreleased: set[str] = set()  # lanes whose release failed (database down): retried

    def start(self) -> None:
        self._listener = asyncio.create_task(self._listen(), name="cluster-wakeups")
        self._tasks = [asyncio.create_task(self._work(), name=f"claim:{i}") for i in range(self.workers)]

    def kick(self) -> None:
        """Look for work now (e.g. after this node recorded a message)."""
        self._wake.set()

    async def stop(self, timeout: float) -> None:
        """Take no new lane; let the running ones finish (bounded), then cancel them: their
        messages stay pending and another node runs them."""
        self._stopping = True
        self._wake.set()
        if self._tasks:
            _, late = await asyncio.wait(self._tasks, timeout=timeout)
            for task in late:
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._listener is not None:
            self._listener.cancel()
            await asyncio.gather(self._listener, return_exceptions=True)
        self._tasks, self._listener = [], None

    async def _listen(self) -> None:
        while True:
            try:
                async with InboxWakeups(self.node.dsn) as wakeups:
                    while True:
                        if await wakeups.wait(self.poll_s):
                            self._wake.set()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("wakeup listener failed (%s); polling until it reconnects", exc)
                await asyncio.sleep(min(self.poll_s, 2.0))

    async def _idle(self, seconds: float) -> None:
        try:
            await asyncio.wait_for(self._wake.wait(), seconds)
        except TimeoutError:
            pass

    async def _work(self) -> None:
        failures = 0
        while not self._stopping:
            self._wake.clear()  # before the query: a wakeup from now on is not missed
            for lane in list(self._unreleased):
                self._unreleased.discard(lane)
                await self._give_back(lane)
            if self.node.displaced is not None:  # the id's lanes are another process's now
                await self._idle(self.poll_s)
                continue
            try:
                claim = await claim_lane(self.node.pool, self.node.node_id, CLAIM_BATCH)
                failures = 0
            except NotClaimed:  # our node lease lapsed; the heartbeat rejoins
                await self._idle(min(self.poll_s, self.node.ttl / 3))
                continue
            except Exception as exc:
                failures += 1
                delay = backoff_delay(failures + 1, 0.5, 10.0)
                log.error("claiming a lane failed (%s); retrying in %.1f s", exc, delay)
                await asyncio.sleep(delay)
                continue
            if claim is None:
                await self._idle(self.poll_s)
                continue
            await self._run(claim)

    async def _run(self, claim: Claim) -> None:
        node = self.node
        node.metrics.lane_claimed()
        try:
            held = await node.hold(claim.tenant)
        except Exception as exc:
            if not isinstance(exc, LeaseBusy):
                log.error("could not take the lease of tenant %s (%s)", claim.tenant, exc)
            await self._give_back(claim.lane)
            # the lease holder runs the lane (it was woken by the release); others wait a bit
            await asyncio.sleep(random.uniform(0.2, 1.0))
            return
        node.claims[claim.lane] = held
        self.running.add(claim.lane)
        stalled = False
        try:
            await self.run(claim, held)
        except LeaseLost as exc:
            log.warning("lane given up: %s", exc)
        except LaneStalled as exc:
            log.warning("%s; it is run again shortly", exc)
            stalled = True
        except Exception:
            log.exception("running a claimed lane failed; its messages stay pending")
        finally:
            self.running.discard(claim.lane)
            if node.claims.get(claim.lane) is held:
                del node.claims[claim.lane]
            await self._give_back(claim.lane)
            await node.unhold(held)
        if stalled:  # not at once: what failed may need a moment (another node may take it)
            await asyncio.sleep(random.uniform(0.2, 1.0))

    async def _give_back(self, lane: str) -> None:
        try:
            await release_lane(self.node.pool, self.node.node_id, lane)
        except Exception as exc:  # kept until it works: a live node's claim would hold the lane forever
            self._unreleased.add(lane)
            log.warning("could not release a lane (%s); retrying", exc)
