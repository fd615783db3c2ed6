"""One `Agent` per model the operator offers (docs/concepts.md#models): the default's, built
from the `llm` section, and one for each `llm.models` offer, from the section as the offer
changes it, so a tenant's turns, compression thresholds, summaries and reviews all follow
the model it chose. They share the meter (budgets, fair share) and the token counter."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from agent.turn import Agent

if TYPE_CHECKING:
    from agent.profile import Profile


class Agents:
    def __init__(self, default: Agent, offered: Mapping[str, Agent]) -> None:
        self.default = default
        self.offered = dict(offered)

    def all(self) -> list[Agent]:
        return [self.default, *self.offered.values()]

    def named(self, name: str | None) -> Agent:
        """The offer's agent; the default's for None or a name no longer offered."""
        return self.offered.get(name, self.default) if name is not None else self.default

    async def of(self, profile: Profile) -> Agent:
        """The agent of the model `profile`'s tenant chose."""
        return self.named((await profile.model()).name)


__all__ = ["Agents"]
