"""Every malformed request class gets its documented status code and changes nothing."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

import grpc
import pytest
from grpc_status import rpc_status

from devtools.cluster import Cluster
from tests.integration.support import eventually
from tests.unit.helpers import make_part, sample_arrays
from weightsync import rpc
from weightsync._proto import coordinator_pb2 as cpb
from weightsync._proto import coordinator_pb2_grpc as cpb_grpc
from weightsync._proto import trainer_agent_pb2 as tpb_agent
from weightsync._proto import trainer_agent_pb2_grpc as tpb_agent_grpc
from weightsync._proto import types_pb2 as tpb
from weightsync.client import CoordinatorClient
from weightsync.errors import InvalidArgument
from weightsync.manifest import Endpoint, Part
from weightsync.security import with_credential
from weightsync.wire import PartBuilder, part_to_batches, tensor_to_proto

pytestmark = pytest.mark.slow
C = grpc.StatusCode


def publish_stream(
    part,
    *,
    generation: int,
    version: int,
    seal: str | None = None,
    header_overrides=None,  # noqa: ANN001
    batches=None,
) -> Iterator[cpb.PublishRequest]:  # noqa: ANN001
    header = cpb.PublishHeader(
        session="job",
        generation=generation,
        version=version,
        rank=part.rank,
        idempotency_key="k",
        total_bytes=part.total_bytes,
        chunk_bytes=part.chunk_bytes,
        tensor_count=len(part.tensors),
        shard_count=len(part.shards),
        chunk_count=len(part.chunks),
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
    return builder.build(
        total_bytes=header.total_bytes, chunk_bytes=header.chunk_bytes, endpoint=Endpoint(), stage_seconds=0
    ).digest()


def snapshot(stub: cpb_grpc.CoordinatorStub) -> tuple:
    st = stub.GetStatus(cpb.GetStatusRequest(session="job"), timeout=10)
    return (
        st.generation,
        st.trainer_ranks,
        [v.SerializeToString() for v in st.versions],
        [h.SerializeToString() for h in st.handshakes],
        [p.SerializeToString() for p in st.parts],
        sorted(a.agent_id for a in st.agents),
    )


@dataclasses.dataclass
class World:
    """A coordinator and a trainer holding version 1, shared by every case of the module."""

    stub: cpb_grpc.CoordinatorStub
    agent: tpb_agent_grpc.TrainerAgentStub
    gen: int
    token: str
    probe_key: str  # the agent key of "probe", a registered rollout
    trainer_id: str
    part: Part
    other: Part
    before: tuple

    def probe(self, request: cpb.ReportAppliedRequest) -> cpb.ReportAppliedRequest:
        request.agent_key = self.probe_key
        return request

    @property
    def overlapping(self) -> Part:
        c = self.part.chunks
        return dataclasses.replace(self.part, chunks=(c[0], dataclasses.replace(c[1], offset=c[1].offset - 8), *c[2:]))

    bad_dtype = [tpb.DescriptorBatch(rank=0, tensors=[tpb.TensorDescriptor(name="a.b", dtype=99, shape=[2])])]
    many = [
        tpb.DescriptorBatch(
            rank=0, tensors=[tpb.TensorDescriptor(name=f"t{i}", dtype=1, shape=[1]) for i in range(2048)]
        )
    ]
    long_name = [tpb.DescriptorBatch(rank=0, tensors=[tpb.TensorDescriptor(name="x" * (1 << 20), dtype=1, shape=[1])])]

    @property
    def long_names(self) -> list[tpb.DescriptorBatch]:
        """70,000 tensors of 500-character names: each name allowed, together more than a
        rollout's handshake has room for (Limits.max_name_chars)."""
        return [
            tpb.DescriptorBatch(
                rank=0,
                tensors=[
                    tpb.TensorDescriptor(name=f"t{i:07d}".ljust(500, "x"), dtype=1, shape=[1])
                    for i in range(start, min(start + 2048, 70_000))
                ],
            )
            for start in range(0, 70_000, 2048)
        ]

    @property
    def huge(self) -> list[tpb.DescriptorBatch]:
        t = self.part.tensors[0]
        return [
            tpb.DescriptorBatch(
                rank=0,
                tensors=[tensor_to_proto(dataclasses.replace(t, shape=(1 << 41,)))],
                shards=[tpb.ShardDescriptor(tensor_name=t.name, start=[0], stop=[1 << 41], nbytes=1 << 43)],
            )
        ]

    def read(self, **kw: object) -> object:
        fields = {"session": "job", "version": 1, "rank": 0, "indices": [0], "access_token": self.token, **kw}
        return list(self.agent.ReadChunks(tpb_agent.ReadChunksRequest(**fields), timeout=10))


