"""Property: over random sequences of private chats, group messages, /forget, /memory
share|unshare, `personal_memory_in_groups` changes, /link (issue, redeem, the issuer's
confirm or deny), /unlink, /unlink <account> and link codes pasted into groups, across
several accounts on two platforms (loopback Telegram and Discord), no canary ever reaches
an audience that must not see it.

The model is the canary repeater (tests/fakes/llm.py): every canary anywhere in a request
comes back in its reply, so whatever reaches a prompt reaches the chat. `World` is the
running gateway plus an oracle of who may see what; each action does one thing through the
loopback adapters, updates the oracle, and `World.check` asserts on every reply and prompt.

The oracle's rules (an "account" is one platform account; a "store" is the memory of the
tenant the account maps to: its own, or its link's):
- A private chat of account A may show what A was allowed to see: everything A said or
  was told there (it stays in the history), and every entry of A's store. A confirmed link joins the stores: every account of the link
  may then see everything any of them could (memory and conversations move into the link).
- A group lane of A may show what was said in that lane, and A's store's *shared* entries
  (none under `personal_memory_in_groups: off`). Its system prompt holds only those.
- An entry keeps its visibility through a link's merge (shared stays shared).
- Unlink (docs/operator-guide.md#linking-your-accounts, the unlink table): the departed account starts over with a fresh,
  empty profile, so from then on its model sees nothing of the link: no entry and no
  conversation from before the unlink, and nothing the link writes after it; it may see
  only what it says itself from then on. The remaining accounts keep everything of the
  linked time (including what the departed account said while linked), but nothing the
  departed account says afterwards. If the account joins the link again (confirmed), the
  link's conversations of its lanes are its own again.
- A link code seen in a group is burnt: redeeming it afterwards links nothing.
- Reminders (their text is a canary): one set in a lane may be shown (by `/reminders`, by
  the tool's `list`, by a cancel) in that lane, and in a private chat of any account of the
  store that holds it; never in another lane, chat, thread or account. A link's merge
  joins the stores' reminders; on unlink the departed account's reminders stop (the
  remaining accounts are told which) and it sees none of the link's.

No memory provider is configured here (its recall of group chatter follows its own rules;
tests/test_memory_visibility.py covers it).

To add an action: write a frozen dataclass with a `strategy()` classmethod and an
`async run(world)` method, and append it to ACTIONS.
"""

from __future__ import annotations

import asyncio
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from gateway.build import build_gateway
from gateway.runtime import GatewayApp
from tests.conftest import RecordingAdapter, dm, group, make_config, say
from tests.fakes.llm import (
    FakeLLM,
    canaries_in,
    canary_repeater,
    last_user_text,
    memory_saving_responder,
    tool_call,
)

# (platform, user id): ann and ben have an account on each platform, cat only on Telegram
ACCOUNTS = (("telegram", "ann"), ("discord", "ann"), ("telegram", "ben"), ("discord", "ben"), ("telegram", "cat"))
GROUPS = {"telegram": ("g1", "g2"), "discord": ("chan",)}
MODES = ("full", "read", "off")
CODE_RE = re.compile(r"\b([A-Z2-9]{5}-[A-Z2-9]{5})\b")

Account = tuple[str, str]
accounts = st.sampled_from(ACCOUNTS)
chats = st.none() | st.integers(0, 1)  # None: the account's private chat; n: a group of its platform


def _system_text(request: dict) -> str:
    messages = request.get("messages") or []
    return messages[0]["content"] if messages and messages[0].get("role") == "system" else ""


def _group_of(account: Account, pick: int | None) -> str | None:
    if pick is None:
        return None
    options = GROUPS[account[0]]
    return options[pick % len(options)]


def _name(account: Account) -> str:
    return f"{account[0]}:{account[1]}"


