"""weightsync.arena_files: an arena appears whole and locked or not at all, and the files
of processes that died while making one are reclaimed."""

from __future__ import annotations

import errno
import fcntl
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from weightsync import arena_files
from weightsync.arena_files import SHM_DIR, create_locked, owner_alive, reclaim_orphans

ROOT = Path(__file__).resolve().parents[2]
# The child makes an arena but never gets to give it its name: the step that would (link,
# or rename on the hidden-name path) waits until the parent kills it with -9.
_DIES_WHILE_CREATING = """
import os, sys, time
from pathlib import Path
from weightsync import arena_files
def stuck(*args, **kwargs):
    print("creating", flush=True)
    time.sleep(60)
arena_files.os.link = arena_files.os.rename = stuck
arena_files.create_locked(Path(sys.argv[1]), 1 << 20)
"""


def test_a_process_killed_while_making_an_arena_leaves_no_file() -> None:
    tag = f"test-{uuid.uuid4().hex[:6]}"
    with subprocess.Popen(
        [sys.executable, "-c", _DIES_WHILE_CREATING, str(SHM_DIR / f"weightsync-{tag}-1-abcdef12")],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    ) as child:
        try:
            assert child.stdout is not None and child.stdout.readline() == "creating\n"
        finally:
            child.send_signal(signal.SIGKILL)
            child.wait(timeout=30)
    assert not [p for p in SHM_DIR.iterdir() if tag in p.name]  # the nameless file died with it


def test_an_arena_is_locked_by_its_maker_from_the_moment_it_has_a_name(tmp_path: Path) -> None:
    path = tmp_path / "weightsync-test-1-abcdef12"
    fd = create_locked(path, 4096)
    try:
        assert path.stat().st_size == 4096 and owner_alive(path)
        assert [p.name for p in tmp_path.iterdir()] == [path.name]
        with pytest.raises(FileExistsError):
            create_locked(path, 4096)
    finally:
        os.close(fd)
    assert not owner_alive(path)


def test_without_nameless_files_a_hidden_name_is_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A filesystem (or kernel) without O_TMPFILE: the hidden-name path, same result."""
    real_open = os.open

    def no_tmpfile(file: object, flags: int, *args: object, **kwargs: object) -> int:
        if flags & os.O_TMPFILE == os.O_TMPFILE:
            raise OSError(errno.EOPNOTSUPP, "O_TMPFILE not supported")
        return real_open(file, flags, *args, **kwargs)

    monkeypatch.setattr(arena_files.os, "open", no_tmpfile)
    path = tmp_path / "weightsync-test-1-abcdef12"
    fd = create_locked(path, 4096)
    try:
        assert path.stat().st_size == 4096 and owner_alive(path)
        assert [p.name for p in tmp_path.iterdir()] == [path.name]
    finally:
        os.close(fd)


def test_reclaim_removes_hidden_half_made_arenas_only_of_dead_makers(tmp_path: Path) -> None:
    """A hidden file is unlocked for an instant after its maker creates it, so it goes only
    when nothing holds its lock and the pid in its name is gone."""
    with subprocess.Popen(["true"]) as dead:
        dead.wait()

    def hidden(pid: int, suffix: str) -> Path:
        p = tmp_path / f".weightsync-test-{pid}-{suffix}.creating"
        p.write_bytes(b"")
        return p

    orphan = hidden(dead.pid, "aaaa0001")
    alive_maker = hidden(os.getpid(), "aaaa0002")
    locked = hidden(dead.pid, "aaaa0003")
    fd = os.open(locked, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    try:
        assert reclaim_orphans(tmp_path) == [orphan]
    finally:
        os.close(fd)
    assert not orphan.exists() and alive_maker.exists() and locked.exists()
