"""The adapters' sink: record an inbound message (gateway.db, or the shared inbox in a
cluster), then refuse it with a clear sentence or queue it on its lane. Refusals are
told in chat, never a crash and never a lost message."""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Mapping

from core.lanes import Lane
from core.messages import InboundMessage, OutboundMessage
from core.protocols import Adapter
from core.settings import Config
from gateway.access import Access
from gateway.commands import parse_command
from gateway.inbox import Inbox
from gateway.jobs import Background, Job, RunningTurns, input_uid
from gateway.lanes import Lanes
from gateway.limits import RateLimiter
from gateway.linking import Linking
from gateway.metrics import Metrics
from gateway.modes import SharedInbox, StopSignals
from gateway.reminders import is_reminder
from gateway.replies import Replies
from tenancy.identity import IdentityLinks
from tenancy.keys import resolve_lane

log = logging.getLogger("hermes.gateway")

BUSY = "I'm still working on your earlier messages. Please wait for my answer, then send this again."
QUIET_S = 60.0  # a rate refusal is said at most once this often per person


class Refusals:
    """Why a message was not taken, told to the person (or, where that would tell a
    stranger in a group anything, only recorded)."""

    def __init__(
        self,
        cfg: Config,
        adapters: Mapping[str, Adapter],
        inbox: Inbox,
        access: Access,
        metrics: Metrics,
        replies: Replies,
        background: Background,
        *,
        shared: bool = False,
    ) -> None:
        self.cfg = cfg
        self.adapters = adapters
        self.inbox = inbox
        self.access = access
        self.metrics = metrics
        self.replies = replies
        self.background = background
        self.shared = shared  # cluster mode: a message never stored is not in the shared inbox either
        self._notified: dict[str, float] = {}  # quiet key -> when its refusal was last said

    async def refuse(self, msg: InboundMessage, outcome: str, text: str, quiet_key: str | None = None) -> None:
        """Tell the person why their message was not taken (rate refusals once a minute)."""
        self.metrics.refused(msg.platform, outcome)
        now = time.monotonic()
        if quiet_key is None or now - self._notified.get(quiet_key, -1e9) >= QUIET_S:
            if quiet_key is not None:
                self._notified[quiet_key] = now
            await self.replies.send_and_finish(msg, text, "error", outcome)
            return
        await self.inbox.finish(msg, outcome)

    def forget_quiet(self) -> None:
        """Forget rate-refusal notes older than a minute (housekeeping)."""
        now = time.monotonic()
        self._notified = {k: t for k, t in self._notified.items() if now - t < QUIET_S}

    async def refuse_stranger(self, msg: InboundMessage) -> None:
        self.metrics.refused(msg.platform, "unauthorized")
        if msg.chat_type == "dm" and self.cfg.access.unauthorized_dm == "pair":
            code = await self.access.pairing_code(msg.principal)
            text = (
                f"Hi! I don't know you yet. Your pairing code is {code}. "
                f"Ask the operator of this bot to approve it with /pair {code}."
            )
            await self.replies.send_and_finish(msg, text, "notice", "unauthorized")
            return
        if msg.message_id.startswith("interaction-"):
            # a slash command waits visibly for an answer; plain group messages get silence
            await self.replies.send_and_finish(
                msg, "Sorry, you're not on this bot's list of users.", "error", "unauthorized"
            )
            return
        await self.inbox.finish(msg, "unauthorized")

    async def refuse_unreadable(self, msg: InboundMessage) -> None:
        """A message with broken Unicode (lone surrogates) can't be stored or answered as
        usual: it is not recorded, and when its ids are sound the sender gets a clear note."""
        bad = msg.unreadable_fields()
        ids_ok = not set(bad) & {"platform", "chat_id", "thread_id", "message_id"}
        platform = msg.platform if "platform" not in bad else "unknown"
        self.metrics.refused(platform, "bad_unicode")
        log.warning("refused a %s message: invalid Unicode in %s", platform, ", ".join(bad))
        allowed = False
        if not set(bad) & {"platform", "user_id"}:
            try:
                allowed = await self.access.is_allowed(msg.principal)
            except Exception:
                log.exception("access check failed for a refused message")
        # like any refusal: said in a private chat, or in a group only to someone the bot serves
        if ids_ok and platform in self.adapters and (msg.chat_type == "dm" or allowed):
            clean = msg.model_copy(
                update={"text": "", "user_name": "", "user_id": "?", "reply_to_message_id": None, "attachments": ()}
            )
            self.background.run(
                self._send_quietly(
                    clean,
                    (
                        "Sorry, I can't read that message: it contains invalid characters (broken Unicode). "
                        "Please send it again as plain text."
                    ),
                )
            )

    async def _send_quietly(self, msg: InboundMessage, text: str) -> None:
        """A refusal of a message that is never stored: nothing of it (not even its id as
        the reply target) goes into gateway.db."""
        try:
            adapter = self.adapters.get(msg.platform)
            if self.shared and adapter is not None:  # cluster mode: not in the shared inbox either
                await adapter.send(
                    OutboundMessage(chat_id=msg.chat_id, thread_id=msg.thread_id, text=text, kind="error")
                )
                return
            await self.replies.send(msg, text, kind="error", reply=False)
        except Exception:
            log.exception("could not send a refusal")


