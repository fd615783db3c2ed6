"""Answers across crashes (docs/operator-guide.md#answers-across-crashes): an answer the model gave and
the profile stored, whose delivery a crash kept from being recorded, is sent exactly once,
in order, however many crashes come between, and whatever the replay collects it with."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Sequence

from gateway.build import build_gateway
from tests.conftest import RecordingAdapter, dm

USER = "kim"
TOKEN = re.compile(r"\bn\d+\b")


def note(i: int):
    return dm(USER, f"n{i}", message_id=f"{USER}-{i}")


async def life(cfg, send: Sequence[int] = (), *, die_recording: int | None = None) -> list[str]:
    """One process life: start (replaying what is pending), take `send`, then either die as
    the answer naming message `die_recording` is about to be recorded (after the session
    store wrote it, before the outbox/inbox commit), or drain. What it sent."""
    adapter = RecordingAdapter()
    app = build_gateway(cfg, [adapter])
    await app.start()
    died = asyncio.Event()
    real_record = app.outbox.record

    async def record_or_die(drafts, *, finish=(), source=None):
        if die_recording is not None and any(m.message_id == f"{USER}-{die_recording}" for m, _ in finish):
            died.set()
            await asyncio.sleep(3600)  # the process is gone before the answer is recorded
        return await real_record(drafts, finish=finish, source=source)

    app.outbox.record = record_or_die  # type: ignore[method-assign]
    try:
        assert adapter.sink is not None
        for i in send:
            await adapter.sink(note(i))
        if die_recording is None:
            assert await app.drain(20)
        else:
            await asyncio.wait_for(died.wait(), 20)
    finally:
        await app.stop(drain_timeout=0.2)
    return adapter.texts()


async def statuses(app_cfg) -> list[tuple[str, str]]:
    from gateway.inbox import Inbox

    inbox = Inbox(app_cfg.data_dir / "gateway.db")
    await inbox.open()
    try:
        rows = await inbox.db.execute_fetchall("SELECT message_id, status FROM inbound ORDER BY message_id")
        return [(r[0], r[1]) for r in rows]
    finally:
        await inbox.close()


def tokens(sent: list[str]) -> list[str]:
    return [t for text in sent for t in TOKEN.findall(text)]


async def test_two_stored_but_unsent_answers_collected_with_a_newer_message_are_each_sent_once_in_order(
    config_for, fake_llm
):
    """n1's answer is stored and the process dies before recording it; the replay collects
    n1 with n2, stores n2's answer and dies the same way; the next replay collects both with
    n3: n1's and n2's stored answers go out once each, in order, ahead of n3's."""
    cfg = config_for(limits={"coalesce_burst_ms": 300, "rate_limit_per_minute": 1000})
    sent = await life(cfg, [1], die_recording=1)
    sent += await life(cfg, [2], die_recording=2)
    asked = len(fake_llm.requests)
    assert asked == 2 and sent == []
    sent += await life(cfg, [3])
    assert tokens(sent) == ["n1", "n2", "n3"], sent
    assert len(fake_llm.requests) == asked + 1  # only n3 was asked: the stored answers were reused
    assert {s for _, s in await statuses(cfg)} == {"done"}


async def test_two_stored_but_unsent_answers_replayed_alone_are_both_sent(config_for, fake_llm):
    """The same two stored answers, replayed with nothing newer: the reply carries both, not
    only the last one's (the first message was marked replied and never answered)."""
    cfg = config_for(limits={"coalesce_burst_ms": 300, "rate_limit_per_minute": 1000})
    await life(cfg, [1], die_recording=1)
    await life(cfg, [2], die_recording=2)
    sent = await life(cfg)
    assert tokens(sent) == ["n1", "n2"], sent
    assert len(fake_llm.requests) == 2


async def test_a_stored_answer_ahead_of_a_stored_collected_answer_survives_a_third_replay(config_for, fake_llm):
    """n1's answer is stored; the replay collects n1 with n2 and n3, answers n2 and n3 in one
    stored answer, and dies before recording it; after yet another crash mid-replay the
    gateway sends n1's answer and then the collected one, each once."""
    cfg = config_for(limits={"coalesce_burst_ms": 300, "rate_limit_per_minute": 1000})
    await life(cfg, [1], die_recording=1)
    await life(cfg, [2, 3], die_recording=3)
    await life(cfg, die_recording=3)  # replayed, stored answers reused, and the crash again
    sent = await life(cfg, [4])
    assert tokens(sent) == ["n1", "n2", "n3", "n4"], sent
    assert len(fake_llm.requests) == 3  # n1; n2 with n3; n4
    assert {s for _, s in await statuses(cfg)} == {"done"}


async def test_a_replayed_message_collected_with_a_later_pending_one_gets_its_own_stored_answer_first(
    config_for, fake_llm
):
    """n1 has a stored answer and n2 was collected with n3 into a stored answer; the replay
    runs n1 and n2 alone (n3 arrives after the batch was taken): n1's answer goes out with
    that batch, and n2's comes with n3's turn, nothing twice."""
    cfg = config_for(limits={"coalesce_burst_ms": 300, "rate_limit_per_minute": 1000})
    await life(cfg, [1], die_recording=1)
    await life(cfg, [2, 3], die_recording=3)
    adapter = RecordingAdapter()
    app = build_gateway(cfg, [adapter])
    # the replay takes only n1 and n2: n3 is held back until their turn has run
    from gateway.inbox import Inbox

    real_pending = Inbox.pending

    async def without_n3(self):
        return [m for m in await real_pending(self) if m.message_id != f"{USER}-3"]

    Inbox.pending = without_n3  # type: ignore[method-assign]
    try:
        await app.start()
    finally:
        Inbox.pending = real_pending  # type: ignore[method-assign]
    try:
        assert await app.drain(20)
        first = adapter.texts()
        await app._admit(note(3), replay=True)
        assert await app.drain(20)
    finally:
        await app.stop()
    assert tokens(first) == ["n1"], first
    assert tokens(adapter.texts()) == ["n1", "n2", "n3"], adapter.texts()