def publish(
    w: World, part: Part | None = None, *, generation: int | None = None, version: int = 2, **stream: object
) -> object:
    """PublishVersion of a stream `publish_stream` builds (defaults: version 2 of the
    world's part under its generation)."""
    gen = w.gen if generation is None else generation
    return w.stub.PublishVersion(publish_stream(part or w.part, generation=gen, version=version, **stream), timeout=5)


@dataclasses.dataclass(frozen=True)
class Case:
    what: str
    call: Callable[[World], object]
    code: grpc.StatusCode
    field: str | None  # the field the message must start with (None: any message)


CASES = [
    Case(
        "empty session",
        lambda w: w.stub.OpenSession(cpb.OpenSessionRequest(session="", role=tpb.ROLLOUT), timeout=5),
        C.INVALID_ARGUMENT,
        "session",
    ),
    Case(
        "bad session name",
        lambda w: w.stub.OpenSession(cpb.OpenSessionRequest(session="Job!", role=tpb.ROLLOUT), timeout=5),
        C.INVALID_ARGUMENT,
        "session",
    ),
    Case(
        "no role",
        lambda w: w.stub.OpenSession(cpb.OpenSessionRequest(session="job"), timeout=5),
        C.INVALID_ARGUMENT,
        "role",
    ),
    Case(
        "register unknown session",
        lambda w: w.stub.RegisterAgent(
            cpb.RegisterAgentRequest(session="nope", agent_id="a", role=tpb.ROLLOUT), timeout=5
        ),
        C.NOT_FOUND,
        None,
    ),
    Case(
        "register bad address",
        lambda w: w.stub.RegisterAgent(
            cpb.RegisterAgentRequest(
                session="job", agent_id="a", role=tpb.ROLLOUT, endpoint=tpb.Endpoint(address="nowhere")
            ),
            timeout=5,
        ),
        C.INVALID_ARGUMENT,
        "endpoint.address",
    ),
    # names are matched whole: `$` also matches before a final newline, which would take
    # "job\n" as a session of its own (a name that splits log lines and fs store paths)
    Case(
        "session name ending in a newline",
        lambda w: w.stub.OpenSession(cpb.OpenSessionRequest(session="job\n", role=tpb.ROLLOUT), timeout=5),
        C.INVALID_ARGUMENT,
        "session",
    ),
    Case(
        "agent id ending in a newline",
        lambda w: w.stub.RegisterAgent(
            cpb.RegisterAgentRequest(session="job", agent_id="r0\n", role=tpb.ROLLOUT), timeout=5
        ),
        C.INVALID_ARGUMENT,
        "agent_id",
    ),
    Case(
        "consumed tensor name ending in a newline",
        lambda w: w.stub.ReportApplied(
            w.probe(cpb.ReportAppliedRequest(session="job", version=1, agent_id="probe", consumed_names=["w\n"])),
            timeout=5,
        ),
        C.INVALID_ARGUMENT,
        "consumed_names[0]",
    ),
    # an address no other agent can dial (--advertise-host -1): its relay's children and
    # its trainer's rollouts failed to connect, version after version
    Case(
        "register an address whose host is no host name",
        lambda w: w.stub.RegisterAgent(
            cpb.RegisterAgentRequest(
                session="job", agent_id="a", role=tpb.ROLLOUT, endpoint=tpb.Endpoint(address="-1:5000")
            ),
            timeout=5,
        ),
        C.INVALID_ARGUMENT,
        "endpoint.address",
    ),
    Case(
        "publish a tcp address whose host is no host name",
        lambda w: publish(w, header_overrides={"endpoint": tpb.Endpoint(address="127.0.0.1:1", tcp_address="a b:1")}),
        C.INVALID_ARGUMENT,
        "header.endpoint.tcp_address",
    ),
    Case(
        "register bad agent id",
        lambda w: w.stub.RegisterAgent(
            cpb.RegisterAgentRequest(session="job", agent_id="A B", role=tpb.ROLLOUT), timeout=5
        ),
        C.INVALID_ARGUMENT,
        "agent_id",
    ),
    Case(
        "register trainer rank out of range",
        lambda w: w.stub.RegisterAgent(
            cpb.RegisterAgentRequest(session="job", agent_id="t9", role=tpb.TRAINER, rank=9), timeout=5
        ),
        C.INVALID_ARGUMENT,
        "rank",
    ),
    # an agent's calls carry its key; its id is its registering process's while its lease lives
    Case(
        "heartbeat without the agent's key",
        lambda w: w.stub.Heartbeat(cpb.HeartbeatRequest(session="job", agent_id="probe"), timeout=5),
        C.PERMISSION_DENIED,
        "agent_id",
    ),
    Case(
        "heartbeat as the trainer with a rollout's key",
        lambda w: w.stub.Heartbeat(
            cpb.HeartbeatRequest(session="job", agent_id=w.trainer_id, agent_key=w.probe_key), timeout=5
        ),
        C.PERMISSION_DENIED,
        "agent_id",
    ),
    Case(
        "register a live rollout's id from another process",
        lambda w: w.stub.RegisterAgent(
            cpb.RegisterAgentRequest(
                session="job", agent_id="probe", role=tpb.ROLLOUT, endpoint=tpb.Endpoint(address="10.9.9.9:1")
            ),
            timeout=5,
        ),
        C.ALREADY_EXISTS,
        "agent_id",
    ),
    Case(
        "register the trainer's id as a rollout",
        lambda w: w.stub.RegisterAgent(
            cpb.RegisterAgentRequest(session="job", agent_id=w.trainer_id, role=tpb.ROLLOUT, instance="x"), timeout=5
        ),
        C.PERMISSION_DENIED,
        "agent_id",
    ),
    Case(
        "heartbeat unknown agent",
        lambda w: w.stub.Heartbeat(cpb.HeartbeatRequest(session="job", agent_id="ghost"), timeout=5),
        C.NOT_FOUND,
        None,
    ),
    # uint64 values past SQLite's int64 are refused, never INTERNAL
    Case(
        "heartbeat version 2^64-1",
        lambda w: w.stub.Heartbeat(
            cpb.HeartbeatRequest(session="job", agent_id="probe", current_version=(1 << 64) - 1), timeout=5
        ),
        C.INVALID_ARGUMENT,
        "current_version",
    ),
    Case(
        "watch since 2^63",
        lambda w: next(w.stub.WatchVersions(cpb.WatchVersionsRequest(session="job", since_seq=1 << 63), timeout=5)),
        C.INVALID_ARGUMENT,
        "since_seq",
    ),
    Case(
        "manifest version 2^63",
        lambda w: list(w.stub.GetManifest(cpb.GetManifestRequest(session="job", version=1 << 63), timeout=5)),
        C.INVALID_ARGUMENT,
        "version",
    ),
    Case(
        "release version 2^64-1",
        lambda w: w.stub.ReleaseVersion(
            cpb.ReleaseVersionRequest(session="job", version=(1 << 64) - 1, generation=w.gen), timeout=5
        ),
        C.INVALID_ARGUMENT,
        "version",
    ),
    Case(
        "attach next_version 2^64-1",
        lambda w: w.stub.OpenSession(
            cpb.OpenSessionRequest(session="job", role=tpb.TRAINER, incarnation="x", next_version=(1 << 64) - 1),
            timeout=5,
        ),
        C.INVALID_ARGUMENT,
        "next_version",
    ),
    Case("publish version 2^63", lambda w: publish(w, version=1 << 63), C.INVALID_ARGUMENT, "header.version"),
    Case(
        "publish stage_seconds NaN",
        lambda w: publish(w, header_overrides={"stage_seconds": float("nan")}),
        C.INVALID_ARGUMENT,
        "header.stage_seconds",
    ),
    # huge values are refused naming the field, not echoed whole into trailing metadata
    Case(
        "1 MiB session name",
        lambda w: w.stub.OpenSession(cpb.OpenSessionRequest(session="a" * (1 << 20), role=tpb.ROLLOUT), timeout=5),
        C.INVALID_ARGUMENT,
        "session",
    ),
    Case(
        "1 MiB tensor name",
        lambda w: w.stub.ReportApplied(
            w.probe(
                cpb.ReportAppliedRequest(session="job", version=1, agent_id="probe", consumed_names=["x" * (1 << 20)])
            ),
            timeout=5,
        ),
        C.INVALID_ARGUMENT,
        "consumed_names[0]",
    ),
    Case(
        "publish without header",
        lambda w: w.stub.PublishVersion(iter([cpb.PublishRequest(seal=cpb.PublishSeal())]), timeout=5),
        C.INVALID_ARGUMENT,
        "header",
    ),
    Case(
        "publish a generation never issued (lost state)",
        lambda w: publish(w, generation=w.gen + 5),
        C.NOT_FOUND,
        None,
    ),
    Case("publish version 0", lambda w: publish(w, version=0), C.INVALID_ARGUMENT, "header.version"),
    Case("publish wrong counts", lambda w: publish(w, header_overrides={"chunk_count": 99}), C.INVALID_ARGUMENT, None),
    Case(
        "publish shm path outside /dev/shm",
        lambda w: publish(w, header_overrides={"endpoint": tpb.Endpoint(shm_path="/etc/passwd")}),
        C.INVALID_ARGUMENT,
        "header.endpoint.shm_path",
    ),
    Case(
        "publish fs_uri outside the store",
        lambda w: publish(w, header_overrides={"endpoint": tpb.Endpoint(fs_uri="../../etc")}),
        C.INVALID_ARGUMENT,
        "header.endpoint.fs_uri",
    ),
    Case(
        "publish fs_uri of another scheme",
        lambda w: publish(w, header_overrides={"endpoint": tpb.Endpoint(fs_uri="file:///etc")}),
        C.INVALID_ARGUMENT,
        "header.endpoint.fs_uri",
    ),
    Case(
        "publish announcing 10^6 tensors",
        lambda w: publish(w, header_overrides={"tensor_count": 10**6}),
        C.RESOURCE_EXHAUSTED,
        "header.tensor_count",
    ),
    Case(
        "publish more tensors than announced",
        lambda w: publish(
            w, batches=w.many, seal="0", header_overrides={"tensor_count": 1, "shard_count": 0, "chunk_count": 4096}
        ),
        C.INVALID_ARGUMENT,
        "part.tensors",
    ),
    Case(
        "publish a 1 MiB tensor name",
        lambda w: publish(
            w, batches=w.long_name, seal="0", header_overrides={"tensor_count": 1, "shard_count": 0, "chunk_count": 0}
        ),
        C.INVALID_ARGUMENT,
        "part.tensors[0].name",
    ),
    Case(
        "publish tensor names past the handshake's room",
        lambda w: publish(
            w,
            batches=w.long_names,
            seal="0",
            header_overrides={"tensor_count": 70_000, "shard_count": 0, "chunk_count": 0},
        ),
        C.RESOURCE_EXHAUSTED,
        "part.tensors",
    ),
    Case("publish wrong seal", lambda w: publish(w, seal="00"), C.INVALID_ARGUMENT, "seal.part_digest"),
    Case(
        "publish bad dtype",
        lambda w: publish(
            w, batches=w.bad_dtype, header_overrides={"tensor_count": 1, "shard_count": 0, "chunk_count": 0}
        ),
        C.INVALID_ARGUMENT,
        "part.tensors[0].dtype",
    ),
    Case(
        "publish overlapping chunks", lambda w: publish(w, w.overlapping), C.INVALID_ARGUMENT, "part.chunks[1].offset"
    ),
    Case(
        "publish over the size limit",
        lambda w: publish(w, batches=w.huge, header_overrides={"tensor_count": 1, "shard_count": 1, "chunk_count": 0}),
        C.RESOURCE_EXHAUSTED,
        None,
    ),
    Case(
        "publish rank out of range", lambda w: publish(w, dataclasses.replace(w.part, rank=3)), C.INVALID_ARGUMENT, None
    ),
    Case("republish v1 other content", lambda w: publish(w, w.other, version=1), C.ALREADY_EXISTS, None),
    Case(
        "manifest unknown version",
        lambda w: list(w.stub.GetManifest(cpb.GetManifestRequest(session="job", version=42), timeout=5)),
        C.NOT_FOUND,
        None,
    ),
    Case(
        "manifest unknown session",
        lambda w: list(w.stub.GetManifest(cpb.GetManifestRequest(session="nope"), timeout=5)),
        C.NOT_FOUND,
        None,
    ),
    Case(
        "watch unknown session",
        lambda w: next(w.stub.WatchVersions(cpb.WatchVersionsRequest(session="nope"), timeout=5)),
        C.NOT_FOUND,
        None,
    ),
    Case(
        "report version 0",
        lambda w: w.stub.ReportApplied(cpb.ReportAppliedRequest(session="job", version=0, agent_id="a"), timeout=5),
        C.INVALID_ARGUMENT,
        "version",
    ),
    Case(
        "report bad tensor name",
        lambda w: w.stub.ReportApplied(
            cpb.ReportAppliedRequest(session="job", version=1, agent_id="a", consumed_names=["../x"]), timeout=5
        ),
        C.INVALID_ARGUMENT,
        "consumed_names[0]",
    ),
    Case(
        "report bad agent",
        lambda w: w.stub.ReportApplied(cpb.ReportAppliedRequest(session="job", version=1, agent_id=""), timeout=5),
        C.INVALID_ARGUMENT,
        "agent_id",
    ),
    Case(
        "abort with a generation never issued (lost state)",
        lambda w: w.stub.AbortVersion(
            cpb.AbortVersionRequest(session="job", generation=w.gen + 3, version=1), timeout=5
        ),
        C.NOT_FOUND,
        None,
    ),
    Case(
        "release unknown version",
        lambda w: w.stub.ReleaseVersion(
            cpb.ReleaseVersionRequest(session="job", version=9, generation=w.gen), timeout=5
        ),
        C.NOT_FOUND,
        None,
    ),
    Case(
        "release without generation",
        lambda w: w.stub.ReleaseVersion(cpb.ReleaseVersionRequest(session="job", version=1, force=True), timeout=5),
        C.INVALID_ARGUMENT,
        "generation",
    ),
    Case(
        "release with a generation never issued (lost state)",
        lambda w: w.stub.ReleaseVersion(
            cpb.ReleaseVersionRequest(session="job", version=1, force=True, generation=w.gen + 3), timeout=5
        ),
        C.NOT_FOUND,
        None,
    ),
    Case(
        "register a trainer with a generation never issued (lost state)",
        lambda w: w.stub.RegisterAgent(
            cpb.RegisterAgentRequest(session="job", agent_id="t9", role=tpb.TRAINER, generation=w.gen + 3), timeout=5
        ),
        C.NOT_FOUND,
        None,
    ),
    Case(
        "deregister bad agent",
        lambda w: w.stub.DeregisterAgent(cpb.DeregisterAgentRequest(session="job", agent_id="Bad Id"), timeout=5),
        C.INVALID_ARGUMENT,
        "agent_id",
    ),
    Case(
        "status limit too big",
        lambda w: w.stub.GetStatus(cpb.GetStatusRequest(session="job", version_limit=5000), timeout=5),
        C.INVALID_ARGUMENT,
        "version_limit",
    ),
    Case(
        "audit bad session",
        lambda w: w.stub.AuditSession(cpb.AuditSessionRequest(session="Job!"), timeout=5),
        C.INVALID_ARGUMENT,
        "session",
    ),
    Case(
        "audit unknown session",
        lambda w: w.stub.AuditSession(cpb.AuditSessionRequest(session="nope", fresh=True), timeout=5),
        C.NOT_FOUND,
        None,
    ),
    Case(
        "audit wait too long",
        lambda w: w.stub.AuditSession(cpb.AuditSessionRequest(session="job", fresh=True, wait_seconds=1e9), timeout=5),
        C.INVALID_ARGUMENT,
        "wait_seconds",
    ),
    Case(
        "audit wait not a number",
        lambda w: w.stub.AuditSession(cpb.AuditSessionRequest(session="job", wait_seconds=float("nan")), timeout=5),
        C.INVALID_ARGUMENT,
        "wait_seconds",
    ),
    Case(
        "beat with an audit naming too many tensors",
        lambda w: w.stub.Heartbeat(
            cpb.HeartbeatRequest(
                session="job",
                agent_id="nobody",  # refused for the audit before the store is asked about the agent
                audit=tpb.AuditResult(mismatches=[tpb.AuditMismatch(tensor="t")] * 100),
            ),
            timeout=5,
        ),
        C.INVALID_ARGUMENT,
        "audit.mismatches",
    ),
    Case("read unknown version", lambda w: w.read(version=9), C.NOT_FOUND, None),
    Case("read other session", lambda w: w.read(session="other"), C.NOT_FOUND, None),
    Case("read wrong rank", lambda w: w.read(rank=1), C.INVALID_ARGUMENT, "rank"),
    Case("read index out of range", lambda w: w.read(indices=[0, 10_000]), C.INVALID_ARGUMENT, "indices[1]"),
    Case("read no indices", lambda w: w.read(indices=[]), C.INVALID_ARGUMENT, "indices"),
    Case("read too many indices", lambda w: w.read(indices=[0] * 5000), C.INVALID_ARGUMENT, "indices"),
    # refused by grpc before it is buffered (buffered, a dozen 70 MiB reads at once take a trainer to 1.9 GB)
    Case("read larger than any chunk read", lambda w: w.read(session="a" * (2 << 20)), C.RESOURCE_EXHAUSTED, None),
]


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    cluster = Cluster(tmp_path_factory.mktemp("malformed") / "cluster")
    try:
        coord = cluster.start_coordinator()
        trainer = cluster.start_trainer(
            "trainer",
            coord.address,
            "job",
            ["--model-size", "tiny", "--steps", "1", "--wait-commit", "false", "--hold"],
        )
        admin = with_credential(None, coord.address, "admin")  # the coordinator's default credential
        with rpc.channel(coord.address, admin) as channel, grpc.insecure_channel(trainer.address) as trainer_channel:
            stub = cpb_grpc.CoordinatorStub(channel)
            eventually(
                lambda: stub.GetStatus(cpb.GetStatusRequest(session="job"), timeout=5).versions, what="version 1"
            )
            st = stub.GetStatus(cpb.GetStatusRequest(session="job"), timeout=5)
            gen, trainer_id = st.generation, next(a.agent_id for a in st.agents if a.role == tpb.TRAINER)
            with CoordinatorClient(coord.address) as reader:  # a leased reader holds the access token
                key = reader.register_agent("job", "probe", trainer=False, endpoint=Endpoint()).agent_key
                token = reader.get_manifest("job", 1, agent_id="probe")[0].access_token
                w = World(
                    stub,
                    tpb_agent_grpc.TrainerAgentStub(trainer_channel),
                    gen,
                    token,
                    key,
                    trainer_id,
                    make_part(sample_arrays())[0],
                    make_part(sample_arrays(seed=7))[0],
                    (),
                )
                assert w.read(), "a well-formed read is answered"
                w.before = snapshot(stub)
                yield w
    finally:
        cluster.close()


