"""Every error class is mapped to a status; public surfaces are explicit."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from google.rpc import error_details_pb2

import weightsync.transports as transports
from weightsync import errors
from weightsync.rpc import to_status

ROOT = Path(__file__).resolve().parents[2]


def all_error_classes() -> list[type[errors.WeightsyncError]]:
    return [c for _, c in inspect.getmembers(errors, inspect.isclass) if issubclass(c, errors.WeightsyncError)]


@pytest.mark.parametrize("cls", all_error_classes(), ids=lambda c: c.__name__)
def test_every_error_maps_to_a_real_status(cls: type[errors.WeightsyncError]) -> None:
    err = cls("x")  # one signature for every class: (message, *, field=None)
    name = errors.status_name_for(err)
    assert name in grpc.StatusCode.__members__
    if cls is not errors.InternalError and cls is not errors.WeightsyncError:
        assert name != "INTERNAL", f"{cls.__name__} is not in STATUS_BY_ERROR"
    status = to_status(err)
    assert grpc.StatusCode[name].value[0] == status.code


def test_invalid_argument_carries_the_field_in_a_bad_request_detail() -> None:
    status = to_status(errors.InvalidArgument("too big", field="header.rank"))
    assert status.message == "header.rank: too big" and len(status.details) == 2
    assert any(d.Is(error_details_pb2.BadRequest.DESCRIPTOR) for d in status.details)


def _instance(cls: type[errors.WeightsyncError]) -> errors.WeightsyncError:
    return cls("x")


def test_a_field_prefixes_the_message_once() -> None:
    assert errors.InvalidArgument("must be > 0", field="version").message == "version: must be > 0"
    assert errors.PermissionDenied("token: wrong", field="token").message == "token: wrong"
    err = errors.error_for_status("INVALID_ARGUMENT", "rank: out of range", "rank", "InvalidArgument")
    assert (type(err), err.message, err.field) == (errors.InvalidArgument, "rank: out of range", "rank")
    more = err.with_message(f"publishing: {err.message}")
    assert (type(more), more.message, more.field) == (errors.InvalidArgument, "publishing: rank: out of range", "rank")


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


@pytest.mark.parametrize("package", ["weightsync", "weightsync.transports", "trainer_agent", "rollout_agent"])
def test_every_exported_name_resolves_and_is_public(package: str) -> None:
    mod = importlib.import_module(package)
    assert mod.__all__, f"{package} exports nothing"
    for name in mod.__all__:
        assert not name.startswith("_") or name == "__version__", name
        assert getattr(mod, name) is not None, f"{package}.{name} does not resolve"
    with pytest.raises(AttributeError):
        mod.no_such_member  # noqa: B018 - the lookup is the test


def test_the_documented_entry_points_are_exported() -> None:
    import rollout_agent
    import trainer_agent
    from trainer_agent.publish.publisher import WeightPublisher

    assert trainer_agent.WeightPublisher is WeightPublisher  # README: from trainer_agent import ...
    assert trainer_agent.PublisherSettings.__module__ == "trainer_agent.settings"
    assert {"convert_maxtext", "ConvertOptions", "ModelDims"} <= set(trainer_agent.__all__)
    assert {"RolloutAgent", "WeightsyncWorkerExtension"} <= set(rollout_agent.__all__)
    assert ("WeightsyncEngine" in rollout_agent.__all__) is (importlib.util.find_spec("vllm") is not None)
    assert ("WeightsyncTrainerEngine" in trainer_agent.__all__) is (importlib.util.find_spec("vllm") is not None)


# rollout_agent where vLLM is not installed (a JAX-only rollout, a TPU VM): a None in
# sys.modules makes `import vllm` fail and find_spec find nothing, as there.
_WITHOUT_VLLM = """
import json, sys
sys.modules["vllm"] = None
import rollout_agent
from rollout_agent import *
seen = {"all": rollout_agent.__all__, "resolved": [n for n in rollout_agent.__all__ if getattr(rollout_agent, n)]}
try:
    from rollout_agent import WeightsyncEngine
