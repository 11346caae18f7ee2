"""Weight-sync modes (`--weight-sync-mode`): names, aliases, validation."""

from __future__ import annotations

from weightsync.errors import InvalidArgument

MODES = ("grpc", "tcp", "shm", "fs", "relay")
ALIASES = {"filesystem": "fs", "gcs": "fs"}  # gcs: the fs mode with a gs:// root (gcsfs)


def normalize_mode(value: str, field: str = "weight_sync_mode", *, allow_empty: bool = False) -> str:
    """The canonical mode name; empty stays empty where the session's default applies."""
    if not value and allow_empty:
        return ""
    mode = ALIASES.get(value, value)
    if mode in MODES:
        return mode
    raise InvalidArgument(
        f"{value!r} is not a weight-sync mode; use one of {', '.join(MODES)} (aliases: {', '.join(ALIASES)})",
        field=field,
    )
