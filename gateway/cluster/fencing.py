"""The one exception a fenced write raises, importable without psycopg.

A node whose tenant lease was taken over or ran out (its local deadline passed, or the
database refused the epoch) must stop the turn, close the profile and commit nothing. The
gateway catches `LeaseLost` around a turn; the PostgreSQL layer's `FencedOut` is one too.
"""

from __future__ import annotations


class LeaseLost(Exception):
    """A write on behalf of a tenant whose lease this node no longer holds."""
