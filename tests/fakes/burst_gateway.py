"""A gateway process for crash tests: pushes a burst of N messages from several people
through the real GatewayApp and prints every reply it sends, one line each, flushed.

    python -m tests.fakes.burst_gateway CONFIG N

Run it again with the same N after a SIGKILL: the same platform message ids are pushed
again (the gateway must answer each once), and what the dead run left pending is replayed.
"""

from __future__ import annotations

import asyncio
import sys

from adapters.loopback import LoopbackAdapter
from core.messages import InboundMessage
from core.settings import load_config
from gateway.build import build_gateway


async def main(config_path: str, n: int) -> None:
    cfg = load_config(config_path)
    adapter = LoopbackAdapter("burst", record=False, on_send=lambda m: print(f"SENT {m.chat_id} {m.text}", flush=True))
    app = build_gateway(cfg, [adapter])
    await app.start()
    print("READY", flush=True)
    people = [f"p{i}" for i in range(5)]
    for i in range(n):
        person = people[i % len(people)]
        await adapter.push(
            InboundMessage(
                platform="burst",
                chat_id=f"dm-{person}",
                chat_type="dm",
                user_id=person,
                message_id=f"burst-{i}",
                text=f"burst-{i}",
            )
        )
    await app.drain(120)
    print("DONE", flush=True)
    await app.stop()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2])))
