"""Identity linking from the chat: `/link` gives a code, `/link CODE` from the person's other
account asks the issuer, `/link confirm` (or `/link deny`) from the issuer's private chat
joins both into one tenant, `/unlink [account]` separates an account again.

Safe by construction: a code is only ever typed in the redeemer's private chat. `screen()`
looks at every inbound message outside private chats (code-shaped words only, hashed and
looked up) and burns any live code it finds, telling the issuer privately. A redeemed code
never links anything by itself: the issuer must confirm in their own private chat, where
the request names the account asking to join (`link-request:<issuer>`, same lifetime as a
code). Any account of a link can remove any other (non-config) account of it.

Codes: 10 characters (shown `XXXXX-XXXXX`, about 50 bits), valid `CODE_TTL_S` (10 min),
single use, stored in gateway.db's kv table only as a SHA-256 hash (`link-code:<hash>`),
one live code per account (a new one revokes the old). At most `MAX_CODES_PER_HOUR` codes
per account per hour and `MAX_FAILS_PER_HOUR` wrong codes. Codes are never logged: this
module logs no code, and `logging.include_text` logs `/link [code]`. Both `/link` and
`/link CODE` only work in a private chat.

Joining (A issued the code, B redeems it):
- If neither is linked, a new link name is drawn and both join tenant `link-<name>`; if
  one of them is linked already, the other joins that link. Two different links are
  refused (send /unlink first).
- Data moves, it is not shared: the personal profile of each joining account is merged
  into the link's profile and then removed, so a person's data lives in exactly one place
  (and `profiles delete` of the link removes all of it). The file-level merge is
  tenancy/merge.py: sessions keep their ids, journals are copied byte for byte, state.db
  rows (sessions, messages with FTS, routes, journal offsets) are copied with SQLite
  ATTACH, so every conversation continues where it was on both platforms. MEMORY.md and
  USER.md entries are merged and deduplicated; if the result is over the limit, the oldest
  entries of the larger side are set aside (one note entry says so, the entries themselves
  go to `memories/merged-overflow.md`). Provider files are copied (`*.jsonl` appended).
- The merge runs in a background task once every profile involved is idle: the tenants
  involved are gated (new turns for them wait), their in-flight turns finish, the profiles
  are closed, merged, the link is saved (links.json), the old personal profiles removed,
  and the gates opened. Jobs that were queued for an old tenant are moved to the lane of
  the new one (`LaneMoved`). Both chats get a confirmation.

`/unlink` (runtime links only; config links are the operator's) removes this account, and
`/unlink <principal>` another account of the same link, from now on: it leaves links.json
and the link's tenant.json, starts over with a fresh personal profile, and everything from
the linked time (memory, sessions of every account) stays with the link. The last account
of a link cannot unlink (its data would be stranded).

All state lives on the instance (one per gateway); nothing is module-global.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import re
import secrets
import shutil
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from contextlib import AbstractAsyncContextManager, asynccontextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agent.fileio import atomic_write
from agent.model_choice import read_model
from agent.reminders import Reminder, ReminderStore
from agent.sessions import SessionStore
from agent.vault import DataKey, ProfileFiles, key_of
from core.errors import LaneMoved
from core.lanes import Lane
from core.messages import InboundMessage
from gateway.kv import KeyValue, SqliteKV
from gateway.tenants import dm_chats
from tenancy.keys import link_tenant_id, person_tenant_id, resolve_lane, tenant_dir
from tenancy.merge import PENDING_MARKER, MergeKeys, merge_profiles
from tenancy.merge import Swap as _Swap
from tenancy.merge import clean_staging as _clean_staging
from tenancy.merge import init_profile as _init_profile
from tenancy.merge import retire as _retire

if TYPE_CHECKING:  # pragma: no cover
    from agent.profile import Profile
    from core.settings import Config
    from gateway.inbox import Inbox
    from gateway.metrics import Metrics
    from gateway.modes import Reminders
    from tenancy.identity import IdentityLinks
    from tenancy.profiles import ProfileManager

log = logging.getLogger("hermes.linking")

CODE_TTL_S = 600
MAX_CODES_PER_HOUR = 5
MAX_FAILS_PER_HOUR = 10
IDLE_TIMEOUT_S = 300.0
CODE_LEN = 10
_ALPHABET = "ABCDEFGHJKLMNPQRSTUVWXYZ23456789"  # no 0/O/1/I


Send = Callable[..., Awaitable[object]]
"""`Replies.send`: `send(msg, text, kind=..., reply=...)` records a message for msg's chat."""

