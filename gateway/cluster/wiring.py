"""A started cluster node's shared parts, put into the running app: identity state in
PostgreSQL, the `/healthz` cluster check, and the ingress election over the adapters that
run in elected mode (`hermes-gateway run` builds them so in cluster mode)."""

from __future__ import annotations

from collections.abc import Iterable
from functools import partial
from typing import TYPE_CHECKING, Any

from core.settings import Config
from gateway.cluster.health import ClusterHealth
from gateway.cluster.identity import share_identity
from gateway.cluster.ingress import TELEGRAM_POLLING, TELEGRAM_WEBHOOK, IngressElection, Role, discord_shard

if TYPE_CHECKING:  # pragma: no cover
    from gateway.app import GatewayApp
    from gateway.cluster.node import ClusterNode


def ingress_roles(adapters: Iterable[Any], cfg: Config) -> list[Role]:
    """One role per way in: Telegram's polling or webhook registration, each Discord shard."""
    roles: list[Role] = []
    for adapter in adapters:
        if not getattr(adapter, "elected", False):
            continue  # receives by itself (a test's loopback adapter, a console)
        if adapter.platform == "telegram":
            name = TELEGRAM_WEBHOOK if cfg.platforms.telegram.mode == "webhook" else TELEGRAM_POLLING
            roles.append(Role(name, adapter.start_receiving, adapter.stop_receiving))
        elif adapter.platform == "discord":
            for n in range(cfg.platforms.discord.shard_count):
                roles.append(
                    Role(discord_shard(n), partial(adapter.start_shard, n), partial(adapter.stop_shard, n), spread=True)
                )
    return roles


async def attach_shared_state(app: GatewayApp, node: ClusterNode) -> None:
    """Before the adapters start: pairing, link codes and links in PostgreSQL; /healthz."""
    await share_identity(app, node.pool, node.node_id, node.ttl)
    app.cluster_health = ClusterHealth(node.pool, node.node_id, instance=node.instance).check


def ingress_election(app: GatewayApp, node: ClusterNode) -> IngressElection | None:
    """The election over the app's elected adapters; None when none receives by election."""
    roles = ingress_roles(app.adapters.values(), app.cfg)
    if not roles:
        return None
    return IngressElection(
        node.pool, node.node_id, node.ttl, roles, metrics=node.metrics, may_hold=lambda: node.displaced is None
    )
