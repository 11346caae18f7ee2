"""ShmTransport: a rollout on the trainer's host maps the arena read-only; no network.

Chunks come back as views into the mapping; the puller copies each into its receive
buffer and hashes it in the same pass (`native.copy_digest`), so what it verifies and
applies is its own copy, which the trainer's next write into the slot cannot change. The
mapping is populated when it is made (`weightsync.populated`): the first pull of each
slot finds its pages mapped. Only arena files under /dev/shm with weightsync's prefix
are ever opened: a manifest cannot point this at arbitrary files.
"""

from __future__ import annotations

import logging
import mmap
import os
import time
from collections.abc import Iterator
from pathlib import Path

from weightsync.arena_files import ARENA_NAME, SHM_DIR
from weightsync.errors import InvalidArgument, TransportUnavailable
from weightsync.manifest import Endpoint
from weightsync.populated import map_shared
from weightsync.transports.base import ChunkPayload, FetchRequest, Transport

log = logging.getLogger(__name__)


def check_arena_path(path: str) -> Path:
    """The arena file, if `path` names one (no '..', symlinks or other directories)."""
    p = Path(path)
    if not p.is_absolute() or p.parent != SHM_DIR or not ARENA_NAME.fullmatch(p.name) or ".." in p.parts:
        raise InvalidArgument(f"{path!r} is not a weightsync arena under {SHM_DIR}", field="endpoint.shm_path")
    return p


class ShmTransport(Transport):
    name = "shm"
    cross_host = False

    def __init__(self) -> None:
        self._mm: mmap.mmap | None = None
        self._view: memoryview | None = None
        self._base = 0
        self._path = ""

    def open(self, endpoint: Endpoint) -> None:
        path = check_arena_path(endpoint.shm_path)
        if self._mm is not None and str(path) == self._path:
            self._base = endpoint.shm_offset  # same arena, maybe another slot: keep the mapping
            return
        self.close()
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError as e:
            raise TransportUnavailable(f"cannot open arena {path}: {e}") from None
        t0 = time.perf_counter()
        try:
            self._mm = map_shared(fd, 0)  # every slot mapped now, not a fault a page at the first pull
        finally:
            os.close(fd)
        log.info("arena %s: %d bytes mapped in %.3f s", path, len(self._mm), time.perf_counter() - t0)
        self._view = memoryview(self._mm)
        self._path = str(path)
        self._base = endpoint.shm_offset

    def fetch(self, request: FetchRequest) -> Iterator[ChunkPayload]:
        self._mapped()
        if len(request.spans) != len(request.indices):
            raise InvalidArgument("the shm transport needs (offset, length) for every index", field="spans")
        for index, (offset, length) in zip(request.indices, request.spans):
            yield ChunkPayload(index, offset, self._slice(offset, length))

    def _mapped(self) -> memoryview:
        if self._view is None:
            raise TransportUnavailable("not open; call open() first")
        return self._view

    def _slice(self, offset: int, length: int) -> memoryview:
        """Bytes [offset, offset + length) of the open slot, as a view of the mapping."""
        view, start = self._mapped(), self._base + offset
        if start + length > len(view):
            raise TransportUnavailable(f"arena {self._path} is smaller than the manifest says (reallocated?)")
        return view[start : start + length]

    def close(self) -> None:
        if self._view is not None:
            self._view.release()
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:  # a payload view is still alive; the mapping goes with it
                pass
        self._mm = self._view = None
        self._path = ""
