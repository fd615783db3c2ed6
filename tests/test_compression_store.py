"""The session-store side of compression: summary placement in history(), the atomic
compact() and rotate(carry=...), undo around summaries, per-session compression state —
all surviving a reopen and a rebuild of state.db from the journals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import agent.sessions.db as session_db
from agent.messages import StoredMessage
from agent.sessions import SessionStore
from tests.test_sessions import assert_consistent, jlines


@pytest.fixture
def profile(tmp_path: Path) -> Path:
    return tmp_path / "profiles" / "tenant-c"


def summary_msg(sid: str, after: str, text: str = "the summary") -> StoredMessage:
    return StoredMessage(sid, "user", text, meta={"compressed_summary": True, "after_uid": after})


async def conversation(s: SessionStore, sid: str, n: int = 5) -> list[StoredMessage]:
    out = [StoredMessage(sid, "system", "sys")]
    for i in range(n):
        out += [StoredMessage(sid, "user", f"q{i}"), StoredMessage(sid, "assistant", f"a{i}")]
    return await s.append_many(out)


def contents(msgs: list[StoredMessage]) -> list[str | None]:
    return [m.content for m in msgs]


def drop_db(profile: Path) -> None:
    for name in ("state.db", "state.db-wal", "state.db-shm"):
        (profile / name).unlink(missing_ok=True)


async def test_compact_places_the_summary_between_head_and_tail_atomically(profile: Path) -> None:
    async with SessionStore(profile) as s:
        sid = await s.start_session("lane")
        msgs = await conversation(s, sid)  # sys q0 a0 q1 a1 q2 a2 q3 a3 q4 a4
        middle = msgs[2:7]  # a0 .. a2
        n = await s.compact(sid, [m.uid for m in middle], [summary_msg(sid, msgs[1].uid)], reason="compression")
        assert n == 5
        expected = ["sys", "q0", "the summary", "q3", "a3", "q4", "a4"]
        assert contents(await s.history(sid)) == expected
        assert len(await s.history(sid, include_inactive=True)) == 12
        assert {h["uid"] for h in await s.search("a1")} == {msgs[4].uid}
        # the journal got the message line and one flags event, in one write
        tail = jlines(profile, sid)[-2:]
        assert tail[0]["type"] == "message" and tail[0]["content"] == "the summary"
        assert tail[1]["event"] == "flags" and tail[1]["compacted"] is True and len(tail[1]["uids"]) == 5
        # new messages go after the tail, not after the summary
        await s.append(StoredMessage(sid, "user", "q5"))
        assert contents(await s.history(sid))[-3:] == ["q4", "a4", "q5"]
    assert_consistent(profile)
    async with SessionStore(profile) as s:
        assert contents(await s.history(sid)) == [*expected, "q5"]
    drop_db(profile)
    async with SessionStore(profile) as s:  # rebuilt from the journals alone
        assert contents(await s.history(sid)) == [*expected, "q5"]
        assert sum(m.compacted for m in await s.history(sid, include_inactive=True)) == 5


async def test_compact_is_all_or_nothing(profile: Path, monkeypatch) -> None:
    async with SessionStore(profile) as s:
        sid = await s.start_session("lane")
        msgs = await conversation(s, sid, 3)

        def boom(*a, **k):
            raise RuntimeError("disk on fire")

        monkeypatch.setattr(session_db, "apply_flags", boom)
        with pytest.raises(RuntimeError):
            await s.compact(sid, [msgs[2].uid], [summary_msg(sid, msgs[1].uid)])
        monkeypatch.undo()
        assert contents(await s.history(sid)) == ["sys", "q0", "a0", "q1", "a1", "q2", "a2"]
        assert not any(d.get("content") == "the summary" for d in jlines(profile, sid))
    assert_consistent(profile)


async def test_summary_with_a_missing_anchor_keeps_insertion_order(profile: Path) -> None:
    async with SessionStore(profile) as s:
        sid = await s.start_session("lane")
        msgs = await conversation(s, sid, 2)
        await s.append(summary_msg(sid, "no-such-uid"))
        assert contents(await s.history(sid))[-1] == "the summary"
        other = await s.append(StoredMessage(sid, "user", "x", meta={"after_uid": "loop"}))
        await s.append(StoredMessage(sid, "user", "loop", uid="loop", meta={"after_uid": other.uid}))
        hist = await s.history(sid)
        assert len(hist) == len(msgs) + 3 and {"x", "loop"} <= set(contents(hist))


async def test_undo_after_compaction_never_takes_back_the_summary(profile: Path) -> None:
    async with SessionStore(profile) as s:
        sid = await s.start_session("lane")
        msgs = await conversation(s, sid, 4)
        q4 = await s.append(StoredMessage(sid, "user", "q4"))
        await s.compact(sid, [m.uid for m in msgs[2:6]], [summary_msg(sid, msgs[1].uid)])
        await s.append(StoredMessage(sid, "assistant", "a4"))
        assert contents(await s.history(sid)) == ["sys", "q0", "the summary", "a2", "q3", "a3", "q4", "a4"]
        assert await s.undo_last_turn(sid) == 2  # q4 and a4, not the summary written after q4
        assert contents(await s.history(sid)) == ["sys", "q0", "the summary", "a2", "q3", "a3"]
        assert await s.undo_last_turn(sid) == 2
        assert "the summary" in contents(await s.history(sid))
        assert q4.uid not in {m.uid for m in await s.history(sid)}


async def test_rotate_with_carry_moves_route_and_compacts_parent_in_one_step(profile: Path) -> None:
    async with SessionStore(profile) as s:
        parent = await s.start_session("lane", source="telegram")
        msgs = await conversation(s, parent, 3)
        carry = [
            StoredMessage("placeholder", "system", "fresh sys"),
            StoredMessage("placeholder", "user", "sum", meta={"compressed_summary": True}),
            StoredMessage("placeholder", "user", "q2", meta={"copied_from": msgs[5].uid}),
        ]
        child = await s.rotate("lane", parent, "compression", carry=carry, compact_uids=[m.uid for m in msgs[1:5]])
        assert await s.route("lane") == child
        info = await s.session_info(child)
        assert info["parent_session_id"] == parent and info["message_count"] == 3 and info["source"] == "telegram"
        assert contents(await s.history(child)) == ["fresh sys", "sum", "q2"]
        assert all(m.session_id == child for m in await s.history(child))
        pinfo = await s.session_info(parent)
        assert pinfo["end_reason"] == "compression"
        every = await s.history(parent, include_inactive=True)
        assert len(every) == 7 and sum(m.compacted for m in every) == 4
        with pytest.raises(ValueError):  # carried messages must be new rows
            await s.rotate("lane", child, "compression", carry=[msgs[0]])
        assert await s.route("lane") == child
    assert_consistent(profile)
    drop_db(profile)
    async with SessionStore(profile) as s:
        assert await s.route("lane") == child
        assert contents(await s.history(child)) == ["fresh sys", "sum", "q2"]
        assert sum(m.compacted for m in await s.history(parent, include_inactive=True)) == 4


async def test_compression_state_is_per_session_and_survives_reopen(profile: Path) -> None:
    async with SessionStore(profile) as s:
        a = await s.start_session("a")
        b = await s.start_session("b")
        assert await s.compression_state(a) == {}
        await s.set_compression_state(a, {"ineffective": 2, "blocked_at": 123.5, "warned": True})
        await s.set_compression_state(a, {"ineffective": 1, "blocked_at": None})
        assert await s.compression_state(b) == {}
        await s.increment_compressions(b, by=3)
        assert (await s.session_info(b))["compressions"] == 3
    async with SessionStore(profile) as s:
        assert await s.compression_state(a) == {"ineffective": 1, "blocked_at": None}
        assert json.dumps(await s.compression_state(a))
