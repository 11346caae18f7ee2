"""The fs store's writes and removals: what a failed or refused part leaves behind."""

from __future__ import annotations

import errno
import uuid
from pathlib import Path

import pytest

from weightsync.errors import InvalidArgument, ResourceExhausted
from weightsync.transports.fs import MARKER, FsStore


@pytest.fixture(params=["file", "memory"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> FsStore:
    root = str(tmp_path / "store") if request.param == "file" else f"memory://ws-{uuid.uuid4().hex}"
    return FsStore(root)


def _tree(store: FsStore) -> list[str]:
    return sorted(p[len(store.root) :] for p in store.fs.find(store.root))


def test_a_write_that_fails_midway_takes_its_partial_part_with_it(store: FsStore) -> None:
    """A store that filled up after part.bin kept that partial copy of the model for good
    (no marker: never read, and no version of the coordinator's named it)."""
    store.write_part("job", 1, 0, b"kept", content="a" * 16)

    def full(path: str, value: bytes) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    real = store.fs.pipe_file
    store.fs.pipe_file = full  # type: ignore[method-assign]
    try:
        with pytest.raises(ResourceExhausted, match="fs_root"):
            store.write_part("job", 2, 0, b"x" * 4096, content="b" * 16)
        with pytest.raises(ResourceExhausted):  # beside an accepted part of its version
            store.write_part("job", 1, 0, b"y" * 4096, content="c" * 16)
    finally:
        store.fs.pipe_file = real  # type: ignore[method-assign]
    assert _tree(store) == [f"/job/v1/r0/{'a' * 16}/{MARKER}", f"/job/v1/r0/{'a' * 16}/part.bin"]
    assert store.versions("job") == [1]


def test_a_part_already_written_is_reported_as_found_not_written(store: FsStore) -> None:
    assert store.write_part("job", 1, 0, b"bytes", content="a" * 16) == (f"job/v1/r0/{'a' * 16}", True)
    assert store.write_part("job", 1, 0, b"bytes", content="a" * 16) == (f"job/v1/r0/{'a' * 16}", False)


def test_removing_one_content_keeps_its_siblings_and_empty_parents_go(store: FsStore) -> None:
    store.write_part("job", 1, 0, b"accepted", content="a" * 16)
    store.write_part("job", 1, 0, b"refused", content="b" * 16)
    store.write_part("job", 2, 1, b"refused", content="c" * 16)
    store.remove_content("job", 1, 0, "b" * 16)
    store.remove_content("job", 2, 1, "c" * 16)
    assert store.versions("job") == [1]
    assert [p.rsplit("/", 1)[-1] for p in store.fs.ls(f"{store.root}/job/v1/r0", detail=False)] == ["a" * 16]


def test_a_deleted_sessions_directory_is_removed_whole_and_only_it(store: FsStore) -> None:
    for session in ("job", "job-2"):
        store.write_part(session, 1, 0, b"bytes", content="a" * 16)
    assert store.remove_session("job") is True
    assert store.remove_session("job") is False
    assert store.versions("job") == [] and store.versions("job-2") == [1]
    for name in ("../job-2", "job-2/v1", ""):
        with pytest.raises(InvalidArgument, match="session"):
            store.remove_session(name)
    assert store.versions("job-2") == [1]