MergeGuard = Callable[[list[str]], AbstractAsyncContextManager[None]]
"""Cluster mode: `guard(tenants)` holds every tenant's lease for this node while a merge
runs (waiting until other nodes let go of them) and gives them back afterwards."""


def _hash(code: str) -> str:
    return hashlib.sha256(f"hermes-link:{code}".encode()).hexdigest()


def normalize_code(text: str) -> str:
    return "".join(ch for ch in text.upper() if ch.isalnum())


_CANDIDATE_RE = re.compile(r"(?<![A-Za-z0-9])([A-Za-z2-9]{5})[-\s]?([A-Za-z2-9]{5})(?![A-Za-z0-9])")
_MAX_CANDIDATES = 32


def code_candidates(text: str) -> list[str]:
    """Normalized code-shaped words of `text` (`XXXXX-XXXXX`, any case, dash or space
    optional), at most `_MAX_CANDIDATES`; only code alphabet letters count."""
    out: list[str] = []
    for m in _CANDIDATE_RE.finditer(text):
        code = (m.group(1) + m.group(2)).upper()
        if all(ch in _ALPHABET for ch in code) and code not in out:
            out.append(code)
            if len(out) >= _MAX_CANDIDATES:
                break
    return out


def _issuer_chat(record: dict) -> InboundMessage:
    """A notice target: the private chat a code was issued in."""
    return InboundMessage(
        platform=record["platform"],
        chat_id=record["chat_id"],
        chat_type="dm",
        user_id=record["user_id"],
        user_name=record.get("user_name") or "",
        message_id=f"link-{secrets.token_hex(4)}",
    )


def _platform_name(principal: str) -> str:
    return principal.partition(":")[0].capitalize()


@dataclass
class _Plan:
    name: str
    target: str  # the link tenant id
    joiners: list[str]  # principals to add to the link
    sources: list[str]  # person tenants merged into the target, then removed
    notify: list[InboundMessage] = field(default_factory=list)
    principals: list[str] = field(default_factory=list)


