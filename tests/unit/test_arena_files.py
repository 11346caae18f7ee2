"""weightsync.arena_files: an arena appears whole and locked or not at all, whether /dev/shm
makes nameless files (O_TMPFILE) or not (gVisor's, on the TPU host); the files of
processes that died while making one are reclaimed by their lock. Makers and reclaimers
run as an ordinary user, as on the TPU host."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.unit.helpers import as_ordinary_user, shared_directory
from weightsync import arena_files
from weightsync.arena_files import SHM_DIR, create_locked, hidden_name, owner_alive, reclaim_orphans
from weightsync.errors import InvalidArgument
from weightsync.transports.shm import check_arena_path

ROOT = Path(__file__).resolve().parents[2]
NAME = "weightsync-test-1-abcdef12"  # pid 1 in the name: alive, so it cannot be what reclaims
# The child makes an arena and stops for good at one step (argv[2]: link, which gives it its
# name, or unlink, which removes the hidden name after), until the test kills it with -9.
# argv[3] "hidden": its /dev/shm refuses O_TMPFILE, as gVisor's does.
_MAKER = """
import errno, os, sys, time
from pathlib import Path
from weightsync import arena_files
real_open = os.open
def no_tmpfile(file, flags, *args, **kwargs):
    if flags & os.O_TMPFILE == os.O_TMPFILE:
        raise OSError(errno.EOPNOTSUPP, "Operation not supported")
    return real_open(file, flags, *args, **kwargs)
def stuck(*args, **kwargs):
    print("creating", flush=True)
    time.sleep(60)
if sys.argv[3] == "hidden":
    os.open = no_tmpfile
setattr(os, sys.argv[2], stuck)
arena_files.create_locked(Path(sys.argv[1]), 1 << 20)
"""


def _nameless_files_refused(directory: Path) -> str:
    """Why `directory` cannot make nameless files ("" where it can)."""
    try:
        os.close(os.open(directory, os.O_TMPFILE | os.O_RDWR, 0o600))
    except OSError as e:
        return f"{directory} makes no nameless files (O_TMPFILE: {errno.errorcode.get(e.errno or 0, e.errno)})"
    return ""


def _refuse_nameless(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process's os.open refuses O_TMPFILE as gVisor's /dev/shm does."""
    real_open = os.open

    def no_tmpfile(file: object, flags: int, *args: object, **kwargs: object) -> int:
        if flags & os.O_TMPFILE == os.O_TMPFILE:
            raise OSError(errno.EOPNOTSUPP, "Operation not supported")
        return real_open(file, flags, *args, **kwargs)

    monkeypatch.setattr(arena_files.os, "open", no_tmpfile)


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    """A directory on /dev/shm's filesystem that the ordinary user may use as /dev/shm."""
    directory = shared_directory(SHM_DIR)
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@contextlib.contextmanager
def _maker_stopped_at(path: Path, step: str, way: str) -> Iterator[subprocess.Popen[str]]:
    """An ordinary user's process making the arena `path` (`way`: nameless or hidden),
    stopped for good at `step`; killed with -9 on the way out, if the test has not."""
    command = [*as_ordinary_user(), sys.executable, "-c", _MAKER, str(path), step, way]
    with subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, text=True) as child:
        try:
            assert child.stdout is not None and child.stdout.readline() == "creating\n"
            yield child
        finally:
            child.kill()
            child.wait(timeout=30)


