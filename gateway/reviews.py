"""Background memory review (agent/review.py) after replies, and the flush of every lane of
this run at shutdown. Neither ever delays an answer or is shown to the person."""

from __future__ import annotations

import logging
from collections import OrderedDict

from agent.agents import Agents
from agent.prompt import ChatPlace
from agent.turn import TurnResult
from core.errors import LaneMoved, LeaseLost
from core.lanes import Lane
from core.messages import InboundMessage
from core.settings import MemoryConfig
from gateway.jobs import Background
from gateway.linking import Linking
from gateway.outbox import Deliverer

log = logging.getLogger("hermes.gateway")

MAX_ACTIVE_LANES = 1000  # lanes remembered for the shutdown flush


class Reviews:
    def __init__(
        self, cfg: MemoryConfig, agents: Agents, linking: Linking, deliverer: Deliverer, background: Background
    ) -> None:
        self.cfg = cfg
        # the turn counters per lane are the default agent's; a review runs with the model
        # the tenant chose (agent/agents.py)
        self.agents = agents
        self.agent = agents.default
        self.linking = linking
        self.deliverer = deliverer
        self.background = background
        # lanes that ran turns in this process, newest last: flushed at shutdown (bounded)
        self.active: OrderedDict[str, tuple[InboundMessage, Lane, ChatPlace]] = OrderedDict()

    def after_reply(
        self, msg: InboundMessage, lane: Lane, place: ChatPlace, result: TurnResult, *, last_chunk: int | None = None
    ) -> None:
        """The reply is recorded: count the turn and start a review in the background when
        due; it waits until the reply's last chunk was sent, so it never delays the answer."""
        key = lane.key
        self.active[key] = (msg, lane, place)
        self.active.move_to_end(key)
        while len(self.active) > MAX_ACTIVE_LANES:
            self.active.popitem(last=False)
        memory, skills = self.agent.reviewer.note_turn(lane, result.tool_iterations)
        if memory or skills:
            self.background.run(self._review(msg, lane, place, result.session_id, memory, skills, last_chunk))

    async def _review(
        self,
        msg: InboundMessage,
        lane: Lane,
        place: ChatPlace,
        session_id: str,
        memory: bool,
        skills: bool,
        last_chunk: int | None = None,
    ) -> None:
        try:
            if last_chunk is not None:
                await self.deliverer.wait(last_chunk, timeout=self.cfg.review_timeout_s)
            async with self.linking.use(msg, lane) as profile:
                history = await profile.sessions.history(session_id)
                await (await self.agents.of(profile)).reviewer.review(
                    profile, lane, place, history, memory=memory, skills=skills, trigger="nudge"
                )
        except LaneMoved:
            log.info("background review skipped: the lane moved to another profile")
        except LeaseLost as lost:
            log.info("background review skipped: %s", lost)
        except Exception:  # never shown to the person
            log.exception("background review failed")

    async def flush(self) -> None:
        """Shutdown ends every session of this run: flush those with enough unreviewed turns."""
        for msg, lane, place in list(self.active.values()):
            if not self.agent.reviewer.has_unreviewed(lane):
                continue
            try:
                async with self.linking.use(msg, lane) as profile:
                    session_id = await profile.sessions.route(lane.session_key)
                    if session_id is not None:
                        agent = await self.agents.of(profile)
                        await agent.flush(profile, lane, place, await profile.sessions.history(session_id))
            except (LaneMoved, LeaseLost):  # moved, or another node runs the tenant now
                continue
            except Exception:
                log.exception("memory flush at shutdown failed")
