"""The fs store's writes and removals: what a failed or refused part leaves behind."""

from __future__ import annotations

import errno
import uuid
from pathlib import Path

import pytest

from weightsync.errors import FailedPrecondition, InvalidArgument, ResourceExhausted, TransportUnavailable
from weightsync.transports.fs import MARKER, FsStore


@pytest.fixture(params=["file", "memory"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> FsStore:
    root = str(tmp_path / "store") if request.param == "file" else f"memory://ws-{uuid.uuid4().hex}"
    return FsStore(root)


def _tree(store: FsStore) -> list[str]:
    return sorted(p[len(store.root) :] for p in store.fs.find(store.root))


def test_a_write_that_fails_midway_takes_its_partial_part_with_it(store: FsStore) -> None:
    """A store that fills up after part.bin is written removes that partial copy of the
    model (without a marker it is never read, and no version of the coordinator's names it)."""
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


def test_a_root_that_is_a_file_is_refused_for_good_naming_fs_root(tmp_path: Path) -> None:
    """A write the store refuses until an operator acts (a root that is a file, a read-only
    mount, a directory not this user's) is FAILED_PRECONDITION naming `fs_root`, not
    UNAVAILABLE, which a publish would ride out for its whole publish_wait_s (120 s)."""
    (tmp_path / "store").write_bytes(b"not a directory")
    store = FsStore(str(tmp_path / "store"))
    with pytest.raises(FailedPrecondition, match="not writable") as e:
        store.write_part("job", 1, 0, b"bytes", content="a" * 16)
    assert e.value.field == "fs_root"


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        (errno.EROFS, FailedPrecondition),
        (errno.EACCES, FailedPrecondition),
        (errno.EPERM, FailedPrecondition),
        (errno.EIO, TransportUnavailable),  # may pass: tried again
        (errno.ENOSPC, ResourceExhausted),
    ],
)
def test_a_write_error_says_whether_it_may_pass(
    store: FsStore, code: int, expected: type, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refused(path: str, mode: str = "rb", **kwargs: object) -> None:
        raise OSError(code, errno.errorcode[code])

    monkeypatch.setattr(store.fs, "open", refused)  # fsspec shares the instance: undone after
    with pytest.raises(expected) as e:
        store.write_part("job", 1, 0, b"bytes", content="a" * 16)
    assert e.value.field == "fs_root"
    assert store.versions("job") == []
