"""Storage options of the fs store: `--fs-option key=value` flags made into fsspec's keyword
arguments, and the same options as they may be shown (secrets hidden)."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

from weightsync.errors import InvalidArgument

_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")
_INT = re.compile(r"-?[0-9]{1,18}")
# Keys whose values are credentials: kept as given (never made numbers) and never shown.
_SECRET = re.compile(r"secret|token|password|key|credential|session", re.IGNORECASE)
# Options the fs store sets itself; a flag could only break what the store relies on.
RESERVED = frozenset({"skip_instance_cache", "use_listings_cache", "listings_expiry_time"})


def is_secret(key: str) -> bool:
    """Whether an option's value is a credential (by its name: key, secret, token...)."""
    return bool(_SECRET.search(key.rsplit(".", 1)[-1]))


def parse_fs_options(items: Iterable[str], field: str = "fs_option") -> dict[str, Any]:
    """`key=value` strings as fsspec storage options. `true`/`false` become booleans and
    decimal integers ints (block sizes), except under secret names; a dotted key nests
    (`client_kwargs.region_name=eu-west-1`).

    Raises:
        InvalidArgument: an item without '=', a key that is not a dotted identifier, a key
        given twice, or one the store sets itself (`RESERVED`).
    """
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not _KEY.fullmatch(key):
            raise InvalidArgument(f"{_shown(item)!r} is not key=value (e.g. endpoint_url=https://...)", field=field)
        if key.split(".", 1)[0] in RESERVED:
            raise InvalidArgument(f"{key!r} is set by the fs store itself", field=field)
        value: Any = raw
        if not is_secret(key):
            if raw.lower() in ("true", "false"):
                value = raw.lower() == "true"
            elif _INT.fullmatch(raw):
                value = int(raw)
        *parents, last = key.split(".")
        node = out
        for p in parents:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise InvalidArgument(f"{key!r}: {p!r} is given a value and nested keys", field=field)
        if last in node:
            raise InvalidArgument(f"{key!r} is given twice", field=field)
        node[last] = value
    return out


def _shown(item: str) -> str:
    key = item.partition("=")[0]
    return f"{key}=***" if "=" in item and is_secret(key) else item[:100]


def redacted(options: Mapping[str, Any]) -> dict[str, Any]:
    """`options` with every secret's value replaced by '***' (for logs and status)."""
    return {k: redacted(v) if isinstance(v, Mapping) else ("***" if is_secret(k) else v) for k, v in options.items()}