class Ingress:
    """Record, screen, refuse or queue: `handle_inbound` is what every adapter calls."""

    def __init__(
        self,
        cfg: Config,
        inbox: Inbox,
        access: Access,
        links: IdentityLinks,
        linking: Linking,
        lanes: Lanes[Job],
        metrics: Metrics,
        replies: Replies,
        refusals: Refusals,
        running: RunningTurns,
        background: Background,
        *,
        links_refresh: Callable[[], Awaitable[object]] | None = None,
        shared: SharedInbox | None = None,
        stop_signals: StopSignals | None = None,
    ) -> None:
        self.cfg = cfg
        self.inbox = inbox
        self.access = access
        self.links = links
        self.linking = linking
        self.lanes = lanes
        self.metrics = metrics
        self.replies = replies
        self.refusals = refusals
        self.running = running
        self.background = background
        # cluster mode: brings `links` up to date with links other nodes made, before routing
        self.links_refresh = links_refresh
        self.shared = shared  # cluster mode: messages go to the shared inbox, claim workers run them
        self.stop_signals = stop_signals  # cluster mode: a /stop reaches the node running the turn
        self.limiter = RateLimiter(cfg.limits.rate_limit_per_minute)
        self.accepting = False  # the runtime opens and closes the doors (start, stop)
        # cluster mode: /stop messages that stopped a turn on arrival (here, or signalled by another node)
        self._stopped_here: set[str] = set()

    async def handle_inbound(self, msg: InboundMessage) -> None:
        """The adapters' sink: returns once `msg` is durably recorded (or known already)."""
        if msg.unreadable_fields():
            await self.refusals.refuse_unreadable(msg)
            return
        if self.shared is not None:
            await self._record_shared(msg, self.shared)
            return
        if not await self.inbox.record(msg):
            self.metrics.inbound.inc(platform=msg.platform, outcome="duplicate")
            log.info("duplicate %s message ignored", msg.platform)
            return
        self.metrics.inbound.inc(platform=msg.platform, outcome="new")
        if not self.accepting:
            return  # recorded: replayed on the next start
        try:
            await self.admit(msg)
        except Exception:
            # not admitted: forget the record and fail the sink, so the adapter does not
            # acknowledge and the platform's redelivery is taken in afresh
            log.exception("could not admit a %s message; it will be taken again on redelivery", msg.platform)
            try:
                await self.inbox.forget(msg)
            except Exception:
                log.exception("could not forget the record; the message is replayed on the next start")
            raise

    async def _record_shared(self, msg: InboundMessage, shared: SharedInbox) -> None:
        """Cluster mode's ingress: commit `msg` to the shared inbox on its lane (once per
        platform message id) and return; a claim worker of some node runs it."""
        if self.links_refresh is not None:  # a link another node made routes this message too
            await self.links_refresh()
        lane: Lane | None
        try:
            lane = resolve_lane(msg, self.cfg.tenancy, self.links)
        except ValueError:  # refused ("bad_ids") by whichever node runs it, like on one node
            lane = None
        if not await shared.record(msg, lane):
            self.metrics.inbound.inc(platform=msg.platform, outcome="duplicate")
            log.info("duplicate %s message ignored", msg.platform)
            return
        self.metrics.inbound.inc(platform=msg.platform, outcome="new")
        if lane is not None and not is_reminder(msg):
            command = parse_command(msg.text)
            if command is not None and command[0].name == "stop":
                uid = input_uid(msg)
                # the lane's turn runs here, or on the node the signal reaches
                # (docs/cluster.md#stop-and-confirmations-across-nodes)
                if not self.stop_here(lane.key, uid) and self.stop_signals is not None:
                    await self.stop_signals.publish(lane.key, uid)

    def stop_here(self, lane_key: str, uid: str) -> bool:
        """Cluster mode: stop `lane_key`'s turn if it runs on this node, and remember that the
        /stop message `uid` did, so that it answers "Stopped." when its lane runs it; False
        when no turn of the lane runs here (a signal from another node is then ignored)."""
        running = self.running.get(lane_key)
        if running is None or running.is_set():
            return False
        running.set()
        self._stopped_here.add(uid)
        return True

    async def overheard(self, platform: str, text: str) -> None:
        """A group message the adapter does not answer (no mention): nothing is recorded or
        said, but a live link code in it is burnt like anywhere else outside a private chat."""
        msg = InboundMessage(
            platform=platform,
            chat_id="overheard",
            chat_type="group",
            user_id="overheard",
            message_id="overheard",
            text=text,
        )
        await self.linking.screen(msg)

    async def admit(self, msg: InboundMessage, *, replay: bool = False, force: bool = False) -> str | None:
        """Refuse `msg`, or queue it on its lane (`force`: never refused as busy, as for a
        message a cluster node claimed); the lane key it was queued on, else None."""
        try:  # a link code typed where others can read it is burnt, whoever sent it
            await self.linking.screen(msg)
        except Exception:
            log.exception("could not screen a %s message for link codes", msg.platform)
        if not await self.access.is_allowed(msg.principal):
            await self.refusals.refuse_stranger(msg)
            return None
        if len(msg.text) > self.cfg.limits.max_text_length:
            await self.refusals.refuse(
                msg,
                "too_long",
                (
                    f"Your message is {len(msg.text):,} characters long; I can take at most "
                    f"{self.cfg.limits.max_text_length:,}. Please split it or send a shorter version."
                ),
            )
            return None
        if not msg.text.strip() and not msg.attachments:
            await self.inbox.finish(msg, "empty")
            return None
        if not replay and not is_reminder(msg):  # a due reminder is no message of the person's
            allowed, wait = self.limiter.allow(msg.principal)
            if not allowed:
                await self.refusals.refuse(
                    msg,
                    "rate_limited",
                    f"You're sending messages faster than I can answer. Please wait about {int(wait) + 1} seconds and send it again.",
                    quiet_key=msg.principal,
                )
                return None
        if self.links_refresh is not None:
            await self.links_refresh()
        try:
            lane = resolve_lane(msg, self.cfg.tenancy, self.links)
        except ValueError as err:
            log.warning("cannot place a %s message: %s", msg.platform, err)
            await self.refusals.refuse(msg, "bad_ids", "Sorry, I can't handle messages from this chat.")
            return None
        key = lane.key
        command = None if is_reminder(msg) else parse_command(msg.text)
        if command is not None and command[0].name == "stop":  # handled now, not behind the lane's queue
            await self._stop_turn(msg, key, replay)
            return None
        # a replayed message was accepted once already: it never gets a "busy" refusal
        if not self.lanes.submit(key, Job(msg, lane), force=replay or force):
            await self.refusals.refuse(msg, "busy", BUSY)
            return None
        if self.cfg.limits.busy_mode == "interrupt" and command is None and not replay:
            running = self.running.get(key)
            if running is not None:
                running.set()  # the running turn ends; this message is answered next
        return key

    async def submit_reminder(self, msg: InboundMessage) -> bool:
        """A due reminder occurrence: recorded once in the inbox (False: it was before), then
        run on its lane like a replayed message (never refused as busy)."""
        if not await self.inbox.record(msg):
            return False
        if self.accepting:
            await self.admit(msg, replay=True)
        return True

    async def _stop_turn(self, msg: InboundMessage, key: str, replay: bool) -> None:
        """/stop: end the lane's running turn (its partial answer is kept, flagged interrupted)."""
        running = self.running.get(key)
        if replay:  # a /stop from before a restart has nothing left to stop
            await self.inbox.finish(msg, "command")
            return
        if running is not None and not running.is_set():
            running.set()
            text = "Stopped."
        elif input_uid(msg) in self._stopped_here:  # cluster mode: it stopped the turn on arrival
            self._stopped_here.discard(input_uid(msg))
            text = "Stopped."
        else:
            text = "There's nothing to stop right now."
        if self.shared is not None:  # recorded under this lane's claim, before it is given back
            await self.replies.send_and_finish(msg, text, "notice", "command")
            return
        self.background.run(self.replies.send_and_finish(msg, text, "notice", "command"))
