"""Property: over random sequences of private chats, group messages, /forget, /memory
share|unshare and `personal_memory_in_groups` changes across several people, no canary ever
reaches an audience that must not see it.

The model is the canary repeater (tests/fakes/llm.py): every canary anywhere in a request
comes back in its reply, so whatever reaches a prompt reaches the chat. `World` is the
running gateway plus an oracle of who may see what; each action does one thing through the
loopback adapter, updates the oracle, and `World.check` asserts on every reply and prompt.

To add an action (e.g. /link): write a frozen dataclass with a `strategy()` classmethod and
an `async run(world)` method, and append it to ACTIONS.
"""

from __future__ import annotations

import asyncio
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.app import GatewayApp
from tests.conftest import RecordingAdapter, dm, group, make_config, say
from tests.fakes.llm import FakeLLM, canaries_in, canary_repeater

PEOPLE = ("ann", "ben", "cat")
GROUPS = ("g1", "g2")
MODES = ("full", "read", "off")

people = st.sampled_from(PEOPLE)
chats = st.sampled_from((None, *GROUPS))  # None: the person's private chat


def _system_text(request: dict) -> str:
    messages = request.get("messages") or []
    return messages[0]["content"] if messages and messages[0].get("role") == "system" else ""


@dataclass
class World:
    """The gateway under test and what each audience may see."""

    data_dir: Path
    llm: FakeLLM
    mode: str = "full"
    app: GatewayApp | None = None
    adapter: RecordingAdapter = field(default_factory=RecordingAdapter)
    # a person's memory entries now: canary -> "private" | "shared" (insertion = file order)
    entries: dict[str, dict[str, str]] = field(default_factory=lambda: {p: {} for p in PEOPLE})
    own: dict[str, set[str]] = field(default_factory=lambda: {p: set() for p in PEOPLE})  # all a person said
    heard: dict[tuple[str, str], set[str]] = field(default_factory=dict)  # (group, person) lane -> canaries in it
    counter: int = 0

    async def start(self) -> None:
        cfg = make_config(self.data_dir, self.llm.base_url, tenancy={"personal_memory_in_groups": self.mode})
        self.app = GatewayApp(cfg, [self.adapter])
        await self.app.start()

    async def stop(self) -> None:
        if self.app is not None:
            await self.app.stop()
            self.app = None

    def canary(self, person: str) -> str:
        self.counter += 1
        return f"CANARY-{person}{self.counter}"

    async def send(self, person: str, chat: str | None, text: str) -> str:
        """Send `text` as `person` in `chat` and check what came back and what the model saw."""
        assert self.app is not None
        n = len(self.llm.requests)
        msg = dm(person, text) if chat is None else group(chat, person, text)
        if chat is not None:
            self.heard.setdefault((chat, person), set()).update(canaries_in(text))
        self.own[person] |= canaries_in(text)
        out = "\n".join(await say(self.app, self.adapter, msg))
        self.check(person, chat, out, self.llm.requests[n:])
        return out

    def shared(self, person: str) -> set[str]:
        return {c for c, v in self.entries[person].items() if v == "shared"}

    def check(self, person: str, chat: str | None, reply: str, requests: list[dict]) -> None:
        if chat is None:
            allowed, prompt_may_hold = self.own[person], set(self.entries[person])
        else:
            loaded = self.shared(person) if self.mode != "off" else set()
            allowed = self.heard.get((chat, person), set()) | loaded
            prompt_may_hold = loaded
        leaked = canaries_in(reply) - allowed
        where = "a private chat" if chat is None else f"group {chat}"
        assert not leaked, f"{sorted(leaked)} reached {person} in {where} (mode {self.mode})"
        for request in requests:
            stale = canaries_in(_system_text(request)) - prompt_may_hold
            assert not stale, f"{sorted(stale)} in {person}'s prompt in {where} (mode {self.mode})"
        if chat is not None:
            self.heard.setdefault((chat, person), set()).update(canaries_in(reply))

    async def number_of(self, person: str, canary: str) -> str | None:
        """The number /memory gives `canary` in `person`'s private chat."""
        listing = await self.send(person, None, "/memory")
        m = re.search(rf"^(\d+)\. \[\w+\] {re.escape(canary)}$", listing, re.MULTILINE)
        return m.group(1) if m else None


