"""Per-tenant encryption at rest: data keys, sealed records, the keyring (docs/privacy.md).

Each tenant has a random 32-byte data key. It is kept in the profile (`key.json`), wrapped
by a key derived from the master key and the tenant's *slot*, a random secret in the
keyring (`<data_dir>/keyring/`, sealed by the master key). Destroying the slot destroys the
only way to unwrap the data key, so every copy of the profile, backups included, becomes
unreadable (docs/privacy.md#delete-is-crypto-shredding). Records are AES-GCM with a random
96-bit nonce each and their place (a file name, a journal) as associated data, so a record
moved to another place or tenant does not open.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from agent.fileio import atomic_write, fsync_dir, private_mkdir

__all__ = [
    "KEYRING_DIR",
    "KEY_FILE",
    "DataKey",
    "Keyring",
    "ProfileFiles",
    "TenantKeys",
    "VaultError",
    "as_files",
    "is_sealed",
    "is_sealed_line",
    "key_of",
    "parse_master_key",
    "shred_file",
    "shred_slot",
]

KEY_FILE = "key.json"  # in the profile: the wrapped data key
KEYRING_DIR = "keyring"  # in data_dir: one sealed slot per tenant, and the master key's check
_CHECK_FILE = "master.check"
_MAGIC = b"HGS1"  # every sealed record starts with it: sealed and plain bytes never mix up
_NONCE = 12
_KEY_BYTES = 32


class VaultError(Exception):
    """A key is missing, wrong or destroyed; the message is one sentence for a person."""


def is_sealed(blob: bytes) -> bool:
    """Whether `blob` is a sealed record (and so needs a key to read)."""
    return blob.startswith(_MAGIC)


# a sealed journal line is base64 of a sealed record: these first characters never change
_LINE_MAGIC = base64.b64encode(_MAGIC + b"\0\0")[:5]


def is_sealed_line(line: bytes) -> bool:
    """Whether a journal line (without its newline) is a sealed record (DataKey.seal_line)."""
    return line.startswith(_LINE_MAGIC)


class InvalidTag(Exception):
    """A record that is not sealed, or does not authenticate under this key and place."""


# `cryptography` is imported on first use: a gateway with encryption off never loads it
# (its OpenSSL bindings cost ~7 MiB of RSS, docs/privacy.md#what-it-costs)
def _hkdf(secret: bytes, salt: bytes, info: str) -> bytes:
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    return HKDF(algorithm=hashes.SHA256(), length=_KEY_BYTES, salt=salt, info=info.encode()).derive(secret)


def _seal(key: bytes, data: bytes, aad: bytes) -> bytes:
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    nonce = os.urandom(_NONCE)
    return _MAGIC + nonce + AESGCM(key).encrypt(nonce, data, aad)


def _open(key: bytes, blob: bytes, aad: bytes) -> bytes:
    from cryptography.exceptions import InvalidTag as Forged
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    if not is_sealed(blob) or len(blob) < len(_MAGIC) + _NONCE + 16:
        raise InvalidTag
    nonce = blob[len(_MAGIC) : len(_MAGIC) + _NONCE]
    try:
        return AESGCM(key).decrypt(nonce, blob[len(_MAGIC) + _NONCE :], aad)
    except Forged:
        raise InvalidTag from None


def parse_master_key(text: str, where: str) -> bytes:
    """A master key as an operator writes it: 64 hex digits or base64 of 32 bytes."""
    text = text.strip()
    try:
        raw = bytes.fromhex(text) if len(text) == 2 * _KEY_BYTES else base64.b64decode(text, validate=True)
    except (ValueError, binascii.Error):
        raw = b""
    if len(raw) != _KEY_BYTES:
        raise VaultError(
            f"{where} does not hold a master key: it must be 32 random bytes as 64 hex digits or base64 "
            f"(make one with `hermes-gateway keys new`)"
        )
    return raw


@dataclass(frozen=True)
class DataKey:
    """One tenant's data key: seals its records and keys its state.db."""

    tenant_id: str
    raw: bytes = field(repr=False)

    def _aad(self, place: str) -> bytes:
        return f"{self.tenant_id}\0{place}".encode()

    def seal(self, data: bytes, place: str) -> bytes:
        """`data` sealed for `place` (e.g. "memories/MEMORY.md"): magic, nonce, ciphertext."""
        return _seal(self.raw, data, self._aad(place))

    def open(self, blob: bytes, place: str) -> bytes:
        """The plaintext of a record sealed for `place`; VaultError if it is not one."""
        try:
            return _open(self.raw, blob, self._aad(place))
        except InvalidTag:
            raise VaultError(
                f"{place} of {self.tenant_id} does not open with its key: it is damaged or not this profile's"
            ) from None

    def seal_line(self, text: str, place: str) -> str:
        """One journal line's text sealed, as base64 (no newline inside)."""
        return base64.b64encode(self.seal(text.encode("utf-8"), place)).decode("ascii")

    def open_line(self, line: str, place: str) -> str:
        try:
            blob = base64.b64decode(line, validate=True)
        except (ValueError, binascii.Error):
            raise VaultError(f"a line of {place} of {self.tenant_id} is not a sealed record") from None
        return self.open(blob, place).decode("utf-8")

    def db_pragma(self) -> str:
        """The statement that keys state.db (SQLite3 Multiple Ciphers, raw key, no KDF)."""
        return f'PRAGMA key="{self.db_key()}"'

    def db_key(self) -> str:
        """state.db's raw key as SQLite3 Multiple Ciphers reads it (`x'<hex>'`, no KDF)."""
        sub = _hkdf(self.raw, b"hermes-gateway state.db", self.tenant_id)
        return f"x'{sub.hex()}'"


