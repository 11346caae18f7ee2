"""The `hostshm` transport, both halves: rollouts on one host read a relay's receive buffers.

A relay on a unix socket (`--relay-host unix:DIR`) receives each version into buffers of
shared memory: memfd files, sealed against shrinking, so a reader's mapping can never
lose its pages under it (SIGBUS). A reader on the same host asks the relay over its unix
socket where a window of chunks lies (`tcp.MAP_MAGIC`, the tcp request otherwise): the
relay waits until the first is verified on its side and answers with a read-only
descriptor of the buffer (SCM_RIGHTS) and how many of the chunks are ready. The reader
maps it read-only and copies each chunk into its own receive buffer, hashing the bytes it
wrote (`native.copy_digest`), so what it verifies and applies is its own copy, which no
other process can change after the check. No chunk byte crosses the socket; nothing
needs an inet socket; no file is named, so nothing is left behind however a process dies.
"""

from __future__ import annotations

import dataclasses
import fcntl
import mmap
import os
import socket
import weakref
from collections.abc import Sequence

import numpy as np

from weightsync import native
from weightsync.digests import xxh3
from weightsync.errors import FailedPrecondition, TransportUnavailable
from weightsync.populated import map_shared
from weightsync.transports.base import FetchRequest
from weightsync.transports.tcp import MAP_MAGIC, REPLY, TcpTransport, recv_exact

# Sealed on the relay's side and demanded on the reader's: the file keeps its size.
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


class _SharedMap(mmap.mmap):
    """A writable mapping of a sealed memfd; `fd` is the file's (closed with the mapping)."""

    fd: int


def shared_array(nbytes: int) -> np.ndarray:
    """`nbytes` of zeroed shared memory as a writable uint8 array (a relay's receive buffer);
    `readonly_fd` hands readers a descriptor of it. The memory goes when the array (and
    every view of it) and every reader's mapping are gone."""
    fd = os.memfd_create("weightsync-relay", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, nbytes)
        os.posix_fallocate(fd, 0, nbytes)  # its pages, so that MAP_POPULATE maps each one
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
        # populated now, as `map_shared` maps: not a fault a page at the first version's receive
        mapping = _SharedMap(fd, nbytes, mmap.MAP_SHARED | mmap.MAP_POPULATE)
    except BaseException:
        os.close(fd)
        raise
    mapping.fd = fd
    weakref.finalize(mapping, os.close, fd)
    return np.frombuffer(mapping, np.uint8)


def readonly_fd(array: np.ndarray) -> int:
    """A new read-only descriptor of the shared memory `array` (or a view of it) lies in:
    a reader can map it for reading only. FailedPrecondition for memory not made by
    `shared_array`."""
    base: object = array
    while isinstance(base, np.ndarray):
        base = base.base
    owner = base.obj if isinstance(base, memoryview) else None
    if not isinstance(owner, _SharedMap):
        raise FailedPrecondition("this relay's buffers are not shared memory", field="request")
    return os.open(f"/proc/self/fd/{owner.fd}", os.O_RDONLY | os.O_CLOEXEC)


class HostShmTransport(TcpTransport):
    """Reads chunks from a relay's shared buffers on this host (its `unix:` address)."""

    name = "hostshm"
    cross_host = False
    receives_in_place = True
    magic = MAP_MAGIC

    def __init__(self) -> None:
        super().__init__()
        self._received: list[int] = []  # descriptors of the last reply
        self._file: tuple[int, int] | None = None  # (device, inode) of the buffer mapped
        self._source: np.ndarray | None = None

    def _recv_head(self, sock: socket.socket) -> bytes:
        head, fds, _flags, _addr = socket.recv_fds(sock, REPLY.size, 1, socket.MSG_CMSG_CLOEXEC)
        self._received += fds
        if not head:
            raise ConnectionResetError("peer closed the connection")
        return head + recv_exact(sock, REPLY.size - len(head))

    def fetch_into(
        self, request: FetchRequest, buf: np.ndarray, base: int, digests: Sequence[int] | None
    ) -> np.ndarray:
        """Copies the requested chunks out of the relay's buffer into buf[offset - base :
        ...] as they become ready there, hashing what lands (unless `digests` is None);
        returns one bool per index (digest matched)."""
        ok = np.zeros(len(request.indices), bool)
        done = 0
        while done < len(ok):
            rest = dataclasses.replace(request, indices=request.indices[done:], spans=request.spans[done:])
            try:
                _, ready = self._request(rest)
                source = self._map(ready, len(ok) - done)
            finally:
                received, self._received = self._received, []
                for fd in received:
                    os.close(fd)
            for i in range(done, done + ready):
                offset, length = request.spans[i]
                if offset + length > source.nbytes:
                    raise TransportUnavailable(f"hostshm {self._address}: its buffer is smaller than the manifest says")
                dst = buf[offset - base : offset - base + length]
                src = source[offset : offset + length]
                if digests is None:
                    np.copyto(dst, src)
                    ok[i] = True
                elif native.available():
                    ok[i] = native.copy_digest(dst, src) == digests[i]
                else:
                    np.copyto(dst, src)
                    ok[i] = xxh3(dst) == digests[i]
            done += ready
        return ok

    def _map(self, ready: int, asked: int) -> np.ndarray:
        """The buffer the last reply's descriptor names, mapped read-only (kept while the
        relay answers with the same file)."""
        if len(self._received) != 1 or not 0 < ready <= asked:
            self.close()
            raise TransportUnavailable(f"hostshm {self._address}: not a relay sharing its buffers")
        fd = self._received[0]
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != self._file:
            if not st.st_size or fcntl.fcntl(fd, fcntl.F_GET_SEALS) & SEALS != SEALS:  # could shrink under a mapping
                self.close()
                raise TransportUnavailable(f"hostshm {self._address}: its buffer is empty or not sealed to its size")
            self._source = None  # the old mapping goes before the new one is made
            self._source = np.frombuffer(map_shared(fd, st.st_size), np.uint8)
            self._file = (st.st_dev, st.st_ino)
        assert self._source is not None
        return self._source

    def close(self) -> None:
        super().close()
        self._file = self._source = None
