"""Errors more than one layer raises or catches, and the one walk along a cause chain.

`LeaseLost` is importable without psycopg: single-node code catches it around a turn,
the cluster's fenced writes raise it (docs/cluster.md#how-a-node-runs).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from core.lanes import Lane


class LeaseLost(Exception):
    """A write on behalf of a tenant whose lease this node no longer holds: the turn stops,
    the profile closes and nothing is committed."""


class LaneMoved(Exception):
    """A queued job's tenant changed (an account was linked or unlinked) before it ran;
    the job belongs to `lane` now."""

    def __init__(self, lane: Lane) -> None:
        super().__init__(lane.tenant_id)
        self.lane = lane


def cause_chain(exc: BaseException) -> list[BaseException]:
    """`exc` and what caused it (`__cause__`, else `__context__`), outermost first, each once."""
    seen: set[int] = set()
    out: list[BaseException] = []
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        out.append(cur)
        cur = cur.__cause__ or cur.__context__
    return out


def caused_by(exc: BaseException, kind: type[BaseException] | tuple[type[BaseException], ...]) -> bool:
    """Whether `exc` or anything in its cause chain is a `kind`."""
    return any(isinstance(cur, kind) for cur in cause_chain(exc))
