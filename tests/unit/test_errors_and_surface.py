"""Every error class is mapped to a status; public surfaces are explicit."""

from __future__ import annotations

import inspect

import grpc
import pytest
from google.rpc import error_details_pb2

import weightsync
import weightsync.transports as transports
from weightsync import errors
from weightsync.rpc import to_status


def all_error_classes() -> list[type[errors.WeightsyncError]]:
    return [c for _, c in inspect.getmembers(errors, inspect.isclass) if issubclass(c, errors.WeightsyncError)]


@pytest.mark.parametrize("cls", all_error_classes(), ids=lambda c: c.__name__)
def test_every_error_maps_to_a_real_status(cls: type[errors.WeightsyncError]) -> None:
    err = cls.__new__(cls)
    errors.WeightsyncError.__init__(err, "x")
    name = errors.status_name_for(err)
    assert name in grpc.StatusCode.__members__
    if cls is not errors.InternalError and cls is not errors.WeightsyncError:
        assert name != "INTERNAL", f"{cls.__name__} is not in STATUS_BY_ERROR"
    status = to_status(err)
    assert grpc.StatusCode[name].value[0] == status.code


def test_invalid_argument_carries_the_field_in_a_bad_request_detail() -> None:
    status = to_status(errors.InvalidArgument("header.rank", "too big"))
    assert status.message == "header.rank: too big" and len(status.details) == 2
    assert any(d.Is(error_details_pb2.BadRequest.DESCRIPTOR) for d in status.details)


def _instance(cls: type[errors.WeightsyncError]) -> errors.WeightsyncError:
    err = cls.__new__(cls)
    errors.WeightsyncError.__init__(err, "x")
    return err


@pytest.mark.parametrize(
    "cls", [c for c in all_error_classes() if c is not errors.WeightsyncError], ids=lambda c: c.__name__
)
def test_every_error_class_survives_the_wire(cls: type[errors.WeightsyncError]) -> None:
    """The server sends the class name (ErrorInfo.reason) and the client raises that class:
    a heartbeat's NOT_FOUND must arrive as AgentNotFound, or nobody registers again."""
    status = to_status(_instance(cls))
    (info,) = [d for d in status.details if d.Is(error_details_pb2.ErrorInfo.DESCRIPTOR)]
    unpacked = error_details_pb2.ErrorInfo()
    info.Unpack(unpacked)
    assert unpacked.reason == cls.__name__
    back = errors.error_for_status(errors.status_name_for(_instance(cls)), "m", None, unpacked.reason)
    assert type(back) is cls
    # a reason naming a class of another status (or nothing) falls back to the status's class
    assert type(errors.error_for_status("NOT_FOUND", "m", None, "StaleGeneration")) is errors.NotFound


def test_documented_codes() -> None:
    assert errors.status_name_for(errors.StaleGeneration("x")) == "FAILED_PRECONDITION"
    assert errors.status_name_for(errors.DigestMismatch("x")) == "DATA_LOSS"
    assert errors.status_name_for(errors.VersionConflict("x")) == "ALREADY_EXISTS"
    assert errors.status_name_for(errors.TransportUnavailable("x")) == "UNAVAILABLE"


def test_exported_members() -> None:
    assert weightsync.__all__ == ["__version__"]
    for name in transports.__all__:
        assert hasattr(transports, name)
    assert not any(n.startswith("_") for n in transports.__all__)


def test_shm_transport_opens_only_weightsync_arenas() -> None:
    from weightsync.errors import InvalidArgument
    from weightsync.transports.shm import check_arena_path

    assert str(check_arena_path("/dev/shm/weightsync-job-r0-12-ab12cd34")) == "/dev/shm/weightsync-job-r0-12-ab12cd34"
    for bad in (
        "/etc/passwd",
        "/dev/shm/../etc/passwd",
        "/dev/shm/other-file",
        "weightsync-x",
        "/dev/shm/sub/weightsync-x",
    ):
        with pytest.raises(InvalidArgument):
            check_arena_path(bad)


def test_transport_registry() -> None:
    with pytest.raises(ValueError, match="available: fs, grpc, memory, shm"):
        transports.create_transport("carrier-pigeon")
    with pytest.raises(ValueError, match="already registered"):
        transports.register_transport("grpc", "x:Y")


def test_fs_store_confines_every_uri_to_its_root(tmp_path) -> None:  # noqa: ANN001
    from weightsync.errors import InvalidArgument
    from weightsync.transports.fs import FsStore, check_part_uri

    local = FsStore(str(tmp_path / "root"))
    assert local.confine(str(tmp_path / "root" / "job" / "v1" / "r0")).endswith("/root/job/v1/r0")
    assert local.confine(f"file://{tmp_path}/root/job").endswith("/root/job")
    mem = FsStore("memory://ws")
    assert mem.confine("memory://ws/job/v1/r0") == "/ws/job/v1/r0"
    assert mem.resolve("job/v1/r0") == "/ws/job/v1/r0"
    assert local.resolve("job/v1/r0").endswith("/root/job/v1/r0")
    for bad in ("../etc", "/etc", "file:///etc", "memory://x", "job/../../x", ""):
        with pytest.raises(InvalidArgument):
            mem.resolve(bad)
    check_part_uri("job/v1/r0", "job", 1, 0)
    for bad in ("../../etc", "/etc", "file:///etc", "memory://x", "job/v2/r0", "other/v1/r0", "job/v1/r0/.."):
        with pytest.raises(InvalidArgument, match="relative to the store root"):
            check_part_uri(bad, "job", 1, 0)
    for store, bad in (
        (local, str(tmp_path / "root" / ".." / "etc")),
        (local, "/etc/passwd"),
        (local, "memory://root/job"),
        (mem, "memory://other/job"),
        (mem, "memory://ws/../x"),
        (mem, "gs://ws/job"),
        (mem, str(tmp_path)),
    ):
        with pytest.raises(InvalidArgument):
            store.confine(bad)