@dataclass
class Keyring:
    """The data directory's keyring: unwraps, creates, destroys and re-wraps tenants' keys.

    Blocking file I/O: call it off the event loop (a profile's open runs on a pool thread)."""

    directory: Path
    master: bytes = field(repr=False)

    @classmethod
    def open(cls, data_dir: Path, master: bytes, *, create: bool = True) -> Keyring:
        """The keyring of `data_dir`; refuses a master key other than the one it was made with."""
        ring = cls(Path(data_dir) / KEYRING_DIR, master)
        check = ring.directory / _CHECK_FILE
        expected = ring._check_value()
        try:
            found = check.read_text(encoding="ascii").strip()
        except FileNotFoundError:
            if not create:
                raise VaultError(f"{data_dir} has no keyring: its profiles were not encrypted here") from None
            private_mkdir(ring.directory)
            atomic_write(check, expected + "\n")
            return ring
        if not hmac.compare_digest(found, expected):
            raise VaultError(
                f"the master key is not the one {data_dir}'s keyring was made with "
                f"(check storage.master_key_env or storage.master_key_file)"
            )
        return ring

    def _check_value(self, master: bytes | None = None) -> str:
        return hmac.new(master or self.master, b"hermes-gateway master key check", hashlib.sha256).hexdigest()[:32]

    def _slot_path(self, dir_name: str) -> Path:
        return self.directory / f"{dir_name}.slot"

    def _read_slot(self, tenant_id: str, dir_name: str, master: bytes | None = None) -> bytes | None:
        try:
            blob = self._slot_path(dir_name).read_bytes()
        except FileNotFoundError:
            return None
        try:
            return _open(master or self.master, blob, f"slot\0{tenant_id}".encode())
        except InvalidTag:
            raise VaultError(f"the keyring's slot for {tenant_id} is damaged") from None

    def seal_slot(self, slot: bytes, tenant_id: str) -> bytes:
        """A slot as the keyring stores it: sealed by the master key for its tenant."""
        return _seal(self.master, slot, f"slot\0{tenant_id}".encode())

    def read_slot_file(self, path: Path, tenant_id: str) -> bytes | None:
        """The slot stored at `path` (None when absent); VaultError when damaged."""
        try:
            blob = Path(path).read_bytes()
        except FileNotFoundError:
            return None
        try:
            return _open(self.master, blob, f"slot\0{tenant_id}".encode())
        except InvalidTag:
            raise VaultError(f"the keyring's slot for {tenant_id} is damaged") from None

    def _kek(self, slot: bytes, tenant_id: str, master: bytes | None = None) -> bytes:
        return _hkdf(master or self.master, slot, f"hermes-gateway tenant key {tenant_id}")

    def has_key(self, profile: Path) -> bool:
        """Whether the profile was made encrypted (it holds a wrapped data key)."""
        return (Path(profile) / KEY_FILE).exists()

    def key_for(self, tenant_id: str, profile: Path, *, create: bool = False, slot_name: str | None = None) -> DataKey:
        """The tenant's data key, unwrapped; with `create`, a new one for a profile that has
        none yet (a new tenant). VaultError when it was destroyed or does not unwrap.
        `slot_name`: the profile's directory name when `profile` is a staging copy of it."""
        profile = Path(profile)
        key_file = profile / KEY_FILE
        slot_name = slot_name or profile.name
        slot = self._read_slot(tenant_id, slot_name)
        try:
            wrapped = json.loads(key_file.read_text(encoding="utf-8"))
        except FileNotFoundError:
            wrapped = None
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise VaultError(f"{key_file} is damaged: {tenant_id}'s data cannot be read") from None
        if wrapped is None:
            if not create:
                raise VaultError(f"{tenant_id}'s profile has no data key: it was not made encrypted")
            return self._create(tenant_id, profile, slot, slot_name)
        if slot is None:
            raise VaultError(f"{tenant_id}'s key was destroyed (the profile was deleted); its data cannot be read")
        return DataKey(tenant_id, self._unwrap(wrapped, slot, tenant_id))

    def _unwrap(self, wrapped: dict, slot: bytes, tenant_id: str, master: bytes | None = None) -> bytes:
        try:
            blob = base64.b64decode(wrapped["wrapped"], validate=True)
            return _open(self._kek(slot, tenant_id, master), blob, f"data key\0{tenant_id}".encode())
        except (KeyError, TypeError, ValueError, binascii.Error, InvalidTag):
            raise VaultError(f"{tenant_id}'s data key does not unwrap: its key.json is damaged") from None

    def _wrap(self, raw: bytes, slot: bytes, tenant_id: str, master: bytes | None = None) -> str:
        blob = _seal(self._kek(slot, tenant_id, master), raw, f"data key\0{tenant_id}".encode())
        return json.dumps({"version": 1, "tenant_id": tenant_id, "wrapped": base64.b64encode(blob).decode()})

    def _create(self, tenant_id: str, profile: Path, slot: bytes | None, slot_name: str) -> DataKey:
        if slot is None:
            slot = os.urandom(_KEY_BYTES)
            private_mkdir(self.directory)
            atomic_write(self._slot_path(slot_name), _seal(self.master, slot, f"slot\0{tenant_id}".encode()))
        raw = os.urandom(_KEY_BYTES)
        private_mkdir(profile)
        atomic_write(profile / KEY_FILE, self._wrap(raw, slot, tenant_id))
        return DataKey(tenant_id, raw)

    def shred(self, tenant_id: str, profile: Path) -> bool:
        """Destroy the tenant's slot, which makes every copy of its data unreadable; first,
        before any of its files go. False when it had none."""
        return shred_slot(self.directory.parent, Path(profile))

    def has_slot(self, profile: Path) -> bool:
        """Whether the keyring still holds the slot of the profile directory `profile`."""
        return self._slot_path(Path(profile).name).exists()

    def tenants(self) -> list[str]:
        """Profile directory names that hold a slot."""
        if not self.directory.is_dir():
            return []
        return sorted(p.name[: -len(".slot")] for p in self.directory.glob("*.slot"))

    def rotate(self, new_master: bytes, profiles: list[tuple[str, Path]]) -> int:
        """Re-wrap every data key and re-seal every slot under `new_master`, without
        rewriting data; how many keys. A rotation that died midway left some files under
        either master: both are tried, so running it again finishes it."""
        done = 0
        for tenant_id, profile in profiles:
            key_file = Path(profile) / KEY_FILE
            if not key_file.exists() or not self._slot_path(Path(profile).name).exists():
                continue
            wrapped = json.loads(key_file.read_text(encoding="utf-8"))
            raw = slot = None
            for slot_master in (self.master, new_master):
                try:
                    slot = self._read_slot(tenant_id, Path(profile).name, slot_master)
                    break
                except VaultError:
                    continue
            if slot is None:
                raise VaultError(f"the keyring's slot for {tenant_id} opens under neither master key")
            for wrap_master in (self.master, new_master):
                try:
                    raw = self._unwrap(wrapped, slot, tenant_id, wrap_master)
                    break
                except VaultError:
                    continue
            if raw is None:
                raise VaultError(f"{tenant_id}'s data key unwraps under neither master key")
            atomic_write(key_file, self._wrap(raw, slot, tenant_id, new_master))
            atomic_write(self._slot_path(Path(profile).name), _seal(new_master, slot, f"slot\0{tenant_id}".encode()))
            done += 1
        atomic_write(self.directory / _CHECK_FILE, self._check_value(new_master) + "\n")
        self.master = new_master
        return done


