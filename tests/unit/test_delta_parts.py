"""A part's delta: staged with the previous version, packed, carried on the wire, validated
and rebuilt by the rollout's own decode (hypothesis over dtypes, shapes, change fractions
and special bit patterns); the coordinator refuses a delta on a base it does not hold."""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from coordinator.records import PublishOutcome
from coordinator.store import SessionStore
from rollout_agent.pull.puller import WeightPuller
from tests.unit.helpers import make_part
from trainer_agent.stage.delta import CHUNK_CAP, pack_delta
from trainer_agent.stage.staging import (
    Block,
    DeltaTarget,
    HostShard,
    plan_layout,
    stage_batched_delta,
    stage_blocks,
    stage_shards,
    stage_shards_delta,
)
from weightsync import native
from weightsync.errors import FailedPrecondition, InvalidArgument
from weightsync.manifest import Part
from weightsync.validation import validate_part, values_close
from weightsync.wire import PartBuilder, delta_to_proto, part_to_batches

pytestmark = pytest.mark.skipif(not native.available(), reason="the delta is encoded by the native shim")
DTYPES = [ml_dtypes.bfloat16, np.float16, np.float32, np.int8, np.uint8]
SPECIAL = np.array(
    [0x7FC0, 0xFFC0, 0x8000, 0x0000, 0x0001, 0x7F80, 0xFF80, 0x0080], np.uint16
)  # NaN, -0, subnormal, inf
BASE_DIGEST = "ab" * 32


def _changed(base: np.ndarray, fraction: float, rng: np.random.Generator, special: bool) -> np.ndarray:
    """`base` with about `fraction` of its 16-bit words moved by +-1 (or set to special
    patterns): the kind of change an optimizer step makes, and the edge cases."""
    new = base.copy()
    words = new.reshape(-1).view(np.uint8)
    words = words[: words.size - words.size % 2].view(np.uint16)
    pick = rng.random(words.size) < fraction
    words[pick] += rng.choice(np.array([1, 0xFFFF], np.uint16), int(pick.sum()))
    if special and words.size:
        words[rng.integers(0, words.size, 4)] = rng.choice(SPECIAL, 4)
    return new


def _staged_pair(arrays: dict[str, np.ndarray], new: dict[str, np.ndarray], chunk_bytes: int):  # noqa: ANN202
    """(part, per-chunk encodings, base bytes, new bytes); None when a chunk has an odd
    length (the publisher stages such a layout without a delta)."""
    shards = [HostShard(n, a, a.shape, (0,) * a.ndim) for n, a in arrays.items()]
    layout = plan_layout(shards)
    if any(n % 2 for _, n in layout.chunk_plan(chunk_bytes)):
        return None
    base = np.zeros(layout.total_bytes + 1, np.uint8)
    slot = np.zeros(layout.total_bytes + 1, np.uint8)
    stage_shards(base, shards, layout, chunk_bytes)
    new_shards = [HostShard(n, a, a.shape, (0,) * a.ndim) for n, a in new.items()]
    scratch = np.empty(int(layout.total_bytes * CHUNK_CAP) + 1, np.uint8)
    specs, chunks, encodings = stage_shards_delta(
        slot, new_shards, layout, chunk_bytes, DeltaTarget(base, scratch, CHUNK_CAP)
    )
    part = Part(0, layout.total_bytes, chunk_bytes, layout.tensors, tuple(specs), tuple(chunks))
    return part, encodings, base[: layout.total_bytes], slot[: layout.total_bytes]


