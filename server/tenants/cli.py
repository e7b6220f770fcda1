"""`llm-gateway keys add NAME` and `llm-gateway usage`: the keys file and the usage store from a shell."""

from __future__ import annotations

import os
import secrets
import sqlite3
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

from server.settings.keys_file import KeysFile, KeysFileError, hashed, load_keys_file
from server.tenants.usage import SHOWN, read_rows, totals

LIMIT_OPTIONS = ("requests_per_minute", "tokens_per_minute", "max_concurrent", "budget_tokens", "budget_period",
                 "models", "share")
"""The keys-file fields `llm-gateway keys add` takes as options (--requests-per-minute, ...)."""


def new_key() -> str:
    return "sk-" + secrets.token_urlsafe(32)


def _write_atomically(path: Path, text: str) -> None:
    """Readers (a gateway reloading) see the old file or the new one, never half of one."""
    mode = path.stat().st_mode & 0o777 if path.exists() else 0o640
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _checked(path: Path, text: str) -> KeysFile:
    """`text` as the keys file it would be (validated in a temporary copy)."""
    with tempfile.TemporaryDirectory() as tmp:
        probe = Path(tmp) / path.name
        probe.write_text(text, encoding="utf-8")
        return load_keys_file(probe)


def add_key(path: Path, name: str, limits: dict[str, Any]) -> tuple[str, str]:
    """A new random key for tenant `name`, its SHA-256 written to the keys file at `path`.

    A new name is appended as an entry, keeping the file's comments; an existing name gets the
    key added to its list (a second key while clients move over; limits stay as they are).
    Returns (the key, what was done)."""
    key = new_key()
    current = load_keys_file(path) if path.exists() else KeysFile()
    text = path.read_text(encoding="utf-8") if path.exists() else ""
    existing = next((e for e in current.keys if e.name == name), None)
    if existing is not None:
        if any(v is not None for v in limits.values()):
            raise KeysFileError(f"{name!r} is already in {path}: its limits are not changed here; "
                                "edit the file (the new key was not written)")
        data = yaml.safe_load(text) or {}
        entry = next(e for e in data["keys"] if e.get("name") == name)
        entry["key"] = [*([entry["key"]] if isinstance(entry["key"], str) else entry["key"]), hashed(key)]
        new_text = yaml.safe_dump(data, sort_keys=False)
        done = f"added a second key to {name!r} in {path} (remove the old one once its clients moved)"
    else:
        entry = {"name": name, "key": hashed(key), **{k: v for k, v in limits.items() if v is not None}}
        block = yaml.safe_dump([entry], sort_keys=False)
        if not text.strip():
            new_text = "keys:\n" + _indent(block)
        else:
            new_text = text + ("" if text.endswith("\n") else "\n") + _indent(block)
            try:
                _checked(path, new_text)
            except KeysFileError:  # not a block list to append to (e.g. `keys: []`): write it anew
                data = yaml.safe_load(text) or {}
                data.setdefault("keys", []).append(entry)
                new_text = yaml.safe_dump(data, sort_keys=False)
        done = f"added {name!r} to {path}"
    _checked(path, new_text)
    _write_atomically(path, new_text)
    return key, done


def _indent(block: str) -> str:
    return "".join(f"  {line}" if line.strip() else line for line in block.splitlines(keepends=True))


def print_usage(db: Path, tenant: str | None, start: str | None, end: str | None) -> int:
    """The usage store as a table: one row per tenant and day, then each tenant's totals."""
    if not db.exists():
        print(f"no usage recorded yet: {db} does not exist", file=sys.stderr)
        return 1
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10) as conn:
        rows = read_rows(lambda sql, args: conn.execute(sql, args).fetchall(), tenant, start, end)
    columns = ["tenant", "day", *SHOWN]
    lines = [[str(v) for v in row.as_dict().values()] for row in rows]
    lines += [[name, "total", *(str(v) for v in sums.values())] for name, sums in sorted(totals(rows).items())]
    widths = [max([len(c), *(len(line[i]) for line in lines)]) for i, c in enumerate(columns)]

    def show(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    print(show(columns))
    for line in lines:
        print(show(line))
    if not rows:
        print("(no rows)")
    return 0
