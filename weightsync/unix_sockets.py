"""A server's unix-domain socket file: owner+group access, one live owner, removed at the end.

gRPC binds a unix address by unlinking whatever is at the path first, a live server's
socket included (grpcio 1.85 does: the second server silently takes the path and the first
serves on nothing anyone can dial). So the path is checked here before gRPC binds: a socket
that answers connect() is another process's (refused, naming it); one that refuses is a
dead owner's leftover (removed, then bound); anything else at the path is not replaced.

The socket is bound inside a private directory (mode 0700, made beside the final path),
given mode 0660 there, then renamed into place: nobody outside the owner's user and group
can dial it at any moment, whatever the process's umask, and no process-wide umask is
changed under other threads that create files. A flock on the directory makes the check,
the bind and the rename one step against another server starting on the same path.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import socket
import stat
import struct
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from weightsync.addresses import unix_address
from weightsync.errors import FailedPrecondition

log = logging.getLogger(__name__)
T = TypeVar("T")

SOCKET_MODE = 0o660
# The private directory's socket name (the path's length is checked against this).
BOUND_NAME = "s"
PROBE_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class SocketFile:
    """A bound socket file; `remove()` deletes it if it is still this one."""

    path: str
    device: int
    inode: int

    def remove(self) -> None:
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return
        if (st.st_dev, st.st_ino) == (self.device, self.inode):
            os.unlink(self.path)


def bind_unix(path: str, bind: Callable[[str], T], field: str) -> tuple[T, SocketFile]:
    """Calls `bind(temporary_path)` (which makes a server listen there) and moves the
    socket to `path` with mode 0660; returns bind's result and the socket file.

    FailedPrecondition naming `field` where another process serves on `path`, where
    something other than a socket is there, or where the directory cannot be used."""
    address = unix_address(path)
    directory = os.path.dirname(path) or "/"
    try:
        dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as e:
        raise FailedPrecondition(f"cannot listen on {address}: {directory}: {e.strerror}", field=field) from None
    try:
        fcntl.flock(dir_fd, fcntl.LOCK_EX)
        _clear_leftover(path, field)
        try:
            private = tempfile.mkdtemp(prefix=".", dir=directory)
        except OSError as e:
            raise FailedPrecondition(f"cannot listen on {address}: {directory}: {e.strerror}", field=field) from None
        temporary = os.path.join(private, BOUND_NAME)
        try:
            result = bind(temporary)
            os.chmod(temporary, SOCKET_MODE)
            os.rename(temporary, path)
        except OSError as e:
            raise FailedPrecondition(f"cannot listen on {address}: {e.strerror}", field=field) from None
        finally:
            shutil.rmtree(private, ignore_errors=True)  # empty unless the bind or the rename failed
        st = os.lstat(path)
        return result, SocketFile(path, st.st_dev, st.st_ino)
    finally:
        os.close(dir_fd)  # releases the flock


def _clear_leftover(path: str, field: str) -> None:
    """Removes a socket whose owner is gone; refuses a live one or a file of another kind."""
    address = unix_address(path)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise FailedPrecondition(f"{path} exists and is not a socket: not replacing it", field=field)
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(PROBE_TIMEOUT_S)
    try:
        probe.connect(path)
    except ConnectionRefusedError:  # nothing listens: its process died without removing it
        log.info("%s: its previous server is gone; taking it over", address)
        os.unlink(path)
        return
    except FileNotFoundError:
        return
    except (BlockingIOError, TimeoutError):  # a full accept queue: someone listens
        raise FailedPrecondition(
            f"another process serves on {address} (it accepts no more connections)", field=field
        ) from None
    except PermissionError:
        raise FailedPrecondition(
            f"{address} belongs to another user (uid {st.st_uid}): cannot tell whether it is served", field=field
        ) from None
    else:
        raise FailedPrecondition(
            f"another process serves on {address} ({owner(probe)}): stop it or choose another path", field=field
        )
    finally:
        probe.close()


def owner(connected: socket.socket) -> str:
    """`pid N: its command line` of the process listening at the other end of `connected`."""
    peer = struct.unpack("3i", connected.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))[0]
    if peer <= 0:  # a listener in another pid namespace
        return "its pid is not visible here"
    return process_named(peer)


def process_named(task: int) -> str:
    """`pid N: its command line` of the process that `task` (a process's id or one of its
    threads') belongs to. Linux's SO_PEERCRED gives the listener's process; gVisor's (the
    TPU host's) gives the thread that listened, and gRPC listens from a thread of its own."""
    pid = task
    try:
        with open(f"/proc/{task}/status") as f:
            pid = next((int(line.split()[1]) for line in f if line.startswith("Tgid:")), task)
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            command = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except (OSError, ValueError):
        command = ""
    return f"pid {pid}: {command}" if command else f"pid {pid}"
