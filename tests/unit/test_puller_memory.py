"""Puller, assembly and DictApplier over the in-memory transport (no sockets)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import pytest

from rollout_agent.engines.applier import layer_groups
from rollout_agent.engines.dict_applier import DictApplier
from rollout_agent.pull.assembly import assemble, digest_all, first_difference
from rollout_agent.pull.puller import WeightPuller
from tests.unit.helpers import make_part, row_shards, sample_arrays
from weightsync._proto import coordinator_pb2 as cpb
from weightsync.errors import DigestMismatch, TransportUnavailable, VersionNotFound
from weightsync.manifest import Manifest, Part
from weightsync.transports import memory


class BufferSource:
    """ChunkSource over staged buffers; can corrupt the first N reads of each chunk."""

    def __init__(self, part: Part, buf: np.ndarray, version: int, corrupt_reads: int = 0) -> None:
        self.part, self.buf, self.version = part, buf, version
        self.corrupt_left: dict[int, int] = {c.index: corrupt_reads for c in part.chunks}
        self.reads = 0

    def check_read(self, session: str, version: int, rank: int, indices: Sequence[int]) -> None:
        if version != self.version:
            raise VersionNotFound(f"version {version} not here")

    def chunk_view(self, session: str, version: int, rank: int, index: int) -> tuple[int, memoryview]:
        self.reads += 1
        c = self.part.chunks[index]
        data = bytearray(self.buf[c.offset : c.offset + c.length].tobytes())
        if self.corrupt_left[index] > 0:
            self.corrupt_left[index] -= 1
            data[len(data) // 2] ^= 0x40
        return c.offset, memoryview(bytes(data))


@pytest.fixture
def sources() -> Iterator[dict[str, BufferSource]]:
    yield memory.SOURCES  # type: ignore[misc]
    memory.SOURCES.clear()


def setup_version(
    sources: dict, world: int, corrupt_reads: int = 0, chunk_bytes: int = 4096
) -> tuple[Manifest, dict[str, np.ndarray]]:
    arrays = sample_arrays()
    parts = []
    for r in range(world):
        part, buf = make_part(row_shards(arrays, r, world), rank=r, chunk_bytes=chunk_bytes, address=f"mem-{r}:1")
        sources[part.endpoint.address] = BufferSource(part, buf, 1, corrupt_reads)
        parts.append(part)
    return Manifest("job", 1, 1, chunk_bytes, tuple(parts)), arrays


def puller(**kw: object) -> WeightPuller:
    return WeightPuller(None, "job", "r0", mode="memory", **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("world", [1, 2, 3])
def test_multi_rank_pull_assembles_bit_exactly(sources: dict, world: int) -> None:
    m, arrays = setup_version(sources, world)
    pulled = puller(streams=2, window_chunks=1).pull(cpb.ManifestHeader(), m)
    tensors = assemble(m, pulled.buffers)
    for name, a in arrays.items():
        assert tensors[name].dtype == a.dtype and np.array_equal(tensors[name], a)
    assert first_difference(m, digest_all(m, tensors)) is None
    assert pulled.bytes_pulled == m.total_bytes and pulled.chunk_retries == 0


def test_corrupted_chunks_are_refetched(sources: dict) -> None:
    m, arrays = setup_version(sources, 2, corrupt_reads=1)
    pulled = puller(max_attempts=2).pull(cpb.ManifestHeader(), m)
    assert pulled.chunk_retries == sum(len(p.chunks) for p in m.parts)
    tensors = assemble(m, pulled.buffers)
    assert all(np.array_equal(tensors[n], a) for n, a in arrays.items())


def test_persistently_bad_chunk_gives_data_loss(sources: dict) -> None:
    m, _ = setup_version(sources, 1, corrupt_reads=5)
    with pytest.raises(DigestMismatch, match="failed after 3 attempts"):
        puller(max_attempts=3).pull(cpb.ManifestHeader(), m)


def test_flipped_assembled_byte_is_found_before_apply(sources: dict) -> None:
    m, _ = setup_version(sources, 2)
    tensors = assemble(m, puller().pull(cpb.ManifestHeader(), m).buffers)
    name = "model.norm.weight"
    tensors[name].view(np.uint8)[3] ^= 1
    problem = first_difference(m, digest_all(m, tensors))
    assert problem is not None and name in problem


def test_dict_applier_reuses_buffers_and_drops_stale_names() -> None:
    applier = DictApplier()
    a = {
        "x.layers.0.q": np.ones(4, np.float32),
        "x.layers.0.k": np.ones(2, np.float32),
        "x.norm": np.zeros(3, np.float32),
    }
    specs = dict.fromkeys(a)
    applier.begin_update(1, specs)  # type: ignore[arg-type]
    for group in layer_groups(a):
        applier.apply([(n, a[n]) for n in group])
    assert sorted(applier.commit_update(1)) == sorted(a)
    kept = applier.weights["x.layers.0.q"]
    applier.begin_update(2, {"x.layers.0.q": None})  # type: ignore[dict-item]
    applier.apply([("x.layers.0.q", np.full(4, 2, np.float32))])
    applier.commit_update(2)
    assert applier.weights["x.layers.0.q"] is kept and kept[0] == 2
    assert list(applier.weights) == ["x.layers.0.q"]
    assert layer_groups(["m.layers.1.a", "m.norm", "m.layers.1.b", "m.layers.10.a"]) == [
        ["m.layers.1.a", "m.layers.1.b"],
        ["m.norm"],
        ["m.layers.10.a"],
    ]


def test_streaming_pulls_distant_tensors_of_one_group_as_separate_runs() -> None:
    from rollout_agent.sync.streaming import _run_of, _runs

    spans = {
        "model.embed_tokens.weight": {0: (0, 3), 1: (0, 1)},
        "model.norm.weight": {0: (100, 100), 1: (50, 50)},
        "lm_head.weight": {0: (4, 9)},  # adjacent to the embedding: one run
    }
    runs = _runs(spans)
    assert runs == [(0, 0, 9), (0, 100, 100), (1, 0, 1), (1, 50, 50)]
    assert _run_of(runs, 0, 100) == (0, 100) and _run_of(runs, 0, 5) == (0, 0)


def test_a_relay_source_serves_only_verified_chunks_through_any_server(sources: dict) -> None:
    # One ChunkSource protocol: a relay's buffers are served by the same read path as the
    # trainer's arena (here the in-memory server), chunk by chunk as they verify.
    from rollout_agent.pull.relay import RelaySource

    arrays = sample_arrays()
    part, staged = make_part(arrays, chunk_bytes=4096, address="mem-relay:1")
    m = Manifest("job", 1, 1, 4096, (part,))
    relay = RelaySource("job", wait_s=0.2)
    held = np.zeros_like(staged)
    relay.begin(m, "token", {0: held})
    with pytest.raises(TransportUnavailable, match="chunk 0"):  # not verified here yet
        relay.chunk_view("job", 1, 0, 0)
    held[:] = staged
    relay.mark(1, 0, [c.index for c in part.chunks])
    sources["mem-relay:1"] = relay
    pulled = puller().pull(cpb.ManifestHeader(), m)
    tensors = assemble(m, pulled.buffers)
    assert all(np.array_equal(tensors[n], a) for n, a in arrays.items())
