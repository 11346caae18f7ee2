"""Descriptor-only manifests for control-plane tests and benchmarks: parts with no bytes
behind them (the coordinator checks structure, never weight bytes) and the handshake a
rollout that applied them exactly would send."""

from __future__ import annotations

import random

from weightsync._proto import coordinator_pb2 as pb
from weightsync._proto import types_pb2 as tpb
from weightsync.layout import place_shards, plan_chunks
from weightsync.manifest import ChunkSpec, Endpoint, Manifest, Part, ShardSpec, TensorSpec


def synthetic_part(tensors: int, *, rank: int = 0, chunk_bytes: int = 1 << 20, seed: int = 0) -> Part:
    """A rank's descriptors for `tensors` small fp32 tensors (no bytes behind them: the
    coordinator checks structure, never weight bytes)."""
    rng = random.Random(seed)
    specs = tuple(TensorSpec(f"model.layers.{i // 8}.w{i % 8}.weight", "float32", (16,)) for i in range(tensors))
    offsets, total = place_shards([64] * tensors)
    shards = tuple(ShardSpec(t.name, (0,), (16,), off, 64, rng.getrandbits(64), 0.0) for t, off in zip(specs, offsets))
    chunks = tuple(
        ChunkSpec(i, off, length, rng.getrandbits(64))
        for i, (off, length) in enumerate(plan_chunks(total, chunk_bytes, [(s.offset, s.nbytes) for s in shards]))
    )
    return Part(rank, total, chunk_bytes, specs, shards, chunks, Endpoint("127.0.0.1:1"))


def good_report(session: str, version: int, manifest_digest: str, manifest: Manifest) -> pb.ReportAppliedRequest:
    """What a rollout that applied `manifest` exactly would report."""
    digests, sums = manifest.tensor_digests(), manifest.tensor_sums()
    agg = manifest.aggregates()
    return pb.ReportAppliedRequest(
        session=session,
        version=version,
        manifest_digest=manifest_digest,
        tensors=[pb.TensorDigest(name=n, xxh3=digests[n], sum=sums[n]) for n in manifest.tensors],
        aggregates=tpb.Aggregates(
            grand_total=agg.grand_total, tensor_count=agg.tensor_count, element_count=agg.element_count
        ),
        consumed_names=list(manifest.tensors),
    )
