"""vLLM's weight-transfer API, both sides, without a server: the trainer engine's init info
and registration, what non-sender ranks do, and how the worker side reads what vLLM's flow
sends (init_info keys, update_info extras, an agent id per worker)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from vllm.distributed.weight_transfer import ModuleSource, WeightSource, WeightTransferTrainerFactory  # noqa: E402
from vllm.distributed.weight_transfer.base import ParamMeta  # noqa: E402

from rollout_agent.vllm_worker.backend import parse_init_info, parse_update_info  # noqa: E402
from rollout_agent.vllm_worker.rollout import worker_agent_id, worker_index  # noqa: E402
from trainer_agent.settings import PublisherSettings  # noqa: E402
from trainer_agent.vllm_trainer import WeightsyncTrainerEngine, WeightsyncTrainerInitInfo  # noqa: E402
from weightsync.errors import InvalidArgument  # noqa: E402


class RecordingClient:
    """A `VLLMWeightSyncClient` that records each call (the protocol is structural)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.calls.append(("init", init_info))

    def start_weight_update(self) -> None:
        self.calls.append(("start", None))

    def update_weights(self, update_info: Any) -> None:
        self.calls.append(("update", update_info))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.calls.append(("finish", weight_version))


class CountingSource(WeightSource):
    """A module's parameters, counting metadata() calls and passes over them."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.inner = ModuleSource(module)
        self.metadata_calls = self.passes = 0

    def metadata(self) -> list[ParamMeta]:
        self.metadata_calls += 1
        return self.inner.metadata()

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        self.passes += 1
        yield from self.inner


def test_the_init_info_is_vllms_and_names_what_it_refuses() -> None:
    info = WeightsyncTrainerInitInfo("coord:1", "job", rank=0, tls_ca_file="", publisher={"weight_dtype": "bfloat16"})
    assert info.backend == "weightsync" and info.is_sender
    assert not WeightsyncTrainerInitInfo("coord:1", "job", rank=2).is_sender
    assert "backend" not in {f.name for f in dataclasses.fields(info)}  # a ClassVar, as vLLM's
    with pytest.raises(TypeError):
        WeightsyncTrainerInitInfo("coord:1", "job")  # type: ignore[call-arg]  # rank is required, keyword-only
    settings = info.publisher_settings()
    assert isinstance(settings, PublisherSettings)
    assert (settings.coordinator, settings.session, settings.rank, settings.world_size) == ("coord:1", "job", 0, 1)
    assert settings.weight_dtype == "bfloat16"
    for key, said in (("nope", "is not a PublisherSettings field"), ("session", "is set by the init info")):
        with pytest.raises(InvalidArgument, match=f"^publisher.{key}: {said}"):
            WeightsyncTrainerInitInfo("coord:1", "job", rank=0, publisher={key: 1}).publisher_settings()
    with pytest.raises(InvalidArgument, match="^weight_dtype: "):
        WeightsyncTrainerInitInfo("coord:1", "job", rank=0, publisher={"weight_dtype": "int4"}).publisher_settings()
    with pytest.raises(InvalidArgument, match="^commit_timeout_s: "):
        WeightsyncTrainerInitInfo("coord:1", "job", rank=0, commit_timeout_s=-1)
    with pytest.raises(InvalidArgument, match="^worker: must be a dict"):
        WeightsyncTrainerInitInfo("coord:1", "job", rank=0, worker=["x"])  # type: ignore[arg-type]
    worker = WeightsyncTrainerInitInfo(
        "coord:1", "job", rank=0, tls_ca_file="/ca.pem", worker={"agent_id": "eng", "coordinator": "inside:1"}
    ).worker_init_info()
    assert worker == {"coordinator": "inside:1", "session": "job", "tls_ca_file": "/ca.pem", "agent_id": "eng"}
    json.dumps(worker)  # plain data: it crosses HTTP and vLLM's RPCs


def test_importing_the_module_registered_the_engine_with_vllms_factory() -> None:
    from trainer_agent import vllm_trainer

    assert WeightTransferTrainerFactory._registry["weightsync"]() is WeightsyncTrainerEngine
    vllm_trainer._register()  # again (the module imported twice): vLLM's factory raises on a name it has
    assert WeightTransferTrainerFactory._registry["weightsync"]() is WeightsyncTrainerEngine


def test_a_non_sender_rank_only_iterates_the_source_and_never_touches_the_client() -> None:
    """As vLLM's NCCL and IPC engines: ranks other than 0 keep the trainer-side collectives
    (metadata(), iteration) in lockstep and leave the wire to the sender."""
    client = RecordingClient()
    source = CountingSource(torch.nn.Linear(3, 2))
    engine = WeightTransferTrainerFactory.trainer_init(
        init_info=WeightsyncTrainerInitInfo("127.0.0.1:1", "job", rank=1), client=client, source=source
    )
    assert isinstance(engine, WeightsyncTrainerEngine) and not engine.is_sender and engine.publisher is None
    for _ in range(3):
        engine.send_weights()
    assert (source.metadata_calls, source.passes) == (3, 3)
    assert client.calls == []
    engine.shutdown()


def test_a_source_is_required() -> None:
    with pytest.raises(InvalidArgument, match="^source: "):
        WeightsyncTrainerEngine.trainer_init(
            WeightsyncTrainerInitInfo("127.0.0.1:1", "job", rank=1), client=RecordingClient(), source=None
        )


def test_the_worker_refuses_an_init_info_key_it_does_not_know_naming_it() -> None:
    info = parse_init_info({"coordinator": "c:1", "session": "job", "packed": True, "prefetch": False})
    assert info.packed is True and info.prefetch is False
    with pytest.raises(InvalidArgument, match="^init_info.prefech: .*did you mean 'prefetch'"):
        parse_init_info({"coordinator": "c:1", "session": "job", "prefech": False})
    with pytest.raises(InvalidArgument, match="^init_info.master_port: .*configuration.md"):
        parse_init_info({"coordinator": "c:1", "session": "job", "master_port": 1})
    with pytest.raises(InvalidArgument, match="^init_info.packed: must be true or false"):
        parse_init_info({"coordinator": "c:1", "session": "job", "packed": "yes"})
    with pytest.raises(InvalidArgument, match="^init_info: must be a dict"):
        parse_init_info([("coordinator", "c:1")])


def test_the_worker_takes_the_version_and_ignores_the_keys_vllms_flows_add() -> None:
    extra = {"names": ["w"], "dtype_names": ["float32"], "shapes": [[2]], "packed": True, "is_checkpoint_format": True}
    assert parse_update_info({"version": 7, **extra}).version == 7
    assert parse_update_info(extra).version == "latest"
    with pytest.raises(InvalidArgument, match="^update_info: must be a dict"):
        parse_update_info([7])


def test_each_worker_of_an_engine_registers_its_own_agent_id() -> None:
    class Parallel:
        def __init__(self, rank: int, world: int, dp: int) -> None:
            self.rank, self.world_size, self.data_parallel_index = rank, world, dp

    indices = [worker_index(Parallel(r, 2, d)) for d in range(2) for r in range(2)]
    assert indices == [0, 1, 2, 3]  # vLLM's index into a list of update_infos
    assert worker_index(object()) == 0
    ids = [worker_agent_id("eng-a", i) for i in indices]
    assert ids == ["eng-a", "eng-a-r1", "eng-a-r2", "eng-a-r3"]


def test_vllms_packed_is_accepted_and_ignored_and_the_connect_wait_is_bounded() -> None:
    """vLLM's IPC and NCCL init infos take `packed=`; a trainer switching keeps it. The
    connect wait bounds the publisher's attach too, unless the publisher says otherwise."""
    info = WeightsyncTrainerInitInfo("coord:1", "job", rank=0, packed=True)
    assert info.packed and "packed" not in info.worker_init_info()
    assert info.publisher_settings().attach_wait_s == info.connect_timeout_s == 10.0
    own = WeightsyncTrainerInitInfo("coord:1", "job", rank=0, connect_timeout_s=2, publisher={"attach_wait_s": 30})
    assert own.publisher_settings().attach_wait_s == 30
    with pytest.raises(InvalidArgument, match="^packed: must be true or false"):
        WeightsyncTrainerInitInfo("coord:1", "job", rank=0, packed="yes")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="^connect_timeout_s: "):
        WeightsyncTrainerInitInfo("coord:1", "job", rank=0, connect_timeout_s=float("nan"))


