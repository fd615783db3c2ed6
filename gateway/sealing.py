"""Message text in gateway.db sealed with its tenant's data key (docs/privacy.md#encryption-at-rest).

With `storage.encryption: per_tenant` the inbox's pending payloads and the outbox's unsent
chunks are kept as `hgs1:<tenant>:<record>`: AES-GCM under the key of the tenant whose lane
the message is on, bound to its row, so the text is unreadable once that tenant's key is
destroyed and a record moved to another row does not open. The tenant is known at ingress,
before its profile opens: its key comes from the same `TenantKeys` the profiles use (a new
tenant's is made there, once).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
from collections.abc import Callable
from pathlib import Path

from agent.vault import DataKey, TenantKeys, VaultError
from core.messages import InboundMessage
from tenancy.keys import tenant_dir

PREFIX = "hgs1:"


class MessageSeal:
    """Seals and opens the text a message leaves in gateway.db (one per gateway)."""

    def __init__(self, keys: TenantKeys, data_dir: Path, tenant_of: Callable[[InboundMessage], str | None]) -> None:
        """`tenant_of` names the tenant whose lane a message is on (None: it has none, e.g. an
        unroutable chat; its text is then not kept, see `seal`)."""
        self.keys = keys
        self.data_dir = data_dir
        self.tenant_of = tenant_of

    async def _key(self, tenant_id: str) -> DataKey:
        key = self.keys.cached(tenant_id)
        if key is None:  # a first use unwraps (or makes) it: file I/O, off the loop
            key = await asyncio.to_thread(self.keys.key_for, tenant_id, tenant_dir(self.data_dir, tenant_id))
        if key is None:
            raise VaultError("storage.encryption is off: nothing is sealed")
        return key

    async def seal(self, msg: InboundMessage, text: str, place: str) -> str | None:
        """`text` sealed for `place` with the key of `msg`'s tenant; None when `msg` has no
        tenant (an unroutable message is refused at once: its text is never stored)."""
        tenant_id = self.tenant_of(msg)
        if tenant_id is None:
            return None
        key = await self._key(tenant_id)
        tenant = base64.urlsafe_b64encode(tenant_id.encode("utf-8")).decode("ascii")
        return f"{PREFIX}{tenant}:{base64.b64encode(key.seal(text.encode('utf-8'), place)).decode('ascii')}"

    async def open(self, value: str, place: str) -> str:
        """The text of a value `seal` made (a plain value as it is); VaultError, one
        sentence, when its tenant's key is gone or the record is not this row's."""
        if not value.startswith(PREFIX):
            return value
        tenant, _, blob = value[len(PREFIX) :].partition(":")
        try:
            tenant_id = base64.urlsafe_b64decode(tenant).decode("utf-8")
            raw = base64.b64decode(blob, validate=True)
        except (ValueError, binascii.Error):
            raise VaultError(f"{place} is not a sealed record") from None
        key = await self._key(tenant_id)
        try:
            return key.open(raw, place).decode("utf-8")
        except VaultError:  # sealed by this process just before a rekey (/forget all) replaced the key
            old = self.keys.retired(tenant_id)
            if old is None:
                raise
            return old.open(raw, place).decode("utf-8")


def sealed(value: str | None) -> bool:
    """Whether a gateway.db text value is sealed (and so needs its tenant's key)."""
    return value is not None and value.startswith(PREFIX)


__all__ = ["PREFIX", "MessageSeal", "sealed"]
