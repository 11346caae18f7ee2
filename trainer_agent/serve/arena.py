"""The persistent shared-memory arena: one file in /dev/shm, split into equal slots.

Pages are populated once, when the arena is mapped (`weightsync.populated`: a first
touch costs ~1.6-3 GB/s here, far more under gVisor; a warm rewrite ~20 GB/s), then
reused every step. Growing a slot reallocates the whole arena and says so.

An arena's file is removed on any exit of the process that made it: `close()`, a normal
exit, `sys.exit` or an uncaught exception (atexit), and SIGTERM where nothing else
handles it (the handler removes the files, then lets SIGTERM end the process as it
would have). The handler is Python's, so it runs when the main thread next runs bytecode:
a main thread blocked in one long call holds it, where another thread took the signal
(`weightsync.signal_wait`). A `kill -9` or `os._exit` runs no code: the next trainer on the host
reclaims such a file by its free lock (`weightsync.arena_files.reclaim_orphans`).
"""

from __future__ import annotations

import atexit
import logging
import mmap
import os
import signal
import threading
import time
import weakref
from pathlib import Path
from types import FrameType

import numpy as np

from weightsync.arena_files import SHM_DIR, create_locked, new_arena_name
from weightsync.layout import align_up
from weightsync.populated import map_shared

log = logging.getLogger(__name__)
_SLOT_ALIGN = 2 << 20  # whole huge pages per slot


_LIVE: weakref.WeakSet[Arena] = weakref.WeakSet()  # arenas holding a file, of this process
_exit_hooks_pid = 0  # the process that installed the exit hooks (a forked child installs its own)


def _remove_files() -> None:
    """Unlinks the files of this process's live arenas (not a forked parent's: only its own)."""
    for arena in list(_LIVE):
        path = arena.path
        if path is not None and arena.owner_pid == os.getpid():
            path.unlink(missing_ok=True)


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    _remove_files()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.raise_signal(signal.SIGTERM)  # ends the process as SIGTERM would have
    # Still here: the host did not deliver it to this thread (seen under gVisor, where the
    # process went on running); exit as a shell reports a SIGTERM'd process.
    os._exit(128 + signal.SIGTERM)


def _install_exit_hooks() -> None:
    """atexit, and a SIGTERM handler where SIGTERM has none (the default action; the main
    thread only, as Python requires): once per process."""
    global _exit_hooks_pid
    if _exit_hooks_pid == os.getpid():
        return
    _exit_hooks_pid = os.getpid()
    atexit.register(_remove_files)
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _on_sigterm)


class Arena:
    """A shm file of `slots` slots of `slot_bytes` each, mapped read-write.

    Not thread-safe for concurrent writers; the publisher owns all writes. Readers (the
    chunk server) take views through `slot()`. The file's fd stays open holding the
    owner lock (`weightsync.arena_files`), so a trainer starting on this host after a
    `kill -9` reclaims it.
    """

    def __init__(self, tag: str, *, slots: int = 2, directory: str | Path = SHM_DIR) -> None:
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        self.tag = tag
        self.slots = slots
        self.directory = directory
        self.slot_bytes = 0
        self.path: Path | None = None
        self.allocations = 0
        self._mm: mmap.mmap | None = None
        self._buf: np.ndarray | None = None
        self._fd = -1  # holds the owner lock while the arena exists
        self.owner_pid = os.getpid()

    @property
    def nbytes(self) -> int:
        return self.slots * self.slot_bytes

    def fits(self, needed: int) -> bool:
        """Whether every slot already holds `needed` bytes (no reallocation)."""
        return self._mm is not None and needed <= self.slot_bytes

    def ensure_slot_bytes(self, needed: int) -> bool:
        """Makes every slot hold at least `needed` bytes; True when it (re)allocated.

        Raises:
            ResourceExhausted (field `arena`): no room for it in the directory;
            FailedPrecondition (field `arena`): no file can be made there. Either way the
                arena is then unallocated (a reallocation has released the old one).
        """
        if self.fits(needed):
            return False
        new_slot = align_up(max(needed, 1), _SLOT_ALIGN)
        if self._mm is not None:
            log.warning(
                "arena %s: layout grew from %d to %d bytes per slot; reallocating (pages are populated again)",
                self.path,
                self.slot_bytes,
                new_slot,
            )
        self._release()
        self.slot_bytes = new_slot
        path = Path(self.directory) / new_arena_name(self.tag)
        t0 = time.perf_counter()
        try:
            self._fd = create_locked(path, self.nbytes)
            self.path = path  # made: _release removes it, as does this process's exit
            self.owner_pid = os.getpid()
            _install_exit_hooks()
            _LIVE.add(self)
            self._mm = map_shared(self._fd, self.nbytes, writable=True)  # its pages reserved by create_locked
        except BaseException:
            self.close()  # unallocated, as before the first call: the old slots are gone too
            raise
        self._buf = np.frombuffer(self._mm, dtype=np.uint8)
        self.allocations += 1
        log.info(
            "arena %s: %d slots x %d bytes allocated and populated in %.3f s",
            self.path,
            self.slots,
            self.slot_bytes,
            time.perf_counter() - t0,
        )
        return True

    def slot(self, index: int) -> np.ndarray:
        """A uint8 view of one slot (valid until the arena is reallocated or closed)."""
        if self._buf is None:
            raise RuntimeError("arena is not allocated; call ensure_slot_bytes() first")
        if not 0 <= index < self.slots:
            raise IndexError(f"slot {index} not in [0, {self.slots})")
        return self._buf[index * self.slot_bytes : (index + 1) * self.slot_bytes]

    def buffer(self) -> np.ndarray:
        """The whole arena as one uint8 view (slot i starts at i * slot_bytes)."""
        if self._buf is None:
            raise RuntimeError("arena is not allocated; call ensure_slot_bytes() first")
        return self._buf

    def _release(self) -> None:
        self._buf = None
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:
                # A reader still holds a view: the mapping dies with the last view.
                log.warning("arena %s: views still exported at close; unmapping when they are dropped", self.path)
            self._mm = None
        if self.path is not None:
            self.path.unlink(missing_ok=True)
            self.path = None
        if self._fd >= 0:
            os.close(self._fd)  # drops the owner lock
            self._fd = -1

    def close(self) -> None:
        """Unmaps and unlinks the shm file; idempotent."""
        self._release()
        self.slot_bytes = 0