class AskedClient(RecordingClient):
    """Answers the workers' `weightsync_ready` as `answers` say, one list per call."""

    def __init__(self, answers: list[list[Any]]) -> None:
        super().__init__()
        self.answers = answers

    def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
        self.calls.append((method, args))
        return self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]


def test_wait_prefetched_asks_every_worker_until_all_hold_the_version() -> None:
    ready = {"agent_id": "a", "ready": True}
    client = AskedClient([[ready, {"ready": False}], [ready, ready]])
    engine = WeightsyncTrainerEngine(client=client, source=CountingSource(torch.nn.Linear(3, 2)))
    with pytest.raises(Exception, match="call publish_weights first"):
        engine.wait_prefetched()
    engine._unapplied = 7  # as publish_weights leaves it
    assert engine.wait_prefetched(timeout_s=5, poll_s=0)
    assert client.calls == [("weightsync_ready", ("7",))] * 2
    never = WeightsyncTrainerEngine(client=AskedClient([[ready, {"ready": False}]]), source=engine.source)
    never._unapplied = 8
    assert not never.wait_prefetched(timeout_s=0)
    off = AskedClient([[ready, {"ready": False, "prefetch": False}]])  # a worker that does not prefetch
    unprefetched = WeightsyncTrainerEngine(client=off, source=engine.source)
    unprefetched._unapplied = 9
    assert not unprefetched.wait_prefetched(timeout_s=600)  # at once: nothing to wait for
    assert len(off.calls) == 1
    with pytest.raises(InvalidArgument, match="shut down"):
        never.apply_weights()  # no publisher