@dataclass
class World:
    """The gateway under test and what each audience may see."""

    data_dir: Path
    llm: FakeLLM
    mode: str = "full"
    app: GatewayApp | None = None
    adapters: dict[str, RecordingAdapter] = field(
        default_factory=lambda: {p: RecordingAdapter(p) for p in ("telegram", "discord")}
    )
    # which store an account's memory is in (its own, or a link's shared by several accounts)
    store_of: dict[Account, str] = field(default_factory=lambda: {a: _name(a) for a in ACCOUNTS})
    # a store's memory entries now: canary -> "private" | "shared" (insertion = file order)
    entries: dict[str, dict[str, str]] = field(default_factory=lambda: {_name(a): {} for a in ACCOUNTS})
    # a store's reminders: canary text -> the account that set it
    reminders: dict[str, dict[str, Account]] = field(default_factory=lambda: {_name(a): {} for a in ACCOUNTS})
    may_see: dict[Account, set[str]] = field(default_factory=lambda: {a: set() for a in ACCOUNTS})
    heard: dict[tuple[str, Account], set[str]] = field(default_factory=dict)  # (group, account) lane
    # group lanes a store's profile still holds of accounts that left it (a rejoin gets them back)
    left_lanes: dict[str, dict[tuple[str | None, Account], set[str]]] = field(default_factory=dict)
    counter: int = 0
    stores: int = 0

    async def start(self) -> None:
        cfg = make_config(
            self.data_dir,
            self.llm.base_url,
            tenancy={"personal_memory_in_groups": self.mode},
            limits={"rate_limit_per_minute": 1000},
        )
        self.app = build_gateway(cfg, list(self.adapters.values()))
        await self.app.start()

    async def stop(self) -> None:
        if self.app is not None:
            await self.app.stop()
            self.app = None

    def canary(self, account: Account) -> str:
        self.counter += 1
        return f"CANARY-{account[1]}{account[0][0]}{self.counter}"

    def store(self, account: Account) -> dict[str, str]:
        return self.entries[self.store_of[account]]

    def members(self, account: Account) -> list[Account]:
        return [a for a in ACCOUNTS if self.store_of[a] == self.store_of[account]]

    async def send(self, account: Account, chat: str | None, text: str) -> list[str]:
        """Send `text` as `account` in `chat`; check what came back and what the model saw."""
        assert self.app is not None
        platform, user = account
        n = len(self.llm.requests)
        msg = dm(user, text, platform=platform) if chat is None else group(chat, user, text, platform=platform)
        if chat is not None:
            self.heard.setdefault((chat, account), set()).update(canaries_in(text))
        else:
            self.may_see[account] |= canaries_in(text)
        adapter = self.adapters[platform]
        before = len(adapter.sent)
        await say(self.app, adapter, msg)
        out = [m.text for m in adapter.sent[before:] if m.chat_id == msg.chat_id]  # not notices to others
        self.check(account, chat, "\n".join(out), self.llm.requests[n:])
        return out

    def shared(self, account: Account) -> set[str]:
        return {c for c, v in self.store(account).items() if v == "shared"}

    def check(self, account: Account, chat: str | None, reply: str, requests: list[dict]) -> None:
        if chat is None:  # a private chat lists every reminder of its store
            allowed = self.may_see[account] | set(self.store(account)) | set(self.reminders[self.store_of[account]])
            prompt_may_hold = set(self.store(account))
        else:
            loaded = self.shared(account) if self.mode != "off" else set()
            allowed = self.heard.get((chat, account), set()) | loaded
            prompt_may_hold = loaded
        leaked = canaries_in(reply) - allowed
        where = "a private chat" if chat is None else f"group {chat}"
        assert not leaked, f"{sorted(leaked)} reached {_name(account)} in {where} (mode {self.mode})"
        for request in requests:
            stale = canaries_in(_system_text(request)) - prompt_may_hold
            assert not stale, f"{sorted(stale)} in {_name(account)}'s prompt in {where} (mode {self.mode})"
        if chat is not None:  # a reply is in the lane's history from now on
            self.heard.setdefault((chat, account), set()).update(canaries_in(reply))
        else:
            self.may_see[account] |= canaries_in(reply)

    async def notices(self, account: Account) -> list[str]:
        """What the gateway sent to `account`'s private chat on its own (link notices)."""
        platform, user = account
        assert self.app is not None
        await self.app.linking.wait_idle(30)
        assert await self.app.drain(30)
        return self.adapters[platform].texts(f"dm-{user}")

    async def number_of(self, account: Account, canary: str) -> str | None:
        """The number /memory gives `canary` in `account`'s private chat."""
        listing = "\n".join(await self.send(account, None, "/memory"))
        m = re.search(rf"^(\d+)\. \[\w+\] {re.escape(canary)}$", listing, re.MULTILINE)
        return m.group(1) if m else None

    def linked(self, account: Account) -> bool:
        """Whether `account` belongs to a link (the last account left in one still does)."""
        return self.store_of[account].startswith("link")

    def join(self, a: Account, b: Account) -> None:
        """Oracle: a confirmed link joins the stores of `a` and `b` (marks kept)."""
        sa, sb = self.store_of[a], self.store_of[b]
        if sa == sb:
            return
        self.stores += 1
        merged = f"link{self.stores}"
        self.entries[merged] = {**self.entries[sa], **self.entries[sb]}
        self.reminders[merged] = {**self.reminders[sa], **self.reminders[sb]}
        everyone = [x for x in ACCOUNTS if self.store_of[x] in (sa, sb)]
        seen = set().union(*(self.may_see[x] for x in everyone))
        lanes = self.left_lanes.pop(sa, {})
        for key, heard in self.left_lanes.pop(sb, {}).items():
            lanes.setdefault(key, set()).update(heard)
        self.left_lanes[merged] = lanes
        for x in everyone:
            self.store_of[x] = merged
            self.may_see[x] = set(seen)
        for (chat, x), heard in lanes.items():
            if x in everyone and chat is None:
                self.may_see[x] |= heard
            elif x in everyone:
                self.heard.setdefault((chat, x), set()).update(heard)

    def leave(self, account: Account) -> None:
        """Oracle: `account` left its link; it starts over with nothing of the link."""
        self.stores += 1
        fresh = f"alone{self.stores}"
        self.entries[fresh] = {}
        self.reminders[fresh] = {}
        kept = self.reminders[self.store_of[account]]
        stopped = {c for c, setter in kept.items() if setter == account}
        for c in stopped:
            del kept[c]
        for x in self.members(account):  # told in their private chats which ones stopped
            if x != account:
                self.may_see[x] |= stopped
        lanes = self.left_lanes.setdefault(self.store_of[account], {})
        lanes.setdefault((None, account), set()).update(self.may_see[account])
        self.store_of[account] = fresh
        self.may_see[account] = set()
        for key in [k for k in self.heard if k[1] == account]:
            lanes.setdefault(key, set()).update(self.heard.pop(key))