except ImportError as e:
    seen["engine"] = str(e)
print(json.dumps(seen))
"""


def test_without_vllm_a_rollout_imports_whole_and_its_vllm_name_says_what_to_install() -> None:
    done = subprocess.run([sys.executable, "-c", _WITHOUT_VLLM], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert (
        seen["all"]
        == seen["resolved"]
        == ["PulledVersion", "RolloutAgent", "RolloutConfig", "WeightPuller", "WeightsyncWorkerExtension"]
    )
    assert (
        seen["engine"]
        == "rollout_agent.WeightsyncEngine needs vllm, which is not installed here: pip install 'weightsync[vllm]'"
    )


_TRAINER_WITHOUT_VLLM = _WITHOUT_VLLM.replace("rollout_agent", "trainer_agent").replace(
    "WeightsyncEngine", "WeightsyncTrainerEngine"
)


def test_without_vllm_a_trainer_imports_whole_and_its_vllm_names_say_what_to_install() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _TRAINER_WITHOUT_VLLM], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert seen["all"] == seen["resolved"] and "WeightPublisher" in seen["all"]
    assert not {"WeightsyncTrainerEngine", "WeightsyncTrainerInitInfo"} & set(seen["all"])
    assert seen["engine"] == (
        "trainer_agent.WeightsyncTrainerEngine needs vllm, which is not installed here: pip install 'weightsync[vllm]'"
    )


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
    with pytest.raises(ValueError, match="available: fs, grpc, hostshm, memory, shm"):
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
    check_part_uri("job/v1/r0/0123456789abcdef", "job", 1, 0)
    check_part_uri("job/v1/r0", "job", 1, 0)  # a trainer that writes no content id
    for bad in (
        "../../etc",
        "/etc",
        "file:///etc",
        "memory://x",
        "job/v2/r0",
        "other/v1/r0",
        "job/v1/r0/..",
        "job/v1/r0/0123456789abcdef/..",
        "job/v1/r0/x",
        "job/v1/r1/0123456789abcdef",
    ):
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


def test_a_deleted_sessions_series_are_dropped_and_others_kept() -> None:
    from prometheus_client import generate_latest

    from weightsync.metrics import build_metrics

    m = build_metrics("coordinator")
    for session in ("gone", "kept"):
        m.handshakes.labels(session=session, outcome="ok").inc()
        m.versions_total.labels(session=session, state="READY").inc()
        m.pause_seconds.labels(session=session).observe(0.2)
        m.digest_failures.labels(role="coordinator", session=session).inc()
    m.forget_session("gone")
    text = generate_latest(m.registry).decode()
    assert 'session="gone"' not in text
    assert text.count('session="kept"') >= 4  # each metric's series of the other session stay


def test_a_publish_tries_again_only_what_may_pass_and_only_for_its_wait() -> None:
    from trainer_agent.publish.retry import may_pass as _may_pass
    from trainer_agent.publish.retry import ride_out as _ride_out

    calls: list[int] = []

    def flaky(failures: int, error: errors.WeightsyncError) -> Callable[[], str]:
        def call() -> str:
            calls.append(1)
            if len(calls) <= failures:
                raise error
            return "published"

        return call

    assert _ride_out("x", 10.0, flaky(1, errors.TransportUnavailable("down")), _may_pass) == "published"
    assert len(calls) == 2
    for error, wait_s in (
        (errors.TransportUnavailable("down"), 0.0),  # publish_wait_s 0: raised at once
        (errors.ResourceExhausted("too many", field="part.tensors"), 10.0),  # a limit does not pass
        (errors.StaleGeneration("fenced"), 10.0),
        (errors.InvalidArgument("bad", field="params"), 10.0),
    ):
        calls.clear()
        with pytest.raises(type(error)):
            _ride_out("x", wait_s, flaky(1, error), _may_pass)
        assert len(calls) == 1, error
    assert _may_pass(errors.ResourceExhausted("full", field="arena"))
    assert _may_pass(errors.SlotBusy("leased"))
