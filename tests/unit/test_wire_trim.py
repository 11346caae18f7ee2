"""The publish's requests and protobuf's malloc_trim: protobuf's Python module (upb) calls
glibc's `malloc_trim(0)` on every 10,000th block it frees, and on a trainer's heap (after
XLA's compile: ~300,000 free chunks) a trim held the interpreter lock for ~200 ms on a TPU
host. Counted here with a shim preloaded into a child interpreter that counts the calls
(`dlsym(RTLD_NEXT)` passes each on): building and serializing a 0.6b-sized part's requests
version after version must bring almost none, where a message per descriptor brought one
every few versions."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import google.protobuf as protobuf
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.unit.helpers import make_part, python_path, sample_arrays
from weightsync._proto import types_pb2 as tpb
from weightsync.manifest import ChunkSpec, DeltaChunkSpec, Part, PartDelta, ShardSpec, TensorSpec
from weightsync.wire import PartBuilder, part_to_batches

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
sys.path.insert(0, str(BENCH))
from descriptor_trim import per_descriptor_batches  # noqa: E402

SHIM = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stddef.h>
static int calls;
int malloc_trim(size_t pad) {
    static int (*real)(size_t);
    if (!real) real = (int (*)(size_t))dlsym(RTLD_NEXT, "malloc_trim");
    calls++;
    return real ? real(pad) : 0;
}
int trim_calls(void) { return calls; }
"""

CHILD = r"""
import ctypes, json, sys
from descriptor_trim import WAYS, requests, synthetic_part, version_of

build, part = WAYS[sys.argv[1]], synthetic_part("0.6b")
count = ctypes.CDLL(None).trim_calls
before = count()
for v in range(1, int(sys.argv[2]) + 1):  # fresh digests every version, as a publish has
    sent = requests(build, version_of(part, v))
print(json.dumps({"trims": count() - before, "requests": len(sent)}))
"""


@pytest.fixture(scope="module")
def shim(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the counting shim")
    src = tmp_path_factory.mktemp("trim") / "count_trim.c"
    src.write_text(SHIM)
    lib = src.with_suffix(".so")
    subprocess.run([cc, "-shared", "-fPIC", "-O2", "-o", str(lib), str(src), "-ldl"], check=True)
    return lib


def _trims(shim: Path, way: str, versions: int) -> dict[str, int]:
    env = {**os.environ, "LD_PRELOAD": str(shim), "PYTHONPATH": python_path(ROOT, BENCH)}
    out = subprocess.run(
        [sys.executable, "-c", CHILD, way, str(versions)], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_publishs_requests_bring_protobufs_malloc_trim_almost_never(shim: Path) -> None:
    # the control: a message per descriptor, as the requests were built before
    old = _trims(shim, "per-descriptor", 60)
    if old["trims"] == 0:  # protobuf 7.36.2's module trims; a release that stops would make this moot
        pytest.skip(f"protobuf {protobuf.__version__}'s Python module calls no malloc_trim")
    assert old["trims"] >= 4, old  # one trim every few versions
    new = _trims(shim, "in-place", 60)
    assert new["requests"] == old["requests"] == 2  # a batch and the seal
    assert new["trims"] <= 1, new


def test_batches_built_in_place_are_the_messages_a_descriptor_each_would_make() -> None:
    """Two versions of one layout (the second from the kept placement, its digests its own),
    and the same split over batches of one and of three descriptors each kind."""
    for seed in (0, 1):
        arrays = {k: v + seed for k, v in sample_arrays().items()}
        part, _ = make_part(arrays, rank=2, chunk_bytes=256)
        (whole,) = per_descriptor_batches(part)
        assert list(part_to_batches(part)) == [whole]
        for n in (1, 3):
            merged = tpb.DescriptorBatch(rank=2)
            for batch in part_to_batches(part, n):
                assert batch.rank == 2 and max(len(batch.tensors), len(batch.shards), len(batch.chunks)) <= n
                merged.MergeFrom(batch)
            assert merged == whole


_u64 = st.integers(0, (1 << 64) - 1)
_u32 = st.integers(0, (1 << 32) - 1)


@st.composite
def _parts(draw: st.DrawFn) -> Part:
    """Parts of random counts, shapes, placements and digests, a delta or none."""
    n = draw(st.integers(0, 9))
    shapes = draw(st.lists(st.lists(st.integers(1, 9), min_size=1, max_size=3), min_size=n, max_size=n))
    tensors = tuple(
        TensorSpec(f"t{i}", draw(st.sampled_from(["float32", "bfloat16"])), tuple(s)) for i, s in enumerate(shapes)
    )
    shards = tuple(
        ShardSpec(t.name, (0,) * len(t.shape), t.shape, draw(_u64), draw(_u64), draw(_u64), draw(st.floats(-1e9, 1e9)))
        for t in tensors
    )
    chunks = tuple(ChunkSpec(i, draw(_u64), draw(_u64), draw(_u64)) for i in range(draw(st.integers(0, 9))))
    delta = None
    if draw(st.booleans()):
        deltas = tuple(
            DeltaChunkSpec(len(chunks) + i, draw(_u32), draw(_u64), draw(_u64), draw(_u64))
            for i in range(draw(st.integers(0, 7)))
        )
        delta = PartDelta(3, "d" * 64, draw(_u64), deltas, tuple(draw(st.lists(_u32, max_size=7))))
    return Part(1, 0, 4096, tensors, shards, chunks, delta=delta)


@settings(max_examples=60, deadline=None)
@given(parts=st.lists(_parts(), min_size=1, max_size=3), batch_items=st.integers(1, 12))
def test_any_part_comes_back_whole_from_its_batches(parts: list[Part], batch_items: int) -> None:
    """One after another (the kept placements reused where layouts repeat), each part's
    batches give back every descriptor, digests included, in order."""
    for part in parts + parts:
        builder = PartBuilder(1, max_items=1 << 20)
        for batch in part_to_batches(part, batch_items):
            builder.add(batch)
        assert tuple(builder.tensors) == part.tensors and tuple(builder.shards) == part.shards
        assert tuple(builder.chunks) == part.chunks
        assert tuple(builder.delta_chunks) == (part.delta.chunks if part.delta else ())
        assert tuple(builder.raw) == (part.delta.raw if part.delta else ())