def load_master_key(env_name: str | None, key_file: Path | None) -> bytes:
    """The master key from the variable `env_name` or the file `key_file` (one of them)."""
    if env_name is not None:
        text = os.environ.get(env_name)
        if not text:
            raise VaultError(
                f"storage.master_key_env names {env_name}, which is not set: the master key is needed to read any profile"
            )
        return parse_master_key(text, f"the variable {env_name}")
    assert key_file is not None
    try:
        text = Path(key_file).read_text(encoding="ascii")
    except FileNotFoundError:
        raise VaultError(f"storage.master_key_file {key_file} does not exist") from None
    except (OSError, UnicodeDecodeError) as err:
        raise VaultError(
            f"storage.master_key_file {key_file} cannot be read: {getattr(err, 'strerror', None) or err}"
        ) from None
    return parse_master_key(text, f"storage.master_key_file {key_file}")


def new_master_key() -> str:
    """A fresh master key as text (`hermes-gateway keys new`)."""
    return base64.b64encode(os.urandom(_KEY_BYTES)).decode("ascii")


class TenantKeys:
    """Every tenant's data key in this process: unwrapped once, or created exactly once for
    a new tenant, whoever asks first (the ingress sealing a message, a profile's open).
    Thread-safe; blocking on a first use (file I/O): call it off the event loop."""

    def __init__(self, keyring: Keyring | None, rows: Callable[[DataKey, DataKey], object] | None = None) -> None:
        """`rows` re-seals what gateway.db keeps of a tenant when its key changes (a rekey)."""
        self.keyring = keyring
        self.rows = rows
        self._keys: dict[str, DataKey] = {}
        self._retired: dict[str, DataKey] = {}  # the key a rekey replaced, in this process's memory only
        self._lock = threading.Lock()

    @property
    def on(self) -> bool:
        return self.keyring is not None

    def cached(self, tenant_id: str) -> DataKey | None:
        """The key if it was unwrapped before (no I/O, safe on the event loop)."""
        return self._keys.get(tenant_id)

    def key_for(self, tenant_id: str, profile: Path) -> DataKey | None:
        """The tenant's data key (None when encryption is off, which refuses an encrypted
        profile in one sentence); a profile with nothing stored yet gets a new one."""
        profile = Path(profile)
        if self.keyring is None:
            if (profile / KEY_FILE).exists():
                raise VaultError(
                    f"{tenant_id}'s profile is encrypted, but storage.encryption is off: "
                    f"set it to per_tenant with its master key"
                )
            return None
        key = self._keys.get(tenant_id)
        if key is not None:
            return key
        with self._lock:  # two first uses at once must not make two keys
            key = self._keys.get(tenant_id)
            if key is None and (profile / "rekey.json").exists():
                key = self._during_rekey(tenant_id, profile)
            if key is None:
                fresh = not (profile / "state.db").exists()  # nothing stored yet: a new tenant
                key = self.keyring.key_for(tenant_id, profile, create=fresh)
                self._keys[tenant_id] = key
        return key

    def _during_rekey(self, tenant_id: str, profile: Path) -> DataKey:
        """The key while a rekey is under way and the profile may be open (the ingress, a
        reminder): the old one until everything is re-sealed; past that point, the rekey's
        last steps are finished here (nothing is left to re-seal)."""
        from agent.rekey import committed, finish_rekey  # it builds on this module

        assert self.keyring is not None
        if committed(profile):
            key = finish_rekey(self.keyring, tenant_id, profile, rows=self.rows)
            assert key is not None
            return key
        return self.keyring.key_for(tenant_id, profile)

    def begin_rekey(self, tenant_id: str, profile: Path) -> None:
        """Mark the tenant's profile for a new key (agent/rekey.py): whoever next needs its key,
        `rekey` or the profile's open, first re-seals everything under the new one."""
        from agent.rekey import begin_rekey

        if self.keyring is None:
            return
        with self._lock:
            begin_rekey(self.keyring, tenant_id, Path(profile))
            if tenant_id in self._keys:  # the key about to be replaced (see `retired`)
                self._retired[tenant_id] = self._keys[tenant_id]

    def rekey(self, tenant_id: str, profile: Path, progress: Callable[[int], None] | None = None) -> DataKey | None:
        """Finish the tenant's rekey (begun by `begin_rekey`) while its profile is closed: the
        old key forgotten here and shredded in the keyring; the new key, None when none."""
        from agent.rekey import finish_rekey

        if self.keyring is None or not (Path(profile) / "rekey.json").exists():
            return None
        with self._lock:
            old = self._keys.pop(tenant_id, None)
            if old is not None:  # what this process sealed with it meanwhile still opens (`retired`)
                self._retired[tenant_id] = old
            key = finish_rekey(self.keyring, tenant_id, Path(profile), rows=self.rows, progress=progress)
            if key is not None:
                self._keys[tenant_id] = key
            return key

    def retired(self, tenant_id: str) -> DataKey | None:
        """The key the tenant's last rekey in this process replaced: a text sealed with it
        just before (gateway.db) still opens here, and is sealed again (`Rekeys`)."""
        return self._retired.get(tenant_id)

    def files(self, tenant_id: str, profile: Path) -> ProfileFiles:
        """The profile's files, sealed with the tenant's key when encryption is on."""
        return ProfileFiles(Path(profile), self.key_for(tenant_id, profile))

    def forget(self, tenant_id: str) -> None:
        """Drop the cached key (a profile deleted or its key shredded)."""
        with self._lock:
            self._keys.pop(tenant_id, None)


