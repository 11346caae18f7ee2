"""One ERROR line per refused version in a vLLM server's log, not a traceback per process.

A refusal is an answer, not a crash: the engine's last worker logs it once at ERROR
(`backend`) and raises it for vLLM to return. vLLM then logs the exception's traceback in
the worker ("WorkerProc hit an exception."), again in the engine core ("Invocation of
collective_rpc method failed") and, in the OpenAI server, uvicorn logs the route's
("Exception in ASGI application"): some fifty ERROR lines that say nothing the first did
not. `install()` (the plugin's `register`, in every vLLM process) adds a filter to those
loggers that keeps each such record as one INFO line without its traceback, for records
whose exception carries `MARKER`; every other record passes as it is.
"""

from __future__ import annotations

import logging

MARKER = "weightsync refused"
LOGGERS = (
    "vllm.v1.executor.multiproc_executor",
    "vllm.v1.engine.core",
    "vllm.entrypoints.serve.exception_handling.handlers.exception",
    "uvicorn.error",
)


def _carries_marker(error: BaseException | None) -> bool:
    seen = 0
    while error is not None and seen < 8:  # the exception, what caused it, and its notes
        if MARKER in str(error) or any(MARKER in note for note in getattr(error, "__notes__", ())):
            return True
        error, seen = error.__cause__ or error.__context__, seen + 1
    return False


class RefusalTracebacks(logging.Filter):
    """Keeps a refused version's traceback records as one INFO line each."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if not _carries_marker(error):
            return True
        first = str(error).strip().splitlines()[0][:300] if str(error).strip() else type(error).__name__
        record.msg, record.args = f"{record.getMessage()} ({first}; the worker's ERROR line has it)", ()
        record.exc_info, record.exc_text, record.stack_info = None, None, None
        record.levelno, record.levelname = logging.INFO, "INFO"
        return True


def install() -> None:
    """Adds the filter to vLLM's and uvicorn's loggers in this process (once)."""
    for name in LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, RefusalTracebacks) for f in logger.filters):
            logger.addFilter(RefusalTracebacks())
