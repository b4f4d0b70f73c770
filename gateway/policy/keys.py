"""API keys: the keys file (YAML, `--keys FILE`), salted hashes, roles and per-key limits.

The file holds only a random salt and SHA-256(salt + key) per key, never the key: `blinkctl keys add`
(or `POST /admin/keys`) prints a new key once. Keys are 256 random bits, so one salted SHA-256 is as
hard to invert as the key is to guess; a slow hash (scrypt) would only add latency to every request.

    keys:
      alice:
        role: client            # client (the /v1 API and gRPC) | admin (/admin/) | both
        salt: 9f1c...           # hex
        sha256: 3b7a...         # hex of sha256(salt bytes + key bytes)
        requests_per_minute: 60
        tokens_per_minute: 20000         # prompt + completion
        max_streams: 4                   # generations in flight at once
        max_tokens_per_request: 512      # completion budget, enforced mid-stream
        cache_salt: team-a               # prefix-cache namespace (default: the key's name); keys that
                                         # share one share cached prompts (and can time each other's)

Plain keys from `--api-key`/BLINK_API_KEY and `--admin-key`/BLINK_ADMIN_KEY keep working, unlimited.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import os
import secrets
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import yaml

ROLES = ("client", "admin", "both")
LIMIT_FIELDS = ("requests_per_minute", "tokens_per_minute", "max_streams", "max_tokens_per_request")
KEY_PREFIX = "blk-"
MAX_KNOWN = 4096  # keys remembered after a first match (bounded: a full cache is simply dropped)


class KeysFileError(ValueError):
    """The keys file is malformed; the message names the key and field."""


@dataclass(frozen=True)
class KeyLimits:
    """Per-key limits; None: unlimited. They hold across the workers of `--workers N` (gateway/policy/quotas.py)."""

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None  # prompt + completion tokens
    max_streams: int | None = None  # generations (streamed or not) in flight at once
    max_tokens_per_request: int | None = None  # completion tokens; the stream is cut with "length"

    def __post_init__(self) -> None:
        for name in LIMIT_FIELDS:
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise KeysFileError(f"{name} must be a positive integer or absent, got {value!r}")

    @property
    def unlimited(self) -> bool:
        return all(getattr(self, name) is None for name in LIMIT_FIELDS)

    def as_dict(self) -> dict:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


@dataclass(frozen=True)
class KeyRecord:
    """One key as the file stores it: no plain text."""

    name: str
    salt: str
    sha256: str
    role: str = "client"
    limits: KeyLimits = field(default_factory=KeyLimits)
    cache_salt: str | None = None  # None: the key's name (one prefix-cache namespace per key)

    def matches(self, key: str) -> bool:
        return hmac.compare_digest(hash_key(key, self.salt), self.sha256)

    def to_yaml(self) -> dict:
        extra = {"cache_salt": self.cache_salt} if self.cache_salt is not None else {}
        return {"role": self.role, "salt": self.salt, "sha256": self.sha256, **self.limits.as_dict(), **extra}

    @classmethod
    def from_yaml(cls, name: str, entry: dict) -> KeyRecord:
        if not isinstance(entry, dict):
            raise KeysFileError(f"key {name!r}: expected a mapping, got {type(entry).__name__}")
        unknown = set(entry) - {"role", "salt", "sha256", "cache_salt", *LIMIT_FIELDS}
        if unknown:
            raise KeysFileError(f"key {name!r}: unknown field(s) {', '.join(sorted(unknown))}")
        role = entry.get("role", "client")
        if role not in ROLES:
            raise KeysFileError(f"key {name!r}: role must be one of {', '.join(ROLES)}, got {role!r}")
        if not entry.get("salt") or not entry.get("sha256"):
            raise KeysFileError(f"key {name!r}: 'salt' and 'sha256' are required")
        try:
            limits = KeyLimits(**{k: entry[k] for k in LIMIT_FIELDS if k in entry})
        except KeysFileError as exc:
            raise KeysFileError(f"key {name!r}: {exc}") from None
        cache_salt = entry.get("cache_salt")
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise KeysFileError(f"key {name!r}: cache_salt must be a non-empty string or absent, got {cache_salt!r}")
        return cls(name, str(entry["salt"]), str(entry["sha256"]), role, limits, cache_salt)


@dataclass(frozen=True)
class Principal:
    """Who sent a request: a key's name, what it may call, and its limits."""

    name: str
    client: bool
    admin: bool
    limits: KeyLimits = field(default_factory=KeyLimits)
    cache_salt: str = ""  # the key's prefix-cache namespace (gateway/request/prefix.py)


def hash_key(key: str, salt_hex: str) -> str:
    return hashlib.sha256(bytes.fromhex(salt_hex) + key.encode()).hexdigest()


def new_record(name: str, role: str = "client", limits: KeyLimits | None = None,
               cache_salt: str | None = None) -> tuple[KeyRecord, str]:
    """A fresh key: its record (to store) and its plain text (to show once)."""
    if not name or not name.replace("-", "").replace("_", "").replace(".", "").isalnum():
        raise KeysFileError(f"key name must be letters, digits, '-', '_' or '.', got {name!r}")
    if role not in ROLES:
        raise KeysFileError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
    if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
        raise KeysFileError(f"cache_salt must be a non-empty string or absent, got {cache_salt!r}")
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    salt = secrets.token_hex(16)
    return KeyRecord(name, salt, hash_key(key, salt), role, limits or KeyLimits(), cache_salt), key