@pytest.mark.parametrize("case", CASES, ids=[c.what for c in CASES])
def test_malformed_request_gets_its_documented_code(world: World, case: Case) -> None:
    with pytest.raises(grpc.RpcError) as exc:
        case.call(world)
    err = exc.value
    assert err.code() == case.code, err.details()
    assert err.details(), "no message"
    assert len(err.details()) < 2048, f"a {len(err.details())}-character message echoes the input"
    if case.field is not None:
        assert err.details().startswith(case.field), f"{err.details()!r} does not name {case.field}"
        status = rpc_status.from_call(err)
        assert status is not None and status.details, "no BadRequest detail"
    assert snapshot(world.stub) == world.before, "a refused request changed the coordinator's state"


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


# Bytes that parse as no message at all: a truncated tag, wire type 7, an unterminated
# group, a length past the end.
UNDECODABLE = [b"\xff", b"\x07", b"\x0b", b"\x0a\x05ab"]


def test_undecodable_request_bytes_are_invalid_argument_on_every_method(inprocess_coordinator) -> None:  # noqa: ANN001
    """grpc answers bytes it cannot deserialize with UNKNOWN (unary calls) or hands the
    DecodeError to the handler (client streams: INTERNAL); every method of every service
    (ours, health, reflection v1) must refuse them as INVALID_ARGUMENT naming `request`,
    also when they follow a good message on a stream, and the call must change nothing."""
    from tests.integration.support import reflected_methods

    def stored(client: CoordinatorClient) -> tuple:
        s = client.status("job")
        return (s.generation, list(s.versions), list(s.parts), s.event_seq, sorted(a.agent_id for a in s.agents))

    raw = {"request_serializer": None, "response_deserializer": None}
    with CoordinatorClient(inprocess_coordinator.address) as client:
        gen = client.open_session("job", trainer=True).generation
        client.register_agent("job", "r0", trainer=False, endpoint=Endpoint())
        heartbeat = client.keyed(cpb.HeartbeatRequest(session="job", agent_id="r0"))
        client.publish_part("job", generation=gen, version=1, idempotency_key="k", part=make_part(sample_arrays())[0])
        before = stored(client)
    with grpc.insecure_channel(inprocess_coordinator.address) as channel:
        methods = list(reflected_methods(channel))
        assert {"/weightsync.v1.Coordinator/PublishVersion", "/grpc.health.v1.Health/Check"} <= {m[0] for m in methods}
        methods.append(("/grpc.reflection.v1.ServerReflection/ServerReflectionInfo", None, True, True))
        for path, _cls, cstream, sstream in methods:
            good = {
                "/weightsync.v1.Coordinator/Heartbeats": heartbeat,
                "/weightsync.v1.Coordinator/PublishVersion": cpb.PublishRequest(
                    header=cpb.PublishHeader(session="job", generation=gen, version=2, idempotency_key="k2")
                ),
            }.get(path, cpb.HeartbeatRequest()).SerializeToString()
            for payload in UNDECODABLE:
                streams = [[payload], [good, payload]] if cstream else [[payload]]
                for requests in streams:
                    with pytest.raises(grpc.RpcError) as exc:
                        if cstream and sstream:
                            list(channel.stream_stream(path, **raw)(iter(requests), timeout=5))
                        elif cstream:
                            channel.stream_unary(path, **raw)(iter(requests), timeout=5)
                        elif sstream:
                            list(channel.unary_stream(path, **raw)(payload, timeout=5))
                        else:
                            channel.unary_unary(path, **raw)(payload, timeout=5)
                    err = exc.value
                    assert err.code() == C.INVALID_ARGUMENT, f"{path} {requests}: {err.code()} {err.details()}"
                    assert err.details().startswith("request: not a valid "), f"{path}: {err.details()}"
    with CoordinatorClient(inprocess_coordinator.address) as client:
        assert stored(client) == before