@dataclass(frozen=True)
class ProfileFiles:
    """One profile's files, plain or sealed with the tenant's key: every store that keeps
    a file in a profile reads and writes it through this (docs/privacy.md#encryption-at-rest).

    Blocking: call it off the event loop. `place` is the path relative to the profile. A
    plain view refuses to write into a profile that holds a data key, so a store handed the
    wrong view fails instead of leaving plaintext beside sealed files."""

    root: Path
    key: DataKey | None = None

    @property
    def sealed(self) -> bool:
        return self.key is not None

    def path(self, place: str) -> Path:
        return self.root / place

    def unseal(self, blob: bytes, place: str) -> bytes:
        """The plaintext of the bytes read from `place`; a sealed profile refuses a plain
        file, and a plain profile a sealed one, in one sentence (VaultError)."""
        if self.key is None:
            if is_sealed(blob):
                raise VaultError(
                    f"{place} is encrypted, but storage.encryption is off: set it to per_tenant with its master key"
                )
            return blob
        return self.key.open(blob, place)

    def seal(self, data: bytes, place: str) -> bytes:
        """The bytes to store at `place` (`data` itself when plain)."""
        if self.key is None:
            if (self.root / KEY_FILE).exists():
                raise VaultError(
                    f"{place} would be written in plain text into an encrypted profile; nothing was written"
                )
            return data
        return self.key.seal(data, place)

    def read_bytes(self, place: str) -> bytes:
        """The file's plaintext (FileNotFoundError when missing); see `unseal`."""
        return self.unseal((self.root / place).read_bytes(), place)

    def read_text(self, place: str) -> str:
        return self.read_bytes(place).decode("utf-8")

    def write_bytes(self, place: str, data: bytes) -> None:
        """Replace the file atomically (agent/fileio.py atomic_write), sealed when keyed."""
        atomic_write(self.root / place, self.seal(data, place))

    def write_text(self, place: str, text: str) -> None:
        self.write_bytes(place, text.encode("utf-8"))

    def seal_line(self, text: str, place: str) -> str:
        """One line of an append-only file at `place`: itself when plain, else sealed (base64)."""
        if self.key is None:
            self.seal(b"", place)  # the same refusal as a write
            return text
        return self.key.seal_line(text, place)

    def open_line(self, line: str, place: str) -> str:
        return line if self.key is None else self.key.open_line(line, place)

    def hidden_name(self, label: str) -> str:
        """A file name for `label` that says nothing of it: an HMAC under the tenant's key
        (stable, so a replay rewrites the same file), or `label` itself when plain."""
        if self.key is None:
            return label
        return hmac.new(self.key.raw, f"file name\0{label}".encode(), hashlib.sha256).hexdigest()[:32]


