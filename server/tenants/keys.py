"""The keys file: tenants, their API keys and their limits, and the directory built from it.

```yaml
tenants:
  acme:
    keys: [sk-acme-1, "sha256:<64 hex digits>"]
    requests_per_minute: 600
    tokens_per_minute: 200000
    monthly_tokens: 50000000
```

Keys may be written in plain text or as the SHA-256 of the key (`sha256:<hex>`), so the file
need not hold secrets. The directory looks a presented key up by its SHA-256 digest.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

DEFAULT_TENANT = "default"
"""The tenant of keys from `auth.api_keys` / `auth.api_key_file`, and of every request when the
API is open. A keys-file entry with this name gives it limits and more keys."""

TENANT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
HASHED_KEY = re.compile(r"^sha256:[0-9a-f]{64}$")
# What may appear in an `Authorization: Bearer` value that clients actually send.
PLAIN_KEY = re.compile(r"^[\x21-\x7e]+$")


class KeysFileError(ValueError):
    """The keys file cannot be used; the message names the file and the problem."""


class TenantLimits(BaseModel):
    """A tenant's limits; None means no limit of that kind."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    requests_per_minute: int | None = Field(None, ge=1)
    """Generation requests per minute (a bucket of this size, refilled continuously)."""

    tokens_per_minute: int | None = Field(None, ge=1)
    """Prompt + completion tokens per minute; a request reserves its worst case when it starts
    (see `server.tenants.reservation`) and gives back what it did not use when it ends."""

    monthly_tokens: int | None = Field(None, ge=1)
    """Prompt + completion tokens per calendar month (UTC); beyond it 429 `insufficient_quota`."""

    @property
    def counts_tokens(self) -> bool:
        return self.tokens_per_minute is not None or self.monthly_tokens is not None

    @property
    def any(self) -> bool:
        return self.requests_per_minute is not None or self.counts_tokens


class TenantEntry(TenantLimits):
    keys: list[str] = Field(default_factory=list)
    """The tenant's API keys: plain, or `sha256:<hex digest of the key>`."""

    @field_validator("keys")
    @classmethod
    def _keys_are_sendable(cls, keys: list[str]) -> list[str]:
        for key in keys:
            if key.startswith("sha256:"):
                if not HASHED_KEY.match(key):
                    raise ValueError("a hashed key is `sha256:` and 64 lower-case hex digits")
            elif not PLAIN_KEY.match(key):
                raise ValueError("a key must be printable ASCII without spaces (it is sent as a Bearer token)")
        return keys


class KeysFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tenants: dict[str, TenantEntry]

    @field_validator("tenants")
    @classmethod
    def _names_are_labels(cls, tenants: dict[str, TenantEntry]) -> dict[str, TenantEntry]:
        for name in tenants:
            if not TENANT_NAME.match(name):
                raise ValueError(f"tenant name {name!r}: letters, digits, `_`, `.`, `-`, at most 64 "
                                 "characters, starting with a letter or digit (it is a metric label)")
        return tenants


@dataclass(frozen=True)
class Tenant:
    name: str
    limits: TenantLimits


def key_digest(key: str) -> bytes:
    """The SHA-256 digest a key is looked up by (`sha256:<hex>` entries are already one)."""
    if key.startswith("sha256:"):
        return bytes.fromhex(key.removeprefix("sha256:"))
    return hashlib.sha256(key.encode()).digest()


def load_keys_file(path: Path) -> KeysFile:
    """The parsed keys file; KeysFileError says what is wrong, naming the tenant and field."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise KeysFileError(f"keys file {path} cannot be read: {getattr(exc, 'strerror', None) or exc}") from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise KeysFileError(f"keys file {path} is not valid YAML: {str(exc).splitlines()[0]}") from exc
    if not isinstance(data, dict):
        raise KeysFileError(f"keys file {path} must be a mapping with a `tenants:` section")
    try:
        parsed = KeysFile.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in exc.errors()[:5])
        raise KeysFileError(f"keys file {path}: {problems}") from exc
    seen: dict[bytes, str] = {}
    for name, entry in parsed.tenants.items():
        for key in entry.keys:
            digest = key_digest(key)
            if digest in seen:
                raise KeysFileError(f"keys file {path}: tenants {seen[digest]!r} and {name!r} share a key "
                                    "(a key must name exactly one tenant)")
            seen[digest] = name
    return parsed


def check_admin_keys(keys_file: KeysFile, admin_keys: list[str]) -> None:
    """An admin key must not also be a tenant's API key (a request would be both)."""
    admin = {key_digest(k) for k in admin_keys}
    for name, entry in keys_file.tenants.items():
        if any(key_digest(k) in admin for k in entry.keys):
            raise KeysFileError(f"tenant {name!r} has a key that is also an admin key (auth.admin_keys); "
                                "use separate keys")


def load_directory(path: Path | None, api_keys: list[str], admin_keys: list[str]) -> KeyDirectory:
    """The directory of a keys file (None: the inline keys only), with every cross-check."""
    keys_file = load_keys_file(path) if path is not None else None
    if keys_file is not None:
        check_admin_keys(keys_file, admin_keys)
    return KeyDirectory.build(keys_file, api_keys)


class KeyDirectory:
    """Which tenant a presented API key belongs to.

    Lookup is by the SHA-256 digest of the presented key: the dictionary lookup's timing can
    depend on the digest, never on how much of a real key an attacker has guessed.
    """

    def __init__(self, tenants: dict[str, Tenant], by_digest: dict[bytes, Tenant]) -> None:
        self.tenants = tenants
        self._by_digest = by_digest

    @property
    def default(self) -> Tenant:
        return self.tenants[DEFAULT_TENANT]

    @property
    def open(self) -> bool:
        """No key is configured at all: the API is open and every request is the default tenant."""
        return not self._by_digest

    def lookup(self, token: bytes) -> Tenant | None:
        return self._by_digest.get(hashlib.sha256(token).digest())

    @classmethod
    def build(cls, keys_file: KeysFile | None, inline_keys: list[str]) -> KeyDirectory:
        entries = dict(keys_file.tenants) if keys_file else {}
        default_entry = entries.pop(DEFAULT_TENANT, TenantEntry())
        tenants = {DEFAULT_TENANT: Tenant(DEFAULT_TENANT, TenantLimits(**default_entry.model_dump(exclude={"keys"})))}
        by_digest: dict[bytes, Tenant] = {}
        for key in [*default_entry.keys, *inline_keys]:
            by_digest[key_digest(key)] = tenants[DEFAULT_TENANT]
        for name, entry in entries.items():
            tenant = Tenant(name, TenantLimits(**entry.model_dump(exclude={"keys"})))
            tenants[name] = tenant
            for key in entry.keys:
                digest = key_digest(key)
                if by_digest.get(digest, tenant) is not tenant:
                    raise KeysFileError(f"tenant {name!r} has a key that is also in auth.api_keys "
                                        f"(tenant {DEFAULT_TENANT!r}); a key must name exactly one tenant")
                by_digest[digest] = tenant
        return cls(tenants, by_digest)
