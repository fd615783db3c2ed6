"""`profiles delete` in cluster mode removes the person's rows from PostgreSQL too (inbox,
outbox, lanes, lease, pairing and link codes, shared_kv, identity links, reminders' due rows), not only from
gateway.db, and leaves everyone else's (real PostgreSQL, one schema per test)."""

from __future__ import annotations

import asyncio
import json
from urllib.parse import quote

from gateway.build import build_gateway
from gateway.cluster.erase import delete_tenant_everywhere
from gateway.tenants import find_tenant
from tests.conftest import RecordingAdapter, dm, make_config, say
from tests.pg import DSN, require_postgres

require_postgres()


async def _rows(pool, sql: str) -> list:
    async with pool.connection() as conn:
        return [tuple(r.values()) for r in await (await conn.execute(sql)).fetchall()]


async def _linked_profile(data, fake_llm) -> None:
    """alice's linked profile (telegram:111 with discord:222), made by a single node on `data`."""
    single = make_config(data, fake_llm.base_url, tenancy={"identity_links": {"al": ["telegram:111", "discord:222"]}})
    tg = RecordingAdapter("telegram")
    app = build_gateway(single, [tg])
    await app.start()
    try:
        await say(app, tg, dm("111", "hello", platform="telegram"))
    finally:
        await app.stop()


async def _seed(pool) -> None:
    """Shared rows of alice (telegram:111, a link with discord:222) and of bob (telegram:333)."""
    async with pool.connection() as conn:
        for who, tenant, chat in (
            ("111", "link-al", "111"),
            ("222", "link-al", "dm-222"),
            ("333", "telegram-333", "333"),
        ):
            platform = "discord" if who == "222" else "telegram"
            payload = json.dumps({"platform": platform, "user_id": who, "text": f"secret of {who}"})
            row = await (
                await conn.execute(
                    "INSERT INTO inbox (platform, chat_id, message_id, lane, tenant, payload) VALUES "
                    "(%s, %s, 'm1', %s, %s, %s) RETURNING id",
                    (platform, chat, f"{tenant}/lane-{who}", tenant, payload),
                )
            ).fetchone()
            await conn.execute(
                "INSERT INTO outbox (inbox_id, seq, lane, tenant, platform, chat_id, body, epoch) VALUES "
                "(%s, 0, %s, %s, %s, %s, %s, 1)",
                (row["id"], f"{tenant}/lane-{who}", tenant, platform, chat, json.dumps({"text": f"reply to {who}"})),
            )
            await conn.execute(
                "INSERT INTO lanes (lane, tenant) VALUES (%s, %s) ON CONFLICT DO NOTHING",
                (f"{tenant}/lane-{who}", tenant),
            )
            await conn.execute(
                "INSERT INTO pairing_codes (code, platform, user_id, expires_at) VALUES (%s, %s, %s, now())",
                (f"P{who}", platform, who),
            )
            await conn.execute(
                "INSERT INTO link_codes (code, principal, expires_at) VALUES (%s, %s, now())",
                (f"L{who}", f"{platform}:{who}"),
            )
            await conn.execute("INSERT INTO shared_kv (key, value) VALUES (%s, '1')", (f"paired:{platform}:{who}",))
        for tenant in ("link-al", "telegram-333"):
            await conn.execute(
                "INSERT INTO tenant_leases (tenant, holder, epoch, expires_at) VALUES (%s, 'n1', 1, now())", (tenant,)
            )
        for principal in ("telegram:111", "discord:222"):
            await conn.execute("INSERT INTO identity_links (principal, link_name) VALUES (%s, 'al')", (principal,))
        for tenant, rid, principal in (  # reminders' due rows: alice's own, one she set in a group, bob's
            ("link-al", 1, "telegram:111"),
            ("telegram-chat-555", 1, "discord:222"),
            ("telegram-chat-555", 2, "telegram:333"),
            ("telegram-333", 1, "telegram:333"),
        ):
            await conn.execute(
                "INSERT INTO reminder_due (tenant, reminder_id, due_at, principal) VALUES (%s, %s, 1e9, %s)",
                (tenant, rid, principal),
            )