def _reclaim_as_ordinary_user(directory: Path) -> list[str]:
    """reclaim_orphans(directory) in a process of the ordinary user: the names it removed."""
    code = (
        "import json, sys; from pathlib import Path; from weightsync.arena_files import reclaim_orphans;"
        " print(json.dumps([p.name for p in reclaim_orphans(Path(sys.argv[1]))]))"
    )
    command = [*as_ordinary_user(), sys.executable, "-c", code, str(directory)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return sorted(json.loads(done.stdout))


@pytest.mark.skipif(
    bool(_nameless_files_refused(SHM_DIR)),
    reason=f"{_nameless_files_refused(SHM_DIR)}: a maker killed there leaves its hidden file, reclaimed by its lock"
    " (test_without_nameless_files_...)",
)
def test_a_process_killed_while_making_an_arena_leaves_no_file(shm_dir: Path) -> None:
    with _maker_stopped_at(shm_dir / NAME, "link", "nameless") as child:
        child.kill()
        child.wait(timeout=30)
    assert list(shm_dir.iterdir()) == []  # the nameless file died with it


@pytest.mark.parametrize(
    ("step", "left"),
    [("link", [f".{NAME}.creating"]), ("unlink", [f".{NAME}.creating", NAME])],
)
def test_without_nameless_files_a_killed_makers_files_are_unmappable_or_whole_and_reclaimed_by_their_lock(
    shm_dir: Path, step: str, left: list[str]
) -> None:
    """Killed before the link, a maker leaves its hidden file, a name no reader maps; killed
    after it, the arena too, whole. Both are kept while the maker lives and removed once it
    is gone, by their lock: the pid their name records (1) lives."""
    path = shm_dir / NAME
    with _maker_stopped_at(path, step, "hidden") as child:
        assert sorted(p.name for p in shm_dir.iterdir()) == left
        assert all(owner_alive(shm_dir / name) for name in left)
        assert _reclaim_as_ordinary_user(shm_dir) == []
        child.kill()
        child.wait(timeout=30)
    with pytest.raises(InvalidArgument):
        check_arena_path(str(SHM_DIR / hidden_name(path).name))
    assert not path.exists() or path.stat().st_size == 1 << 20
    assert _reclaim_as_ordinary_user(shm_dir) == left
    assert list(shm_dir.iterdir()) == []


@pytest.mark.parametrize("way", ["nameless", "hidden"])
def test_an_arena_is_locked_by_its_maker_from_the_moment_it_has_a_name(
    shm_dir: Path, monkeypatch: pytest.MonkeyPatch, way: str
) -> None:
    """A second maker at the same name is refused and leaves the first's arena as it was."""
    if way == "nameless" and (why := _nameless_files_refused(shm_dir)):
        pytest.skip(why)
    if way == "hidden":
        _refuse_nameless(monkeypatch)
    path = shm_dir / NAME
    fd = create_locked(path, 4096)
    try:
        first = path.stat()
        assert first.st_size == 4096 and owner_alive(path)
        assert [p.name for p in shm_dir.iterdir()] == [path.name]
        with pytest.raises(FileExistsError):
            create_locked(path, 8192)
        assert (path.stat().st_ino, path.stat().st_size) == (first.st_ino, 4096) and owner_alive(path)
        assert [p.name for p in shm_dir.iterdir()] == [path.name]
    finally:
        os.close(fd)
    assert not owner_alive(path)


def test_a_hidden_file_a_reclaimer_takes_before_its_maker_locks_it_is_made_anew(
    shm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Between making its hidden file and locking it, a maker's file looks like a dead
    maker's: a reclaimer coming then removes it (under the lock), and the maker makes
    another."""
    _refuse_nameless(monkeypatch)
    path = shm_dir / NAME
    taken: list[list[Path]] = []
    real_flock = fcntl.flock

    def reclaimer_first(fd: int, operation: int) -> None:
        if not taken:  # the maker's first lock
            taken.append([])
            taken[0] = reclaim_orphans(shm_dir)
        real_flock(fd, operation)

    monkeypatch.setattr(arena_files.fcntl, "flock", reclaimer_first)
    fd = create_locked(path, 4096)
    try:
        assert taken == [[hidden_name(path)]]
        assert [p.name for p in shm_dir.iterdir()] == [path.name] and owner_alive(path)
    finally:
        os.close(fd)


def test_reclaim_goes_by_the_lock_whatever_pid_a_name_records(shm_dir: Path) -> None:
    with subprocess.Popen(["true"]) as dead:
        dead.wait()

    def made(name: str) -> Path:
        (shm_dir / name).write_bytes(b"")
        return shm_dir / name

    unlocked = [
        made(f".weightsync-test-{os.getpid()}-aaaa0001.creating"),
        made(f"weightsync-test-{os.getpid()}-aaaa0002"),
    ]
    locked = [made(f".weightsync-test-{dead.pid}-aaaa0003.creating"), made(f"weightsync-test-{dead.pid}-aaaa0004")]
    others = [made(".weightsync-test-1-aaaa0005.partial"), made("target"), shm_dir / "weightsync-test-1-aaaa0006"]
    others[-1].symlink_to(others[1])  # a link is nobody's arena, whatever it points at
    fds = [os.open(p, os.O_RDONLY) for p in locked]
    try:
        for fd in fds:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert sorted(reclaim_orphans(shm_dir)) == sorted(unlocked)
    finally:
        for fd in fds:
            os.close(fd)
    assert (
        all(p.exists() for p in locked + others) and others[-1].is_symlink() and not any(p.exists() for p in unlocked)
    )


def test_an_ordinary_users_reclaim_leaves_other_users_files_alone(shm_dir: Path) -> None:
    """In a shared /dev/shm another user's dead arena can be neither tested (mode 0600) nor
    removed (the sticky bit): reclaim passes over it."""
    if not as_ordinary_user():
        pytest.skip("needs root here, to make files of another user than the reclaimer")
    theirs = [shm_dir / f"weightsync-test-1-aaaa000{i}" for i in range(2)] + [shm_dir / f".{NAME}.creating"]
    for path, mode in zip(theirs, (0o600, 0o644, 0o600), strict=True):
        path.write_bytes(b"")
        path.chmod(mode)
    assert _reclaim_as_ordinary_user(shm_dir) == []
    assert all(p.exists() for p in theirs)
