"""Who may talk to the agent: the allowlist, admins, and pairing codes for unknown DM users.

Approved pairings and live codes live in a `KeyValue` store, so they survive restarts:
gateway.db's kv table on a single node, PostgreSQL in a cluster (a code one node gave is
approved through any node). Codes are never logged.
"""

from __future__ import annotations

import json
import secrets
import time

from core.settings import AccessConfig
from gateway.kv import KeyValue

_CODE_ALPHABET = "ABCDEFGHJKLMNPQRSTUVWXYZ23456789"  # no 0/O/1/I


class Access:
    def __init__(self, cfg: AccessConfig, store: KeyValue) -> None:
        self.cfg = cfg
        self.store = store

    def is_admin(self, principal: str) -> bool:
        return principal in self.cfg.admins

    async def is_allowed(self, principal: str) -> bool:
        if "*" in self.cfg.allowed_users or principal in self.cfg.allowed_users or self.is_admin(principal):
            return True
        return await self.store.get(f"paired:{principal}") is not None

    async def pairing_code(self, principal: str) -> str:
        """The live pairing code for `principal`, issuing a new one if none is live."""
        now = time.time()
        existing = await self.store.get(f"pairing-of:{principal}")
        if existing:
            data = json.loads(existing)
            if data["expires"] > now:
                return data["code"]
            await self.store.put(f"pairing:{data['code']}", None)
        code = "".join(secrets.choice(_CODE_ALPHABET) for _ in range(8))
        record = json.dumps({"code": code, "principal": principal, "expires": now + self.cfg.pairing_code_ttl_s})
        await self.store.put(f"pairing:{code}", record)
        await self.store.put(f"pairing-of:{principal}", record)
        return code

    async def approve(self, code: str) -> str | None:
        """Approve a pairing code; returns the principal it paired, or None if unknown/expired."""
        code = code.strip().upper()
        raw = await self.store.take(f"pairing:{code}")  # single use, even with two approvers racing
        if raw is None:
            return None
        data = json.loads(raw)
        await self.store.put(f"pairing-of:{data['principal']}", None)
        if data["expires"] <= time.time():
            return None
        await self.store.put(f"paired:{data['principal']}", str(time.time()))
        return data["principal"]