def test_wait_prefetched_says_why_when_the_workers_cannot_be_asked() -> None:
    engine = WeightsyncTrainerEngine(client=RecordingClient(), source=CountingSource(torch.nn.Linear(3, 2)))
    engine._unapplied = 1
    with pytest.raises(Exception, match="neither collective_rpc nor base_url"):
        engine.wait_prefetched(timeout_s=0)


class _Rollout:
    agent_id = "eng"

    def __init__(self, prefetcher: object | None) -> None:
        self.prefetcher = prefetcher
        self.asked: list[tuple[Any, float]] = []

    def wait_ready(self, version: Any, timeout_s: float) -> bool:
        self.asked.append((version, timeout_s))
        return self.prefetcher is not None


def test_the_worker_extension_answers_ready_for_the_backends_rollout_with_vllms_string_args() -> None:
    from types import SimpleNamespace

    from rollout_agent.vllm_worker.extension import WeightsyncWorkerExtension

    worker = WeightsyncWorkerExtension()
    with pytest.raises(RuntimeError, match="neither attached nor initialized"):
        worker.weightsync_ready("3")
    rollout = _Rollout(prefetcher=object())
    worker.weight_transfer_engine = SimpleNamespace(rollout=rollout)  # type: ignore[attr-defined]  # vLLM's worker's
    assert worker.weightsync_ready("3", "0.5") == {"agent_id": "eng", "version": "3", "ready": True, "prefetch": True}
    assert rollout.asked == [("3", 0.5)]
    worker.weight_transfer_engine = SimpleNamespace(rollout=_Rollout(prefetcher=None))  # type: ignore[attr-defined]
    assert worker.weightsync_ready(4)["prefetch"] is False