# ----- actions --------------------------------------------------------------------------


@dataclass(frozen=True)
class Talk:
    account: Account
    chat: int | None

    @classmethod
    def strategy(cls):
        return st.builds(cls, accounts, chats)

    async def run(self, w: World) -> None:
        await w.send(self.account, _group_of(self.account, self.chat), "what do you know?")


@dataclass(frozen=True)
class Remember:
    """ "remember CANARY-x": private from a private chat, shared from a group lane under full."""

    account: Account
    chat: int | None

    @classmethod
    def strategy(cls):
        return st.builds(cls, accounts, chats)

    async def run(self, w: World) -> None:
        canary = w.canary(self.account)
        chat = _group_of(self.account, self.chat)
        await w.send(self.account, chat, f"remember {canary}")
        if chat is None:
            w.store(self.account)[canary] = "private"
        elif w.mode == "full":
            w.store(self.account)[canary] = "shared"


@dataclass(frozen=True)
class Mark:
    """/memory share N or /memory unshare N on one of the account's entries."""

    account: Account
    pick: int
    share: bool

    @classmethod
    def strategy(cls):
        return st.builds(cls, accounts, st.integers(0, 5), st.booleans())

    async def run(self, w: World) -> None:
        entries = list(w.store(self.account))
        if not entries:
            await w.send(self.account, None, "/memory share 1")
            return
        canary = entries[self.pick % len(entries)]
        number = await w.number_of(self.account, canary)
        assert number is not None, f"{canary} missing from /memory"
        await w.send(self.account, None, f"/memory {'share' if self.share else 'unshare'} {number}")
        w.store(self.account)[canary] = "shared" if self.share else "private"