def as_files(where: ProfileFiles | Path) -> ProfileFiles:
    """`where` as a profile's files: a bare path is a plain profile (its writes refused when
    the profile is encrypted, see ProfileFiles)."""
    return where if isinstance(where, ProfileFiles) else ProfileFiles(Path(where))


def shred_slot(data_dir: Path, profile: Path) -> bool:
    """Overwrite and remove the keyring slot of the profile directory `profile`: no master
    key needed, so a delete shreds even while encryption is off (docs/privacy.md#delete-is-crypto-shredding).
    False when there was none."""
    directory = Path(data_dir) / KEYRING_DIR
    nxt = directory / f"{Path(profile).name}.slot-next"  # a rekey's new slot (agent/rekey.py)
    shred_file(nxt)
    path = directory / f"{Path(profile).name}.slot"
    if not path.exists():
        return False
    shred_file(path)
    return True


def shred_file(path: Path) -> None:
    """Overwrite, fsync and unlink a slot, so it is not left in free blocks of a simple FS;
    nothing when it is absent."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return
    with open(path, "r+b") as fh:
        fh.write(os.urandom(size))
        fh.flush()
        os.fsync(fh.fileno())
    path.unlink()
    fsync_dir(path.parent)


def key_of(keyring: Keyring | None, tenant_id: str, profile: Path) -> DataKey | None:
    """The key a reader outside the store needs (the CLI, doctor, backups, exports): None
    for a plain profile; VaultError, one sentence, for an encrypted one without a keyring
    or whose key was destroyed (docs/privacy.md#keys)."""
    if not (Path(profile) / KEY_FILE).exists():
        return None
    if keyring is None:
        raise VaultError(
            f"{tenant_id}'s profile is encrypted, but storage.encryption is off: set it to per_tenant with its master key"
        )
    if (Path(profile) / "rekey.json").exists():  # its files are under two keys until the gateway finishes it
        raise VaultError(
            f"{tenant_id}'s profile is being re-keyed (after /forget all); the gateway finishes it when it next opens the profile"
        )
    return keyring.key_for(tenant_id, profile)


def open_keyring(data_dir: Path, encryption: str, env_name: str | None, key_file: Path | None) -> Keyring | None:
    """The keyring storage.encryption asks for (None when off); VaultError, one sentence,
    when the master key is missing or is not the one the keyring was made with."""
    if encryption == "off":
        return None
    return Keyring.open(data_dir, load_master_key(env_name, key_file))