def read_keys_file(path: str | Path) -> dict[str, KeyRecord]:
    """The records of a keys file; a missing file holds none."""
    path = Path(path)
    if not path.exists():
        return {}
    try:
        doc = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise KeysFileError(f"{path}: not valid YAML: {exc}") from None
    entries = doc.get("keys") if isinstance(doc, dict) else None
    if entries is None:
        return {}
    if not isinstance(entries, dict):
        raise KeysFileError(f"{path}: 'keys' must map key names to entries")
    return {str(name): KeyRecord.from_yaml(str(name), entry) for name, entry in entries.items()}


def write_keys_file(path: str | Path, records: Iterable[KeyRecord]) -> None:
    """Atomically (temp file + rename), readable by the owner only."""
    path = Path(path)
    doc = {"keys": {r.name: r.to_yaml() for r in records}}
    text = "# blink keys file: salted SHA-256 hashes only (blinkctl keys add/list/remove)\n"
    text += yaml.safe_dump(doc, sort_keys=False)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class KeyStore:
    """Every key the gateway accepts: plain ones from flags/environment and hashed ones from the file.

    `identify` answers who a key belongs to. `maybe_reload` picks up edits of the file by another
    process (another worker, `blinkctl keys` run offline) by its modification time.
    """

    def __init__(self, path: str | Path | None = None, plain_client_keys: Iterable[str] = (),
                 plain_admin_keys: Iterable[str] = ()):
        self.path = Path(path) if path else None
        self._plain_client = tuple(plain_client_keys)
        self._plain_admin = tuple(plain_admin_keys)
        self.records: dict[str, KeyRecord] = {}
        # sha256(key) -> record name, in memory only: one hash per request instead of one per stored key.
        self._known: dict[bytes, str] = {}
        self._stamp: tuple[int, int, int] | None = None
        self.reload()

    @property
    def auth_enabled(self) -> bool:
        """Client keys exist: /v1 needs one. Otherwise the inference API is open."""
        return bool(self._plain_client) or any(r.role != "admin" for r in self.records.values())

    @property
    def admin_enabled(self) -> bool:
        return bool(self._plain_admin) or any(r.role != "client" for r in self.records.values())

    def reload(self) -> None:
        if self.path is not None:
            self._stamp = _stamp(self.path)
            self.records = read_keys_file(self.path)
            self._known = {}

    def maybe_reload(self) -> bool:
        if self.path is None or _stamp(self.path) == self._stamp:
            return False
        self.reload()
        return True

    def identify(self, key: str) -> Principal | None:
        # Every candidate is compared (constant time each), so timing does not say which nearly matched.
        client = any([hmac.compare_digest(key.encode(), k.encode()) for k in self._plain_client])
        admin = any([hmac.compare_digest(key.encode(), k.encode()) for k in self._plain_admin])
        r = self._record_of(key)
        if r is not None:
            return Principal(r.name, client or r.role != "admin", admin or r.role != "client", r.limits,
                             r.cache_salt or r.name)
        if client or admin:  # a plain key: a namespace of its own, named by its hash
            return Principal("admin" if admin and not client else "default", client, admin,
                             cache_salt="plain:" + hashlib.sha256(key.encode()).hexdigest()[:16])
        return None

    def _record_of(self, key: str) -> KeyRecord | None:
        digest = hashlib.sha256(key.encode()).digest()
        name = self._known.get(digest)
        if name is not None and name in self.records:
            return self.records[name]
        for r in self.records.values():
            if r.matches(key):
                if len(self._known) >= MAX_KNOWN:
                    self._known.clear()
                self._known[digest] = r.name
                return r
        return None

    def add(self, name: str, role: str = "client", limits: KeyLimits | None = None,
            cache_salt: str | None = None) -> str:
        """Create a key, write its hash to the file, return the plain text (shown once). `cache_salt`: its
        prefix-cache namespace (None: its own, by name)."""
        self._need_file()
        self.reload()
        if name in self.records:
            raise KeysFileError(f"a key named {name!r} exists; remove it first")
        record, key = new_record(name, role, limits, cache_salt)
        write_keys_file(self.path, [*self.records.values(), record])
        self.reload()
        return key

    def remove(self, name: str) -> bool:
        self._need_file()
        self.reload()
        if name not in self.records:
            return False
        write_keys_file(self.path, [r for r in self.records.values() if r.name != name])
        self.reload()
        return True

    def listing(self) -> list[dict]:
        """Names, roles, limits and prefix-cache salts; never the hashing salts or hashes."""
        return [{"name": r.name, "role": r.role, "limits": r.limits.as_dict(), "cache_salt": r.cache_salt or r.name}
                for r in self.records.values()]

    def _need_file(self) -> None:
        if self.path is None:
            raise KeysFileError("no keys file: start the gateway with --keys FILE")


def _stamp(path: Path) -> tuple[int, int, int] | None:
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return st.st_mtime_ns, st.st_size, st.st_ino  # a rename gives a new inode
