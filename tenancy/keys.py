"""Session keys, lanes, tenant ids and the tenant id -> profile directory mapping.

Everything here is a pure function of its arguments: no module state, no I/O (except
`tenant_dir`, which only resolves a path to check it stays inside `profiles/`).

Session keys (docs/concepts.md#session-keys-and-tenants):

| where                                   | key                                                  |
| --------------------------------------- | ---------------------------------------------------- |
| DM                                      | `agent:main:<platform>:dm:<chat_id>`                 |
| group/channel, per user (default)       | `agent:main:<platform>:group:<chat_id>:<user_id>`    |
| group/channel, shared                   | `agent:main:<platform>:group:<chat_id>`              |
| thread / forum topic, shared (default)  | `agent:main:<platform>:group:<chat_id>:<thread_id>`  |
| thread, per user                        | `agent:main:<platform>:group:<chat_id>:<thread_id>:<user_id>` |

Ids are platform strings and may be hostile. Each id component of a key has `%`, `:` and
every non-printable character percent-encoded (`%XX` per UTF-8 byte, upper-case hex), so a
component can never contain the `:` separator and the escaping is reversible: for a given
lane shape the key is injective in its components. Plain ids (no `%`, `:` or
non-printable characters) appear exactly as the table shows.

One ambiguity is in the table itself: a per-user group lane `group:<chat>:<user>` and a
shared thread lane `group:<chat>:<thread>` have the same shape, so user id "5" and thread id
"5" in the same chat give the same key string. Those two lanes always belong to different
tenants (the person vs. the chat), so a lane is identified by the pair
`(Lane.tenant_id, Lane.session_key)`, which *is* injective; anything that indexes lanes
across tenants (queues, locks, routes) should key on that pair, not on the key alone.

Tenant ids: a person `<platform>-<user_id>` (`telegram-111`), a linked identity
`link-<name>`, a shared chat `<platform>-chat-<chat_id>` (`telegram-chat--100123`); a
private thread (`InboundMessage.private_thread`) is its own shared chat,
`<platform>-chat-<thread_id>`, never its parent channel's. The
builders escape just enough that different inputs never give the same tenant id (plain
platform names and numeric ids are unchanged):
- every component has `%`, `:` and non-printable characters percent-encoded;
- the platform additionally has every character outside `[a-z0-9_]` (so `-`) encoded, and
  the reserved platform name `link` is written `%6Cink`, so the text before the first `-`
  is always the platform (or `link`);
- a person's user id that starts with `chat-` has its first `c` written `%63`, so a person
  tenant can never equal a chat tenant.

Tenant id -> directory name (`tenant_dir_name`), injective and path-safe:
- ids matching `[a-z0-9_]{1,64}` are used as they are;
- otherwise `x-<body>` where body keeps `[a-z0-9-]`, writes `_` as `__` and every other
  character as `_xx` per UTF-8 byte (lower-case hex): `telegram-111` -> `x-telegram-111`,
  `Telegram-1` -> `x-_54elegram-1`, `a/..` -> `x-a_2f_2e_2e`. The escaping parses back
  uniquely, so it is injective; a plain name never contains `-`, so it never collides with
  an encoded one;
- if `x-<body>` would be longer than 120 characters: `h-<slug>-<sha256 hex of the id>`,
  where slug is at most 40 characters of `[a-z0-9_]` taken from the id (readability only).

Every directory name consists only of `[a-z0-9_-]`, so it is never empty, `.` or `..`,
never contains `/`, `\\` or NUL, never starts with `.` or `-`, is at most 120 bytes, and two
names differing only in case cannot occur (capitals are always encoded), so the mapping is
also injective on case-insensitive filesystems.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import TYPE_CHECKING

from core.lanes import Lane, LaneKind, PersonalMemory

if TYPE_CHECKING:  # pragma: no cover
    from core.messages import InboundMessage
    from core.settings import TenancyConfig
    from tenancy.identity import IdentityLinks

__all__ = [
    "Lane",
    "LaneKind",
    "PersonalMemory",
    "chat_tenant_id",
    "escape_key_component",
    "is_shared_lane",
    "link_tenant_id",
    "person_tenant_id",
    "resolve_lane",
    "session_key",
    "tenant_dir",
    "tenant_dir_name",
]

_KEY_PREFIX = "agent:main"
_PLAIN_DIR_RE = re.compile(r"[a-z0-9_]{1,64}")
_PLAIN_PLATFORM_RE = re.compile(r"[a-z0-9_]*")
_MAX_ESCAPED_DIR = 120
_SLUG_LEN = 40


# --- escaping helpers -------------------------------------------------------------------


def _utf8(ch: str) -> bytes:
    # surrogatepass keeps the function total (lone surrogates can come out of json.loads)
    # and still injective: every code point gets its own prefix-free byte sequence.
    return ch.encode("utf-8", "surrogatepass")


def _pct(ch: str) -> str:
    return "".join(f"%{b:02X}" for b in _utf8(ch))


def escape_key_component(value: str) -> str:
    """Percent-encode `%`, `:` and non-printable characters; anything else is kept.

    Reversible, so injective; never contains `:`. Plain ids come back unchanged.
    """
    if not isinstance(value, str):
        raise TypeError(f"ids must be strings, got {type(value).__name__}")
    if value.isprintable() and ":" not in value and "%" not in value:
        return value
    return "".join(_pct(ch) if (ch in ":%" or not ch.isprintable()) else ch for ch in value)


def _escape_platform(platform: str) -> str:
    if not isinstance(platform, str):
        raise TypeError(f"platform must be a string, got {type(platform).__name__}")
    if platform == "link":
        return "%6Cink"
    if _PLAIN_PLATFORM_RE.fullmatch(platform):
        return platform
    return "".join(ch if _PLAIN_PLATFORM_RE.fullmatch(ch) else _pct(ch) for ch in platform)


# --- session keys -----------------------------------------------------------------------


def _thread_of(msg: InboundMessage) -> str | None:
    """The thread id when the message is in a thread lane, else None.

    Only `chat_type == "thread"` makes a thread lane (the adapter decides what a thread
    is); a "thread" without a thread_id falls back to the group rules.
    """
    if msg.chat_type == "thread" and msg.thread_id is not None:
        return msg.thread_id
    return None


def is_shared_lane(msg: InboundMessage, cfg: TenancyConfig) -> bool:
    """True when the message goes to a lane shared by the whole chat (the chat's tenant)."""
    if msg.chat_type == "dm":
        return False
    if _thread_of(msg) is not None:
        return not cfg.thread_sessions_per_user
    return not cfg.group_sessions_per_user  # group, channel, or thread without an id


def session_key(msg: InboundMessage, cfg: TenancyConfig) -> str:
    """The session key of the lane `msg` belongs to (see the module docstring's table)."""
    e = escape_key_component
    base = f"{_KEY_PREFIX}:{e(msg.platform)}"
    if msg.chat_type == "dm":
        return f"{base}:dm:{e(msg.chat_id)}"
    parts = [base, "group", e(msg.chat_id)]
    thread = _thread_of(msg)
    if thread is not None:
        parts.append(e(thread))
        if cfg.thread_sessions_per_user:
            parts.append(e(msg.user_id))
    elif cfg.group_sessions_per_user:
        parts.append(e(msg.user_id))
    return ":".join(parts)


# --- tenant ids -------------------------------------------------------------------------


def person_tenant_id(platform: str, user_id: str) -> str:
    """`<platform>-<user_id>`, e.g. `telegram-111` (hostile parts escaped, see module doc)."""
    uid = escape_key_component(user_id)
    if uid.startswith("chat-"):
        uid = "%63" + uid[1:]
    return f"{_escape_platform(platform)}-{uid}"


def chat_tenant_id(platform: str, chat_id: str) -> str:
    """`<platform>-chat-<chat_id>`, e.g. `telegram-chat--100123`."""
    return f"{_escape_platform(platform)}-chat-{escape_key_component(chat_id)}"


def link_tenant_id(name: str) -> str:
    """`link-<name>` for a linked identity."""
    return f"link-{escape_key_component(name)}"


# --- lanes ------------------------------------------------------------------------------


def resolve_lane(msg: InboundMessage, cfg: TenancyConfig, links: IdentityLinks) -> Lane:
    """The lane of `msg`: its session key, tenant and memory mode."""
    key = session_key(msg, cfg)
    principal = msg.principal
    if is_shared_lane(msg, cfg):
        thread = _thread_of(msg)
        # a private thread is its own shared chat, never the parent channel's tenant
        chat = thread if thread is not None and msg.private_thread else msg.chat_id
        return Lane(
            session_key=key,
            tenant_id=chat_tenant_id(msg.platform, chat),
            kind="chat",
            principal=principal,
            personal_memory="full",
        )
    tenant = links.tenant_for(principal) or person_tenant_id(msg.platform, msg.user_id)
    memory: PersonalMemory = "full" if msg.chat_type == "dm" else cfg.personal_memory_in_groups
    return Lane(
        session_key=key,
        tenant_id=tenant,
        kind="person",
        principal=principal,
        personal_memory=memory,
    )


# --- tenant directories -----------------------------------------------------------------


def _escape_dir_body(tenant_id: str) -> str:
    out: list[str] = []
    for ch in tenant_id:
        if ch == "_":
            out.append("__")
        elif ("a" <= ch <= "z") or ("0" <= ch <= "9") or ch == "-":
            out.append(ch)
        else:
            out.append("".join(f"_{b:02x}" for b in _utf8(ch)))
    return "".join(out)


def tenant_dir_name(tenant_id: str) -> str:
    """The directory name (under `profiles/`) of a tenant; injective and path-safe."""
    if not isinstance(tenant_id, str):
        raise TypeError(f"tenant_id must be a string, got {type(tenant_id).__name__}")
    if _PLAIN_DIR_RE.fullmatch(tenant_id):
        return tenant_id
    escaped = "x-" + _escape_dir_body(tenant_id)
    if len(escaped) <= _MAX_ESCAPED_DIR:
        return escaped
    digest = hashlib.sha256(tenant_id.encode("utf-8", "surrogatepass")).hexdigest()
    slug = re.sub(r"[^a-z0-9_]", "", tenant_id)[:_SLUG_LEN]
    return f"h-{slug}-{digest}"


def tenant_dir(data_dir: Path, tenant_id: str) -> Path:
    """`<data_dir>/profiles/<tenant_dir_name(tenant_id)>`, checked to stay in `profiles/`.

    Raises ValueError if the resolved path is not a direct child of the resolved
    `profiles/` directory (e.g. the profile directory is a symlink to elsewhere).
    """
    profiles = Path(data_dir) / "profiles"
    name = tenant_dir_name(tenant_id)
    path = profiles / name
    if path.parent != profiles or path.name != name:  # belt and braces; cannot happen
        raise ValueError(f"tenant directory for {tenant_id!r} escapes {profiles}")
    if path.resolve().parent != profiles.resolve():
        raise ValueError(f"tenant directory for {tenant_id!r} resolves outside {profiles}")
    return path
