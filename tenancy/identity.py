"""Identity links: several principals (`telegram:111`, `discord:222`) that are one person.

A linked principal's person lanes belong to the tenant `link-<name>`, so one person on
Telegram and Discord shares one memory. Links come from two places:

- the config (`tenancy.identity_links`): pinned; `unlink` refuses them (edit the config);
- runtime links made with the `/link` chat command: kept in memory and, when the instance
  has a `path`, persisted by `save()` (atomic write) and read back by `load()`.

The JSON file holds only runtime links: `{"version": 1, "links": {"alice": ["telegram:111"]}}`.
When the file and the config disagree about a principal, the config wins.

In a cluster the runtime links live in a shared store instead of the file (a `LinkStore`,
given by the caller): `save()` sends it the changes made since the last save, and the
caller swaps in what the store holds with `replace_runtime()`, so a link made on one node
routes the next message on every node.

All state is per instance (guarded by a lock); there are no module globals.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from agent.fileio import atomic_write, private_mkdir
from tenancy.keys import link_tenant_id

if TYPE_CHECKING:  # pragma: no cover
    from core.settings import TenancyConfig

__all__ = ["IdentityLinks", "LinkStore", "validate_link_name", "validate_principal"]

_FILE_VERSION = 1
_MAX_NAME_LEN = 64


def validate_principal(principal: str) -> str:
    """Check `principal` looks like `platform:user_id` (both non-empty); return it."""
    if not isinstance(principal, str):
        raise ValueError(f"principal must be a string, got {type(principal).__name__}")
    platform, sep, uid = principal.partition(":")
    if not sep or not platform or not uid:
        raise ValueError(f"principal {principal!r} must look like 'platform:user_id'")
    return principal


def validate_link_name(name: str) -> str:
    """A link name: non-empty, at most 64 characters, printable, no surrounding spaces."""
    if not isinstance(name, str) or not name:
        raise ValueError("link name must be a non-empty string")
    if len(name) > _MAX_NAME_LEN:
        raise ValueError(f"link name is longer than {_MAX_NAME_LEN} characters")
    if not name.isprintable() or name != name.strip():
        raise ValueError(f"link name {name!r} has non-printable or surrounding space characters")
    return name


class LinkStore(Protocol):
    """Where runtime links are kept instead of a file (cluster mode)."""

    def apply(self, linked: list[tuple[str, str]], unlinked: list[tuple[str, str]]) -> None:
        """Record `(name, principal)` links made and removed, all or nothing. Raises
        ValueError when a principal was meanwhile linked to another name elsewhere.
        Blocking: called from `IdentityLinks.save()`, which callers run in a thread."""


class IdentityLinks:
    """principal -> link name, and link name -> principals."""

    def __init__(
        self,
        links: Mapping[str, Iterable[str]] | None = None,
        path: Path | None = None,
        *,
        pinned: Mapping[str, Iterable[str]] | None = None,
        store: LinkStore | None = None,
    ) -> None:
        """`links` are runtime (unpinned) links; `pinned` are config links `unlink` refuses;
        `store` (instead of `path`) keeps runtime links where other nodes see them.

        Raises ValueError for a malformed principal or name, or a principal given two names.
        """
        self.path = Path(path) if path is not None else None
        self.store = store
        self._changes: list[tuple[bool, str, str]] = []  # (linked?, name, principal) not yet saved
        self._lock = threading.RLock()
        self._by_principal: dict[str, str] = {}
        self._by_name: dict[str, list[str]] = {}
        self._pinned: set[str] = set()
        for source, is_pinned in ((pinned or {}, True), (links or {}, False)):
            for name, principals in source.items():
                if is_pinned:  # the config accepted it; only refuse what cannot work
                    if not isinstance(name, str) or not name:
                        raise ValueError("link name must be a non-empty string")
                else:
                    validate_link_name(name)
                for p in principals:
                    self._add(name, validate_principal(p), pinned=is_pinned)

    # --- construction ---------------------------------------------------------------

    @classmethod
    def from_config(cls, cfg: TenancyConfig, path: Path | None = None) -> IdentityLinks:
        """The config's `identity_links`, pinned."""
        return cls(None, path, pinned=cfg.identity_links)

    @classmethod
    def shared(cls, store: LinkStore, cfg: TenancyConfig | None = None) -> IdentityLinks:
        """Config links (pinned), runtime links kept in `store`; fill them with `replace_runtime()`."""
        return cls(None, None, pinned=cfg.identity_links if cfg is not None else None, store=store)

    @classmethod
    def load(cls, path: Path, cfg: TenancyConfig | None = None) -> IdentityLinks:
        """Config links (pinned) merged with the runtime links saved at `path`.

        A missing file means no runtime links. A file entry whose principal the config links
        to a different name is dropped (the config wins); invalid entries are skipped.
        Raises ValueError if the file exists but is not a links file (so links are never
        silently lost).
        """
        path = Path(path)
        self = cls(None, path, pinned=cfg.identity_links if cfg is not None else None)
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return self
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}: not a valid identity links file: {err}") from None
        links = data.get("links") if isinstance(data, dict) else None
        if not isinstance(links, dict):
            raise ValueError(f"{path}: not a valid identity links file (no 'links' mapping)")
        for name, principals in links.items():
            if not isinstance(principals, list):
                continue
            try:
                validate_link_name(name)
            except ValueError:
                continue
            for p in principals:
                try:
                    validate_principal(p)
                except ValueError:
                    continue
                if p in self._by_principal:
                    continue  # already linked by the config (or earlier in the file)
                self._add(name, p, pinned=False)
        return self

    # --- queries --------------------------------------------------------------------

    def name_for(self, principal: str) -> str | None:
        """The link name `principal` belongs to, or None."""
        with self._lock:
            return self._by_principal.get(principal)

    def tenant_for(self, principal: str) -> str | None:
        """`link-<name>` if `principal` is linked, else None."""
        name = self.name_for(principal)
        return link_tenant_id(name) if name is not None else None

    def principals_of(self, name: str) -> list[str]:
        """The principals linked under `name` (in link order); [] for an unknown name."""
        with self._lock:
            return list(self._by_name.get(name, ()))

    def names(self) -> list[str]:
        with self._lock:
            return list(self._by_name)

    def is_pinned(self, principal: str) -> bool:
        """True when the link of `principal` comes from the config."""
        with self._lock:
            return principal in self._pinned

    def as_dict(self) -> dict[str, list[str]]:
        """All links, name -> principals (a copy)."""
        with self._lock:
            return {n: list(ps) for n, ps in self._by_name.items()}

    def __contains__(self, principal: object) -> bool:
        with self._lock:
            return principal in self._by_principal

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_principal)

    def __repr__(self) -> str:
        return f"IdentityLinks({len(self)} principals in {len(self._by_name)} links)"

    # --- changes --------------------------------------------------------------------

    def link(self, name: str, principal: str) -> bool:
        """Link `principal` under `name`. Returns False if it already was (no change).

        Raises ValueError if the principal is linked to another name (unlink it first),
        or the name or principal is malformed.
        """
        validate_link_name(name)
        validate_principal(principal)
        with self._lock:
            current = self._by_principal.get(principal)
            if current == name:
                return False
            if current is not None:
                raise ValueError(f"{principal!r} is already linked to {current!r}; unlink it first")
            self._add(name, principal, pinned=False)
            self._note(True, name, principal)
            return True

    def unlink(self, principal: str) -> str | None:
        """Remove `principal`'s link; returns the name it had, or None if it had none.

        Raises ValueError for a link that comes from the config.
        """
        with self._lock:
            name = self._by_principal.get(principal)
            if name is None:
                return None
            if principal in self._pinned:
                raise ValueError(
                    f"{principal!r} is linked to {name!r} in the config file (tenancy.identity_links); change it there"
                )
            del self._by_principal[principal]
            self._drop(name, principal)
            self._note(False, name, principal)
            return name

    def replace_runtime(self, links: Mapping[str, Iterable[str]]) -> None:
        """Make the runtime links exactly `links` (what the shared store holds), keeping the
        config's links (they win) and this instance's changes not yet saved."""
        with self._lock:
            for name, members in list(self._by_name.items()):
                for p in list(members):
                    if p not in self._pinned:
                        del self._by_principal[p]
                        self._drop(name, p)
            for name, principals in links.items():
                for p in principals:
                    if p not in self._by_principal:
                        self._add(name, p, pinned=False)
            for linked, name, p in self._changes:
                current = self._by_principal.get(p)
                if linked and current is None:
                    self._add(name, p, pinned=False)
                elif not linked and current == name and p not in self._pinned:
                    del self._by_principal[p]
                    self._drop(name, p)

    def save(self, path: Path | None = None) -> None:
        """Write the runtime (non-config) links to `path` (default `self.path`) atomically:
        temp file in the same directory, fsync, rename, fsync of the directory."""
        if self.store is not None and path is None:
            with self._lock:
                changes, self._changes = self._changes, []
            try:
                self.store.apply(
                    [(n, p) for linked, n, p in changes if linked], [(n, p) for linked, n, p in changes if not linked]
                )
            except BaseException:
                with self._lock:  # not recorded: they stay pending (callers undo them on failure)
                    self._changes[:0] = changes
                raise
            return
        target = Path(path) if path is not None else self.path
        if target is None:
            raise ValueError("IdentityLinks.save: no path given and none set")
        with self._lock:
            runtime = {n: [p for p in ps if p not in self._pinned] for n, ps in self._by_name.items()}
            payload = {"version": _FILE_VERSION, "links": {n: ps for n, ps in runtime.items() if ps}}
            data = json.dumps(payload, ensure_ascii=False, indent=2, sort_keys=True) + "\n"
            private_mkdir(target.parent)
            atomic_write(target, data)

    # --- internals ------------------------------------------------------------------

    def _note(self, linked: bool, name: str, principal: str) -> None:
        """Remember a change for the store; one that undoes an unsaved change cancels it."""
        if self.store is None:
            return
        if (not linked, name, principal) in self._changes:
            self._changes.remove((not linked, name, principal))
        else:
            self._changes.append((linked, name, principal))

    def _drop(self, name: str, principal: str) -> None:
        members = self._by_name[name]
        members.remove(principal)
        if not members:
            del self._by_name[name]

    def _add(self, name: str, principal: str, *, pinned: bool) -> None:
        current = self._by_principal.get(principal)
        if current is not None:
            if current == name:
                if pinned:
                    self._pinned.add(principal)
                return
            raise ValueError(f"{principal!r} is linked to both {current!r} and {name!r}")
        self._by_principal[principal] = name
        self._by_name.setdefault(name, []).append(principal)
        if pinned:
            self._pinned.add(principal)
