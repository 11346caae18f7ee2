"""Helpers for process tests: polling, reflection listing, publish-and-sync rounds (metrics
scraping: devtools.scrape)."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

import grpc
import numpy as np
from google.protobuf import descriptor_pool, message_factory
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from weightsync._proto import rollout_agent_pb2 as rpb
from weightsync._proto import rollout_agent_pb2_grpc as rpb_grpc
from weightsync._proto import trainer_agent_pb2 as tapb
from weightsync._proto import trainer_agent_pb2_grpc as tapb_grpc
from weightsync._proto import types_pb2 as tpb

if TYPE_CHECKING:
    from rollout_agent.pull.puller import WeightPuller
    from trainer_agent.publish.publisher import WeightPublisher

T = TypeVar("T")


def eventually(fn: Callable[[], T], *, timeout_s: float = 60.0, interval_s: float = 0.1, what: str = "") -> T:
    """Polls fn until it returns a truthy value; the last value or exception is reported."""
    deadline = time.monotonic() + timeout_s
    last: object = None
    while time.monotonic() < deadline:
        try:
            last = fn()
            if last:
                return last  # type: ignore[return-value]
        except Exception as e:  # noqa: BLE001 - reported on timeout
            last = e
        time.sleep(interval_s)
    raise AssertionError(f"timed out waiting for {what or fn}: last {last!r}")


def reflected_services(address: str) -> list[str]:
    """What `grpcurl -plaintext ADDRESS list` prints, through server reflection."""
    with grpc.insecure_channel(address) as channel:
        db = ProtoReflectionDescriptorDatabase(channel)
        services = sorted(db.get_services())
        pool = descriptor_pool.DescriptorPool(db)
        for name in services:
            pool.FindServiceByName(name)  # `grpcurl describe` works: descriptors resolve
        return services


def reflected_methods(channel: grpc.Channel) -> Iterator[tuple[str, Any, bool, bool]]:
    """(path, request class, client streams, server streams) of every method a server
    lists through reflection, grpcio-reflection's own servicer left out (fuzzing it is its
    maintainers' job); request classes are built from the descriptors the server sent."""
    db = ProtoReflectionDescriptorDatabase(channel)
    pool = descriptor_pool.DescriptorPool(db)
    for name in sorted(db.get_services()):
        if name.startswith("grpc.reflection"):
            continue
        for m in pool.FindServiceByName(name).methods:
            cls = message_factory.GetMessageClass(m.input_type)
            yield f"/{name}/{m.name}", cls, m.client_streaming, m.server_streaming


def rollout_status(address: str) -> rpb.RolloutStatus:
    with grpc.insecure_channel(address) as channel:
        return rpb_grpc.RolloutAgentStub(channel).GetStatus(rpb.RolloutStatusRequest(), timeout=10)


def serving(address: str, version: int, timeout_s: float = 30.0) -> rpb.RolloutStatus:
    """The rollout's status once it serves `version`. A commit is visible at the coordinator
    before the rollout has read the verdict that makes the version current (the answer to
    its own report), so a test that saw COMMITTED waits here rather than reading at once."""
    return eventually(
        lambda: (s := rollout_status(address)).current_version == version and s,
        timeout_s=timeout_s,
        what=f"the rollout at {address} to serve version {version}",
    )


def trainer_bytes_served(address: str) -> int:
    """Chunk bytes a trainer sidecar has served, every transport (its GetStatus)."""
    with grpc.insecure_channel(address) as channel:
        return tapb_grpc.TrainerAgentStub(channel).GetStatus(tapb.TrainerStatusRequest(), timeout=10).bytes_served


def state_name(v: tpb.VersionInfo) -> str:
    return tpb.VersionState.Name(v.state)


def free_port() -> int:
    """A port on 127.0.0.1 that nothing listens on now (for a server started later)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def publish_and_sync(
    pub: WeightPublisher, puller: WeightPuller, params: dict[str, np.ndarray], versions: tuple[int, ...] = (1, 2, 3)
) -> dict[str, np.ndarray]:
    """Per version, publishes `params` one higher and syncs it through `puller` into a fresh
    DictApplier, which must then hold exactly what was published; returns the last params."""
    from rollout_agent.engines.dict_applier import DictApplier
    from rollout_agent.sync.round import sync_version

    for version in versions:
        params = {k: v + 1 for k, v in params.items()}
        pub.publish(params, version)
        applier = DictApplier()
        outcome = sync_version(puller, applier, version)
        assert outcome.ok, outcome.mismatch
        assert all(np.array_equal(applier.weights[k], v) for k, v in params.items())
    return params
