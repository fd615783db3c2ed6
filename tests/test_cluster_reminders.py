"""Reminders in cluster mode (docs/cluster.md#reminders): the due index in PostgreSQL, each
occurrence fired once under its tenant's lease and fenced by the epoch, delivered through the
shared inbox and outbox into the chat it was set in, late ones saying so as on one node.

Two in-process nodes on the real PostgreSQL with the real Telegram adapter against the fake
Bot API, and the fake model; a node's reminder clock is moved forward instead of waiting."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from agent.reminders import ReminderChat, ReminderStore
from gateway.cluster.leases import FencedOut
from gateway.cluster.node import HeldLease
from gateway.cluster.reminders import PgReminders
from tenancy.keys import tenant_dir
from tests.fakes.llm import reply, tool_call
from tests.pg import pool, require_postgres, schema  # noqa: F401 (fixtures)
from tests.test_cluster_node import Node, cluster, node_config, post, settled, texts, tg  # noqa: F401 (fixtures)

require_postgres()


def scheduler(node: Node) -> PgReminders:
    assert isinstance(node.app.reminders, PgReminders)
    return node.app.reminders


def later(nodes: list[Node], offset_s: float) -> None:
    """The nodes' reminder clocks (what is due, and how late a delivery is) move on."""
    for node in nodes:
        scheduler(node).clock = lambda: time.time() + offset_s


async def rows(node: Node, sql: str, *args: Any) -> list[tuple]:
    async with node.app.node.pool.connection() as conn:
        return [tuple(r.values()) for r in await (await conn.execute(sql, args)).fetchall()]