@settings(max_examples=60, deadline=None)
@given(
    dtypes=st.lists(st.sampled_from(DTYPES), min_size=1, max_size=4),
    sizes=st.lists(st.integers(0, 9000), min_size=4, max_size=4),
    fraction=st.sampled_from([0.0, 0.001, 0.03, 0.2, 0.6, 1.0]),
    special=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_delta_rebuilds_the_staged_version_bit_for_bit(
    dtypes: list[type], sizes: list[int], fraction: float, special: bool, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    arrays = {
        f"t{i}": rng.standard_normal(n).astype(dt) if np.dtype(dt).kind == "f" or dt is ml_dtypes.bfloat16
        else rng.integers(-100, 100, n).astype(dt)
        for i, (dt, n) in enumerate(zip(dtypes, sizes))
    }  # fmt: skip
    new = {k: _changed(v, fraction, rng, special) for k, v in arrays.items()}
    staged_pair = _staged_pair(arrays, new, 4096)
    assume(staged_pair is not None)
    part, encodings, base, staged = staged_pair
    delta = pack_delta(part.chunks, encodings, 1, BASE_DIGEST)
    part = dataclasses.replace(part, delta=delta.part)
    validate_part(part, trainer_ranks=1)
    if fraction == 0.0 and not special:
        assert delta.wire_bytes == 0 and not delta.part.chunks  # nothing changed: nothing to send
    # The rollout's side: raw chunks land whole, delta chunks decode onto the base.
    buf = base.copy()
    for i in delta.part.raw:
        c = part.chunks[i]
        buf[c.offset : c.offset + c.length] = staged[c.offset : c.offset + c.length]
    broken, digests = WeightPuller._rebuild(part, buf, delta.data, part.chunk_bytes, {t.name for t in part.tensors})
    assert broken == []
    assert buf.tobytes() == staged.tobytes()
    for s in part.shards:  # each tensor's digest, made in the rebuild's pass, as staging made it
        assert digests[s.tensor_name][0] == s.xxh3
        assert values_close(digests[s.tensor_name][1], s.sum, int(np.prod(s.shape)))
    assert delta.wire_bytes <= part.total_bytes


def _delta_part(seed: int = 1) -> tuple[Part, Part]:
    """(base part, next part with a delta against it) of one small bf16 model: 8 chunks,
    the first 6 changed, the last 2 not."""
    rng = np.random.default_rng(seed)
    arrays = {"w": rng.standard_normal((64, 256)).astype(ml_dtypes.bfloat16)}
    new = {"w": _changed(arrays["w"], 0.05, rng, False)}
    new["w"][48:] = arrays["w"][48:]
    part, encodings, _, _ = _staged_pair(arrays, new, 4096)
    base, _ = make_part(arrays, chunk_bytes=4096)
    return base, dataclasses.replace(part, delta=pack_delta(part.chunks, encodings, 1, BASE_DIGEST).part)


def _mutate(part: Part, **kw: object) -> Part:
    assert part.delta is not None
    return dataclasses.replace(part, delta=dataclasses.replace(part.delta, **kw))


def _chunk(part: Part, i: int, **kw: object) -> tuple:
    assert part.delta is not None
    chunks = list(part.delta.chunks)
    chunks[i] = dataclasses.replace(chunks[i], **kw)
    return tuple(chunks)


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda p: _mutate(p, encoding="zstd"), "header.delta.encoding"),
        (lambda p: _mutate(p, base_version=0), "header.delta.base_version"),
        (lambda p: _mutate(p, base_manifest_digest="not-hex"), "header.delta.base_manifest_digest"),
        (lambda p: _mutate(p, total_bytes=p.delta.total_bytes + 1), "header.delta.total_bytes"),
        (lambda p: _mutate(p, chunks=_chunk(p, 0, index=0)), "part.delta.chunks[0].index"),
        (lambda p: _mutate(p, chunks=_chunk(p, 1, target=p.delta.chunks[0].target)), "part.delta.chunks[1].target"),
        (lambda p: _mutate(p, chunks=_chunk(p, 0, target=len(p.chunks))), "part.delta.chunks[0].target"),
        (lambda p: _mutate(p, chunks=_chunk(p, 1, offset=0)), "part.delta.chunks[1].offset"),
        (lambda p: _mutate(p, chunks=_chunk(p, 0, length=4096)), "part.delta.chunks[0].length"),
        (lambda p: _mutate(p, raw=(p.delta.chunks[0].target,)), "part.delta.raw[0]"),
        (lambda p: _mutate(p, raw=(len(p.chunks),)), "part.delta.raw[0]"),
        (lambda p: _mutate(p, raw=(7, 7)), "part.delta.raw[1]"),
    ],
)
def test_a_bad_delta_is_refused_naming_its_field(mutate, field: str) -> None:  # noqa: ANN001
    _, part = _delta_part()
    assert part.delta is not None and [c.target for c in part.delta.chunks] == list(range(6))
    validate_part(part, trainer_ranks=1)
    with pytest.raises(InvalidArgument) as e:
        validate_part(mutate(part), trainer_ranks=1)
    assert e.value.field == field, e.value.message


