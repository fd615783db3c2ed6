"""Cluster mode: several `hermes-gateway run` nodes on one PostgreSQL (docs/cluster.md).

Membership and tenant leases with a fencing epoch (`node`, `leases`), the shared inbox with
lane claims (`inbox`, `claims`, `wakeups`), the node's inbox and outbox (`ledger`), shared
identity state (`identity`, `shared_kv`, `links`), ingress election (`ingress`), the
cluster part of `/healthz` (`health`), `cluster status` (`status`), schema migrations and
the PostgreSQL rows of `profiles delete` (`erase`).
"""


def require_driver() -> None:
    """Cluster mode needs psycopg, the `cluster` extra: without it, one sentence that says
    how to install it, instead of an ImportError from deep inside a command."""
    from core.settings import ConfigError

    try:
        import psycopg  # noqa: F401
        import psycopg_pool  # noqa: F401
    except ImportError:
        raise ConfigError(
            "cluster mode needs the PostgreSQL driver, which is not installed: pip install 'hermes-gateway[cluster]'"
        ) from None
