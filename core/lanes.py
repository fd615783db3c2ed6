"""The `Lane` value: one conversation lane and the tenant whose profile it lives in.

Built by `tenancy.keys.resolve_lane`; everything above `core` passes it around.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

LaneKind = Literal["person", "chat"]
PersonalMemory = Literal["full", "read", "off"]


@dataclass(frozen=True)
class Lane:
    """One conversation lane and the tenant whose profile it lives in.

    `kind` is "person" for DMs and per-user group/thread lanes (tenant = the person, or
    their linked identity) and "chat" for shared lanes (tenant = the chat itself).

    `personal_memory` says how the lane uses its tenant's memory:
    - DMs: "full";
    - per-user group/thread lanes: `tenancy.personal_memory_in_groups` ("full" read and
      write, "read" snapshot loaded but no writes, "off" nothing loaded or written; the
      lane's history is still stored in the person's profile);
    - shared lanes: "full" -- the tenant *is* the chat, so this is the group's own memory,
      read and written; no member's personal memory is ever loaded into a shared lane.

    A lane is identified by `(tenant_id, session_key)` (`key`).
    """

    session_key: str
    tenant_id: str
    kind: LaneKind
    principal: str  # "<platform>:<user_id>" of the sender
    personal_memory: PersonalMemory

    @property
    def key(self) -> str:
        """The one string that names this lane across tenants (queues, locks, stop
        handles, the cluster inbox): `<tenant_id>/<session_key>`. A session key alone is not
        unique across tenants (docs/concepts.md#session-keys-and-tenants). Tenant ids never contain `:`
        and session keys start with `agent:`, so `tenant_of_key` splits it back."""
        return f"{self.tenant_id}/{self.session_key}"

    @property
    def private(self) -> bool:
        """True for a one-to-one chat with the bot (DM, console): nobody else reads it.
        (The key's fourth part is the chat kind; components are escaped, so never ":dm:".)"""
        return self.kind == "person" and self.session_key.split(":")[3:4] == ["dm"]


def tenant_of_key(key: str) -> str:
    """The tenant id of a `Lane.key` (the last `/` before the first `:` ends it)."""
    return key[: key.index(":")].rpartition("/")[0]
