"""Cluster mode's PostgreSQL layer (preview): membership, tenant leases with fencing, the
shared inbox with lane claims, the outbox, shared identity state (`identity`, `shared_kv`,
`links`), ingress election (`ingress`) and the cluster health check (`health`).

`hermes-gateway cluster migrate|status` use it; the run loop does not yet.
"""