async def test_profiles_delete_in_cluster_mode_removes_the_persons_postgresql_rows(
    tmp_path, fake_llm, pool, schema, monkeypatch
):
    data = tmp_path / "data"
    await _linked_profile(data, fake_llm)
    await _seed(pool)
    monkeypatch.setenv("HERMES_DELETE_TEST_DSN", f"{DSN}?options={quote(f'-c search_path={schema}')}")
    cfg = make_config(
        data,
        fake_llm.base_url,
        cluster={"postgres_dsn_env": "HERMES_DELETE_TEST_DSN"},
        tenancy={"identity_links": {"al": ["telegram:111", "discord:222"]}},
    )
    report = await asyncio.to_thread(delete_tenant_everywhere, cfg, find_tenant(cfg, "telegram:111"))
    assert report.shared_rows > 0
    assert await _rows(pool, "SELECT tenant FROM inbox") == [("telegram-333",)]
    assert await _rows(pool, "SELECT tenant FROM outbox") == [("telegram-333",)]
    assert await _rows(pool, "SELECT tenant FROM lanes") == [("telegram-333",)]
    assert await _rows(pool, "SELECT tenant FROM tenant_leases") == [("telegram-333",)]
    assert await _rows(pool, "SELECT user_id FROM pairing_codes") == [("333",)]
    assert await _rows(pool, "SELECT principal FROM link_codes") == [("telegram:333",)]
    assert await _rows(pool, "SELECT key FROM shared_kv WHERE key LIKE 'paired:%'") == [("paired:telegram:333",)]
    assert await _rows(pool, "SELECT principal FROM identity_links") == []
    assert await _rows(pool, "SELECT tenant, principal FROM reminder_due ORDER BY tenant") == [
        ("telegram-333", "telegram:333"),
        ("telegram-chat-555", "telegram:333"),
    ]


async def test_admin_commands_in_cluster_mode_follow_the_links_nodes_made_at_runtime(
    tmp_path, fake_llm, pool, schema, monkeypatch, capsys
):
    """Links made at runtime live in PostgreSQL in a cluster, not in links.json: `profiles`
    and `budget` find a linked account's tenant through them (docs/cluster.md#shared-identity-state)."""
    import yaml

    from gateway.cli import main as cli_main
    from gateway.cli.common import admin_links

    data = tmp_path / "data"
    await _linked_profile(data, fake_llm)
    async with pool.connection() as conn:  # the link as a node records a runtime /link
        for principal in ("telegram:111", "discord:222"):
            await conn.execute("INSERT INTO identity_links (principal, link_name) VALUES (%s, 'al')", (principal,))
    monkeypatch.setenv("HERMES_LINKS_TEST_DSN", f"{DSN}?options={quote(f'-c search_path={schema}')}")
    cfg = make_config(data, fake_llm.base_url, cluster={"postgres_dsn_env": "HERMES_LINKS_TEST_DSN"})
    assert not (data / "links.json").exists()
    links = await asyncio.to_thread(admin_links, cfg)
    assert (await asyncio.to_thread(find_tenant, cfg, "discord:222", links)).tenant_id == "link-al"
    config = tmp_path / "cluster.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "data_dir": str(data),
                "llm": {"base_url": fake_llm.base_url},
                "cluster": {"postgres_dsn_env": "HERMES_LINKS_TEST_DSN"},
            }
        )
    )
    capsys.readouterr()
    assert await asyncio.to_thread(cli_main, ["-c", str(config), "profiles", "path", "discord:222"]) == 0
    assert capsys.readouterr().out.strip().endswith("link-al")
    assert await asyncio.to_thread(cli_main, ["-c", str(config), "profiles", "show", "discord:222", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["tenant"] == "link-al" and "discord:222" in shown["principals"]
