"""What protobuf's malloc_trim costs a publish on a trainer's heap.

Protobuf's Python module (upb) calls glibc's `malloc_trim(0)` on every 10,000th block it
frees. A trim walks every free chunk of every arena in the process (and gives their whole
pages back to the kernel, to be faulted in again), holding each arena's lock in turn and,
called from Python code, the interpreter lock. After XLA's compile a trainer's heap holds
~294,000 free chunks (glibc's count on a v5e host, `bench/train_overlap.py`'s heap_at_end).

This builds a 0.6b-sized part's PublishVersion requests (the descriptor batches and the
seal, serialized as `CoordinatorClient.publish_part` does) version after version, fresh
digests each time, on a worker thread whose glibc arena first gets `--free-chunks` free
chunks between live ones (0: a clean heap). Ways, interleaved (ABAB, `--rounds`):

  per-descriptor  a message per descriptor copied into its batch (the requests before)
  in-place        `weightsync.wire.part_to_batches`: descriptors added in place, the
                  tensors and the shards' placement copied from a batch kept per layout

Prints, per way, the median and longest build (ms a version), the versions that took over
10 times the in-place median (trims land there), and the mean against the in-place mean,
as one JSON object (also to `--out`).

    python bench/descriptor_trim.py                      # 300,000 free chunks, 60 versions a round
    python bench/descriptor_trim.py --free-chunks 0      # a clean heap
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import math
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import emit_json, on_thread  # noqa: E402

from trainer_agent.device.host_heap import libc_function  # noqa: E402
from weightsync._proto import types_pb2 as tpb  # noqa: E402
from weightsync.dtypes import dtype_info  # noqa: E402
from weightsync.layout import DEFAULT_CHUNK_BYTES  # noqa: E402
from weightsync.manifest import ChunkSpec, Part, ShardSpec, TensorSpec  # noqa: E402
from weightsync.model_shapes import PRESETS, param_shapes  # noqa: E402
from weightsync.wire import part_to_batches, publish_requests  # noqa: E402

# free chunks of these sizes (bytes), between live ones: ~17 KB on average, as XLA's
# leftovers on the v5e host (3.9 GB free in 294,000 chunks: ~13 KB)
FRAGMENT_SIZES = (64, 256, 1024, 4096, 16384, 32768, 65536)


def per_descriptor_batches(part: Part) -> Iterator[tpb.DescriptorBatch]:
    """The part's descriptors in one batch, a message made for each and copied in (the way
    the publish's requests were built before `part_to_batches` built them in place)."""
    yield tpb.DescriptorBatch(
        rank=part.rank,
        tensors=[
            tpb.TensorDescriptor(name=t.name, dtype=dtype_info(t.dtype).proto, shape=list(t.shape))
            for t in part.tensors
        ],
        shards=[
            tpb.ShardDescriptor(
                tensor_name=s.tensor_name,
                start=list(s.start),
                stop=list(s.stop),
                offset=s.offset,
                nbytes=s.nbytes,
                xxh3=s.xxh3,
                sum=s.sum,
            )
            for s in part.shards
        ],
        chunks=[tpb.ChunkDescriptor(index=c.index, offset=c.offset, length=c.length, xxh3=c.xxh3) for c in part.chunks],
    )


WAYS: dict[str, Callable[[Part], Iterator[tpb.DescriptorBatch]]] = {
    "per-descriptor": per_descriptor_batches,
    "in-place": part_to_batches,
}


