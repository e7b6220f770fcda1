"""The key directory: which tenant a presented API key belongs to, built from the keys file
(`server.settings.keys_file`) and the inline `auth.api_keys`."""

from __future__ import annotations

import hashlib
from pathlib import Path

from server.settings.keys_file import (
    UNNAMED,
    KeysFile,
    Tenant,
    TenantLimits,
    check_overlaps,
    key_digest,
    load_keys_file,
)


def load_directory(path: Path | None, api_keys: list[str], admin_keys: list[str]) -> KeyDirectory:
    """The directory of a keys file (None: the inline keys only), with every cross-check."""
    keys_file = load_keys_file(path) if path is not None else None
    if keys_file is not None:
        check_overlaps(keys_file, api_keys, admin_keys)
    return KeyDirectory.build(keys_file, api_keys)


class KeyDirectory:
    """Which tenant a presented API key belongs to.

    Lookup is by the SHA-256 digest of the presented key: the dictionary lookup's timing can
    depend on the digest, never on how much of a real key an attacker has guessed.
    """

    def __init__(self, tenants: dict[str, Tenant], by_digest: dict[bytes, Tenant],
                 plain_key_names: list[str] | None = None, *, keys_file: bool = False) -> None:
        self.tenants = tenants
        self._by_digest = by_digest
        self.plain_key_names = plain_key_names or []
        self._keys_file = keys_file

    @property
    def unnamed(self) -> Tenant:
        return self.tenants[UNNAMED]

    @property
    def open(self) -> bool:
        """No key is configured at all: the API is open and every request is tenant `unnamed`.
        A keys file closes it even while it lists no key (every request then gets a 401): a file
        emptied by mistake, or read while being rewritten, must not open the API to anyone."""
        return not self._by_digest and not self._keys_file

    @property
    def refuses_all(self) -> bool:
        """A keys file is configured but no key at all is: every API request gets a 401."""
        return not self._by_digest and self._keys_file

    def lookup(self, token: bytes) -> Tenant | None:
        return self._by_digest.get(hashlib.sha256(token).digest())

    @classmethod
    def build(cls, keys_file: KeysFile | None, api_keys: list[str]) -> KeyDirectory:
        unnamed = Tenant(UNNAMED, TenantLimits())
        tenants = {UNNAMED: unnamed}
        by_digest = {key_digest(k): unnamed for k in api_keys}
        for entry in keys_file.keys if keys_file else []:
            tenant = tenants[entry.name] = Tenant(entry.name, entry.limits())
            for key in entry.keys:
                by_digest[key_digest(key)] = tenant
        return cls(tenants, by_digest, keys_file.plain_key_names() if keys_file else [],
                   keys_file=keys_file is not None)