def test_a_delta_travels_the_wire_and_keeps_its_digest() -> None:
    _, part = _delta_part()
    builder = PartBuilder(0, max_items=1 << 20)
    for batch in part_to_batches(part, batch_items=3):
        builder.add(batch)
    got = builder.build(
        total_bytes=part.total_bytes, chunk_bytes=part.chunk_bytes, endpoint=part.endpoint, stage_seconds=0.0,
        delta=delta_to_proto(part.delta),
    )  # fmt: skip
    assert got == part and got.digest() == part.digest()
    assert got.digest() != dataclasses.replace(part, delta=None).digest()  # the delta is in the manifest digest
    with pytest.raises(InvalidArgument, match="header names no delta"):
        builder.build(
            total_bytes=part.total_bytes, chunk_bytes=part.chunk_bytes, endpoint=part.endpoint, stage_seconds=0
        )


def test_the_coordinator_takes_a_delta_only_on_a_base_it_holds(tmp_path: Path) -> None:
    store = SessionStore(tmp_path / "c.db", lease_ttl_s=10)
    try:
        s, _ = store.open_session("job", trainer=True, incarnation="run", trainer_ranks=1)
        base, part = _delta_part()

        def publish(v: int, p: Part) -> PublishOutcome:
            return store.publish_part("job", generation=s.generation, version=v, idempotency_key=str(v), part=p)

        with pytest.raises(FailedPrecondition, match="header.delta.base_version: version 1 is not known"):
            publish(2, part)
        publish(1, base)
        digest = store.version("job", 1).manifest_digest
        with pytest.raises(FailedPrecondition, match="header.delta.base_manifest_digest"):
            publish(2, part)  # the digest it names is not version 1's
        with pytest.raises(InvalidArgument, match="header.delta.base_version: 3 is not older"):
            publish(2, _mutate(part, base_version=3, base_manifest_digest=digest))
        other_layout, _ = make_part({"w": np.zeros(100, np.float32)}, chunk_bytes=4096)
        publish(2, other_layout)
        with pytest.raises(FailedPrecondition, match="another chunk layout"):
            publish(3, _mutate(part, base_version=2, base_manifest_digest=store.version("job", 2).manifest_digest))
        assert [v.version for v in store.versions("job")] == [2, 1]  # refused: nothing stored
        assert publish(3, _mutate(part, base_manifest_digest=digest)).version.state.value == "READY"
        (stored,) = store.parts("job", 3)
        assert stored.delta is not None and stored.delta.base_version == 1
    finally:
        store.close()


@pytest.mark.parametrize("blocks", [False, True])
def test_the_device_path_encodes_the_same_delta_batch_by_batch(blocks: bool) -> None:
    """`stage_batched_delta` (shards arriving one by one, staged in batches) and
    `stage_blocks` (shards cut into blocks of whole chunks, runs staged on a pool of
    threads) yield the bytes, specs and encodings of the one-pass host path."""
    rng = np.random.default_rng(5)
    arrays = {
        f"t{i}": rng.standard_normal(n).astype(ml_dtypes.bfloat16) for i, n in enumerate((3000, 9000, 128, 20000))
    }
    new = {k: _changed(v, 0.02, rng, True) for k, v in arrays.items()}
    pair = _staged_pair(arrays, new, 4096)
    assert pair is not None
    part, encodings, base, staged = pair
    shards = [HostShard(n, a, a.shape, (0,) * a.ndim) for n, a in new.items()]
    layout = plan_layout(shards)
    slot = np.zeros(layout.total_bytes, np.uint8)
    scratch = np.empty(int(layout.total_bytes * CHUNK_CAP) + 1, np.uint8)
    target = DeltaTarget(base, scratch, CHUNK_CAP)
    if blocks:
        cut = [
            Block(s, at, s.data.reshape(-1)[at // 2 : at // 2 + 4096])  # 8 KiB: two chunks
            for s in shards
            for at in (range(0, s.nbytes, 8192) if s.nbytes > 4096 else [0])
        ]
        with ThreadPoolExecutor(3) as pool:
            specs, chunks, batched = stage_blocks(slot, layout, iter(cut), 4096, target, batch_bytes=1, pool=pool)
    else:
        specs, chunks, batched = stage_batched_delta(slot, layout, iter(shards), 4096, target, batch_bytes=8192)
    assert slot.tobytes() == staged.tobytes()
    assert [s.to_dict() for s in specs] == [s.to_dict() for s in part.shards]  # (NaN sums: as text)
    assert tuple(chunks) == part.chunks and batched == encodings
