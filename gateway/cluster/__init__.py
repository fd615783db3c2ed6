"""Cluster mode's PostgreSQL layer (preview): membership, tenant leases with fencing, the
shared inbox with lane claims, the outbox, and pairing/link tables.

Nothing in the single-node gateway imports this package yet; `hermes-gateway cluster
migrate|status` are its only users so far.
"""
