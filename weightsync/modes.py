"""Weight-sync modes (`--weight-sync-mode`): names, aliases, validation."""

from __future__ import annotations

from weightsync.errors import InvalidArgument

MODES = ("grpc", "shm", "fs")
ALIASES = {"filesystem": "fs", "gcs": "fs"}  # gcs: the fs mode with a gs:// root (gcsfs)
NOT_YET = ("tcp", "relay")


def normalize_mode(value: str, field: str = "weight_sync_mode", *, allow_empty: bool = False) -> str:
    """The canonical mode name; empty stays empty where the session's default applies."""
    if not value and allow_empty:
        return ""
    mode = ALIASES.get(value, value)
    if mode in MODES:
        return mode
    if mode in NOT_YET:
        raise InvalidArgument(field, f"{value!r} is not implemented yet; use one of {', '.join(MODES)}")
    raise InvalidArgument(field, f"{value!r} is not a weight-sync mode; use one of {', '.join(MODES)} (aliases: {', '.join(ALIASES)})")