# ----- actions --------------------------------------------------------------------------


@dataclass(frozen=True)
class Talk:
    person: str
    chat: str | None

    @classmethod
    def strategy(cls):
        return st.builds(cls, people, chats)

    async def run(self, w: World) -> None:
        await w.send(self.person, self.chat, "what do you know?")


@dataclass(frozen=True)
class Remember:
    """ "remember CANARY-x": private from a private chat, shared from a group lane under full."""

    person: str
    chat: str | None

    @classmethod
    def strategy(cls):
        return st.builds(cls, people, chats)

    async def run(self, w: World) -> None:
        canary = w.canary(self.person)
        await w.send(self.person, self.chat, f"remember {canary}")
        if self.chat is None:
            w.entries[self.person][canary] = "private"
        elif w.mode == "full":
            w.entries[self.person][canary] = "shared"


@dataclass(frozen=True)
class Mark:
    """/memory share N or /memory unshare N on one of the person's entries."""

    person: str
    pick: int
    share: bool

    @classmethod
    def strategy(cls):
        return st.builds(cls, people, st.integers(0, 5), st.booleans())

    async def run(self, w: World) -> None:
        entries = list(w.entries[self.person])
        if not entries:
            await w.send(self.person, None, "/memory share 1")
            return
        canary = entries[self.pick % len(entries)]
        number = await w.number_of(self.person, canary)
        assert number is not None, f"{canary} missing from /memory"
        await w.send(self.person, None, f"/memory {'share' if self.share else 'unshare'} {number}")
        w.entries[self.person][canary] = "shared" if self.share else "private"


@dataclass(frozen=True)
class Forget:
    """/forget all, or /forget N of one entry, in the private chat; or /forget all in a group."""

    person: str
    chat: str | None
    pick: int | None

    @classmethod
    def strategy(cls):
        return st.builds(cls, people, chats, st.none() | st.integers(0, 5))

    async def run(self, w: World) -> None:
        entries = list(w.entries[self.person])
        if self.chat is not None:
            await w.send(self.person, self.chat, "/forget all")
            if w.mode == "full":  # a group lane erases only what the group could see
                for canary in w.shared(self.person):
                    del w.entries[self.person][canary]
        elif self.pick is None or not entries:
            await w.send(self.person, None, "/forget all")
            w.entries[self.person].clear()
        else:
            canary = entries[self.pick % len(entries)]
            number = await w.number_of(self.person, canary)
            assert number is not None
            await w.send(self.person, None, f"/forget {number}")
            del w.entries[self.person][canary]


@dataclass(frozen=True)
class SetMode:
    """The operator changes `tenancy.personal_memory_in_groups` and restarts."""

    mode: str

    @classmethod
    def strategy(cls):
        return st.builds(cls, st.sampled_from(MODES))

    async def run(self, w: World) -> None:
        await w.stop()
        w.mode = self.mode
        await w.start()


@dataclass(frozen=True)
class NewSession:
    person: str
    chat: str | None

    @classmethod
    def strategy(cls):
        return st.builds(cls, people, chats)

    async def run(self, w: World) -> None:
        await w.send(self.person, self.chat, "/new")


ACTIONS: list = [Talk, Remember, Mark, Forget, SetMode, NewSession]


async def _play(actions: list) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        async with FakeLLM() as llm:
            llm.responder = canary_repeater()
            world = World(Path(tmp) / "data", llm)
            await world.start()
            try:
                for action in actions:
                    await action.run(world)
                # finally everyone talks everywhere once more
                for person in PEOPLE:
                    for chat in (None, *GROUPS):
                        await world.send(person, chat, "anything else?")
            finally:
                await world.stop()


@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(st.one_of([a.strategy() for a in ACTIONS]), min_size=1, max_size=18))
def test_no_canary_ever_crosses_its_audience(actions):
    asyncio.run(_play(actions))
