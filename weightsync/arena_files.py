"""Arena files in /dev/shm: how they are named, who owns one, and reclaiming the dead's.

An arena is `weightsync-<tag>-<pid>-<random>` in /dev/shm. Its owner holds an exclusive
`flock` on it for as long as it lives (the kernel drops it when the process dies, however
it dies), so "is the owner alive" is a lock test that works across PID namespaces, not a
guess from the pid in the name. The pid is there for people and for tests that know
which processes they started. An arena has its name only once it is whole and locked;
where /dev/shm cannot make nameless files it is made under a hidden name first
(`.weightsync-....creating`), one no reader maps, and reclaimed by the same lock test.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
import stat
import uuid
from pathlib import Path

from weightsync.errors import FailedPrecondition, ResourceExhausted

log = logging.getLogger(__name__)
SHM_DIR = Path("/dev/shm")
ARENA_PREFIX = "weightsync-"
ARENA_GLOB = f"{ARENA_PREFIX}*"
ARENA_NAME = re.compile(r"^weightsync-[A-Za-z0-9._-]+$")
CREATING_SUFFIX = ".creating"
# Makings of one hidden file a reclaimer may remove (as a dead maker's) before the maker gives up.
MAKE_ATTEMPTS = 3


def new_arena_name(tag: str) -> str:
    """A fresh arena file name for this process."""
    return f"{ARENA_PREFIX}{tag}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def owner_pid(name: str) -> int | None:
    """The pid an arena name records (None when the name is not an arena's)."""
    parts = name.split("-")
    if not name.startswith(ARENA_PREFIX) or len(parts) < 4 or not parts[-2].isdigit():
        return None
    return int(parts[-2])


def create_locked(path: Path, nbytes: int) -> int:
    """Creates the arena file at `path`, sized `nbytes`, and returns its fd holding the
    owner's lock. The file is made without a name (O_TMPFILE), locked and sized, then
    linked into place: no reclaimer ever sees an arena without its owner's lock, and a
    process that dies (or exits with the call on another thread) before the link leaves
    nothing behind. Where the filesystem cannot make a nameless file (gVisor's /dev/shm,
    old kernels), it is made under a hidden name instead, locked and sized there, then
    linked into place; a maker killed on the way leaves files whose lock is free, which
    `reclaim_orphans` removes. Neither way replaces a file already at `path`.

    Raises:
        FileExistsError: something is at `path` already (another maker's arena).
        ResourceExhausted (field `arena`): the filesystem has no room for `nbytes`.
        FailedPrecondition (field `arena`): no file can be made there (read-only, missing).
    """
    try:
        fd = os.open(path.parent, os.O_TMPFILE | os.O_RDWR, 0o600)
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.EISDIR):  # EISDIR: a kernel without O_TMPFILE
            raise _unwritable(path.parent, e) from e
        return _create_hidden(path, nbytes)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        _reserve(fd, nbytes, path.parent)
        # linkat(AT_SYMLINK_FOLLOW) of the fd's /proc link needs no privilege; os.link uses
        # linkat (not link, which would link the symlink itself) when given a dir fd.
        parent = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.link(f"/proc/self/fd/{fd}", path.name, dst_dir_fd=parent, follow_symlinks=True)
        finally:
            os.close(parent)
    except BaseException:
        os.close(fd)
        raise
    return fd


def hidden_name(path: Path) -> Path:
    """Where `create_locked` makes the arena `path` on a filesystem without nameless files:
    a name no arena has (`ARENA_NAME`), so nothing maps it."""
    return path.with_name(f".{path.name}{CREATING_SUFFIX}")


def _create_hidden(path: Path, nbytes: int) -> int:
    """create_locked under a hidden name, linked into place (a link, unlike a rename, fails
    where `path` exists), then the hidden name removed."""
    hidden = hidden_name(path)
    fd = _create_and_lock(hidden)
    try:
        _reserve(fd, nbytes, path.parent)
        os.link(hidden, path)
    except BaseException:
        try:
            os.unlink(hidden)  # still ours: a reclaimer removes only files whose lock is free
        finally:
            os.close(fd)
        raise
    os.unlink(hidden)
    return fd


