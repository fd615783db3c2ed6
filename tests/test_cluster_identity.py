"""Cluster mode's shared identity state on the real PostgreSQL: pairing codes and
approvals, link codes and identity links are seen by every node (two GatewayApps, each
with its own connections, standing for two nodes)."""

from __future__ import annotations

import json
import sqlite3

import pytest

from gateway.build import ModeParts, build_parts
from gateway.cluster.db import Pool
from gateway.cluster.identity import SharedIdentity
from gateway.cluster.links import PgLinkStore
from gateway.inbox import Inbox
from gateway.outbox import Outbox
from gateway.runtime import GatewayApp
from tenancy.identity import IdentityLinks
from tenancy.keys import link_tenant_id, tenant_dir
from tests.conftest import RecordingAdapter, dm, make_config, say
from tests.pg import require_postgres, second_pool
from tests.test_linking import code_in

require_postgres()
TTL = 15.0


class Node:
    def __init__(self, app: GatewayApp, pool: Pool, tg: RecordingAdapter, dc: RecordingAdapter) -> None:
        self.app, self.pool, self.tg, self.dc = app, pool, tg, dc


async def _node(tmp_path, fake_llm, schema: str, name: str, *, guard: bool = True, **sections) -> Node:
    pool = await second_pool(schema)
    tg, dc = RecordingAdapter("telegram"), RecordingAdapter("discord")
    sections.setdefault("limits", {"rate_limit_per_minute": 1000})
    cfg = make_config(tmp_path / name, fake_llm.base_url, **sections)
    # a single node whose identity state is the cluster's: pairing, link codes and links in PostgreSQL
    identity = SharedIdentity(cfg, pool, f"node-{name}", TTL)
    inbox = Inbox(cfg.data_dir / "gateway.db", fsync=cfg.storage.fsync)
    mode = ModeParts(
        inbox=inbox,
        outbox=Outbox(inbox),
        links=identity.links,
        kv=identity.kv,
        links_refresh=identity.refresh,
        merge_guard=identity.merge_guard if guard else None,
        cluster=True,
    )
    app = GatewayApp(build_parts(cfg, [tg, dc], mode))
    await identity.start()
    await app.start()
    return Node(app, pool, tg, dc)


@pytest.fixture
async def two_nodes(tmp_path, fake_llm, pool, schema):
    nodes: list[Node] = []

    async def make(*, guard_a: bool = True, **sections) -> tuple[Node, Node]:
        for name in ("a", "b"):
            nodes.append(await _node(tmp_path, fake_llm, schema, name, guard=guard_a or name != "a", **sections))
        return nodes[0], nodes[1]

    yield make
    for n in nodes:
        await n.app.stop()
        await n.pool.close()


async def test_a_pairing_code_made_on_one_node_is_approved_on_another(two_nodes):
    a, b = await two_nodes(access={"allowed_users": [], "admins": ["telegram:boss"]})
    out = await say(a.app, a.tg, dm("stranger", "hi", platform="telegram"))
    assert "pairing code" in out[0]
    code = out[0].split("pairing code is ")[1].split(".")[0]
    assert "Approved telegram:stranger" in (await say(b.app, b.tg, dm("boss", f"/pair {code}", platform="telegram")))[0]
    assert await say(a.app, a.tg, dm("stranger", "hi again", platform="telegram")) == ["ok: hi again"]
    assert await say(b.app, b.tg, dm("stranger", "and here", platform="telegram")) == ["ok: and here"]
    # single use: the code is gone on every node
    assert await a.app.access.approve(code) is None


