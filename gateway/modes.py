"""What the single-node runtime needs of cluster mode, as protocols: gateway/cluster/
implements them (gateway/cluster/build.py builds the parts), and no module outside it
imports gateway.cluster or psycopg (docs/development.md#layers).

- `SharedInbox`: the ingress commits a message to the shared inbox instead of gateway.db.
- `StopSignals`: a `/stop` whose lane's turn runs on another node reaches that node.
- `OpenQuestions`: where tool-call confirmations wait for a press (this process on one
  node, gateway/confirmations.py; PostgreSQL in a cluster, so a press on any node counts).
- `Reminders`: the due-time index of reminders and what fires them (gateway.db and this
  process on one node, gateway/reminders.py; PostgreSQL under tenant leases in a cluster).
- `Fencing`: the lane worker tells a turn fenced out by a lost lease, and a database that
  went away, from other failures.
- `StreamedDrafts`: the draft messages a turn's earlier run (on a node that died) left in
  the chat, so the new run edits them instead of starting another draft.
- `ClusterNode`: the runtime starts and stops the node's parts in its own order.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from core.lanes import Lane
from core.messages import ConfirmRequest, ConfirmVerdict, InboundMessage, SentMessage


class SharedInbox(Protocol):
    async def record(self, msg: InboundMessage, lane: Lane | None) -> bool:
        """Commit `msg` on `lane` (None: it cannot be placed; whichever node runs it refuses
        it) once per platform message id, and wake the claim workers; False: known already."""
        ...


class StopSignals(Protocol):
    async def publish(self, lane_key: str, uid: str) -> None:
        """Tell every node: stop the turn of `lane_key` if it runs there, and remember that the
        /stop message `uid` did (docs/cluster.md#stop-and-confirmations-across-nodes). Never
        raises: a signal that is lost leaves the /stop to be answered when its lane runs it."""
        ...


class OpenQuestions(Protocol):
    """The open tool-call questions (docs/concepts.md#tool-confirmations), by token."""

    async def open(self, request: ConfirmRequest, lane: str) -> None:
        """Keep `request`, asked in the turn of lane `lane`, open for a press."""
        ...

    async def decide(self, token: str, user_id: str, allow: bool) -> ConfirmVerdict:
        """A press: "ok" when `user_id` may answer and the question is still open (then it is
        decided, once), "not_yours" for anyone else, "expired" when it is not open."""
        ...

    async def wait(self, token: str, timeout: float, stop: asyncio.Event | None) -> bool | None:
        """The decision (True: allowed) once pressed; None when `timeout` passed or `stop` was
        set first: the question has expired then, and a later press is told so."""
        ...

    async def close(self, token: str) -> None:
        """Forget the question (a press from now on says "expired")."""
        ...


class Reminders(Protocol):
    """Finds due reminders and hands each occurrence to its lane once
    (docs/concepts.md#reminders, docs/cluster.md#reminders)."""

    #: the time due and late are measured against (tests move it forward)
    clock: Callable[[], float]

    async def open(self) -> None:
        """Make the index ready (a single node's gateway.db table)."""
        ...

    def start(self) -> None:
        """Start firing due occurrences."""
        ...

    async def stop(self) -> None:
        """Stop firing; what is due stays due for the next start (or another node)."""
        ...

    async def note(self, tenant_id: str, due: float | None, lower_only: bool) -> None:
        """The tenant's reminders.json changed (`due`: its next due time, None: none left);
        `lower_only`: called before the write, so it may only make the index look earlier."""
        ...

    async def tick(self) -> int:
        """Hand over every due occurrence now; how many were newly recorded."""
        ...


class Fencing(Protocol):
    def database_fault(self, exc: BaseException) -> str | None:
        """The storage fault `exc` is when the shared database is unreachable, else None."""
        ...

    def fenced(self) -> None:
        """A turn stopped because its tenant's lease went (counted on /metrics)."""
        ...


class StreamedDrafts(Protocol):
    async def drafts_of(self, msgs: Sequence[InboundMessage]) -> list[SentMessage]:
        """The draft messages an earlier run of the turn answering `msgs` sent and recorded,
        in order, as outbox handles (docs/cluster.md#streaming-and-progress-notices)."""
        ...


class ClusterNode(Protocol):
    @property
    def displaced(self) -> str | None:
        """Why this process may hold nothing (another process took its node id), else None."""
        ...

    async def join(self) -> None:
        """Join the cluster and bring in the shared state (before anything is replayed)."""
        ...

    async def receive(self) -> None:
        """Start the ingress roles this node is elected for (after the adapters started)."""
        ...

    def run_claims(self) -> None:
        """Start claiming lanes of the shared inbox (last step of the start)."""
        ...

    async def stop_claims(self, timeout: float) -> None:
        """Take no new lane; the running ones finish and deliver within `timeout`."""
        ...

    async def stop_receiving(self) -> None:
        """Give the ingress roles up (another node takes them over at once)."""
        ...

    async def leave(self) -> None:
        """Leave the cluster (after the profiles closed)."""
        ...

    async def health(self) -> tuple[bool, dict[str, Any]]:
        """The cluster part of /healthz."""
        ...
