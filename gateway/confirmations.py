"""Tool calls that wait for the person (docs/concepts.md#tool-confirmations).

A turn's gate posts a question with "Allow" / "Deny" buttons in the turn's chat (the
adapter's `Confirms`), and waits: a press by the person whose turn it is decides, anyone
else's press is refused by the adapter with a short sentence, and no answer within
`tools.confirm_timeout_s` (or a `/stop`) means deny. The questions live in this process
only: after a restart an old question's buttons say it expired, and the turn, replayed,
asks again; a call is never run without a press.
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

log = logging.getLogger("hermes.gateway")

ALLOWED, DENIED, NO_ANSWER, STOPPED = "Allowed.", "Denied.", "No answer: denied.", "Stopped: denied."


@dataclass
class _Waiting:
    request: ConfirmRequest
    answer: asyncio.Future[bool] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class Confirmations:
    """The open questions of this process, by token."""

    def __init__(self, adapters: Mapping[str, Adapter], timeout_s: float) -> None:
        self._adapters = adapters
        self._timeout_s = timeout_s
        self._open: dict[str, _Waiting] = {}

    async def answer(self, token: str, user_id: str, allow: bool) -> ConfirmVerdict:
        """A press on a question's button (the adapters' `answerer`)."""
        waiting = self._open.get(token)
        if waiting is None or waiting.answer.done():
            return "expired"
        if user_id != waiting.request.user_id:
            return "not_yours"
        waiting.answer.set_result(allow)
        return "ok"

    def gate_for(self, msg: InboundMessage, stop: asyncio.Event | None) -> ConfirmGate:
        """The gate of the turn answering `msg`: asks in its chat, only its sender may press."""

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
            return await self._ask(adapter, request, stop)

        return gate

    async def _ask(self, adapter: Confirms, request: ConfirmRequest, stop: asyncio.Event | None) -> str | None:
        waiting = _Waiting(request)
        self._open[request.token] = waiting
        try:
            try:
                sent = await adapter.ask(request)
            except Exception:
                log.exception("%s: asking for a confirmation failed", request.platform)
                return "the question could not be posted"
            if sent is None:
                return "the chat refused the question"
            allowed, outcome = await self._wait(waiting, stop)
            with contextlib.suppress(Exception):  # the decision stands even if the edit fails
                await adapter.settle(request, sent, outcome)
            if allowed:
                return None
            return {DENIED: "denied", NO_ANSWER: "no answer in time", STOPPED: "stopped"}[outcome]
        finally:
            self._open.pop(request.token, None)

    async def _wait(self, waiting: _Waiting, stop: asyncio.Event | None) -> tuple[bool, str]:
        stopper = asyncio.ensure_future(stop.wait()) if stop is not None else None
        watched: set[asyncio.Future[object]] = {cast("asyncio.Future[object]", waiting.answer)}
        if stopper is not None:
            watched.add(cast("asyncio.Future[object]", stopper))
        try:
            done, _ = await asyncio.wait(watched, timeout=self._timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if stopper is not None:
                stopper.cancel()
        if waiting.answer in done:
            allowed = waiting.answer.result()
            return allowed, ALLOWED if allowed else DENIED
        waiting.answer.cancel()
        return False, STOPPED if stopper is not None and stopper in done else NO_ANSWER

    def open_questions(self) -> int:
        return len(self._open)


__all__ = ["Confirmations"]
