"""Streamed drafts and progress notices in cluster mode (docs/cluster.md#streaming-and-progress-notices),
in process against the real PostgreSQL: two GatewayApp nodes, the real TelegramAdapter and
the fake Bot API, the fake model streaming over SSE. A node "dies" by freezing: its claim
workers, deliverer and heartbeats stop without leaving, as after a SIGKILL or SIGSTOP."""

from __future__ import annotations

import asyncio
from typing import Any

from core.messages import InboundMessage
from gateway.cluster.leases import FencedOut, Lease
from gateway.cluster.ledger import NOTICE_CUT_OFF, insert_chunk
from gateway.replies import Notifier
from gateway.runtime import GatewayApp
from tests.fakes.llm import hang, paused, reply
from tests.fakes.telegram_api import FakeTelegram
from tests.test_cluster_node import node_config, post, settled, started, texts, tg  # noqa: F401 (fixtures)

STREAM = {"streaming": "dm", "stream_edit_interval_s": 0.2}
CURSOR = "…"


async def freeze(app: GatewayApp) -> None:
    """The node stops dead: no claims, no sends, no heartbeats, and it does not leave."""
    assert app.claims is not None and app.node is not None and app.node._beat is not None
    await app.claims.stop(0)
    app.claims = None
    await app.deliverer.close(0)
    app.node._beat.cancel()


async def rows(app: GatewayApp, sql: str, params: tuple[Any, ...] = ()) -> list[dict[str, Any]]:
    assert app.node is not None
    async with app.node.pool.connection() as conn:
        return list(await (await conn.execute(sql, params)).fetchall())


async def until_rows(app: GatewayApp, sql: str, n: int = 1, timeout: float = 20) -> list[dict[str, Any]]:
    """Until `sql` returns at least `n` rows (within `timeout`)."""

    async def wait() -> list[dict[str, Any]]:
        while len(found := await rows(app, sql)) < n:
            await asyncio.sleep(0.05)
        return found

    return await asyncio.wait_for(wait(), timeout)


async def draft_in_chat(fake: FakeTelegram, chat: int) -> dict[str, Any]:
    [draft] = await fake.wait_sent(1, chat, timeout=20)
    assert draft["text"].endswith(CURSOR), draft["text"]
    return draft


async def marked_sent(app: GatewayApp, stream: str) -> None:
    """Until the node has marked its first `stream` chunk sent (past the send window)."""
    await until_rows(app, f"SELECT id FROM outbox WHERE sent_at IS NOT NULL AND body->>'stream' = '{stream}'")


async def test_a_chunk_under_a_stale_epoch_is_refused_by_the_statement_that_would_record_it(tg, fake_llm, node_config):  # noqa: F811
    async with started(node_config("n1", delivery=STREAM)) as one:
        app = one.app
        assert await post(tg, tg.push_private(4100, "hi"), one) == 200
        await settled([one])
        [chunk] = await rows(app, "SELECT id, inbox_id, lane, tenant, platform, chat_id, epoch FROM outbox")
        [lease] = await rows(
            app, "SELECT tenant, holder, epoch, expires_at FROM tenant_leases WHERE tenant = %s", (chunk["tenant"],)
        )
        current = Lease(lease["tenant"], lease["holder"], int(lease["epoch"]), lease["expires_at"])
        stale = Lease(current.tenant, current.holder, current.epoch - 1, current.expires_at)
        edit = {"text": "stale edit", "kind": "notice", "edit_of": chunk["id"], "stream": "draft"}
        assert app.node is not None
        async with app.node.pool.connection() as conn, conn.transaction():  # no check before: only the statement
            args = (chunk["inbox_id"], 7, chunk["lane"], chunk["tenant"], chunk["platform"], chunk["chat_id"], edit)
            try:
                await insert_chunk(conn, *args, stale)
                raise AssertionError("a chunk under a stale epoch was recorded")
            except FencedOut:
                pass
        assert len(await rows(app, "SELECT id FROM outbox")) == 1
        async with app.node.pool.connection() as conn, conn.transaction():  # the same under the current epoch
            await insert_chunk(conn, *args, current)
        assert len(await rows(app, "SELECT id FROM outbox")) == 2


async def test_a_node_fenced_out_mid_stream_records_no_draft_edit_and_the_answer_replaces_its_draft(
    tg,  # noqa: F811
    fake_llm,
    node_config,  # noqa: F811
):
    answer = "Here is a first part that then goes STALE-TAIL on and on"
    fake_llm.script(paused(answer, after_chars=20))
    async with started(node_config("n1", delivery=STREAM)) as one:
        app = one.app
        assert app.node is not None
        assert await post(tg, tg.push_private(4200, "tell me"), one) == 200
        draft = await draft_in_chat(tg, 4200)
        [lease] = await rows(app, "SELECT tenant, epoch FROM tenant_leases WHERE tenant NOT LIKE 'ingress:%%'")
        async with app.node.pool.connection() as conn:  # taken over behind the node's back
            await conn.execute("UPDATE tenant_leases SET epoch = epoch + 1 WHERE tenant = %s", (lease["tenant"],))
        fake_llm.resume_streams()  # the old run goes on writing: its draft edits must not be recorded
        await settled([one], timeout=30)
        recorded = await rows(app, "SELECT epoch, body->>'edit_of' AS edit_of FROM outbox ORDER BY id")
        assert app.node.metrics.fenced.value(kind="turn") == 1  # its final answer was refused too
    # under the stale epoch only the first draft was ever recorded; every edit came later, under the new one
    assert [r["epoch"] for r in recorded if r["epoch"] == lease["epoch"]] == [lease["epoch"]]
    assert all(r["epoch"] > lease["epoch"] for r in recorded if r["edit_of"] is not None)
    assert not any(e["text"].endswith(CURSOR) and "STALE-TAIL" in e["text"] for e in tg.edits)
    # the run again under the new epoch sends the answer the profile kept, in place of the draft
    sent = tg.sent_messages(4200)
    assert [m["message_id"] for m in sent] == [draft["message_id"]]
    assert sent[0]["text"] == answer