@dataclass(frozen=True)
class Forget:
    """/forget all, or /forget N of one entry, in the private chat; or /forget all in a group."""

    account: Account
    chat: int | None
    pick: int | None

    @classmethod
    def strategy(cls):
        return st.builds(cls, accounts, chats, st.none() | st.integers(0, 5))

    async def run(self, w: World) -> None:
        entries = list(w.store(self.account))
        chat = _group_of(self.account, self.chat)
        if chat is not None:
            await w.send(self.account, chat, "/forget all")
            if w.mode == "full":  # a group lane erases only what the group could see
                for canary in w.shared(self.account):
                    del w.store(self.account)[canary]
        elif self.pick is None or not entries:
            await w.send(self.account, None, "/forget all")
            w.store(self.account).clear()
        else:
            canary = entries[self.pick % len(entries)]
            number = await w.number_of(self.account, canary)
            assert number is not None
            await w.send(self.account, None, f"/forget {number}")
            del w.store(self.account)[canary]


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
    account: Account
    chat: int | None

    @classmethod
    def strategy(cls):
        return st.builds(cls, accounts, chats)

    async def run(self, w: World) -> None:
        await w.send(self.account, _group_of(self.account, self.chat), "/new")


async def _issue(w: World, issuer: Account) -> str | None:
    out = await w.send(issuer, None, "/link")
    m = CODE_RE.search("\n".join(out))
    if m is None:
        assert "in the last hour" in out[0], out
    return m.group(1) if m else None


@dataclass(frozen=True)
class Link:
    """`issuer` sends /link, `joiner` redeems the code in its private chat, and the issuer
    answers /link confirm (the link is made) or /link deny (nothing changes)."""

    issuer: Account
    joiner: Account
    confirm: bool

    @classmethod
    def strategy(cls):
        return st.builds(cls, accounts, accounts, st.booleans() | st.just(True))

    async def run(self, w: World) -> None:
        if self.issuer == self.joiner:
            return
        code = await _issue(w, self.issuer)
        if code is None:
            return
        out = await w.send(self.joiner, None, f"/link {code}")
        if not out[0].startswith("Code accepted"):
            linked = {self.issuer, self.joiner} <= set(w.members(self.issuer))
            both = w.linked(self.issuer) and w.linked(self.joiner)
            assert linked or both, out
            return
        answer = await w.send(self.issuer, None, "/link confirm" if self.confirm else "/link deny")
        if not self.confirm:
            assert answer[0].startswith("Declined"), answer
            return
        assert answer[0].startswith("Confirmed"), answer
        notices = await w.notices(self.issuer)
        assert notices[-1].startswith("Linked:"), notices[-1]
        w.join(self.issuer, self.joiner)


@dataclass(frozen=True)
class LeakCode:
    """The issuer's code is pasted into a group (by anyone on either platform): it is burnt,
    and redeeming it afterwards links nothing."""

    issuer: Account
    paster: Account
    joiner: Account
    chat: int

    @classmethod
    def strategy(cls):
        return st.builds(cls, accounts, accounts, accounts, st.integers(0, 1))

    async def run(self, w: World) -> None:
        code = await _issue(w, self.issuer)
        if code is None:
            return
        await w.send(self.paster, _group_of(self.paster, self.chat), f"my code is {code}")
        assert w.app is not None
        await w.app.linking.wait_idle(30)
        if self.joiner == self.issuer:
            return
        out = await w.send(self.joiner, None, f"/link {code}")
        assert "unknown, expired or already used" in out[0], out
        assert "No account is waiting" in (await w.send(self.issuer, None, "/link confirm"))[0]


