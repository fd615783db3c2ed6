"""Fair share under a flood (docs/concepts.md#fair-share).

    .venv/bin/python bench/fair_share.py [--latency 1.0] [--flood 200] [--lanes 14] [--others 20] [--slots 4]
        [--others-after 0] [--first-come] [--json]

One person sends `--flood` messages spread over `--lanes` of their lanes (their DM and
per-user lanes in `--lanes - 1` groups) while `--others` people send one DM each, through
the real `GatewayApp` (inbox, lanes, profiles, turns, the metering gate, delivery) and the
fake model of tests/fakes/llm.py answering every request after `--latency` seconds, with
`llm.max_concurrency: --slots`. The flood is queued first; the others write right after it,
or `--others-after` model latencies later, while the flood is in full swing.

Printed: for each of the others, how long after their message their model call started
(the fake model's arrival time), the worst against the bound ceil(others / slots) + 1
model latencies; whether every flood lane got its answers in the order it was written;
and the wall time of the whole run. Exit status 1 when the bound or the order fails.
`--first-come` is the baseline: the same slots as one first-come queue (every call queued
under one key), what the gateway would do without the round robin.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from adapters.loopback import LoopbackAdapter  # noqa: E402
from agent.fairshare import FairShare  # noqa: E402
from core.messages import InboundMessage  # noqa: E402
from core.settings import parse_config  # noqa: E402
from gateway.build import build_gateway  # noqa: E402
from tests.fakes.llm import FakeLLM, Response, hang, last_user_text, reply  # noqa: E402


def _message(user: str, chat: str, chat_type: str, text: str, n: int) -> InboundMessage:
    return InboundMessage(
        platform="bench",
        chat_id=chat,
        chat_type=chat_type,  # type: ignore[arg-type]
        user_id=user,
        user_name=user,
        message_id=f"m{n}",
        text=text,
        mentions_bot=True,
    )


async def run(
    *, latency: float, flood: int, lanes: int, others: int, slots: int, data_dir: Path, others_after: float = 0.0
) -> dict[str, Any]:
    """One run; the figures as a dict."""
    starts: dict[str, float] = {}

    async def answer(request: dict[str, Any]) -> Response:
        text = last_user_text(request)
        starts.setdefault(text, time.monotonic())
        return hang(latency, reply(f"ok: {text}"))

    async with FakeLLM() as llm:
        llm.responder = answer
        cfg = parse_config(
            {
                "data_dir": str(data_dir),
                "llm": {"base_url": llm.base_url, "model": "fake-model", "max_concurrency": slots, "timeout_s": 600},
                "storage": {"fsync": "batch"},
                "memory": {"nudge_interval": 0, "flush_min_turns": 0},
                "skills": {"creation_nudge_interval": 0},
                # one turn per message, so each flood message has its own answer to order
                "limits": {"rate_limit_per_minute": 100_000, "max_queued_turns": flood + 1, "busy_mode": "queue"},
                "delivery": {"streaming": "off"},
            }
        )
        replies: dict[str, list[str]] = {}
        adapter = LoopbackAdapter(
            "bench", record=False, on_send=lambda m: replies.setdefault(m.chat_id, []).append(m.text)
        )
        app = build_gateway(cfg, [adapter])
        await app.start()
        try:
            n = 0
            chats = [("dm-flood", "dm")] + [(f"g{i}", "group") for i in range(1, lanes)]
            began = time.monotonic()
            for k in range(flood):
                chat, kind = chats[k % lanes]
                n += 1
                await adapter.push(_message("flood", chat, kind, f"flood {chat} {k // lanes:04d}", n))
            sent_at: dict[str, float] = {}
            await asyncio.sleep(others_after * latency)
            for i in range(others):
                n += 1
                text = f"other {i}"
                sent_at[text] = time.monotonic()
                await adapter.push(_message(f"p{i}", f"dm-p{i}", "dm", text, n))
            if not await app.drain(latency * (flood + others) + 120):
                raise RuntimeError("the gateway did not finish the run")
            wall = time.monotonic() - began
        finally:
            await app.stop()
    waits = sorted(starts[t] - sent_at[t] for t in sent_at if t in starts)
    in_order = True
    for chat, _kind in chats:
        got = [r for r in replies.get(chat, []) if r.startswith("ok: flood")]
        in_order &= got == sorted(got) and len(got) == len(range(chats.index((chat, _kind)), flood, lanes))
    bound = (math.ceil(others / slots) + 1) * latency
    return {
        "latency_s": latency,
        "flood": flood,
        "lanes": lanes,
        "others": others,
        "slots": slots,
        "others_after_latencies": others_after,
        "others_started": len(waits),
        "wait_p50_s": round(waits[len(waits) // 2], 3) if waits else None,
        "wait_max_s": round(waits[-1], 3) if waits else None,
        "bound_s": bound,
        "within_bound": len(waits) == others and waits[-1] <= bound,
        "flood_in_order": in_order,
        "wall_s": round(wall, 1),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--latency", type=float, default=1.0)
    ap.add_argument("--flood", type=int, default=200)
    ap.add_argument("--lanes", type=int, default=14)
    ap.add_argument("--others", type=int, default=20)
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--others-after", type=float, default=0.0, help="model latencies into the flood")
    ap.add_argument("--first-come", action="store_true", help="baseline: one first-come queue for everyone")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.first_come:  # the baseline only: every call queued under one key
        fair_slot = FairShare.slot
        FairShare.slot = lambda self, tenant_id: fair_slot(self, "-")  # type: ignore[method-assign]
    with tempfile.TemporaryDirectory(prefix="hermes-fair-") as tmp:
        result = asyncio.run(
            run(
                latency=args.latency,
                flood=args.flood,
                lanes=args.lanes,
                others=args.others,
                slots=args.slots,
                data_dir=Path(tmp),
                others_after=args.others_after,
            )
        )
    result["first_come"] = args.first_come
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"{result['others']} others beside a flood of {result['flood']} messages in {result['lanes']} lanes, "
            f"{result['slots']} slots, model latency {result['latency_s']:g} s:\n"
            f"  model call started after their message: p50 {result['wait_p50_s']} s, max {result['wait_max_s']} s "
            f"(bound {result['bound_s']:g} s: {'ok' if result['within_bound'] else 'EXCEEDED'})\n"
            f"  flood answers in order per lane: {'yes' if result['flood_in_order'] else 'NO'}\n"
            f"  wall time {result['wall_s']} s"
        )
    return 0 if result["within_bound"] and result["flood_in_order"] else 1


if __name__ == "__main__":
    sys.exit(main())