def synthetic_part(preset: str = "0.6b", chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Part:
    """A part of the preset's tensors (bf16, whole tensors as shards, laid end to end) and its
    chunks, digests zero: `version_of` gives each version its own."""
    tensors, shards, offset = [], [], 0
    for name, shape in param_shapes(PRESETS[preset]).items():
        nbytes = 2 * math.prod(shape)
        tensors.append(TensorSpec(name, "bfloat16", tuple(shape)))
        shards.append(ShardSpec(name, (0,) * len(shape), tuple(shape), offset, nbytes, 0, 0))
        offset += nbytes
    chunks = [ChunkSpec(i, o, min(chunk_bytes, offset - o), 0) for i, o in enumerate(range(0, offset, chunk_bytes))]
    return Part(0, offset, chunk_bytes, tuple(tensors), tuple(shards), tuple(chunks))


def version_of(part: Part, version: int) -> Part:
    """The same layout with digests of its own, as each staged version has."""
    return dataclasses.replace(
        part,
        shards=tuple(
            dataclasses.replace(s, xxh3=version << 20 | i, sum=version + i) for i, s in enumerate(part.shards)
        ),
        chunks=tuple(dataclasses.replace(c, xxh3=version << 20 | c.index) for c in part.chunks),
    )


def requests(build: Callable[[Part], Iterator[tpb.DescriptorBatch]], part: Part) -> list[bytes]:
    """The batches and the seal of PublishVersion's stream, serialized as the client does
    (its header aside)."""
    return [r.SerializeToString() for r in publish_requests(part, build(part))]


def fragment(free_chunks: int, seed: int = 0) -> list[int]:
    """Leaves `free_chunks` free chunks in the calling thread's arena, each between two live
    blocks (so none merges); returns the live blocks (kept for the run)."""
    malloc = libc_function("malloc", ctypes.c_void_p, ctypes.c_size_t)
    free = libc_function("free", None, ctypes.c_void_p)
    if malloc is None or free is None:
        raise SystemExit("this C library has no malloc and free to look up")
    rng = random.Random(seed)
    blocks = [malloc(rng.choice(FRAGMENT_SIZES)) for _ in range(2 * free_chunks + 1)]
    for p in blocks[1::2]:
        free(p)
    return blocks[::2]


def run(args: argparse.Namespace) -> dict[str, Any]:
    part = synthetic_part(args.preset)
    ms: dict[str, list[float]] = {w: [] for w in WAYS}

    def worker() -> None:
        _live = fragment(args.free_chunks)  # noqa: F841 (live for the run)
        version = 0
        for _ in range(args.rounds):
            for way, build in WAYS.items():
                for _ in range(args.versions):
                    version += 1
                    v = version_of(part, version)
                    t0 = time.perf_counter()
                    requests(build, v)
                    ms[way].append((time.perf_counter() - t0) * 1e3)

    on_thread(True, worker)
    base = statistics.median(ms["in-place"])
    result: dict[str, Any] = {
        "preset": args.preset,
        "tensors": len(part.tensors),
        "chunks": len(part.chunks),
        "free_chunks": args.free_chunks,
        "versions_per_way": args.versions * args.rounds,
    }
    mean_in_place = statistics.fmean(ms["in-place"])
    for way, xs in ms.items():
        result[way] = {
            "median_ms": round(statistics.median(xs), 2),
            "max_ms": round(max(xs), 1),
            "mean_ms": round(statistics.fmean(xs), 2),
            "over_10x": sum(x > 10 * base for x in xs),
            "mean_to_in_place": round(statistics.fmean(xs) / mean_in_place, 2),
        }
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="0.6b", choices=sorted(PRESETS))
    p.add_argument("--free-chunks", type=int, default=300_000, help="free chunks left in the worker's arena first")
    p.add_argument("--versions", type=int, default=30, help="versions a way builds each round")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default="", help="also write the JSON here")
    args = p.parse_args()
    if args.free_chunks < 0 or args.versions < 1 or args.rounds < 1:
        p.error("--free-chunks >= 0, --versions >= 1 and --rounds >= 1")
    r = run(args)
    for way in WAYS:
        w = r[way]
        print(
            f"{way}: median {w['median_ms']} ms, longest {w['max_ms']} ms, {w['over_10x']} of "
            f"{r['versions_per_way']} over 10x the in-place median; mean {w['mean_ms']} ms, "
            f"{w['mean_to_in_place']}x the in-place mean",
            file=sys.stderr,
        )
    emit_json(r, args.out)


if __name__ == "__main__":
    main()
