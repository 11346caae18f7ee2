"""Manifest validation: every rule names its field; hypothesis explores chunk layouts."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.unit.helpers import make_part, row_shards, sample_arrays
from weightsync._proto import coordinator_pb2 as cpb
from weightsync.errors import InvalidArgument, ResourceExhausted
from weightsync.layout import plan_chunks
from weightsync.manifest import ChunkSpec, Part, ShardSpec, TensorSpec
from weightsync.rpc import MAX_MESSAGE_BYTES
from weightsync.validation import (
    DEFAULT_LIMITS,
    Limits,
    handshake_bound_bytes,
    validate_against_parts,
    validate_part,
)
from weightsync.wire import PartBuilder, part_to_batches


def good_part() -> Part:
    return make_part(sample_arrays())[0]


def replace_shard(part: Part, i: int, **kw: object) -> Part:
    shards = list(part.shards)
    shards[i] = dataclasses.replace(shards[i], **kw)
    return dataclasses.replace(part, shards=tuple(shards))


def replace_chunk(part: Part, i: int, **kw: object) -> Part:
    chunks = list(part.chunks)
    chunks[i] = dataclasses.replace(chunks[i], **kw)
    return dataclasses.replace(part, chunks=tuple(chunks))


def test_good_part_passes() -> None:
    part = good_part()
    assert validate_part(part, trainer_ranks=1) is None  # accepted as it is
    # what acceptance stands for: the chunks tile the part and every shard lies inside it
    ends = [c.offset + c.length for c in part.chunks]
    assert [c.offset for c in part.chunks] == [0, *ends[:-1]] and ends[-1] == part.total_bytes
    assert all(0 <= s.offset and s.offset + s.nbytes <= part.total_bytes for s in part.shards)
    assert validate_part(dataclasses.replace(part, rank=0), trainer_ranks=2) is None  # rank 0 of 2


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda p: dataclasses.replace(p, rank=1), "header.rank"),
        (lambda p: dataclasses.replace(p, chunk_bytes=100), "header.chunk_bytes"),
        (
            lambda p: dataclasses.replace(
                p, tensors=(dataclasses.replace(p.tensors[0], name="../etc/passwd"),) + p.tensors[1:]
            ),
            "part.tensors[0].name",
        ),
        (
            lambda p: dataclasses.replace(p, tensors=(dataclasses.replace(p.tensors[0], name="a..b"),) + p.tensors[1:]),
            "part.tensors[0].name",
        ),
        (
            lambda p: dataclasses.replace(p, tensors=(dataclasses.replace(p.tensors[0], name=""),) + p.tensors[1:]),
            "part.tensors[0].name",
        ),
        (
            lambda p: dataclasses.replace(
                p, tensors=(dataclasses.replace(p.tensors[0], dtype="complex64"),) + p.tensors[1:]
            ),
            "part.tensors[0].dtype",
        ),
        (
            lambda p: dataclasses.replace(
                p, tensors=(dataclasses.replace(p.tensors[0], shape=(1,) * 9),) + p.tensors[1:]
            ),
            "part.tensors[0].shape",
        ),
        (lambda p: dataclasses.replace(p, tensors=p.tensors + (p.tensors[0],)), "part.tensors[3].name"),
        (lambda p: replace_shard(p, 0, nbytes=p.shards[0].nbytes - 4), "part.shards[0].nbytes"),
        (lambda p: replace_shard(p, 0, tensor_name="nope"), "part.shards[0].tensor_name"),
        (lambda p: replace_shard(p, 0, stop=(65, 16)), "part.shards[0].stop"),
        (lambda p: replace_shard(p, 0, start=(0,)), "part.shards[0].start"),
        (lambda p: replace_shard(p, 2, offset=p.total_bytes - 8), "part.shards[2].offset"),
        (lambda p: replace_shard(p, 1, offset=p.shards[0].offset + 16), "part.shards"),
        (lambda p: replace_chunk(p, 1, offset=p.chunks[1].offset - 1), "part.chunks[1].offset"),
        (lambda p: replace_chunk(p, 1, offset=p.chunks[1].offset + 1), "part.chunks[1].offset"),
        (lambda p: replace_chunk(p, 0, index=5), "part.chunks[0].index"),
        (lambda p: replace_chunk(p, 0, length=p.chunk_bytes + 1), "part.chunks[0].length"),
        (lambda p: dataclasses.replace(p, chunks=p.chunks[:-1]), "part.chunks"),
        (lambda p: dataclasses.replace(p, total_bytes=p.total_bytes + 1), "part.chunks"),
    ],
)
def test_each_rule_names_its_field(mutate, field: str) -> None:  # noqa: ANN001
    with pytest.raises(InvalidArgument) as exc:
        validate_part(mutate(good_part()), trainer_ranks=1)
    assert exc.value.field == field, exc.value.message


def test_tensor_without_shard_is_refused() -> None:
    p = good_part()
    extra = TensorSpec("model.extra.weight", "float32", (2,))
    with pytest.raises(InvalidArgument, match="has no shard"):
        validate_part(dataclasses.replace(p, tensors=p.tensors + (extra,)), trainer_ranks=1)


def test_limits_give_resource_exhausted() -> None:
    with pytest.raises(ResourceExhausted) as exc:
        validate_part(good_part(), trainer_ranks=1, limits=Limits(max_chunks=1))
    assert exc.value.field == "part.chunks"


def test_tensor_names_are_bounded_per_part_across_ranks_and_on_arrival() -> None:
    arrays = sample_arrays()
    p0, _ = make_part(row_shards(arrays, 0, 2), rank=0)
    p1, _ = make_part(row_shards(arrays, 1, 2), rank=1)
    chars = sum(len(t.name) for t in p0.tensors)  # both ranks hold a shard of every tensor
    fits = Limits(max_name_chars=chars)
    validate_part(p0, trainer_ranks=2, limits=fits)
    validate_against_parts(p1, [p0], final=True, limits=fits)  # a name on two ranks counts once
    with pytest.raises(ResourceExhausted) as exc:
        validate_part(p0, trainer_ranks=2, limits=Limits(max_name_chars=chars - 1))
    assert exc.value.field == "part.tensors"
    # ranks with names of their own: each fits, together they do not
    q0, _ = make_part({f"a.{k}": v for k, v in arrays.items()}, rank=0)
    q1, _ = make_part({f"b.{k}": v for k, v in arrays.items()}, rank=1)
    own = Limits(max_name_chars=sum(len(t.name) for t in q0.tensors) + 10)
    validate_part(q1, trainer_ranks=2, limits=own)
    with pytest.raises(ResourceExhausted, match="exceed the limit") as exc:
        validate_against_parts(q1, [q0], final=True, limits=own)
    assert exc.value.field == "part.tensors"
    with pytest.raises(ResourceExhausted, match="all ranks together"):
        validate_against_parts(q1, [q0], final=True, limits=Limits(max_tensors=len(q0.tensors) + 1))
    builder = PartBuilder(0, max_items=1 << 20, max_name_chars=chars - 1)
    with pytest.raises(ResourceExhausted) as exc:
        for batch in part_to_batches(p0, batch_items=2):
            builder.add(batch)
    assert exc.value.field == "part.tensors"


def test_the_largest_handshake_the_limits_allow_fits_in_a_message() -> None:
    """A version within the limits makes a handshake a rollout can send: max_tensors
    tensors whose names take max_name_chars, each named in a digest and as consumed."""
    limits = DEFAULT_LIMITS
    n = limits.max_tensors
    width = limits.max_name_chars // n
    names = [f"{i:07d}".ljust(width if i >= limits.max_name_chars % n else width + 1, "x") for i in range(n)]
    assert sum(map(len, names)) == limits.max_name_chars
    report = cpb.ReportAppliedRequest(
        session="s" * 63,
        version=(1 << 63) - 1,
        agent_id="a" * 63,
        manifest_digest="f" * 64,
        tensors=[cpb.TensorDigest(name=name, xxh3=(1 << 64) - 1, sum=-1.5e300) for name in names],
        consumed_names=names,
        local_error="",
    )
    size = cpb.HeartbeatRequest(
        session="s" * 63, agent_id="a" * 63, call_id=(1 << 64) - 1, report_applied=report
    ).ByteSize()
    assert handshake_bound_bytes(limits) - (1 << 20) <= size <= handshake_bound_bytes(limits) + 1024
    assert handshake_bound_bytes(limits) <= MAX_MESSAGE_BYTES - (1 << 20)


def test_cross_rank_overlap_mismatch_and_coverage() -> None:
    arrays = sample_arrays()
    p0, _ = make_part(row_shards(arrays, 0, 2), rank=0)
    p1, _ = make_part(row_shards(arrays, 1, 2), rank=1)
    validate_against_parts(p1, [p0], final=True)
    with pytest.raises(InvalidArgument, match="cover"):
        validate_against_parts(p0, [], final=True)
    with pytest.raises(InvalidArgument, match="overlap"):
        validate_against_parts(dataclasses.replace(p0, rank=1), [p0], final=False)
    other = {k: (v.astype(np.float64) if v.dtype == np.float32 else v) for k, v in arrays.items()}
    p1_wrong, _ = make_part(row_shards(other, 1, 2), rank=1)
    with pytest.raises(InvalidArgument, match="on another rank"):
        validate_against_parts(p1_wrong, [p0], final=True)


@settings(max_examples=200, deadline=None)
@given(total=st.integers(0, 1 << 22), chunk=st.integers(4096, 1 << 20))
def test_planned_chunks_always_validate(total: int, chunk: int) -> None:
    spans = plan_chunks(total, chunk)
    part = Part(0, total, chunk, (), (), tuple(ChunkSpec(i, o, n, 0) for i, (o, n) in enumerate(spans)))
    validate_part(part, trainer_ranks=1)
    assert sum(n for _, n in spans) == total


@settings(max_examples=300, deadline=None)
@given(
    lengths=st.lists(st.integers(-3, 9000), min_size=1, max_size=12),
    gap_at=st.integers(0, 11),
    gap=st.integers(-5, 5),
)
def test_arbitrary_chunk_layouts_pass_only_when_exact(lengths: list[int], gap_at: int, gap: int) -> None:
    chunk_bytes = 8192
    offsets, cursor = [], 0
    for i, n in enumerate(lengths):
        if i == gap_at:
            cursor += gap
        offsets.append(cursor)
        cursor += n
    total = sum(lengths)
    chunks = tuple(ChunkSpec(i, o, n, 0) for i, (o, n) in enumerate(zip(offsets, lengths)))
    exact = all(0 < n <= chunk_bytes for n in lengths) and (gap == 0 or gap_at >= len(lengths))
    part = Part(0, total, chunk_bytes, (), (), chunks)
    if exact:
        validate_part(part, trainer_ranks=1)
    else:
        with pytest.raises(InvalidArgument):
            validate_part(part, trainer_ranks=1)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 40), st.integers(1, 40)), min_size=1, max_size=6), st.integers(4096, 20000))
def test_staged_parts_validate_for_any_shapes(shapes: list[tuple[int, int]], chunk: int) -> None:
    arrays = {f"t.{i}": np.ones(s, np.float32) for i, s in enumerate(shapes)}
    part, buf = make_part(arrays, chunk_bytes=chunk)
    validate_part(part, trainer_ranks=1)
    assert part.total_bytes == len(buf)


def test_shard_sum_and_digest_are_recorded() -> None:
    part, _ = make_part({"a.b": np.arange(10, dtype=np.float32)})
    (shard,) = part.shards
    assert isinstance(shard, ShardSpec) and shard.sum == 45.0 and shard.nbytes == 40


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 6), st.integers(1, 4), st.integers(0, 6), st.integers(1, 4)), min_size=0, max_size=12
    )
)
def test_box_overlap_sweep_agrees_with_comparing_every_pair(boxes: list[tuple[int, int, int, int]]) -> None:
    """The sweep (O(n log n) for split tensors) finds an overlap exactly when some pair overlaps."""
    from weightsync.validation import _boxes_overlap, _check_no_box_overlap

    shards = [ShardSpec("w", (r, c), (r + h, c + w), 0, 0, 0, 0.0) for r, h, c, w in boxes]
    brute = any(_boxes_overlap(a, b) for i, a in enumerate(shards) for b in shards[i + 1 :])
    try:
        _check_no_box_overlap("w", shards, "part.shards")
        found = False
    except InvalidArgument:
        found = True
    assert found == brute


@settings(max_examples=150, deadline=None)
@given(
    names=st.lists(st.sampled_from(["a.weight", "b.bias", "c", "bad..name", "/lead", "x//y", ""]), max_size=8),
    consumed=st.lists(st.sampled_from(["a.weight", "b.bias", "bad..name", "c"]), max_size=6),
)
def test_a_handshake_names_its_first_bad_tensor_field(names: list[str], consumed: list[str]) -> None:
    # The bulk check must refuse exactly what a field-by-field check refuses, naming the
    # same (first) field.
    from coordinator.messages import applied_report
    from weightsync._proto import coordinator_pb2 as pb
    from weightsync.validation import check_tensor_name

    request = pb.ReportAppliedRequest(
        agent_id="r0",
        consumed_names=consumed,
        tensors=[pb.TensorDigest(name=n, xxh3=i, sum=float(i)) for i, n in enumerate(names)],
    )

    def first_bad(names: list[str], field: str, unique: bool = False) -> str | None:
        for i, n in enumerate(names):
            try:
                check_tensor_name(n, field.format(i))
            except InvalidArgument as e:
                return e.field
            if unique and n in names[:i]:
                return field.format(i)
        return None

    expected = first_bad(consumed, "consumed_names[{}]") or first_bad(names, "tensors[{}].name", unique=True)
    if expected is None:
        report = applied_report(request, Limits())
        assert report.tensor_digests == {n: (i, float(i)) for i, n in enumerate(names)}
        assert report.consumed_names == tuple(consumed)
    else:
        with pytest.raises(InvalidArgument) as e:
            applied_report(request, Limits())
        assert e.value.field == expected


def test_addresses_with_ipv6_literals_round_trip_and_validate() -> None:
    from weightsync.addresses import join_host_port, split_host_port
    from weightsync.validation import check_address

    for host in ("127.0.0.1", "trainer-0.trainer", "::1", "fd00::7", "[::1]"):
        joined = join_host_port(host, 50051)
        assert split_host_port(joined) == (host.strip("[]"), "50051")
        check_address(joined, "endpoint.address")
    assert join_host_port("::1", 1) == "[::1]:1"
    for bad in ("::1", "[::1]", "host:", ":80", "host:0", "host:65536"):
        with pytest.raises(InvalidArgument, match="host:port|not in \\[1, 65535\\]"):
            check_address(bad, "endpoint.address")


def test_a_version_from_python_is_an_integer_the_coordinator_can_store() -> None:
    """A publisher refuses -1 and 2^64 before it builds the request (which would leave its
    slot held under that version), and vLLM's update refuses 1.5 and True, not taking
    them as version 1."""
    from rollout_agent.vllm_worker.rollout import parse_version
    from weightsync.validation import check_version_arg

    assert check_version_arg(np.int64(7)) == 7 and check_version_arg((1 << 63) - 1) == (1 << 63) - 1
    for bad in (0, -1, 1 << 63, 1.0, True, "3", None):
        with pytest.raises(InvalidArgument, match="^version: "):
            check_version_arg(bad)
    assert [parse_version(v) for v in ("latest", "0", 0, np.int64(0), None, "12", 12)] == [0, 0, 0, 0, 0, 12, 12]
    for bad in (1.5, True, False, 1 << 64, -1, "-1", " 3", "٣"):
        with pytest.raises(InvalidArgument, match="^update_info.version: "):
            parse_version(bad)
    from rollout_agent.pull.puller import WeightPuller
    from weightsync.client import CoordinatorClient

    with CoordinatorClient("127.0.0.1:1") as client:  # never dialled: refused first
        puller = WeightPuller(client, "job", "r0", mode="grpc")
        for bad in (-1, 1 << 64, 2.0):
            with pytest.raises(InvalidArgument, match="^version: "):
                puller.fetch_manifest(bad)  # type: ignore[arg-type]
        puller.close()


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"session": "Bad Name"}, "session"),
        ({"agent_id": ""}, "agent_id"),
        ({"streams": 0}, "streams"),
        ({"window_chunks": 1 << 40}, "window_chunks"),
        ({"max_attempts": float("nan")}, "max_attempts"),
        ({"timeout_s": -1.0}, "timeout_s"),
        ({"timeout_s": float("inf")}, "timeout_s"),
        ({"mode": "fs"}, "fs_root"),
        ({"mode": "fs", "fs_root": "bogus://x"}, "fs_root"),
        ({"mode": "carrier-pigeon"}, "mode"),
    ],
)
def test_a_puller_built_from_python_refuses_what_its_sidecar_settings_refuse(kwargs: dict, field: str) -> None:
    """WeightPuller is the library half a vLLM worker builds: its arguments are refused as
    the sidecar's settings refuse them, as InvalidArgument naming the field (a session name
    the coordinator refuses, an infinite timeout among them), not as bare `ValueError`s."""
    from rollout_agent.pull.puller import WeightPuller
    from weightsync.client import CoordinatorClient

    args = {"session": "job", "agent_id": "r0", **kwargs}
    with CoordinatorClient("127.0.0.1:1") as client, pytest.raises(InvalidArgument) as e:
        WeightPuller(client, args.pop("session"), args.pop("agent_id"), **args)
    assert e.value.field == field, e.value