def _create_and_lock(path: Path) -> int:
    """A new file at `path` whose lock this process holds. Between its making and its lock
    a reclaimer may take it for a dead maker's leftover and remove it (holding the lock
    while it does): the lock then comes with the name gone, and the file is made anew."""
    for _ in range(MAKE_ATTEMPTS):
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except FileExistsError:
            raise
        except OSError as e:
            raise _unwritable(path.parent, e) from e
        fcntl.flock(fd, fcntl.LOCK_EX)  # waits out a reclaimer's check, at most
        if _is_named(path, fd):
            return fd
        os.close(fd)
    raise FailedPrecondition(
        f"arena: {path} was removed as it was made, {MAKE_ATTEMPTS} times (another process removes files there)",
        field="arena",
    )


def _is_named(path: Path, fd: int) -> bool:
    """True while `path` names the file open at `fd`."""
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)


def _unwritable(directory: Path, error: OSError) -> FailedPrecondition:
    """The error for a directory where no arena can be made (read-only, missing, not ours)."""
    return FailedPrecondition(
        f"arena: cannot create a file in {directory}: {error.strerror} (the trainer needs it writable: in"
        " Kubernetes, an emptyDir with medium: Memory mounted there)",
        field="arena",
    )


def _reserve(fd: int, nbytes: int, directory: Path) -> None:
    """Sizes the file and allocates its pages now. A sparse file on a tmpfs without room
    (Kubernetes gives a pod 64 MiB of /dev/shm unless a memory emptyDir is mounted) maps
    fine and then kills the process with SIGBUS at the first page that finds none; this
    fails here instead, with the figures. (On tmpfs it also costs no more: allocating first
    made allocation plus populate 1.3 s for 2 GiB here, populate alone 1.5-1.6 s.)"""
    os.ftruncate(fd, nbytes)
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            raise
        st = os.statvfs(directory)
        raise ResourceExhausted(
            f"arena: {nbytes} bytes do not fit in {directory} ({st.f_bavail * st.f_frsize} of"
            f" {st.f_blocks * st.f_frsize} bytes free): give it more room (in Kubernetes, an emptyDir"
            " with medium: Memory and a sizeLimit of at least the arena) or free what else is there",
            field="arena",
        ) from e


def owner_alive(path: Path) -> bool:
    """True while some process holds the arena's owner lock (or the file is another user's,
    whose lock this process cannot test)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return False
    except PermissionError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # releases our probe lock, if we got it
    return False


def reclaim_orphans(directory: Path = SHM_DIR) -> list[Path]:
    """Removes arenas whose owner is gone (killed without cleanup), and the hidden files of
    makers killed while making one (`create_locked` without nameless files); returns them.
    Both are told by their lock alone, held while the file is removed (a maker locks its
    hidden file just after making it, finds the name gone, and makes another): never by the
    pid in a name, which in another PID namespace may name anyone. Files of other users,
    whose lock this process cannot test, are left alone."""
    removed = []
    for path in sorted(directory.glob(ARENA_GLOB)):
        if ARENA_NAME.fullmatch(path.name) and _remove_if_unlocked(path):
            removed.append(path)
            log.warning("reclaimed arena %s: its owner (pid %s) is gone", path, owner_pid(path.name))
    for path in sorted(directory.glob(f".{ARENA_GLOB}{CREATING_SUFFIX}")):
        name = path.name[1 : -len(CREATING_SUFFIX)]
        if ARENA_NAME.fullmatch(name) and _remove_if_unlocked(path):
            removed.append(path)
            log.warning("removed half-made arena %s: its maker (pid %s) is gone", path, owner_pid(name))
    return removed


def _remove_if_unlocked(path: Path) -> bool:
    """Removes the regular file `path` if nobody holds its lock, holding the lock meanwhile."""
    try:  # O_NONBLOCK: a FIFO by that name does not wait for a writer
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:  # gone meanwhile, a symlink (ELOOP), another user's (EACCES)
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if not stat.S_ISREG(os.fstat(fd).st_mode) or not _is_named(path, fd):
            return False
        path.unlink()
    except OSError:  # BlockingIOError: its owner lives; EPERM: a sticky directory, not ours
        return False
    finally:
        os.close(fd)
    return True
