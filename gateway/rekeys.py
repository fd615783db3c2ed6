"""`/forget all` with encryption on re-keys the tenant once its profile is closed, so every
older copy of what was forgotten, backups included, no longer opens
(docs/privacy.md#delete-is-crypto-shredding; the steps are in agent/rekey.py)."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

from agent.vault import TenantKeys, VaultError
from gateway.jobs import Background
from tenancy.profiles import ProfileManager

log = logging.getLogger("hermes.rekeys")
CLOSE_TIMEOUT_S = 30.0  # a profile still in use after this re-keys on its next open instead


class Rekeys:
    """Begins a tenant's rekey at once and finishes it in the background when its profile
    is no longer in use; a rekey that cannot finish now finishes when the profile next opens."""

    def __init__(self, keys: TenantKeys, profiles: ProfileManager, background: Background) -> None:
        self.keys = keys
        self.profiles = profiles
        self.background = background

    @property
    def on(self) -> bool:
        return self.keys.on

    async def forget_all(self, tenant_id: str, path: Path) -> None:
        """Mark `tenant_id`'s profile for a new key (durably, before the reply says so) and
        finish the rekey once the profile is closed."""
        await asyncio.to_thread(self.keys.begin_rekey, tenant_id, path)
        self.background.run(self._finish(tenant_id, path))

    async def _finish(self, tenant_id: str, path: Path) -> None:
        deadline = time.monotonic() + CLOSE_TIMEOUT_S
        while not await self.profiles.evict(tenant_id):
            if time.monotonic() > deadline:
                log.warning("a profile stayed in use; its new key is made when it next opens")
                return
            await asyncio.sleep(0.05)
        try:
            new = await asyncio.to_thread(self.keys.rekey, tenant_id, path)
            old = self.keys.retired(tenant_id)
            if new is not None and old is not None and self.keys.rows is not None:
                # a reply sealed with the old key while the rekey ran is sealed again, durably
                await asyncio.to_thread(self.keys.rows, old, new)
        except (OSError, VaultError) as err:  # left marked: the profile's next open finishes it
            log.warning("a rekey stopped (%s); it finishes when the profile next opens", type(err).__name__)