class Linking:
    """Link codes, the merge, and the gates that keep turns out of profiles being merged."""

    def __init__(
        self,
        cfg: Config,
        links: IdentityLinks,
        profiles: ProfileManager,
        inbox: Inbox,
        metrics: Metrics,
        reminders: Reminders,
        send: Send,
        *,
        store: KeyValue | None = None,
        clock: Callable[[], float] = time.time,
        merge_guard: MergeGuard | None = None,
        cluster: bool = False,
    ) -> None:
        """`store` keeps codes and requests (default: gateway.db's kv table). In a cluster
        (`cluster=True`) `merge_guard` must give this node every tenant a merge touches
        (see `MergeGuard`); without one `/link confirm` refuses, and nothing is linked."""
        self.cfg, self.links, self.profiles, self.inbox = cfg, links, profiles, inbox
        self.metrics, self.reminders, self.send = metrics, reminders, send
        self.store: KeyValue = store if store is not None else SqliteKV(inbox)
        self.merge_guard = merge_guard
        self.cluster = cluster
        self.clock = clock
        self.ttl_s = CODE_TTL_S
        self.max_codes_per_hour = MAX_CODES_PER_HOUR
        self.max_fails_per_hour = MAX_FAILS_PER_HOUR
        self.idle_timeout_s = IDLE_TIMEOUT_S
        self._gates: dict[str, asyncio.Event] = {}
        self._active: dict[str, int] = {}
        self._busy: set[str] = set()
        self._tasks: set[asyncio.Task] = set()

    # ----- lane integration -------------------------------------------------------------
    @asynccontextmanager
    async def use(self, msg: InboundMessage, lane: Lane) -> AsyncIterator[Profile]:
        """Open the lane's profile for a job: waits while the tenant is being merged, and
        raises LaneMoved when links changed the job's tenant since it was queued."""
        while True:
            gate = self._gates.get(lane.tenant_id)
            if gate is not None:
                await gate.wait()
                continue
            current = resolve_lane(msg, self.cfg.tenancy, self.links)
            if current.tenant_id != lane.tenant_id:
                raise LaneMoved(current)
            break
        # no await between the gate check and this count, so a merge that sets the gate
        # afterwards always sees this job and waits for it
        tid = lane.tenant_id
        self._active[tid] = self._active.get(tid, 0) + 1
        try:
            async with self.profiles.use(tid, kind=lane.kind) as profile:
                yield profile
        finally:
            self._active[tid] -= 1
            if not self._active[tid]:
                del self._active[tid]

    def _gate(self, tenants: list[str]) -> None:
        for t in tenants:
            self._gates.setdefault(t, asyncio.Event())

    def _ungate(self, tenants: list[str]) -> None:
        for t in tenants:
            gate = self._gates.pop(t, None)
            if gate is not None:
                gate.set()

    async def _wait_idle(self, tenants: list[str]) -> None:
        """Until no job uses any of `tenants` and each profile is closed."""
        deadline = time.monotonic() + self.idle_timeout_s
        pending = list(tenants)
        while pending:
            if time.monotonic() > deadline:
                raise TimeoutError("the accounts stayed busy")
            t = pending[0]
            if self._active.get(t, 0) == 0 and await self.profiles.evict(t):
                pending.pop(0)
                continue
            await asyncio.sleep(0.05)

    async def wait_idle(self, timeout: float | None = None) -> None:
        """Wait for every running merge (tests, shutdown)."""
        tasks = list(self._tasks)
        if tasks:
            await asyncio.wait(tasks, timeout=timeout)

    async def recover(self) -> None:
        """At start, after a crash mid-merge: a merged profile whose link was recorded is
        kept (and finished), one whose link was not is swapped back for the profile from
        before; both accounts are told which."""
        profiles = self.cfg.data_dir / "profiles"
        for marker in sorted(profiles.glob(f"*/{PENDING_MARKER}")) if profiles.is_dir() else []:
            target = marker.parent
            try:
                info = json.loads(marker.read_text(encoding="utf-8"))
                notify = [InboundMessage.model_validate(m) for m in info["notify"]]
            except (OSError, ValueError, KeyError, TypeError):
                log.exception("link: unreadable %s; leaving it for the operator", marker)
                continue
            old = profiles / f".link-old-{target.name}"
            swap = _Swap(target, old if old.exists() else None)
            if all(self.links.name_for(p) == info["name"] for p in info["joiners"]):
                await asyncio.to_thread(swap.forget)
                for source in info.get("sources", []):
                    await asyncio.to_thread(
                        _retire, tenant_dir(self.cfg.data_dir, source), info.get("target", target.name)
                    )
                await self._reindex_reminders(info.get("target", ""), info.get("sources", []))
                log.info("link: finished a merge a crash interrupted (%s)", target.name)
                everyone = ", ".join(self.links.principals_of(info["name"]))
                text = f"Linked: {everyone} are now one person for me, with one memory and all conversations kept."
            else:
                await asyncio.to_thread(swap)
                log.warning("link: undid a merge a crash interrupted before the link was recorded (%s)", target.name)
                text = (
                    "Linking didn't work (I was restarted meanwhile); nothing was changed. Send /link from "
                    "your other account to get a new code and try again."
                )
            for msg in notify:
                await self._tell(msg, text)
        await asyncio.to_thread(_clean_staging, profiles)

    async def close(self, timeout: float = 30.0) -> None:
        await self.wait_idle(timeout)
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    # ----- the commands -----------------------------------------------------------------
    async def link_command(self, msg: InboundMessage, args: str) -> str:
        if msg.chat_type != "dm":
            return "For your privacy, send /link in a private chat with me, not here."
        word = args.strip().lower()
        if word in ("confirm", "deny"):
            return await self._answer(msg, word == "confirm")
        code = normalize_code(args)
        if not code:
            return await self._issue(msg)
        return await self._redeem(msg, code)

    # ----- codes seen where they don't belong ------------------------------------------
    async def screen(self, msg: InboundMessage) -> None:
        """Burn every live link code that appears in `msg` unless `msg` is a private chat
        (the only place a code may be typed), and tell each code's issuer privately.
        Cheap: a regex finds code-shaped words; only those are hashed and looked up."""
        if msg.chat_type == "dm" or not msg.text:
            return
        keys = [f"link-code:{_hash(code)}" for code in code_candidates(msg.text)]
        if not keys:
            return
        live = await self.store.get_many(keys)  # one indexed lookup for every code-shaped word
        for key in keys:
            if key not in live or await self.store.take(key) is None:
                continue
            record = json.loads(live[key])
            issuer = record["principal"]
            digest = key.partition(":")[2]
            if await self.store.get(f"link-code-of:{issuer}") == digest:
                await self.store.put(f"link-code-of:{issuer}", None)
            self.metrics.links.inc(kind="issue", outcome="burnt")
            log.warning(
                "link: a live link code appeared in a %s %s chat; it was cancelled", msg.platform, msg.chat_type
            )
            self._spawn(
                self._tell(
                    _issuer_chat(record),
                    (
                        "Your link code was posted in a chat other people can read, so I cancelled it: nobody can use "
                        "it now. If you still want to link your accounts, send /link here for a new code and type it "
                        "only in a private chat with me from your other account."
                    ),
                ),
                "link-burnt-notice",
            )

    def _spawn(self, coro: Coroutine[Any, Any, object], name: str) -> None:
        """Run `coro` beside the caller (close() waits for it)."""
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _recent(self, key: str, window: float = 3600.0) -> list[float]:
        raw = await self.store.get(key)
        now = self.clock()
        try:
            stamps = [float(t) for t in json.loads(raw)] if raw else []
        except (ValueError, TypeError):
            stamps = []
        return [t for t in stamps if now - t < window]

    async def _issue(self, msg: InboundMessage) -> str:
        inbox, principal, now = self.store, msg.principal, self.clock()
        issued = await self._recent(f"link-issued:{principal}")
        if len(issued) >= self.max_codes_per_hour:
            wait_min = int((3600 - (now - min(issued))) // 60) + 1
            self.metrics.links.inc(kind="issue", outcome="rate_limited")
            return (
                f"You've asked for {self.max_codes_per_hour} link codes in the last hour. "
                f"Please try again in about {wait_min} minutes."
            )
        await self._prune(now)
        old = await inbox.get(f"link-code-of:{principal}")
        if old:
            await inbox.put(f"link-code:{old}", None)
        code = "".join(secrets.choice(_ALPHABET) for _ in range(CODE_LEN))
        digest = _hash(code)
        record = {
            "principal": principal,
            "platform": msg.platform,
            "chat_id": msg.chat_id,
            "user_id": msg.user_id,
            "user_name": msg.user_name,
            "expires": now + self.ttl_s,
        }
        await inbox.put(f"link-code:{digest}", json.dumps(record))
        await inbox.put(f"link-code-of:{principal}", digest)
        await inbox.put(f"link-issued:{principal}", json.dumps([*issued, now]))
        self.metrics.links.inc(kind="issue", outcome="ok")
        shown = f"{code[:5]}-{code[5:]}"
        minutes = max(1, int(self.ttl_s // 60))
        return (
            f"Your link code is {shown}\n\nWithin {minutes} minutes, send\n/link {shown}\nto me from "
            "your other account (for example on Telegram or Discord) in a private chat. Both accounts "
            "will then share one memory and keep all their conversations. The code works once; "
            "don't share it with anyone."
        )

    async def _prune(self, now: float) -> None:
        rows: list[tuple[str, str]] = []
        for prefix in ("link-code:", "link-request:"):  # expired codes and unanswered requests
            rows += await self.store.scan(prefix)
        stale = []
        for key, value in rows:
            try:
                if json.loads(value)["expires"] <= now:
                    stale.append(key)
            except (ValueError, KeyError, TypeError):
                stale.append(key)
        for key in stale:
            await self.store.put(key, None)

    async def _fail(self, principal: str, fails: list[float], text: str) -> str:
        await self.store.put(f"link-fail:{principal}", json.dumps([*fails, self.clock()]))
        self.metrics.links.inc(kind="redeem", outcome="refused")
        return text

    async def _redeem(self, msg: InboundMessage, code: str) -> str:
        inbox, principal, links = self.store, msg.principal, self.links
        fails = await self._recent(f"link-fail:{principal}")
        if len(fails) >= self.max_fails_per_hour:
            self.metrics.links.inc(kind="redeem", outcome="rate_limited")
            return "Too many wrong link codes from this account. Please try again in an hour."
        key = f"link-code:{_hash(code)}"
        raw = await inbox.get(key)
        record = json.loads(raw) if raw else None
        unknown = (
            "That link code is unknown, expired or already used. Send /link from your other account to get a new one."
        )
        if record is None:
            return await self._fail(principal, fails, unknown)
        issuer = record["principal"]
        if issuer == principal:
            return (
                "That code was made by this account. Send it from your other account (the one "
                "you want to link with this one)."
            )
        if await inbox.take(key) is None:  # single use, expired or not; another node was first
            return await self._fail(principal, fails, unknown)
        if await inbox.get(f"link-code-of:{issuer}") == _hash(code):
            await inbox.put(f"link-code-of:{issuer}", None)
        if record["expires"] <= self.clock():
            return await self._fail(principal, fails, unknown)
        name_a, name_b = links.name_for(issuer), links.name_for(principal)
        if name_a is not None and name_a == name_b:
            return f"These accounts are already linked ({', '.join(links.principals_of(name_a))})."
        if name_a is not None and name_b is not None:
            return (
                "Both accounts already belong to different linked identities. Send /unlink from one "
                "of them first, then link again."
            )
        request = {
            "joiner": principal,
            "platform": msg.platform,
            "chat_id": msg.chat_id,
            "user_id": msg.user_id,
            "user_name": msg.user_name,
            "expires": self.clock() + self.ttl_s,
        }
        await inbox.put(f"link-request:{issuer}", json.dumps(request))
        self.metrics.links.inc(kind="redeem", outcome="asked")
        who = f"{principal} ({msg.user_name})" if msg.user_name else principal
        await self._tell(
            _issuer_chat(record),
            (
                f"{who} wants to join your identity: reply /link confirm or /link deny.\n\n"
                "If you confirm, that account will share your memory and conversations. If this wasn't you, "
                "reply /link deny."
            ),
        )
        return (
            f"Code accepted. To finish, confirm from your {_platform_name(issuer)} account: I've asked it "
            "in its private chat with me. Nothing is linked until it confirms."
        )

    async def _answer(self, msg: InboundMessage, confirm: bool) -> str:
        """`/link confirm` or `/link deny` from the issuer, in the issuer's private chat."""
        inbox, issuer, links = self.store, msg.principal, self.links
        raw = await inbox.get(f"link-request:{issuer}")
        request = json.loads(raw) if raw else None
        if request is None or request["expires"] <= self.clock():
            if request is not None:
                await inbox.put(f"link-request:{issuer}", None)
            return "No account is waiting to link with this one (requests expire after 10 minutes)."
        principal = request["joiner"]
        joiner_chat = InboundMessage(
            platform=request["platform"],
            chat_id=request["chat_id"],
            chat_type="dm",
            user_id=request["user_id"],
            user_name=request.get("user_name") or "",
            message_id=f"link-{secrets.token_hex(4)}",
        )
        if not confirm:
            await inbox.put(f"link-request:{issuer}", None)
            self.metrics.links.inc(kind="redeem", outcome="denied")
            await self._tell(
                joiner_chat, f"Your {_platform_name(issuer)} account declined the link; nothing was linked."
            )
            return f"Declined: {principal} was not linked with this account."
        name_a, name_b = links.name_for(issuer), links.name_for(principal)
        if name_a is not None and name_a == name_b:
            await inbox.put(f"link-request:{issuer}", None)
            return f"These accounts are already linked ({', '.join(links.principals_of(name_a))})."
        if name_a is not None and name_b is not None:
            await inbox.put(f"link-request:{issuer}", None)
            return (
                "Both accounts already belong to different linked identities. Send /unlink from one "
                "of them first, then link again."
            )
        if self.cluster and self.merge_guard is None:
            return (
                "Linking accounts is not available on this gateway yet (it runs as a cluster and cannot "
                "merge profiles safely); nothing was linked. Ask the operator."
            )
        name = name_a or name_b or secrets.token_hex(5)
        if {issuer, principal} & self._busy or link_tenant_id(name) in self._gates:
            return "A link for these accounts is already in progress; please wait a minute and try again."
        await inbox.put(f"link-request:{issuer}", None)

        joiners = [p for p, n in ((issuer, name_a), (principal, name_b)) if n is None]
        sources = []
        for p in joiners:
            platform, _, uid = p.partition(":")
            sources.append(person_tenant_id(platform, uid))
        plan = _Plan(
            name=name, target=link_tenant_id(name), joiners=joiners, sources=sources, principals=[issuer, principal]
        )
        plan.notify = [msg, joiner_chat]
        self._busy |= {issuer, principal}
        tenants = [plan.target, *plan.sources]
        self._gate(tenants)  # before returning: no new turn may start in these profiles
        self._spawn(self._run_merge(plan, tenants), "link-merge")
        return f"Confirmed. Joining this account with {principal} now; I'll confirm here in a moment."

    async def _run_merge(self, plan: _Plan, tenants: list[str]) -> None:
        """Wait for the accounts to be idle, then merge and link as one step that a shutdown
        does not interrupt: the profiles end up either exactly as before or merged and
        linked, and both accounts are told which (through the outbox, so even a notice
        recorded during shutdown goes out on the next start)."""
        try:
            redeem = plan.notify[0]
            deadline = time.monotonic() + self.idle_timeout_s
            # let the /link confirm reply go out first (the inbox marks it done after sending)
            while await self.inbox.status(redeem.platform, redeem.chat_id, redeem.message_id) == "pending":
                if time.monotonic() > deadline:
                    raise TimeoutError("the accounts stayed busy")
                await asyncio.sleep(0.02)
            async with self._guarded(tenants):
                await self._wait_idle(tenants)
                step = asyncio.ensure_future(self._merge_and_link(plan))
                try:
                    await asyncio.shield(step)
                except asyncio.CancelledError:
                    if not step.done():
                        log.info("link: shutting down; finishing the merge into %s first", plan.target)
                        await asyncio.wait([step])
                    if step.cancelled() or step.exception() is not None:
                        raise
                    await self._after_merge(plan)
                    raise
        except BaseException as err:
            self._ungate(tenants)
            self._busy -= set(plan.principals)
            self.metrics.links.inc(kind="merge", outcome="error")
            if isinstance(err, asyncio.CancelledError):
                log.warning("link: merge into %s cancelled; nothing was linked", plan.target)
                reason = "I was restarted meanwhile"
            else:
                log.exception("link: merge into %s failed; nothing was linked", plan.target)
                reason = "the accounts stayed busy" if isinstance(err, TimeoutError) else "an internal error"
            for target in plan.notify:
                await self._tell(
                    target,
                    f"Linking didn't work ({reason}); nothing was changed. Send /link "
                    "from your other account to get a new code and try again.",
                )
            if isinstance(err, asyncio.CancelledError):
                raise
            return
        self._ungate(tenants)
        self._busy -= set(plan.principals)
        await self._after_merge(plan)

    def _guarded(self, tenants: list[str]) -> AbstractAsyncContextManager[None]:
        """In a cluster: hold every tenant of the merge on this node (no other node opens
        them meanwhile); on a single node the gates alone are enough."""
        return self.merge_guard(tenants) if self.merge_guard is not None else nullcontext()

    async def _merge_and_link(self, plan: _Plan) -> None:
        """Merge the profiles, then record the link; if recording fails, the merged profile
        is swapped back for the one from before."""
        links = self.links
        undo = await self._merge(plan)
        linked: list[str] = []
        try:
            for p in plan.joiners:
                if links.link(plan.name, p):
                    linked.append(p)
            await asyncio.to_thread(links.save)
        except BaseException:
            for p in linked:
                try:
                    links.unlink(p)
                except ValueError:
                    pass
            await asyncio.to_thread(undo)
            raise
        await asyncio.to_thread(undo.forget)

    async def _after_merge(self, plan: _Plan) -> None:
        """Merged and linked: retire the old personal profiles and tell both accounts."""
        links = self.links
        for source in plan.sources:
            try:
                await asyncio.to_thread(_retire, tenant_dir(self.cfg.data_dir, source), plan.target)
            except Exception:
                log.exception("link: could not remove a merged profile (`profiles delete` of the link removes it)")
        await self._reindex_reminders(plan.target, plan.sources)
        self.metrics.links.inc(kind="merge", outcome="ok")
        log.info("link: merged %d profile(s) into %s", len(plan.sources), plan.target)
        everyone = ", ".join(links.principals_of(plan.name))
        chosen = (await asyncio.to_thread(read_model, tenant_dir(self.cfg.data_dir, plan.target))).name
        model = f" Your model is {chosen} (/model changes it)." if chosen else ""
        for target in plan.notify:
            await self._tell(
                target,
                f"Linked: {everyone} are now one person for me, with one memory and all "
                f"conversations kept.{model} Send /unlink from an account to separate it again.",
            )

    async def _files(self, tenant_id: str) -> ProfileFiles:
        """A tenant's profile files, read with its key when encrypted (the profiles' cache)."""
        return await asyncio.to_thread(self.profiles.keys.files, tenant_id, tenant_dir(self.cfg.data_dir, tenant_id))

    async def _reindex_reminders(self, target: str, sources: list[str]) -> None:
        """After a merge: the scheduler's index names the merged profile's next reminder,
        and no longer the profiles merged into it."""
        if not target or not self.cfg.reminders_on:
            return
        try:
            store = ReminderStore(await self._files(target))
            await self.reminders.note(target, await store.next_due(), False)
            for source in sources:
                await self.reminders.note(source, None, False)
        except Exception:
            log.exception("link: could not index the merged profile's reminders (they fire after the next change)")

    async def _stop_reminders_of(self, link_tenant: str, departed: str) -> list[Reminder]:
        """/unlink: the link's reminders set from the account that left stop (their chat is
        not the link's any more); the stopped ones."""
        store = ReminderStore(await self._files(link_tenant))
        stopped = await store.remove_where(lambda r: r.chat.of_account(departed))
        if stopped and self.cfg.reminders_on:
            await self.reminders.note(link_tenant, await store.next_due(), False)
        return stopped

    async def _tell_stopped(self, link_tenant: str, stayed: list[str], msg: InboundMessage, text: str) -> None:
        """Tell the accounts that stayed, in their private chats with the bot (the link's DM
        lanes on their platforms, not the chat /unlink was sent from)."""
        path = tenant_dir(self.cfg.data_dir, link_tenant)
        users: dict[str, list[str]] = {}
        for p in stayed:
            platform, _, uid = p.partition(":")
            users.setdefault(platform, []).append(uid)
        told = 0
        for platform, chat in sorted(await asyncio.to_thread(dm_chats, path)):
            if platform not in users or (platform, chat) == (msg.platform, msg.chat_id):
                continue
            uids = users[platform]
            user = chat if chat in uids or len(uids) != 1 else uids[0]
            await self._tell(
                InboundMessage(
                    platform=platform,
                    chat_id=chat,
                    chat_type="dm",
                    user_id=user,
                    message_id=f"unlink-{secrets.token_hex(4)}",
                ),
                text,
            )
            told += 1
        if not told:
            log.warning("unlink: no private chat of the remaining accounts is known; the stopped reminders went untold")

    async def _tell(self, msg: InboundMessage, text: str) -> None:
        try:
            await self.send(msg, text, kind="notice", reply=False)
        except Exception:
            log.exception("link: could not send a notice")

    async def _merge(self, plan: _Plan) -> _Swap:
        """Merge into a staging copy of the target (a fresh profile, or a copy of the linked
        one), check it opens, then swap it in. A failure leaves every profile untouched.
        Returns the swap, which can still be undone until the link is recorded."""
        cfg = self.cfg
        data_dir = cfg.data_dir
        fsync = cfg.storage.fsync
        limits = {"memory": cfg.memory.memory_char_limit, "user": cfg.memory.user_char_limit}
        ring = self.profiles.keyring  # encrypted profiles: each opened with its own key
        sources = []
        source_keys: dict[Path, DataKey | None] = {}
        for tid in plan.sources:
            path = tenant_dir(data_dir, tid)
            if path.is_dir():
                source_keys[path] = key = await asyncio.to_thread(key_of, ring, tid, path)
                async with SessionStore(path, fsync=fsync, key=key):  # reconcile journal and state.db first
                    pass
                sources.append(path)
        target = tenant_dir(data_dir, plan.target)
        merging = {tenant_dir(data_dir, t).name for t in self._gates if t != plan.target}
        await asyncio.to_thread(_clean_staging, data_dir / "profiles", keep=merging)
        staging = data_dir / "profiles" / f".link-{secrets.token_hex(6)}"
        try:
            if target.exists():
                key = await asyncio.to_thread(key_of, ring, plan.target, target)
                async with SessionStore(target, fsync=fsync, key=key):  # reconcile before copying
                    pass
                await asyncio.to_thread(shutil.copytree, target, staging)
            else:
                await asyncio.to_thread(_init_profile, staging, plan.target)
                key = None  # a new link tenant's own key, its slot named for the target's directory
                if ring is not None:
                    key = await asyncio.to_thread(
                        ring.key_for, plan.target, staging, create=True, slot_name=target.name
                    )
            async with SessionStore(staging, fsync=fsync, key=key):  # schema (new) or reconcile (copy)
                pass
            keys = MergeKeys(key, source_keys)
            await asyncio.to_thread(merge_profiles, staging, sources, limits, plan.principals, keys)
            async with SessionStore(staging, fsync=fsync, key=key):  # the merged profile opens cleanly
                pass
            pending = {
                "name": plan.name,
                "target": plan.target,
                "joiners": plan.joiners,
                "sources": plan.sources,
                "notify": [m.model_dump(mode="json") for m in plan.notify],
            }
            await asyncio.to_thread(atomic_write, staging / PENDING_MARKER, json.dumps(pending))
            return await asyncio.to_thread(_Swap.apply, staging, target)
        except BaseException:
            await asyncio.to_thread(shutil.rmtree, staging, True)
            raise

    async def unlink_command(self, msg: InboundMessage, args: str = "") -> str:
        """`/unlink` separates this account; `/unlink <principal>` separates another account
        of the same link (so a person can remove an account that should not be there)."""
        if msg.chat_type != "dm":
            return "For your privacy, send /unlink in a private chat with me, not here."
        links, principal = self.links, msg.principal
        name = links.name_for(principal)
        if name is None:
            return "This account isn't linked to another one."
        target = args.strip() or principal
        members = links.principals_of(name)
        if target not in members:
            return (
                f"{target} isn't one of this link's accounts ({', '.join(members)}). "
                "Usage: /unlink, or /unlink <account> with an account listed by /whoami."
            )
        if links.is_pinned(target):
            return (
                "That account is linked in the gateway's configuration (tenancy.identity_links); "
                "ask the operator to change it there."
            )
        others = [p for p in members if p != target]
        if not others:
            return "This is the only account left in its link, so there is nothing to separate."
        if target in self._busy or principal in self._busy:
            return "A link for this account is in progress; please wait a minute."
        platform, _, uid = target.partition(":")
        personal, link_tenant = person_tenant_id(platform, uid), link_tenant_id(name)
        self._gate([personal])
        try:
            links.unlink(target)
            await asyncio.to_thread(links.save)
            await self.profiles.discard_principal(link_tenant, target)
            # a personal profile left from before the link is never used again: start fresh
            path = tenant_dir(self.cfg.data_dir, personal)
            if path.exists() and self._active.get(personal, 0) == 0 and await self.profiles.evict(personal):
                await asyncio.to_thread(shutil.rmtree, path, True)
        finally:
            self._ungate([personal])
        self.metrics.links.inc(kind="unlink", outcome="ok")
        log.info("unlink: one account left %s", link_tenant)
        try:  # in cluster mode this lane's claim holds the link tenant's lease
            stopped = await self._stop_reminders_of(link_tenant, target)
        except Exception:
            log.exception("unlink: could not stop the reminders set from the account that left")
            stopped = []
        note = ""
        if stopped:
            note = (
                f"\n\n{len(stopped)} reminder(s) set from {target} while linked will not fire any more "
                "(they were delivered into its chats):\n" + "\n".join(r.describe() for r in stopped)
            )
        if target == principal:
            if note:
                await self._tell_stopped(link_tenant, others, msg, f"{target} left this identity.{note}")
            return (
                f"Done: this account is separate again from now on, with a fresh memory. Everything from the "
                f"linked time stays with {', '.join(others)}."
            )
        return (
            f"Done: {target} is no longer part of this identity. From now on it starts over with a fresh "
            "memory; it can no longer see this identity's memory or conversations. What it said while "
            f"linked stays here.{note}"
        )