@dataclass(frozen=True)
class Unlink:
    """/unlink from a linked account, or /unlink <other account> of the same link."""

    account: Account
    other: Account | None

    @classmethod
    def strategy(cls):
        return st.builds(cls, accounts, st.none() | accounts)

    async def run(self, w: World) -> None:
        target = self.other or self.account
        out = await w.send(self.account, None, f"/unlink {_name(target)}" if self.other else "/unlink")
        members = w.members(self.account)
        if not w.linked(self.account):
            assert "isn't linked" in out[0], out
        elif target not in members:
            assert "isn't one of this link's accounts" in out[0], out
        elif len(members) < 2:  # the last account of a link stays in it
            assert "only account left" in out[0], out
        else:
            assert out[0].startswith("Done"), out
            w.leave(target)


@dataclass(frozen=True)
class Remind:
    """ "remind me CANARY-x": the model sets a reminder in that lane (due long after the test)."""

    account: Account
    chat: int | None

    @classmethod
    def strategy(cls):
        return st.builds(cls, accounts, chats)

    async def run(self, w: World) -> None:
        canary = w.canary(self.account)
        await w.send(self.account, _group_of(self.account, self.chat), f"remind me {canary}")
        w.reminders[w.store_of[self.account]][canary] = self.account


@dataclass(frozen=True)
class Reminders:
    """A lane's reminders read or cancelled: /reminders, the tool's list, /reminders cancel N."""

    account: Account
    chat: int | None
    how: str
    number: int

    @classmethod
    def strategy(cls):
        return st.builds(cls, accounts, chats, st.sampled_from(("command", "tool", "cancel")), st.integers(1, 4))

    async def run(self, w: World) -> None:
        chat = _group_of(self.account, self.chat)
        text = {"command": "/reminders", "tool": "which reminders?", "cancel": f"/reminders cancel {self.number}"}
        await w.send(self.account, chat, text[self.how])  # a cancel only narrows what anyone sees


def _reminding(request: dict):
    """The memory-saving model, which also sets and lists reminders when asked."""
    messages = request.get("messages") or []
    offered = {t.get("function", {}).get("name") for t in request.get("tools") or [] if isinstance(t, dict)}
    if messages and messages[-1].get("role") == "user" and "reminders" in offered:
        text = last_user_text(request).strip()
        m = re.fullmatch(r"remind me (CANARY-\w+)", text)
        if m:
            return tool_call("reminders", {"action": "create", "text": m.group(1), "in_minutes": 600})
        if text == "which reminders?":
            return tool_call("reminders", {"action": "list"})
    return memory_saving_responder(request)


ACTIONS: list = [Talk, Remember, Mark, Forget, SetMode, NewSession, Link, LeakCode, Unlink, Remind, Reminders]


async def _play(actions: list) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        async with FakeLLM() as llm:
            llm.responder = canary_repeater(_reminding)
            world = World(Path(tmp) / "data", llm)
            await world.start()
            try:
                for action in actions:
                    await action.run(world)
                # finally every account talks everywhere once more
                for account in ACCOUNTS:
                    for chat in (None, *GROUPS[account[0]]):
                        await world.send(account, chat, "anything else?")
            finally:
                await world.stop()


# Links are the rarest setup; make them likely enough that unlinks and merges get exercised.
_actions = st.one_of([a.strategy() for a in ACTIONS] + [Link.strategy(), Link.strategy(), Remember.strategy()])


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(_actions, min_size=1, max_size=20))
# two accounts of one link in one group: a reminder one set there is not the other's lane's
@example(
    [
        Link(("telegram", "ann"), ("telegram", "ben"), True),
        Remind(("telegram", "ann"), 0),
        Reminders(("telegram", "ben"), 0, "command", 1),
    ]
)
# the account that left a link sees none of the link's reminders, its own set while linked stop
@example(
    [
        Link(("telegram", "ann"), ("discord", "ann"), True),
        Remind(("telegram", "ann"), None),
        Remind(("discord", "ann"), None),
        Unlink(("discord", "ann"), None),
        Reminders(("discord", "ann"), None, "tool", 1),
    ]
)
def test_no_canary_ever_crosses_its_audience(actions):
    asyncio.run(_play(actions))
