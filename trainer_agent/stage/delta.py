"""Delta publishing: a version staged against the previous one in another arena slot (the
host path, in the native shim's staging pass), its changed chunks encoded; packed here
into what a `PartDelta` describes and the slot table serves beside the full chunks."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from weightsync.digests import xxh3
from weightsync.manifest import ChunkSpec, DeltaChunkSpec, PartDelta

DELTA_MODES = ("off", "auto")
# A chunk whose encoding would pass this fraction of its bytes goes raw. Measured encodings
# are ~2% of the bytes at lr 1e-6 and ~16% at 1e-5 (make bench-delta); the staging pass
# needs this fraction of the slot as scratch.
CHUNK_CAP = 0.25


@dataclass(frozen=True)
class StagedDelta:
    """A part's delta: its descriptors and the encoded bytes they index, back to back."""

    part: PartDelta
    data: np.ndarray  # uint8
    raw_bytes: int = 0  # of the chunks that go raw

    @property
    def wire_bytes(self) -> int:
        """What a rollout holding the base pulls: the encodings and the raw chunks."""
        return self.part.total_bytes + self.raw_bytes


def pack_delta(
    chunks: Sequence[ChunkSpec], encodings: Sequence[bytes | None], base_version: int, base_manifest_digest: str
) -> StagedDelta:
    """The delta of one staged part from the staging pass's per-chunk encodings (None: the
    chunk goes raw; empty: it did not change, nothing is sent for it)."""
    n = len(chunks)
    specs: list[DeltaChunkSpec] = []
    pieces: list[bytes] = []
    raw: list[int] = []
    pos = raw_bytes = 0
    for c, enc in zip(chunks, encodings, strict=True):
        if enc is None:
            raw.append(c.index)
            raw_bytes += c.length
        elif enc:
            specs.append(DeltaChunkSpec(n + len(specs), c.index, pos, len(enc), xxh3(enc)))
            pieces.append(enc)
            pos += len(enc)
    data = np.frombuffer(b"".join(pieces), np.uint8) if pieces else np.empty(0, np.uint8)
    return StagedDelta(PartDelta(base_version, base_manifest_digest, pos, tuple(specs), tuple(raw)), data, raw_bytes)