async def until(cond: Any, timeout: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not await cond():
        assert time.monotonic() < deadline, f"{what} not reached within {timeout} s"
        await asyncio.sleep(0.02)


def reminder_texts(fake_tg, chat: int) -> list[str]:
    return [t for t in texts(fake_tg, chat) if t.startswith("⏰ Reminder")]


def dm_chat(user: int) -> ReminderChat:
    return ReminderChat("telegram", str(user), "dm", None, str(user), f"u{user}", lane=f"agent:main:telegram:dm:{user}")


async def file_reminder(fake_tg, data_dir, user: int, text: str, due: float, repeat: str | None = None) -> None:
    """A reminder as the lease holder's tool writes it to the person's reminders.json (in
    the private chat the person has with the bot)."""
    fake_tg.add_chat(user, "private")
    store = ReminderStore(tenant_dir(data_dir, f"telegram-{user}"))
    await store.add(text, due, dm_chat(user), tz=None, repeat=repeat, cap=50, now=time.time())


async def test_a_reminder_set_on_one_node_is_indexed_and_delivered_once_whichever_node_scans(tg, fake_llm, node_config):  # noqa: F811
    async with cluster(node_config, "n1", "n2") as nodes:
        fake_llm.script(
            tool_call("reminders", {"action": "create", "text": "water the plants", "in_minutes": 30}),
            reply("Okay, I'll remind you."),
            tool_call("reminders", {"action": "create", "text": "call Sam", "in_minutes": 40}),
            reply("Okay."),
        )
        assert await post(tg, tg.push_private(111, "remind me to water the plants"), nodes[0]) == 200
        await settled(nodes)
        assert await post(tg, tg.push_private(111, "and to call Sam"), nodes[1]) == 200
        await settled(nodes)
        indexed = await rows(nodes[0], "SELECT tenant, reminder_id, principal, fired_at FROM reminder_due ORDER BY 2")
        assert indexed == [("telegram-111", 1, "telegram:111", None), ("telegram-111", 2, "telegram:111", None)]
        assert await post(tg, tg.push_private(111, "/reminders cancel 2"), nodes[1]) == 200
        await settled(nodes)
        assert (await rows(nodes[0], "SELECT reminder_id FROM reminder_due")) == [(1,)]  # the cancel is in step
        later(nodes, 31 * 60)
        await asyncio.gather(*(scheduler(n).tick() for n in nodes for _ in range(3)))
        await settled(nodes)
        await until(lambda: _true(reminder_texts(tg, 111)), what="the delivery")
        assert reminder_texts(tg, 111) == ["⏰ Reminder: water the plants"]
        occurrences = await rows(nodes[0], "SELECT count(*) FROM inbox WHERE message_id LIKE 'reminder:%%'")
        assert occurrences == [(1,)]
        assert await rows(nodes[0], "SELECT * FROM reminder_due") == []  # the one-off is gone from the index
        assert await ReminderStore(tenant_dir(nodes[0].app.cfg.data_dir, "telegram-111")).all() == []


async def _true(value: Any) -> bool:
    return bool(value)


async def test_a_late_reminder_in_a_cluster_says_it_is_late_as_on_one_node(tg, fake_llm, node_config):  # noqa: F811
    async with cluster(node_config, "n1", "n2") as nodes:
        fake_llm.script(
            tool_call("reminders", {"action": "create", "text": "stretch", "in_minutes": 10}), reply("Okay.")
        )
        assert await post(tg, tg.push_private(112, "remind me to stretch"), nodes[1]) == 200
        await settled(nodes)
        later(nodes, 3 * 3600)
        await until(lambda: _true(reminder_texts(tg, 112)), what="the delivery")
        await settled(nodes)
        (sent,) = reminder_texts(tg, 112)
        assert sent == "⏰ Reminder: stretch\n(This is late: it was due 2 hours ago, while I was offline.)"


async def test_a_stale_epoch_cannot_fire_a_reminder_and_the_new_holder_fires_it_once(tg, fake_llm, node_config):  # noqa: F811
    async with cluster(node_config, "n1", "n2") as nodes:
        n1, n2 = nodes
        tenant = "telegram-113"
        held = await n1.app.node.hold(tenant)
        try:
            await file_reminder(tg, n1.app.cfg.data_dir, 113, "take the pills", time.time() + 600)
            await scheduler(n1).sync(tenant, held)
            stale = held.lease
            # the lease lapses (n1 frozen, say) and n2 takes the tenant under a new epoch
            async with n1.app.node.pool.connection() as conn:
                await conn.execute(
                    "UPDATE tenant_leases SET expires_at = now() - interval '1 second' WHERE tenant = %s", (tenant,)
                )
            taken = await n2.app.node.hold(tenant)
            assert taken.epoch == stale.epoch + 1
            try:
                later([n1], 700)
                # n1 wakes with its old lease, its local deadline not yet passed: the database refuses it
                frozen = HeldLease(stale, time.monotonic() + 60)
                try:
                    await scheduler(n1).fire_due(tenant, frozen)
                    raise AssertionError("a stale epoch fired a reminder")
                except FencedOut:
                    pass
                assert await rows(n1, "SELECT count(*) FROM inbox WHERE message_id LIKE 'reminder:%%'") == [(0,)]
                assert await rows(n1, "SELECT fired_at FROM reminder_due") == [(None,)]
                later([n2], 700)
                assert await scheduler(n2).fire_due(tenant, taken) == 1
                assert await scheduler(n2).fire_due(tenant, taken) == 0  # once
            finally:
                await n2.app.node.unhold(taken)
        finally:
            await n1.app.node.unhold(held)
        await until(lambda: _true(reminder_texts(tg, 113)), what="the delivery")
        await settled(nodes)
        assert reminder_texts(tg, 113) == ["⏰ Reminder: take the pills"]


async def test_two_nodes_racing_over_many_due_reminders_record_and_deliver_each_once(tg, fake_llm, node_config):  # noqa: F811
    users = list(range(120, 126))
    async with cluster(node_config, "n1", "n2") as nodes:
        for user in users:
            for k in range(2):
                await file_reminder(tg, nodes[0].app.cfg.data_dir, user, f"chore {k} of {user}", time.time() + 300 + k)
            await scheduler(nodes[0]).note(f"telegram-{user}", None, False)  # the writer's sync
        assert await rows(nodes[0], "SELECT count(*) FROM reminder_due WHERE fired_at IS NULL") == [(12,)]
        later(nodes, 400)
        await asyncio.gather(*(scheduler(n).tick() for _ in range(4) for n in nodes))

        async def all_sent() -> bool:
            return all(len(reminder_texts(tg, u)) >= 2 for u in users)

        await until(all_sent, what="every delivery")
        await settled(nodes)
        assert await rows(nodes[0], "SELECT count(*) FROM inbox WHERE message_id LIKE 'reminder:%%'") == [(12,)]
        for user in users:
            assert sorted(reminder_texts(tg, user)) == [f"⏰ Reminder: chore {k} of {user}" for k in range(2)]
        assert await rows(nodes[0], "SELECT count(*) FROM reminder_due") == [(0,)]


async def test_an_occurrence_fired_by_a_node_that_died_is_not_fired_again(tg, fake_llm, node_config):  # noqa: F811
    async with cluster(node_config, "n1", "n2") as nodes:
        tenant, due = "telegram-114", time.time() + 120
        await file_reminder(tg, nodes[0].app.cfg.data_dir, 114, "daily walk", due, repeat="daily")
        await scheduler(nodes[0]).note(tenant, None, False)
        # a node fired it (its row marked in the same transaction as the inbox record) and died
        async with nodes[0].app.node.pool.connection() as conn:
            await conn.execute(
                "UPDATE reminder_due SET fired_at = now() - interval '1 minute', fired_by = 'gone' WHERE tenant = %s",
                (tenant,),
            )
        later(nodes, 130)
        await asyncio.gather(*(scheduler(n).tick() for n in nodes))
        (kept,) = await ReminderStore(tenant_dir(nodes[0].app.cfg.data_dir, tenant)).all()
        assert abs(kept.due - (due + 86400)) < 0.01  # moved on to tomorrow, not fired again
        assert await rows(nodes[0], "SELECT due_at, fired_at FROM reminder_due") == [(kept.due, None)]
        assert await rows(nodes[0], "SELECT count(*) FROM inbox WHERE message_id LIKE 'reminder:%%'") == [(0,)]
        assert reminder_texts(tg, 114) == []


async def test_a_reminder_in_the_file_but_not_in_the_index_is_indexed_when_its_profile_opens(tg, fake_llm, node_config):  # noqa: F811
    async with cluster(node_config, "n1", "n2") as nodes:
        # its writer died between the file and the index
        await file_reminder(tg, nodes[0].app.cfg.data_dir, 115, "feed the cat", time.time() + 900)
        assert await rows(nodes[0], "SELECT count(*) FROM reminder_due") == [(0,)]
        fake_llm.script(reply("Hi."))
        assert await post(tg, tg.push_private(115, "hello"), nodes[1]) == 200
        await settled(nodes)
        assert await rows(nodes[0], "SELECT tenant, fired_at FROM reminder_due") == [("telegram-115", None)]
        later(nodes, 1000)
        await until(lambda: _true(reminder_texts(tg, 115)), what="the delivery")
        await settled(nodes)
        assert reminder_texts(tg, 115) == ["⏰ Reminder: feed the cat"]


async def test_a_damaged_reminders_file_does_not_keep_its_profile_from_opening(tg, fake_llm, node_config):  # noqa: F811
    async with cluster(node_config, "n1", "n2") as nodes:
        path = tenant_dir(nodes[0].app.cfg.data_dir, "telegram-116") / "reminders.json"
        path.parent.mkdir(parents=True)
        path.write_text('{"next_id": 2, "reminders": [{"id": 1}]}', "utf-8")  # no text, no due
        fake_llm.script(reply("Hi there."))
        assert await post(tg, tg.push_private(116, "hello"), nodes[0]) == 200
        await settled(nodes)
        assert texts(tg, 116) == ["Hi there."]
        assert await rows(nodes[0], "SELECT count(*) FROM reminder_due") == [(0,)]
