"""Cluster mode: several `hermes-gateway run` nodes on one PostgreSQL (docs/cluster.md).

Membership and tenant leases with a fencing epoch (`node`, `leases`), the shared inbox with
lane claims (`inbox`, `claims`, `wakeups`), the node's inbox and outbox (`ledger`), shared
identity state (`identity`, `shared_kv`, `links`), ingress election (`ingress`), the
cluster part of `/healthz` (`health`), `cluster status` (`status`), schema migrations and
the PostgreSQL rows of `profiles delete` (`erase`).
"""
