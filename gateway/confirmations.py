"""Tool calls that wait for the person (docs/concepts.md#tool-confirmations).

A turn's gate posts a question with "Allow" / "Deny" buttons in the turn's chat (the
adapter's `Confirms`), and waits: a press by the person whose turn it is decides, anyone
else's press is refused by the adapter with a short sentence, and no answer within
`tools.confirm_timeout_s` (or a `/stop`) means deny. Where the open questions live is the
mode's `OpenQuestions` (gateway/modes.py): on one node this process (`LocalQuestions`), in
a cluster PostgreSQL (gateway/cluster/questions.py), so a press on any node decides. After
a restart an old question's buttons say it expired, and the turn, replayed, asks again; a
call is never run without a press.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import cast

from agent.toolkit import ConfirmGate
from core.messages import ConfirmRequest, ConfirmVerdict, InboundMessage
from core.protocols import Adapter, Confirms
from gateway.modes import OpenQuestions

log = logging.getLogger("hermes.gateway")

ALLOWED, DENIED, NO_ANSWER, STOPPED = "Allowed.", "Denied.", "No answer: denied.", "Stopped: denied."


@dataclass
class _Waiting:
    request: ConfirmRequest
    answer: asyncio.Future[bool] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class LocalQuestions:
    """The `OpenQuestions` of a single node: the open questions of this process, by token."""

    def __init__(self) -> None:
        self._open: dict[str, _Waiting] = {}

    async def open(self, request: ConfirmRequest, lane: str) -> None:
        self._open[request.token] = _Waiting(request)

    async def decide(self, token: str, user_id: str, allow: bool) -> ConfirmVerdict:
        waiting = self._open.get(token)
        if waiting is None or waiting.answer.done():
            return "expired"
        if user_id != waiting.request.user_id:
            return "not_yours"
        waiting.answer.set_result(allow)
        return "ok"

    async def wait(self, token: str, timeout: float, stop: asyncio.Event | None) -> bool | None:
        waiting = self._open.get(token)
        if waiting is None:
            return None
        stopper = asyncio.ensure_future(stop.wait()) if stop is not None else None
        watched: set[asyncio.Future[object]] = {cast("asyncio.Future[object]", waiting.answer)}
        if stopper is not None:
            watched.add(cast("asyncio.Future[object]", stopper))
        try:
            done, _ = await asyncio.wait(watched, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if stopper is not None:
                stopper.cancel()
        if waiting.answer in done:
            return waiting.answer.result()
        waiting.answer.cancel()  # a press from now on is told it expired
        return None

    async def close(self, token: str) -> None:
        self._open.pop(token, None)

    def open_questions(self) -> int:
        return len(self._open)


class Confirmations:
    """Asks the questions of the turns' gates and hands the presses to the mode's `OpenQuestions`."""

    def __init__(self, adapters: Mapping[str, Adapter], timeout_s: float, questions: OpenQuestions) -> None:
        self._adapters = adapters
        self._timeout_s = timeout_s
        self._questions = questions

    async def answer(self, token: str, user_id: str, allow: bool) -> ConfirmVerdict:
        """A press on a question's button (the adapters' `answerer`), on whichever node it
        arrives; raises when it cannot be recorded (the adapter then says nothing untrue)."""
        return await self._questions.decide(token, user_id, allow)

    def gate_for(self, msg: InboundMessage, lane: str, stop: asyncio.Event | None) -> ConfirmGate:
        """The gate of the turn answering `msg` on lane `lane`: asks in its chat, only its sender may press."""

        async def gate(tool: str, text: str) -> str | None:
            adapter = self._adapters.get(msg.platform)
            if not isinstance(adapter, Confirms):
                return "this chat cannot show buttons to ask"
            request = ConfirmRequest(
                token=secrets.token_hex(8),
                platform=msg.platform,
                chat_id=msg.chat_id,
                thread_id=msg.thread_id,
                user_id=msg.user_id,
                text=text,
            )
            return await self._ask(adapter, request, lane, stop)

        return gate

    async def _ask(
        self, adapter: Confirms, request: ConfirmRequest, lane: str, stop: asyncio.Event | None
    ) -> str | None:
        try:
            await self._questions.open(request, lane)
        except Exception:
            log.exception("%s: a confirmation could not be kept open", request.platform)
            return "the question could not be kept open"
        try:
            try:
                sent = await adapter.ask(request)
            except Exception:
                log.exception("%s: asking for a confirmation failed", request.platform)
                return "the question could not be posted"
            if sent is None:
                return "the chat refused the question"
            allowed = await self._questions.wait(request.token, self._timeout_s, stop)
            if allowed is None:
                outcome = STOPPED if stop is not None and stop.is_set() else NO_ANSWER
            else:
                outcome = ALLOWED if allowed else DENIED
            with contextlib.suppress(Exception):  # the decision stands even if the edit fails
                await adapter.settle(request, sent, outcome)
            if allowed:
                return None
            return {DENIED: "denied", NO_ANSWER: "no answer in time", STOPPED: "stopped"}[outcome]
        finally:
            try:
                await self._questions.close(request.token)
            except Exception as exc:  # the row expires by itself
                log.warning("could not remove a decided confirmation (%s)", type(exc).__name__)


__all__ = ["Confirmations", "LocalQuestions"]
