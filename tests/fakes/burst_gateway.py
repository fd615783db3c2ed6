"""A gateway process for crash tests: pushes a burst of N messages from several people
through the real GatewayApp and prints every reply it sends, one line each, flushed.

    python -m tests.fakes.burst_gateway CONFIG N

Run it again with the same N after a SIGKILL: the same platform message ids are pushed
again (the gateway must answer each once), and what the dead run left pending is replayed.
"""

from __future__ import annotations

import asyncio
import itertools
import sys

from adapters.base import InboundMessage, InboundSink, OutboundMessage, SentMessage
from gateway.app import GatewayApp
from gateway.config import load_config


class BurstAdapter:
    platform = "burst"
    max_message_length = 4000
    can_edit = False

    def __init__(self) -> None:
        self._ids = itertools.count(1)

    @staticmethod
    def measure(text: str) -> int:
        return len(text)

    async def start(self, sink: InboundSink) -> None:
        self.sink = sink

    async def stop(self) -> None: ...

    async def send(self, message: OutboundMessage) -> SentMessage:
        print(f"SENT {message.chat_id} {message.text}", flush=True)
        return SentMessage(chat_id=message.chat_id, message_id=str(next(self._ids)))

    async def edit(self, sent: SentMessage, text: str) -> bool:
        return False

    async def typing(self, chat_id: str, thread_id: str | None) -> None: ...


async def main(config_path: str, n: int) -> None:
    cfg = load_config(config_path)
    adapter = BurstAdapter()
    app = GatewayApp(cfg, [adapter])
    await app.start()
    print("READY", flush=True)
    people = [f"p{i}" for i in range(5)]
    for i in range(n):
        person = people[i % len(people)]
        await adapter.sink(InboundMessage(platform="burst", chat_id=f"dm-{person}", chat_type="dm",
                                          user_id=person, message_id=f"burst-{i}", text=f"burst-{i}"))
    await app.drain(120)
    print("DONE", flush=True)
    await app.stop()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2])))
