"""The keys file (`auth.keys_file`): named keys (tenants), their limits, budgets and allowed
models. Configuration, like the profile: read and checked here, before any engine loads; the
directory a presented key is looked up in is built from it in `server.tenants.directory`.

```yaml
keys:
  - name: team-a
    key: "sha256:<64 hex digits>"     # the key's SHA-256 (what `llm-gateway keys add` writes)
    requests_per_minute: 600
    tokens_per_minute: 200000         # prompt + completion
    max_concurrent: 16
    budget_tokens: 50000000           # prompt + completion tokens per budget_period
    budget_period: month              # or day (UTC)
    models: [gemma-4-e2b-it]          # optional allow-list
    share: 3                          # weight when the engine is full (default 1)
  - name: script
    key: sk-plain-key                 # plain keys work, and are warned about at start
```

`key` may also be a list (several keys of one tenant, e.g. while rotating). The directory looks a
presented key up by its SHA-256 digest. Keys from `--api-key` / `auth.api_keys` stay unlimited
and unnamed (tenant `unnamed`, as is every request on an open API).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

UNNAMED = "unnamed"
"""The tenant of `auth.api_keys` keys and of every request on an open API: no limits, no budget."""

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
    """Prompt + completion tokens per minute; a request reserves its worst case (its exact prompt
    tokens plus n x max_tokens, see `server.tenants.reservation`) once its prompt is tokenized and
    gives back what it did not use when it ends."""

    max_concurrent: int | None = Field(None, ge=1)
    """Generation requests of this tenant running at once."""

    budget_tokens: int | None = Field(None, ge=1)
    """Prompt + completion tokens per budget period; once spent, 429 `insufficient_quota`. A burst
    spends at most this plus one request's reservation."""

    budget_period: Literal["day", "month"] = "month"
    """The budget's period: a UTC calendar day or month."""

    models: list[str] | None = None
    """Models this tenant may use; None: every served model."""

    share: float = Field(1.0, gt=0, le=1000)
    """The tenant's weight when the engine is full (auth.fair_share): active tenants receive
    service in proportion to their shares. Not a limit: an idle engine serves anyone at once."""

    @property
    def counts_tokens(self) -> bool:
        return self.tokens_per_minute is not None or self.budget_tokens is not None

    @property
    def any(self) -> bool:
        """Anything the limiter counts (the model allow-list is checked without it)."""
        return (self.requests_per_minute is not None or self.max_concurrent is not None
                or self.counts_tokens)


class KeyEntry(TenantLimits):
    name: str
    """The tenant's name: the `tenant` label of its metrics and its usage rows."""

    key: str | list[str]
    """`sha256:<hex digest of the key>`, or the key itself (warned about); or a list of them."""

    @field_validator("name")
    @classmethod
    def _name_is_a_label(cls, name: str) -> str:
        if not TENANT_NAME.match(name):
            raise ValueError("letters, digits, `_`, `.`, `-`, at most 64 characters, starting with a "
                             "letter or digit (it is a metric label)")
        if name == UNNAMED:
            raise ValueError(f"{UNNAMED!r} is reserved for the keys of auth.api_keys")
        return name

    @field_validator("key")
    @classmethod
    def _keys_are_sendable(cls, key: str | list[str]) -> str | list[str]:
        keys = [key] if isinstance(key, str) else key
        if not keys:
            raise ValueError("at least one key")
        for one in keys:
            if one.startswith("sha256:"):
                if not HASHED_KEY.match(one):
                    raise ValueError("a hashed key is `sha256:` and 64 lower-case hex digits")
            elif not PLAIN_KEY.match(one):
                raise ValueError("a key must be printable ASCII without spaces (it is sent as a Bearer token)")
        return key

    @property
    def keys(self) -> list[str]:
        return [self.key] if isinstance(self.key, str) else list(self.key)

    def limits(self) -> TenantLimits:
        return TenantLimits(**self.model_dump(exclude={"name", "key"}))


class KeysFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    keys: list[KeyEntry] = Field(default_factory=list)

    @model_validator(mode="after")
    def _names_and_keys_are_unique(self) -> KeysFile:
        names: set[str] = set()
        owners: dict[bytes, str] = {}
        for entry in self.keys:
            if entry.name in names:
                raise ValueError(f"two entries are named {entry.name!r} (list several keys of one "
                                 "tenant under one entry's `key`)")
            names.add(entry.name)
            for key in entry.keys:
                digest = key_digest(key)
                if digest in owners:
                    raise ValueError(f"entries {owners[digest]!r} and {entry.name!r} share a key")
                owners[digest] = entry.name
        return self

    def plain_key_names(self) -> list[str]:
        return [e.name for e in self.keys if any(not k.startswith("sha256:") for k in e.keys)]


@dataclass(frozen=True)
class Tenant:
    name: str
    limits: TenantLimits


def key_digest(key: str) -> bytes:
    """The SHA-256 digest a key is looked up by (`sha256:<hex>` entries are already one)."""
    if key.startswith("sha256:"):
        return bytes.fromhex(key.removeprefix("sha256:"))
    return hashlib.sha256(key.encode()).digest()


def hashed(key: str) -> str:
    """How the keys file writes a key without holding it: `sha256:<hex>`."""
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()


def load_keys_file(path: Path) -> KeysFile:
    """The parsed keys file; KeysFileError says what is wrong, naming the entry and field."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise KeysFileError(f"keys file {path} cannot be read: {getattr(exc, 'strerror', None) or exc}") from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise KeysFileError(f"keys file {path} is not valid YAML: {str(exc).splitlines()[0]}") from exc
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise KeysFileError(f"keys file {path} must be a mapping with a `keys:` list")
    try:
        return KeysFile.model_validate(data)
    except ValidationError as exc:
        entries = data.get("keys") if isinstance(data.get("keys"), list) else []

        def where(loc: tuple) -> str:
            if len(loc) >= 2 and loc[0] == "keys" and isinstance(loc[1], int) and loc[1] < len(entries):
                name = entries[loc[1]].get("name") if isinstance(entries[loc[1]], dict) else None
                rest = ".".join(str(p) for p in loc[2:])
                return f"keys[{loc[1]}]" + (f" ({name})" if name else "") + (f".{rest}" if rest else "")
            return ".".join(str(p) for p in loc) or "file"

        problems = "; ".join(f"{where(err['loc'])}: {err['msg'].removeprefix('Value error, ')}"
                             for err in exc.errors()[:5])
        raise KeysFileError(f"keys file {path}: {problems}") from exc


def check_overlaps(keys_file: KeysFile, api_keys: list[str], admin_keys: list[str]) -> None:
    """A key names one tenant: never also an `auth.api_keys` key or an admin key."""
    for other, what in ((api_keys, "in auth.api_keys"), (admin_keys, "an admin key (auth.admin_keys)")):
        digests = {key_digest(k) for k in other}
        for entry in keys_file.keys:
            if any(key_digest(k) in digests for k in entry.keys):
                raise KeysFileError(f"the key of {entry.name!r} is also {what}; use separate keys")
