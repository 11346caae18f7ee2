"""Process logging: one line per record, as text or JSON (`--log-format json`).

JSON lines carry time (RFC 3339, UTC), level, logger, pid and message, plus what every
line of a weightsync process should name: `session` and `agent_id` (bound once by the
entry point) and `version` wherever the code logging knows it (`extra={"version": v}`, or
`version_context(v)` around a sync or a publish, for the thread doing it).
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator
from contextvars import ContextVar
from datetime import UTC, datetime
from typing import Any

LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s pid=%(process)d %(message)s"

_bound: dict[str, Any] = {}
_version: ContextVar[int | None] = ContextVar("weightsync_log_version", default=None)


def bind(**fields: Any) -> None:
    """Names this process's session / agent_id on every JSON line from now on."""
    _bound.update({k: v for k, v in fields.items() if v not in (None, "")})


@contextlib.contextmanager
def version_context(version: int) -> Iterator[None]:
    """Lines this thread logs inside carry `version`."""
    token = _version.set(version)
    try:
        yield
    finally:
        _version.reset(token)


class JsonFormatter(logging.Formatter):
    """One JSON object per line (jq- and log-pipeline-friendly)."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC)
            .isoformat(timespec="milliseconds")
            .replace("+00:00", "Z"),
            "level": record.levelname,
            "logger": record.name,
            "pid": record.process,
            "message": record.getMessage(),
            **_bound,
        }
        version = getattr(record, "version", None)
        version = _version.get() if version is None else version
        if version:
            line["version"] = version
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


def setup_logging(level: str, fmt: str = "text") -> None:
    """Root logging for an entry point: `fmt` "text" (one key=value line) or "json"."""
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}, got {fmt!r}")
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(getattr(logging, level.upper(), logging.INFO))
