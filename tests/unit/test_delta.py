"""The 16-bit delta codec (native/delta.cc): rebuilt bytes equal the new version bit for bit,
whatever changed; a broken encoding is refused, never half-trusted."""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer_agent.update_model import AdamSteps, initial_weights
from weightsync import native
from weightsync.errors import DataLoss, InvalidArgument

pytestmark = pytest.mark.skipif(not native.available(), reason=native.missing_reason())

SPECIAL = [
    0x0000,
    0x8000,
    0x7F80,
    0xFF80,
    0x7FC0,
    0xFFC1,
    0x0001,
    0x8001,
    0x7F7F,
    0x3F80,
]  # +-0, +-inf, NaNs, subnormals


def reference_encode(base: np.ndarray, now: np.ndarray) -> bytes:
    """The encoding, spelled out: LEB128 gap of unchanged elements, then a step byte (the
    int16 difference when in [-127, 127]) or 0x80 + the new pattern, little-endian."""
    out = bytearray()
    last = 0
    for i in np.flatnonzero(base != now):
        gap = int(i) - last
        while gap >= 0x80:
            out.append((gap & 0x7F) | 0x80)
            gap >>= 7
        out.append(gap)
        step = (int(now[i]) - int(base[i])) & 0xFFFF
        step -= 0x10000 if step >= 0x8000 else 0
        if -127 <= step <= 127:
            out.append(step & 0xFF)
        else:
            out += bytes([0x80, int(now[i]) & 0xFF, int(now[i]) >> 8])
        last = int(i) + 1
    return bytes(out)