async def test_a_link_code_issued_on_one_node_is_redeemed_on_another_and_the_link_routes_on_both(two_nodes):
    a, b = await two_nodes()
    code = code_in(await say(a.app, a.tg, dm("111", "/link", platform="telegram")))
    out = await say(b.app, b.dc, dm("222", f"/link {code}", platform="discord"))
    assert out[0].startswith("Code accepted"), out
    # node B asked the issuer (its request is in the shared store); the issuer confirms on A
    assert any("wants to join your identity" in t for t in b.tg.texts("dm-111"))
    out = await say(a.app, a.tg, dm("111", "/link confirm", platform="telegram"))
    assert out[0].startswith("Confirmed"), out
    await a.app.linking.wait_idle(30)
    assert await a.app.drain(30)
    name = a.app.links.name_for("telegram:111")
    assert name is not None and a.app.links.name_for("discord:222") == name
    # node B routes the next message of either account to the link's tenant
    assert b.app.links.name_for("discord:222") is None  # not refreshed yet: nothing routed since
    assert await say(b.app, b.dc, dm("222", "hello from B", platform="discord")) == ["ok: hello from B"]
    assert b.app.links.principals_of(name) == ["telegram:111", "discord:222"]
    assert tenant_dir(b.app.cfg.data_dir, link_tenant_id(name)).is_dir()
    # the code was single use everywhere, and the merge's leases were given back
    again = await say(b.app, b.dc, dm("333", f"/link {code}", platform="discord"))
    assert "unknown, expired or already used" in again[0]
    async with a.pool.connection() as conn:
        rows = await (await conn.execute("SELECT tenant FROM tenant_leases WHERE expires_at > now()")).fetchall()
    assert rows == []


async def test_without_a_merge_guard_a_cluster_node_refuses_to_link_and_links_nothing(two_nodes):
    a, b = await two_nodes(guard_a=False)  # node a is given no guard
    code = code_in(await say(a.app, a.tg, dm("111", "/link", platform="telegram")))
    assert (await say(b.app, b.dc, dm("222", f"/link {code}", platform="discord")))[0].startswith("Code accepted")
    out = await say(a.app, a.tg, dm("111", "/link confirm", platform="telegram"))
    assert "not available" in out[0] and "nothing was linked" in out[0]
    assert a.app.links.name_for("telegram:111") is None


async def test_a_node_with_stale_links_cannot_link_a_principal_another_node_linked(pool):
    fresh, stale = IdentityLinks.shared(PgLinkStore(pool)), IdentityLinks.shared(PgLinkStore(pool))
    fresh.link("alice", "telegram:1")
    fresh.save()
    stale.link("bob", "telegram:1")  # this node has not seen alice's link yet
    with pytest.raises(ValueError, match="already linked to 'alice'"):
        stale.save()
    stale.unlink("telegram:1")  # the caller undoes; nothing of it was recorded
    stale.save()
    assert await PgLinkStore(pool).refresh(stale)
    assert stale.as_dict() == {"alice": ["telegram:1"]}
    fresh.unlink("telegram:1")
    fresh.save()
    assert await PgLinkStore(pool).refresh(stale) and stale.as_dict() == {}


async def test_the_first_cluster_node_brings_in_single_node_links_and_pairings_once(tmp_path, fake_llm, pool, schema):
    data = tmp_path / "a"
    data.mkdir()
    (data / "links.json").write_text(json.dumps({"version": 1, "links": {"al": ["telegram:1", "discord:2"]}}))
    conn = sqlite3.connect(data / "gateway.db")
    conn.execute("CREATE TABLE kv (key TEXT PRIMARY KEY, value TEXT)")
    conn.execute("INSERT INTO kv VALUES ('paired:telegram:9', '1'), ('pairing:XYZ', '{}')")
    conn.commit()
    conn.close()
    node = await _node(tmp_path, fake_llm, schema, "a", access={"allowed_users": []})
    try:
        assert node.app.links.principals_of("al") == ["telegram:1", "discord:2"]
        assert await node.app.access.is_allowed("telegram:9")
        assert await node.app.access.store.get("pairing:XYZ") is None  # live codes stay behind
        node.app.links.unlink("discord:2")
        node.app.links.save()
    finally:
        await node.app.stop()
        await node.pool.close()
    again = await _node(tmp_path, fake_llm, schema, "a")  # a restart does not bring the link back
    try:
        assert again.app.links.principals_of("al") == ["telegram:1"]
    finally:
        await again.app.stop()
        await again.pool.close()