async def test_a_streamed_answer_whose_node_died_mid_stream_is_finished_by_the_next_node_in_the_same_message(
    tg,  # noqa: F811
    fake_llm,
    node_config,  # noqa: F811
):
    fake_llm.script(
        paused("Part of an answer that the dying node never finishes", after_chars=18), reply("Whole answer.")
    )
    async with started(node_config("n1", delivery=STREAM)) as one:
        assert await post(tg, tg.push_private(4300, "tell me"), one) == 200
        draft = await draft_in_chat(tg, 4300)
        await marked_sent(one.app, "draft")
        await freeze(one.app)
        async with started(node_config("n2", delivery=STREAM)) as two:
            await tg.wait_for(lambda: tg.sent_messages(4300)[0]["text"] == "Whole answer.", timeout=30)
            await settled([two], timeout=30)
            fake_llm.resume_streams()  # the frozen node's run, if it still waits, finds its lease gone
    sent = tg.sent_messages(4300)
    assert [m["message_id"] for m in sent] == [draft["message_id"]]  # one message: the draft became the final
    assert sent[0]["text"] == "Whole answer."
    assert texts(tg, 4300) == ["Whole answer."]


async def test_a_draft_the_platform_took_but_the_dead_node_never_marked_is_left_stale_above_one_final_answer(
    tg,  # noqa: F811
    fake_llm,
    node_config,  # noqa: F811
):
    fake_llm.script(
        paused("Part of an answer that the dying node never finishes", after_chars=18), reply("Whole answer.")
    )
    async with started(node_config("n1", delivery=STREAM)) as one:
        tg.delay_next("sendMessage", 5.0)  # the draft is carried out, its answer comes late
        assert await post(tg, tg.push_private(4350, "tell me"), one) == 200
        await draft_in_chat(tg, 4350)
        await freeze(one.app)  # Telegram shows the draft; the ledger never learns its message id
        async with started(node_config("n2", delivery=STREAM)) as two:
            await tg.wait_sent(2, 4350, timeout=30)
            await settled([two], timeout=30)
    # the send window (docs/cluster.md#streaming-and-progress-notices): a stale draft, then the answer once
    [stale, final] = texts(tg, 4350)
    assert stale.endswith(CURSOR) and final == "Whole answer."
    assert (
        tg.sent_messages(4350)[1]["reply_to_message"]["message_id"]
        == tg.sent_messages(4350)[0]["reply_to_message"]["message_id"]
    )


async def test_a_final_edit_the_platform_took_but_the_dead_node_never_marked_is_not_sent_twice(
    tg,  # noqa: F811
    fake_llm,
    node_config,  # noqa: F811
):
    fake_llm.script(paused("Thinking about it and then some more", after_chars=12))
    async with started(node_config("n1", delivery=STREAM)) as one:
        app = one.app
        assert await post(tg, tg.push_private(4400, "tell me"), one) == 200
        await draft_in_chat(tg, 4400)
        for _ in range(5):  # every edit from now on is carried out but answered late
            tg.delay_next("editMessageText", 3.0)
        fake_llm.resume_streams()
        final = "Thinking about it and then some more"
        await tg.wait_for(lambda: tg.sent_messages(4400)[0]["text"] == final, timeout=20)
        await freeze(app)  # Telegram has the final text; the node dies before it is marked sent
        [unsent] = await rows(app, "SELECT id FROM outbox WHERE sent_at IS NULL AND body->>'stream' IS NULL")
        assert unsent
        async with started(node_config("n2", delivery=STREAM)) as two:
            await settled([two], timeout=30)
    sent = tg.sent_messages(4400)
    assert len(sent) == 1 and sent[0]["text"] == final  # edited again to the same text: no second answer
    assert len(fake_llm.requests) == 1  # the answer was recorded: not asked for again


async def test_a_progress_notice_left_open_by_a_node_that_died_is_ended_by_the_next_holder(tg, fake_llm, node_config):  # noqa: F811
    fake_llm.script(hang(60, "never"), reply("ok: done"))
    async with started(node_config("n1", compression={"progress_notices": True})) as one:
        app = one.app
        assert await post(tg, tg.push_private(4500, "long chat"), one) == 200
        await tg.wait_for(lambda: len(fake_llm.requests) == 1, timeout=20)  # the turn waits at the model
        [row] = await until_rows(app, "SELECT payload FROM inbox")
        await until_rows(app, "SELECT lane FROM lanes WHERE claimed_by = 'n1'")
        msg = InboundMessage.model_validate(row["payload"])
        # what compression's notify does while the turn runs (agent/compression.py)
        await Notifier(app.replies, msg)("progress", "Compressing the conversation (9,000 tokens)…")
        await tg.wait_sent(1, 4500, timeout=20)
        await marked_sent(app, "progress")
        await freeze(app)
        async with started(node_config("n2", compression={"progress_notices": True})) as two:
            await tg.wait_sent(2, 4500, timeout=30)
            await settled([two], timeout=30)
    assert texts(tg, 4500) == [NOTICE_CUT_OFF, "ok: done"]  # the notice no longer claims work in progress
