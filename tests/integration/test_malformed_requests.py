"""Every malformed request class gets its documented status code and changes nothing."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

import grpc
import pytest
from grpc_status import rpc_status

from tests.integration.support import eventually
from tests.unit.helpers import make_part, sample_arrays
from weightsync._proto import coordinator_pb2 as cpb
from weightsync._proto import coordinator_pb2_grpc as cpb_grpc
from weightsync._proto import trainer_agent_pb2 as tpb_agent
from weightsync._proto import trainer_agent_pb2_grpc as tpb_agent_grpc
from weightsync._proto import types_pb2 as tpb
from weightsync.client import CoordinatorClient
from weightsync.cluster import Cluster
from weightsync.errors import InvalidArgument
from weightsync.manifest import Endpoint
from weightsync.wire import PartBuilder, part_to_batches, tensor_to_proto

pytestmark = pytest.mark.slow
C = grpc.StatusCode


def publish_stream(part, *, generation: int, version: int, seal: str | None = None, header_overrides=None,  # noqa: ANN001
                   batches=None) -> Iterator[cpb.PublishRequest]:  # noqa: ANN001
    header = cpb.PublishHeader(
        session="job", generation=generation, version=version, rank=part.rank, idempotency_key="k",
        total_bytes=part.total_bytes, chunk_bytes=part.chunk_bytes, tensor_count=len(part.tensors),
        shard_count=len(part.shards), chunk_count=len(part.chunks),
    )
    for k, v in (header_overrides or {}).items():
        if k == "endpoint":
            header.endpoint.CopyFrom(v)
        else:
            setattr(header, k, v)
    if batches is not None and seal is None:
        seal = sealed_digest(header, batches)
    yield cpb.PublishRequest(header=header)
    for b in batches if batches is not None else part_to_batches(part):
        yield cpb.PublishRequest(batch=b)
    yield cpb.PublishRequest(seal=cpb.PublishSeal(part_digest=part.digest() if seal is None else seal))


def sealed_digest(header: cpb.PublishHeader, batches: list[tpb.DescriptorBatch]) -> str:
    """The digest a well-behaved client would seal hand-made batches with."""
    builder = PartBuilder(header.rank, max_items=1 << 30)
    try:
        for b in batches:
            builder.add(b)
    except InvalidArgument:
        return ""
    return builder.build(total_bytes=header.total_bytes, chunk_bytes=header.chunk_bytes, endpoint=Endpoint(), stage_seconds=0).digest()


def snapshot(stub: cpb_grpc.CoordinatorStub) -> tuple:
    st = stub.GetStatus(cpb.GetStatusRequest(session="job"), timeout=10)
    return (st.generation, st.trainer_ranks, [v.SerializeToString() for v in st.versions],
            [h.SerializeToString() for h in st.handshakes], [p.SerializeToString() for p in st.parts],
            sorted(a.agent_id for a in st.agents))


def test_malformed_requests_get_documented_codes_and_leave_state_intact(cluster: Cluster) -> None:
    coord = cluster.start_coordinator()
    trainer = cluster.start_trainer("trainer", coord.address, "job",
                                    ["--model-size", "tiny", "--steps", "1", "--wait-commit", "false", "--hold"])
    channel = grpc.insecure_channel(coord.address)
    stub = cpb_grpc.CoordinatorStub(channel)
    eventually(lambda: stub.GetStatus(cpb.GetStatusRequest(session="job"), timeout=5).versions, what="version 1")
    gen = stub.GetStatus(cpb.GetStatusRequest(session="job"), timeout=5).generation
    part, _ = make_part(sample_arrays())
    other, _ = make_part(sample_arrays(seed=7))
    overlapping = dataclasses.replace(part, chunks=(part.chunks[0], dataclasses.replace(part.chunks[1], offset=part.chunks[1].offset - 8)) + part.chunks[2:])
    bad_dtype = [tpb.DescriptorBatch(rank=0, tensors=[tpb.TensorDescriptor(name="a.b", dtype=99, shape=[2])])]
    huge = [tpb.DescriptorBatch(rank=0, tensors=[tensor_to_proto(dataclasses.replace(part.tensors[0], shape=(1 << 41,)))],
                                shards=[tpb.ShardDescriptor(tensor_name=part.tensors[0].name, start=[0], stop=[1 << 41], nbytes=1 << 43)])]
    many = [tpb.DescriptorBatch(rank=0, tensors=[tpb.TensorDescriptor(name=f"t{i}", dtype=1, shape=[1]) for i in range(2048)])]
    long_name = [tpb.DescriptorBatch(rank=0, tensors=[tpb.TensorDescriptor(name="x" * (1 << 20), dtype=1, shape=[1])])]
    trainer_channel = grpc.insecure_channel(trainer.address)
    agent = tpb_agent_grpc.TrainerAgentStub(trainer_channel)
    reader = CoordinatorClient(coord.address)  # a leased reader holds the version's access token
    reader.register_agent("job", "probe", trainer=False, endpoint=Endpoint())
    token = reader.get_manifest("job", 1, agent_id="probe")[0].access_token
    assert list(agent.ReadChunks(tpb_agent.ReadChunksRequest(session="job", version=1, rank=0, indices=[0], access_token=token), timeout=10))

    def read(**kw: object) -> Callable[[], object]:
        fields = {"session": "job", "version": 1, "rank": 0, "indices": [0], "access_token": token, **kw}
        req = tpb_agent.ReadChunksRequest(**fields)
        return lambda: list(agent.ReadChunks(req, timeout=10))

    cases: list[tuple[str, Callable[[], object], grpc.StatusCode, str | None]] = [
        ("empty session", lambda: stub.OpenSession(cpb.OpenSessionRequest(session="", role=tpb.ROLLOUT), timeout=5), C.INVALID_ARGUMENT, "session"),
        ("bad session name", lambda: stub.OpenSession(cpb.OpenSessionRequest(session="Job!", role=tpb.ROLLOUT), timeout=5), C.INVALID_ARGUMENT, "session"),
        ("no role", lambda: stub.OpenSession(cpb.OpenSessionRequest(session="job"), timeout=5), C.INVALID_ARGUMENT, "role"),
        ("register unknown session", lambda: stub.RegisterAgent(cpb.RegisterAgentRequest(session="nope", agent_id="a", role=tpb.ROLLOUT), timeout=5), C.NOT_FOUND, None),
        ("register bad address", lambda: stub.RegisterAgent(cpb.RegisterAgentRequest(session="job", agent_id="a", role=tpb.ROLLOUT, endpoint=tpb.Endpoint(address="nowhere")), timeout=5), C.INVALID_ARGUMENT, "endpoint.address"),
        ("register bad agent id", lambda: stub.RegisterAgent(cpb.RegisterAgentRequest(session="job", agent_id="A B", role=tpb.ROLLOUT), timeout=5), C.INVALID_ARGUMENT, "agent_id"),
        ("register trainer rank out of range", lambda: stub.RegisterAgent(cpb.RegisterAgentRequest(session="job", agent_id="t9", role=tpb.TRAINER, rank=9), timeout=5), C.INVALID_ARGUMENT, "rank"),
        ("heartbeat unknown agent", lambda: stub.Heartbeat(cpb.HeartbeatRequest(session="job", agent_id="ghost"), timeout=5), C.NOT_FOUND, None),
        # uint64 values past SQLite's int64 once came back INTERNAL
        ("heartbeat version 2^64-1", lambda: stub.Heartbeat(cpb.HeartbeatRequest(session="job", agent_id="probe", current_version=(1 << 64) - 1), timeout=5), C.INVALID_ARGUMENT, "current_version"),
        ("watch since 2^63", lambda: next(stub.WatchVersions(cpb.WatchVersionsRequest(session="job", since_seq=1 << 63), timeout=5)), C.INVALID_ARGUMENT, "since_seq"),
        ("manifest version 2^63", lambda: list(stub.GetManifest(cpb.GetManifestRequest(session="job", version=1 << 63), timeout=5)), C.INVALID_ARGUMENT, "version"),
        ("release version 2^64-1", lambda: stub.ReleaseVersion(cpb.ReleaseVersionRequest(session="job", version=(1 << 64) - 1, generation=gen), timeout=5), C.INVALID_ARGUMENT, "version"),
        ("attach next_version 2^64-1", lambda: stub.OpenSession(cpb.OpenSessionRequest(session="job", role=tpb.TRAINER, incarnation="x", next_version=(1 << 64) - 1), timeout=5), C.INVALID_ARGUMENT, "next_version"),
        ("publish version 2^63", lambda: stub.PublishVersion(publish_stream(part, generation=gen, version=1 << 63), timeout=5), C.INVALID_ARGUMENT, "header.version"),
        ("publish stage_seconds NaN", lambda: stub.PublishVersion(publish_stream(part, generation=gen, version=2, header_overrides={"stage_seconds": float("nan")}), timeout=5), C.INVALID_ARGUMENT, "header.stage_seconds"),
        # huge values are refused naming the field, not echoed whole into trailing metadata
        ("1 MiB session name", lambda: stub.OpenSession(cpb.OpenSessionRequest(session="a" * (1 << 20), role=tpb.ROLLOUT), timeout=5), C.INVALID_ARGUMENT, "session"),
        ("1 MiB tensor name", lambda: stub.ReportApplied(cpb.ReportAppliedRequest(session="job", version=1, agent_id="probe", consumed_names=["x" * (1 << 20)]), timeout=5), C.INVALID_ARGUMENT, "consumed_names[0]"),
        ("publish without header", lambda: stub.PublishVersion(iter([cpb.PublishRequest(seal=cpb.PublishSeal())]), timeout=5), C.INVALID_ARGUMENT, "header"),
        ("publish stale generation", lambda: stub.PublishVersion(publish_stream(part, generation=gen - 1 if gen > 1 else gen + 5, version=2), timeout=5), C.FAILED_PRECONDITION, None),
        ("publish version 0", lambda: stub.PublishVersion(publish_stream(part, generation=gen, version=0), timeout=5), C.INVALID_ARGUMENT, "header.version"),
        ("publish wrong counts", lambda: stub.PublishVersion(publish_stream(part, generation=gen, version=2, header_overrides={"chunk_count": 99}), timeout=5), C.INVALID_ARGUMENT, None),
        ("publish shm path outside /dev/shm", lambda: stub.PublishVersion(publish_stream(part, generation=gen, version=2, header_overrides={"endpoint": tpb.Endpoint(shm_path="/etc/passwd")}), timeout=5), C.INVALID_ARGUMENT, "header.endpoint.shm_path"),
        ("publish fs_uri outside the store", lambda: stub.PublishVersion(publish_stream(part, generation=gen, version=2, header_overrides={"endpoint": tpb.Endpoint(fs_uri="../../etc")}), timeout=5), C.INVALID_ARGUMENT, "header.endpoint.fs_uri"),
        ("publish fs_uri of another scheme", lambda: stub.PublishVersion(publish_stream(part, generation=gen, version=2, header_overrides={"endpoint": tpb.Endpoint(fs_uri="file:///etc")}), timeout=5), C.INVALID_ARGUMENT, "header.endpoint.fs_uri"),
        ("publish announcing 10^6 tensors", lambda: stub.PublishVersion(publish_stream(part, generation=gen, version=2, header_overrides={"tensor_count": 10**6}), timeout=5), C.RESOURCE_EXHAUSTED, "header.tensor_count"),
        ("publish more tensors than announced", lambda: stub.PublishVersion(publish_stream(part, generation=gen, version=2, batches=many, seal="0", header_overrides={"tensor_count": 1, "shard_count": 0, "chunk_count": 4096}), timeout=5), C.INVALID_ARGUMENT, "part.tensors"),
        ("publish a 1 MiB tensor name", lambda: stub.PublishVersion(publish_stream(part, generation=gen, version=2, batches=long_name, seal="0", header_overrides={"tensor_count": 1, "shard_count": 0, "chunk_count": 0}), timeout=5), C.INVALID_ARGUMENT, "part.tensors[0].name"),
        ("publish wrong seal", lambda: stub.PublishVersion(publish_stream(part, generation=gen, version=2, seal="00"), timeout=5), C.INVALID_ARGUMENT, "seal.part_digest"),
        ("publish bad dtype", lambda: stub.PublishVersion(publish_stream(part, generation=gen, version=2, batches=bad_dtype, header_overrides={"tensor_count": 1, "shard_count": 0, "chunk_count": 0}), timeout=5), C.INVALID_ARGUMENT, "part.tensors[0].dtype"),
        ("publish overlapping chunks", lambda: stub.PublishVersion(publish_stream(overlapping, generation=gen, version=2), timeout=5), C.INVALID_ARGUMENT, "part.chunks[1].offset"),
        ("publish over the size limit", lambda: stub.PublishVersion(publish_stream(part, generation=gen, version=2, batches=huge, header_overrides={"tensor_count": 1, "shard_count": 1, "chunk_count": 0}), timeout=5), C.RESOURCE_EXHAUSTED, None),
        ("publish rank out of range", lambda: stub.PublishVersion(publish_stream(dataclasses.replace(part, rank=3), generation=gen, version=2), timeout=5), C.INVALID_ARGUMENT, None),
        ("republish v1 other content", lambda: stub.PublishVersion(publish_stream(other, generation=gen, version=1), timeout=5), C.ALREADY_EXISTS, None),
        ("manifest unknown version", lambda: list(stub.GetManifest(cpb.GetManifestRequest(session="job", version=42), timeout=5)), C.NOT_FOUND, None),
        ("manifest unknown session", lambda: list(stub.GetManifest(cpb.GetManifestRequest(session="nope"), timeout=5)), C.NOT_FOUND, None),
        ("watch unknown session", lambda: next(stub.WatchVersions(cpb.WatchVersionsRequest(session="nope"), timeout=5)), C.NOT_FOUND, None),
        ("report version 0", lambda: stub.ReportApplied(cpb.ReportAppliedRequest(session="job", version=0, agent_id="a"), timeout=5), C.INVALID_ARGUMENT, "version"),
        ("report bad tensor name", lambda: stub.ReportApplied(cpb.ReportAppliedRequest(session="job", version=1, agent_id="a", consumed_names=["../x"]), timeout=5), C.INVALID_ARGUMENT, "consumed_names[0]"),
        ("report bad agent", lambda: stub.ReportApplied(cpb.ReportAppliedRequest(session="job", version=1, agent_id=""), timeout=5), C.INVALID_ARGUMENT, "agent_id"),
        ("abort stale generation", lambda: stub.AbortVersion(cpb.AbortVersionRequest(session="job", generation=gen + 3, version=1), timeout=5), C.FAILED_PRECONDITION, None),
        ("release unknown version", lambda: stub.ReleaseVersion(cpb.ReleaseVersionRequest(session="job", version=9, generation=gen), timeout=5), C.NOT_FOUND, None),
        ("release without generation", lambda: stub.ReleaseVersion(cpb.ReleaseVersionRequest(session="job", version=1, force=True), timeout=5), C.INVALID_ARGUMENT, "generation"),
        ("release stale generation", lambda: stub.ReleaseVersion(cpb.ReleaseVersionRequest(session="job", version=1, force=True, generation=gen + 3), timeout=5), C.FAILED_PRECONDITION, None),
        ("register trainer stale generation", lambda: stub.RegisterAgent(cpb.RegisterAgentRequest(session="job", agent_id="t9", role=tpb.TRAINER, generation=gen + 3), timeout=5), C.FAILED_PRECONDITION, None),
        ("deregister bad agent", lambda: stub.DeregisterAgent(cpb.DeregisterAgentRequest(session="job", agent_id="Bad Id"), timeout=5), C.INVALID_ARGUMENT, "agent_id"),
        ("status limit too big", lambda: stub.GetStatus(cpb.GetStatusRequest(session="job", version_limit=5000), timeout=5), C.INVALID_ARGUMENT, "version_limit"),
        ("read unknown version", read(version=9), C.NOT_FOUND, None),
        ("read other session", read(session="other"), C.NOT_FOUND, None),
        ("read wrong rank", read(rank=1), C.INVALID_ARGUMENT, "rank"),
        ("read index out of range", read(indices=[0, 10_000]), C.INVALID_ARGUMENT, "indices[1]"),
        ("read no indices", read(indices=[]), C.INVALID_ARGUMENT, "indices"),
        ("read too many indices", read(indices=[0] * 5000), C.INVALID_ARGUMENT, "indices"),
    ]
    before = snapshot(stub)
    for what, call, code, field in cases:
        with pytest.raises(grpc.RpcError) as exc:
            call()
        err = exc.value
        assert err.code() == code, f"{what}: got {err.code()} {err.details()}"
        assert err.details(), f"{what}: no message"
        assert len(err.details()) < 2048, f"{what}: a {len(err.details())}-character message echoes the input"
        if field is not None:
            assert err.details().startswith(field), f"{what}: {err.details()!r} does not name {field}"
            status = rpc_status.from_call(err)
            assert status is not None and status.details, f"{what}: no BadRequest detail"
    assert snapshot(stub) == before
    channel.close()
    trainer_channel.close()
    reader.close()


def test_health_list_is_answered_not_internal(inprocess_coordinator) -> None:  # noqa: ANN001
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(inprocess_coordinator.address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.List(health_pb2.HealthListRequest(), timeout=5)
        except grpc.RpcError as e:
            assert e.code() == C.UNIMPLEMENTED, e.details()
        else:
            assert "weightsync.v1.Coordinator" in reply.statuses