@st.composite
def versions(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray]:
    """(base, new) uint16 patterns: a size, a fraction changed (0 and 1 included), steps
    of +-1 ulp, larger ones and special patterns."""
    n = draw(st.integers(0, 3000))
    seed = draw(st.integers(0, 2**32 - 1))
    fraction = draw(st.sampled_from([0.0, 0.001, 0.03, 0.2, 0.7, 1.0]))
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 2**16, n, dtype=np.uint16)
    if n:
        base[rng.integers(0, n, max(1, n // 50))] = rng.choice(SPECIAL, max(1, n // 50))
    new = base.copy()
    pick = rng.random(n) < fraction
    kind = rng.integers(0, 4, n)
    new[pick & (kind == 0)] += np.uint16(1)
    new[pick & (kind == 1)] -= np.uint16(1)
    new[pick & (kind == 2)] = rng.integers(0, 2**16, int((pick & (kind == 2)).sum()), dtype=np.uint16)
    new[pick & (kind == 3)] = rng.choice(SPECIAL, int((pick & (kind == 3)).sum()))
    return base, new


@settings(max_examples=200, deadline=None)
@given(versions())
def test_the_rebuilt_bytes_equal_the_new_version_and_the_encoding_is_the_reference(
    pair: tuple[np.ndarray, np.ndarray],
) -> None:
    base, new = pair
    want = reference_encode(base, new)
    enc, changed = native.delta16_encode(base, new, cap=4 * base.size)  # room for any encoding
    assert enc == want
    assert changed == int((base != new).sum())
    # by default never more than the raw bytes: larger encodings are refused
    assert native.delta16_encode(base, new)[0] == (want if len(want) <= new.nbytes else None)
    rebuilt = base.copy()
    native.delta16_decode(rebuilt, enc)
    assert rebuilt.tobytes() == new.tobytes()


def test_bf16_special_values_round_trip_by_bit_pattern() -> None:
    base = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-40, 1.0], ml_dtypes.bfloat16)
    new = np.array([-0.0, 0.0, -np.inf, np.nan, np.inf, -1e-40, 1.0078125], ml_dtypes.bfloat16)
    enc, changed = native.delta16_encode(base, new, cap=64)
    assert changed == 7  # -0.0 != 0.0 and NaN vs NaN payloads compare as bits, not as floats
    rebuilt = base.copy()
    native.delta16_decode(rebuilt, enc)
    assert rebuilt.view(np.uint16).tobytes() == new.view(np.uint16).tobytes()
    assert native.delta16_encode(new, new.copy())[0] == b""  # nothing changed: nothing to send


def test_an_encoding_over_the_cap_is_refused_so_the_raw_bytes_go_instead() -> None:
    base = np.zeros(1000, np.uint16)
    new = base + np.uint16(1)  # every element: 1000 x (gap 0, step 1) = 2000 bytes
    assert native.delta16_encode(base, new, cap=1999)[0] is None
    assert len(native.delta16_encode(base, new, cap=2000)[0]) == 2000


@pytest.mark.parametrize(
    ("enc", "why"),
    [
        (b"\x05", "truncated after a gap"),
        (b"\x80\x80", "truncated varint"),
        (b"\x0a\x01", "a change past the end"),
        (b"\x00\x80\x01", "truncated escape"),
        (b"\x00\x00", "a step of 0"),
        (b"\x09\x01\x00\x01", "a change past the end after one inside"),
        (b"\xff" * 11 + b"\x01", "overlong varint"),
    ],
)
def test_a_broken_encoding_is_data_loss(enc: bytes, why: str) -> None:
    buf = np.zeros(10, np.uint16)
    with pytest.raises(DataLoss):
        native.delta16_decode(buf, enc)


def test_arguments_are_checked() -> None:
    with pytest.raises(InvalidArgument, match="now"):
        native.delta16_encode(np.zeros(4, np.uint16), np.zeros(5, np.uint16))
    with pytest.raises(InvalidArgument, match="base"):
        native.delta16_encode(np.zeros(4, np.float32), np.zeros(4, np.float32))
    with pytest.raises(InvalidArgument, match="buf"):
        native.delta16_decode(np.zeros(4, np.uint16)[::2], b"")


def test_the_update_model_moves_a_few_percent_of_bf16_elements_per_step() -> None:
    shapes = {"model.layers.0.mlp.up_proj.weight": (512, 256), "model.norm.weight": (256,)}
    initial = initial_weights(shapes, ml_dtypes.bfloat16, seed=0)
    assert abs(float(initial["model.norm.weight"].astype(np.float32).mean()) - 1.0) < 0.01
    steps = AdamSteps(initial, 1e-5, seed=1)
    before, after = steps.step(), steps.step()
    assert all(v.dtype == ml_dtypes.bfloat16 for v in after.values())
    assert all(v.dtype == np.float32 for v in steps.master.values()) and steps.steps == 2
    moved = np.mean(
        before["model.layers.0.mlp.up_proj.weight"].view(np.uint16)
        != after["model.layers.0.mlp.up_proj.weight"].view(np.uint16)
    )
    assert 0.05 < moved < 0.35  # ~15% at lr 1e-5 (README "Delta"); most values do not move
    assert 0.05 < steps.changed < 0.35  # counted by the step itself, over every tensor
    with pytest.raises(ValueError, match="lr"):
        AdamSteps(initial, 0.0)


@st.composite
def staged_versions(draw: st.DrawFn) -> tuple[list[tuple[np.ndarray, np.ndarray, int]], list[int], int]:
    """Two versions of a few tensors (bf16 patterns, and odd-sized int8 ones whose words
    straddle the alignment gaps), placed with gaps, and a chunk plan of even lengths."""
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    fraction = draw(st.sampled_from([0.0, 0.02, 0.3, 1.0]))
    tensors, offset = [], 0
    for _ in range(draw(st.integers(1, 6))):
        offset += int(rng.integers(0, 40)) * 2
        if rng.random() < 0.3:
            old = rng.integers(-128, 128, int(rng.integers(1, 200)), dtype=np.int8)
        else:
            old = rng.integers(0, 2**16, int(rng.integers(1, 5000)), dtype=np.uint16).view(ml_dtypes.bfloat16)
        new = old.copy()
        bits = new.view(np.uint8 if new.itemsize == 1 else np.uint16)
        pick = rng.random(bits.size) < fraction
        bits[pick] += 1
        tensors.append((old, new, offset))
        offset += old.nbytes
    total = offset + int(rng.integers(0, 20)) * 2 + (offset % 2)
    cuts = (
        sorted({int(c) * 2 for c in rng.integers(1, total // 2, int(rng.integers(0, 6)))} - {0, total})
        if total > 2
        else []
    )
    bounds = [0, *cuts, total]
    return tensors, [b - a for a, b in zip(bounds, bounds[1:])], total


@settings(max_examples=150, deadline=None)
@given(staged_versions(), st.sampled_from([0.0, 0.5, 1.0]))
def test_staging_with_a_base_encodes_each_chunk_as_the_codec_does(case, cap: float) -> None:  # noqa: ANN001
    """The fused pass stages exactly as without a base, and each chunk's delta rebuilds the
    new chunk from the base chunk; a chunk over its cap goes raw (None)."""
    tensors, chunk_lengths, total = case
    code = {np.dtype(np.int8): 5}
    old_slot, new_slot, plain = (np.full(total + 8, 0xAB, np.uint8) for _ in range(3))
    sources = lambda which: [(t[which], t[2], code.get(t[0].dtype, 3)) for t in tensors]  # noqa: E731
    native.stage(old_slot, total, chunk_lengths, 4096, sources(0))
    fused = native.stage(new_slot, total, chunk_lengths, 4096, sources(1), base=old_slot, delta_cap=cap)
    alone = native.stage(plain, total, chunk_lengths, 4096, sources(1))
    assert new_slot[:total].tobytes() == plain[:total].tobytes()
    assert fused.chunk_digests.tolist() == alone.chunk_digests.tolist()
    assert fused.span_digests.tolist() == alone.span_digests.tolist()
    assert fused.chunk_deltas is not None and len(fused.chunk_deltas) == len(chunk_lengths)
    start = 0
    for length, enc in zip(chunk_lengths, fused.chunk_deltas):
        old_words = old_slot[start : start + length].view(np.uint16)
        new_words = new_slot[start : start + length].view(np.uint16)
        want = native.delta16_encode(old_words, new_words, cap=int(length * cap))[0]
        assert enc == want
        if enc is not None:
            rebuilt = old_words.copy()
            native.delta16_decode(rebuilt, enc)
            assert rebuilt.tobytes() == new_words.tobytes()
        start += length


def test_staging_with_a_base_refuses_odd_chunks_and_a_short_base() -> None:
    a = np.ones(50, np.uint16).view(ml_dtypes.bfloat16)
    slot = np.zeros(128, np.uint8)
    with pytest.raises(InvalidArgument, match="chunk_lengths"):
        native.stage(slot, 100, [51, 49], 4096, [(a, 0, 3)], base=np.zeros(128, np.uint8))
    with pytest.raises(InvalidArgument, match="base"):
        native.stage(slot, 100, [100], 4096, [(a, 0, 3)], base=np.zeros(64, np.uint8))
    with pytest.raises(InvalidArgument, match="base"):  # the slot being staged cannot be its own base
        native.stage(slot, 100, [100], 4096, [(a, 0, 3)], base=slot)


@dataclass
class RebuildCase:
    """A staged pair as a rollout gets it: the base slot (raw chunks already in place), the
    new slot it must become, the encodings back to back, (chunk, offset, length) of each
    encoded chunk, and the spans as the manifest describes them."""

    chunk_lengths: list[int]
    base: np.ndarray
    new: np.ndarray
    enc: np.ndarray
    encoded: list[tuple[int, int, int]]
    spans: list[tuple[int, int, int]]
    staged: native.StageResult  # staging's digests of the new version

    def rebuild(self) -> tuple[np.ndarray, native.RebuildResult]:
        buf = self.base.copy()
        return buf, native.rebuild_digest(buf, self.chunk_lengths, 4096, self.spans, self.enc, self.encoded)


def _rebuild_case(case) -> RebuildCase:  # noqa: ANN001
    tensors, chunk_lengths, total = case
    code = {np.dtype(np.int8): 5}
    old_slot, new_slot = np.zeros(total, np.uint8), np.zeros(total, np.uint8)
    sources = lambda which: [(t[which], t[2], code.get(t[0].dtype, 3)) for t in tensors]  # noqa: E731
    native.stage(old_slot, total, chunk_lengths, 4096, sources(0))
    fused = native.stage(new_slot, total, chunk_lengths, 4096, sources(1), base=old_slot, delta_cap=1.0)
    assert fused.chunk_deltas is not None
    encoded, pieces, pos, start = [], [], 0, 0
    for i, (enc, length) in enumerate(zip(fused.chunk_deltas, chunk_lengths)):
        if enc is None:  # a raw chunk lands whole, as a rollout fetches it
            old_slot[start : start + length] = new_slot[start : start + length]
        start += length
        if enc:
            encoded.append((i, pos, len(enc)))
            pieces.append(enc)
            pos += len(enc)
    spans = [(offset, arr.nbytes, dtype) for arr, offset, dtype in sources(0)]
    enc = np.frombuffer(b"".join(pieces), np.uint8).copy()
    return RebuildCase(chunk_lengths, old_slot, new_slot, enc, encoded, spans, fused)


@settings(max_examples=150, deadline=None)
@given(staged_versions())
def test_a_rebuild_digests_what_staging_digested(case) -> None:  # noqa: ANN001
    """The rollout's one pass (decode each block's changes, then sum and hash it) leaves the
    new version's bytes and the digests and sums staging made of them."""
    c = _rebuild_case(case)
    buf, result = c.rebuild()
    assert result.broken == []
    assert buf.tobytes() == c.new.tobytes()
    assert result.chunk_digests.tolist() == c.staged.chunk_digests.tolist()
    assert result.span_digests.tolist() == c.staged.span_digests.tolist()
    assert np.allclose(result.span_sums, c.staged.span_sums, equal_nan=True)


@settings(max_examples=150, deadline=None)
@given(staged_versions(), st.data())
def test_a_corrupted_encoding_marks_its_chunk_broken_or_its_digest_differs(case, data) -> None:  # noqa: ANN001
    """A flipped byte in one chunk's encoding never touches another chunk: that chunk is
    reported broken, or its digest differs from staging's (the tensor check's catch), or
    the flip happened to rebuild the same bytes."""
    c = _rebuild_case(case)
    if not c.encoded:
        return
    chunk, offset, length = c.encoded[data.draw(st.integers(0, len(c.encoded) - 1))]
    c.enc[offset + data.draw(st.integers(0, length - 1))] ^= data.draw(st.integers(1, 255))
    buf, result = c.rebuild()
    bounds = np.concatenate([[0], np.cumsum(c.chunk_lengths)])
    lo, hi = int(bounds[chunk]), int(bounds[chunk + 1])
    assert buf[:lo].tobytes() == c.new[:lo].tobytes() and buf[hi:].tobytes() == c.new[hi:].tobytes()
    assert set(result.broken) <= {chunk}
    if not result.broken:
        same = buf[lo:hi].tobytes() == c.new[lo:hi].tobytes()
        assert same == (int(result.chunk_digests[chunk]) == int(c.staged.chunk_digests[chunk]))


def test_a_rebuild_decodes_across_the_blocks_of_a_large_chunk() -> None:
    """Changes at the edges of the pass's 256 KiB blocks land before each block is hashed."""
    old = np.random.default_rng(3).integers(0, 2**16, 1 << 20, dtype=np.uint16)
    new = old.copy()
    block = (256 << 10) // 2
    for i in (0, block - 1, block, 3 * block + 7, new.size - 1):
        new[i] += 1
    enc, _ = native.delta16_encode(old, new)
    assert enc is not None
    buf = old.view(np.uint8).copy()
    spans = [(0, buf.nbytes, 3)]
    result = native.rebuild_digest(
        buf, [buf.nbytes], buf.nbytes, spans, np.frombuffer(enc, np.uint8), [(0, 0, len(enc))]
    )
    assert buf.tobytes() == new.tobytes() and result.broken == []
    assert int(result.span_digests[0]) == int(native.digest_arrays([(new.view(np.uint8), 3)], buf.nbytes)[0][0])


def test_rebuild_arguments_are_checked() -> None:
    buf = np.zeros(64, np.uint8)
    with pytest.raises(InvalidArgument, match="chunk_lengths"):
        native.rebuild_digest(buf, [33, 31], 4096, [], np.zeros(4, np.uint8), [])
    with pytest.raises(InvalidArgument, match="encoded"):
        native.rebuild_digest(buf, [64], 4096, [], np.zeros(4, np.uint8), [(1, 0, 4)])
    with pytest.raises(InvalidArgument):  # an encoding past the end of the encodings
        native.rebuild_digest(buf, [64], 4096, [], np.zeros(4, np.uint8), [(0, 2, 4)])
    with pytest.raises(InvalidArgument):  # spans overlap
        native.rebuild_digest(buf, [64], 4096, [(0, 32, 3), (16, 32, 3)], np.zeros(4, np.uint8), [])
