"""The device path's blocks (`trainer_agent.device.device_blocks`), with CPU devices taking the
accelerator's branch: block sizes, the window over what is issued and not yet staged, and
blocks that cover every shard in order, cast on the device."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from trainer_agent.device import device_blocks as device_blocks_module
from trainer_agent.device.device_blocks import PackRuns, Window, block_size, cut_blocks, cuts, device_blocks, warm
from trainer_agent.device.host_heap import HEAP_BYTES, BlockHeaps
from trainer_agent.device.snapshot import device_copy
from trainer_agent.publish.async_publish import held_bytes, held_params
from trainer_agent.publish.stage_plan import plan_staging, stage_device
from trainer_agent.settings import PublisherSettings
from trainer_agent.stage import params as params_module
from trainer_agent.stage.cut_array import CutArray, PackSlice
from trainer_agent.stage.params import shard_metas
from trainer_agent.stage.staging import plan_layout, stage_blocks
from weightsync.errors import FailedPrecondition

CHUNK = 4096
BLOCK = 2 * CHUNK
_SLICERS = device_blocks_module.slicers  # the cached jitted programs, put back after a test wraps them


@contextlib.contextmanager
def on_accelerator_branch() -> Iterator[None]:
    """CPU devices take the accelerator's branch inside (a hypothesis test cannot take a
    function-scoped fixture)."""
    saved = params_module.HOST_MEMORY_PLATFORMS
    params_module.HOST_MEMORY_PLATFORMS = frozenset()
    try:
        yield
    finally:
        params_module.HOST_MEMORY_PLATFORMS = saved


@pytest.fixture
def accelerator_branch() -> Iterator[None]:
    with on_accelerator_branch():
        yield


@contextlib.contextmanager
def recording_packs() -> Iterator[list[tuple[int, int]]]:
    """(arrays, bytes) of each pack program the device path runs inside."""
    real = _SLICERS()
    made: list[tuple[int, int]] = []

    def pack(xs: tuple[Any, ...], dtype: Any) -> Any:
        out = real[2](xs, dtype)
        made.append((len(xs), int(out.nbytes)))
        return out

    device_blocks_module.slicers = lambda: (real[0], real[1], pack)  # type: ignore[assignment]
    try:
        yield made
    finally:
        device_blocks_module.slicers = _SLICERS


# up to 12 tensors of up to 3,000 elements (a block is 2,048 float32), float32 or bfloat16
SMALL_TENSORS = st.lists(
    st.tuples(st.integers(0, 3000), st.sampled_from(["float32", "bfloat16"])), min_size=1, max_size=12
)


def small_tensors(tensors: list[tuple[int, str]]) -> dict[str, jax.Array]:
    """The arrays `SMALL_TENSORS` drew, named t00, t01, ... in order."""
    rng = np.random.default_rng(len(tensors))
    return {
        f"t{i:02d}": jnp.asarray(rng.integers(-64, 64, size) / 8, jnp.dtype(dtype))
        for i, (size, dtype) in enumerate(tensors)
    }


class RecordingWindow(Window):
    """A Window that keeps the most bytes it ever counted as issued and not yet staged."""

    def __init__(self, limit_bytes: int, **kw: Any) -> None:
        super().__init__(limit_bytes, **kw)
        self.most = 0

    def issued(self, nbytes: int) -> None:
        super().issued(nbytes)
        self.most = max(self.most, self._used)


class SetHeaps(BlockHeaps):
    """BlockHeaps holding `count` heaps whatever the buffers' addresses (they are the test
    process's own, anywhere): counts the buffers noted instead."""

    def __init__(self, count: int) -> None:
        super().__init__()
        for i in range(count):
            super().note(i * HEAP_BYTES, 1)
        self.landed = 0

    def note(self, address: int, nbytes: int) -> bool:
        self.landed += 1
        return False


def test_blocks_are_whole_chunks_nearest_the_setting_and_zero_keeps_shards_whole() -> None:
    assert block_size(8 << 20, 3 << 20) == 9 << 20
    assert block_size(4 << 20, 3 << 20) == 3 << 20
    assert block_size(1, 3 << 20) == 3 << 20
    assert block_size(0, 3 << 20) == 0


def values() -> dict[str, jax.Array]:
    rng = np.random.default_rng(3)
    return {
        "big": jnp.asarray(rng.integers(-64, 64, (300, 100)) / 8, jnp.float32),  # 120,000 B: 15 blocks
        "norm": jnp.ones((100,), jnp.float32),
        "odd": jnp.asarray(rng.integers(-64, 64, (7, 2049)) / 8, jnp.float32),  # 57,372 B: a tail block
        "even": jnp.asarray(rng.integers(-64, 64, (16, 1024)) / 8, jnp.float32),  # 8 blocks, the last in the last rows
        "cube": jnp.asarray(rng.integers(-64, 64, (5, 7, 300)) / 8, jnp.float32),  # rows of 8,400 B
        "empty": jnp.zeros((0, 4), jnp.float32),
    }


def test_cpu_arrays_are_cut_only_on_the_accelerator_branch(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not cuts(values().values())
    assert not cuts([np.ones(3)])
    monkeypatch.setattr(params_module, "HOST_MEMORY_PLATFORMS", frozenset())
    assert cuts(values().values())


@pytest.mark.parametrize("weight_dtype", ["", "bfloat16"])
def test_blocks_cover_every_shard_in_order_cast_on_the_device(accelerator_branch: None, weight_dtype: str) -> None:
    params = values()
    window = RecordingWindow(1 << 30, until_staged=False)
    got: dict[str, list[tuple[int, np.ndarray]]] = {}
    for b in device_blocks(params.items(), weight_dtype, window, BLOCK):
        assert b.data.ndim == 1 and b.data.flags.c_contiguous
        got.setdefault(b.shard.name, []).append((b.offset, b.data))
    assert list(got) == list(params)
    dtype = ml_dtypes.bfloat16 if weight_dtype else np.float32
    for name, value in params.items():
        want = np.asarray(value).astype(dtype).reshape(-1)
        offsets = [o for o, _ in got[name]]
        assert offsets == [i * BLOCK for i in range(len(offsets))], name  # blocks of whole chunks, in order
        joined = np.concatenate([d for _, d in got[name]]) if got[name] else np.empty(0, dtype)
        assert joined.dtype == dtype and joined.tobytes() == want.tobytes(), name
    assert len(got["big"]) == (120_000 // (2 if weight_dtype else 1) + BLOCK - 1) // BLOCK
    assert window._used == 0  # every copy landed


def test_the_window_bounds_what_is_issued_and_not_yet_staged(accelerator_branch: None) -> None:
    params = {f"w{i}": jnp.full((64, 512), i, jnp.float32) for i in range(6)}  # 128 KiB each: 16 blocks
    layout = plan_layout([m for n, v in params.items() for m in shard_metas(n, v)])
    slot = np.zeros(layout.total_bytes, np.uint8)
    limit = 5 * BLOCK
    window = RecordingWindow(limit)
    with ThreadPoolExecutor(2) as pool:
        blocks = device_blocks(params.items(), "", window, BLOCK)
        stage_blocks(slot, layout, blocks, CHUNK, batch_bytes=BLOCK, threads=1, pool=pool, window=window)
    # past the limit only by a run not yet handed over, when nothing else is in flight
    assert 2 * BLOCK <= window.most <= limit + 2 * BLOCK, window.most
    assert window._used == 0
    for i, (off, n) in enumerate(zip(layout.offsets, layout.nbytes)):
        assert (slot[off : off + n].view(np.float32) == i).all()


@settings(max_examples=25, deadline=None)
@given(
    shape=st.lists(st.integers(1, 40), min_size=1, max_size=3),
    block_elements=st.integers(1, 700),
    cast=st.booleans(),
)
def test_cut_blocks_rebuild_the_array_flattened_whatever_its_shape(
    shape: list[int], block_elements: int, cast: bool
) -> None:
    x = jnp.arange(int(np.prod(shape)), dtype=jnp.float32).reshape(shape)
    dtype = np.dtype(ml_dtypes.bfloat16) if cast else np.dtype(np.float32)
    cuts = cut_blocks(x, dtype, block_elements * dtype.itemsize)
    got = [np.asarray(cut()) for _, _, cut in cuts]
    assert [o for o, _, _ in cuts] == [i * block_elements * dtype.itemsize for i in range(len(cuts))]
    assert [n for _, n, _ in cuts] == [g.nbytes for g in got]
    assert np.concatenate(got).tobytes() == np.asarray(x).astype(dtype).reshape(-1).tobytes()


def test_a_stream_of_pairs_takes_the_blocks_when_its_first_value_is_on_an_accelerator(
    accelerator_branch: None,
) -> None:
    """`stage_device` of (name, value) pairs read once (a publish_stream with specs) stages
    what the same values as a mapping do, cut into blocks."""
    params = values()
    layout = plan_layout([m for n, v in params.items() for m in shard_metas(n, v)])
    settings = PublisherSettings(coordinator="127.0.0.1:1", chunk_bytes=CHUNK, d2h_block_bytes=BLOCK)
    from_mapping = np.zeros(layout.total_bytes, np.uint8)
    from_pairs = np.ones(layout.total_bytes, np.uint8)
    want = stage_device(from_mapping, layout, params, settings)
    pairs = ((name, value) for name, value in params.items())
    assert stage_device(from_pairs, layout, pairs, settings) == want
    assert from_pairs.tobytes() == from_mapping.tobytes()


@pytest.mark.parametrize("weight_dtype", ["", "bfloat16"])
def test_an_async_snapshot_cut_by_its_program_stages_as_the_blocks_cut_later(
    accelerator_branch: None, weight_dtype: str
) -> None:
    """`held_params(snapshot=True)` with a block size holds single-device arrays as the
    blocks the device path would cut (`CutArray`, written by the snapshot's one program):
    staged, they give the slot bytes, specs and chunks of the arrays cut when copied."""
    params = values()
    settings = PublisherSettings(
        coordinator="127.0.0.1:1", chunk_bytes=CHUNK, d2h_block_bytes=BLOCK, weight_dtype=weight_dtype
    )
    held = held_params(params, snapshot=True, weight_dtype=weight_dtype, block_bytes=BLOCK)
    assert all(isinstance(v, CutArray) for v in held.values())
    assert held_bytes(held) == sum(m.nbytes for n, v in params.items() for m in shard_metas(n, v, weight_dtype))
    plan = plan_staging(held, settings)
    assert plan.path == "device" and plan.layout == plan_staging(params, settings).layout
    want_slot = np.zeros(plan.layout.total_bytes, np.uint8)
    want = stage_device(want_slot, plan.layout, params, settings)
    slot = np.ones(plan.layout.total_bytes, np.uint8)
    assert stage_device(slot, plan.layout, held, settings) == want
    assert slot.tobytes() == want_slot.tobytes()
    with pytest.raises(FailedPrecondition, match="staged once already") as again:
        stage_device(slot, plan.layout, held, settings)
    assert again.value.field == f"params[{next(iter(params))!r}]"


@settings(max_examples=20, deadline=None)
@given(shape=st.lists(st.integers(0, 40), max_size=3), block_elements=st.integers(1, 300), cast=st.booleans())
def test_a_cut_snapshot_holds_the_array_flattened_in_blocks_whatever_its_shape(
    shape: list[int], block_elements: int, cast: bool
) -> None:
    # a program of tens of thousands of outputs takes XLA minutes and GBs to compile
    assume(int(np.prod(shape)) <= 400 * block_elements)
    with on_accelerator_branch():
        x = jnp.arange(int(np.prod(shape)), dtype=jnp.float32).reshape(shape)
        dtype = np.dtype(ml_dtypes.bfloat16) if cast else np.dtype(np.float32)
        held = device_copy({"x": x}, "bfloat16" if cast else "", block_elements * dtype.itemsize)["x"]
    assert isinstance(held, CutArray) and held.shape == tuple(shape) and held.dtype == dtype
    blocks = list(held.take("x"))
    assert [o for o, _, _ in blocks] == [i * block_elements * dtype.itemsize for i in range(len(blocks))]
    got = [np.asarray(b) for _, _, b in blocks]
    assert [n for _, n, _ in blocks] == [g.nbytes for g in got]
    flat = np.asarray(x).astype(dtype).reshape(-1)
    assert (np.concatenate(got) if got else np.empty(0, dtype)).tobytes() == flat.tobytes()


@settings(max_examples=25, deadline=None)
@given(tensors=SMALL_TENSORS, weight_dtype=st.sampled_from(["", "bfloat16"]))
def test_a_snapshot_packs_runs_of_small_tensors_into_blocks_and_stages_as_the_tensors(
    tensors: list[tuple[int, str]], weight_dtype: str
) -> None:
    """Consecutive tensors no larger than a block, of one staged dtype, share a pack of at
    most a block (one device-to-host copy); larger ones are cut and, as empty ones, end a
    pack; staged, the snapshot gives the slot bytes and specs of the tensors."""
    params = small_tensors(tensors)
    settings_ = PublisherSettings(
        coordinator="127.0.0.1:1", chunk_bytes=CHUNK, d2h_block_bytes=BLOCK, weight_dtype=weight_dtype
    )
    with on_accelerator_branch():
        held = held_params(params, snapshot=True, weight_dtype=weight_dtype, block_bytes=BLOCK)
        packs: list[tuple[Any, list[str]]] = []  # (pack, its tensors) in the order first seen
        for name, cut in held.items():
            assert isinstance(cut, CutArray)
            small = cut.nbytes <= BLOCK and cut.nbytes > 0
            kinds = {type(b) for _, _, b in cut.blocks}
            assert kinds <= ({PackSlice} if small else {type(jnp.zeros(1))})
            if small:
                ((_, _, piece),) = cut.blocks
                if not packs or packs[-1][0] is not piece.pack:
                    packs.append((piece.pack, []))
                packs[-1][1].append(name)
        order = list(held)
        for pack, names in packs:  # runs of consecutive tensors
            assert pack.nbytes <= BLOCK and len({held[n].dtype for n in names}) == 1
            assert names == order[order.index(names[0]) :][: len(names)]
        for _, names in packs:  # a pack ends where the next tensor would not fit, or is cut or empty
            if (i := order.index(names[-1]) + 1) < len(order):
                nxt = held[order[i]]
                full = sum(held[n].nbytes for n in names) + nxt.nbytes > BLOCK
                assert full or held[names[0]].dtype != nxt.dtype or not 0 < nxt.nbytes <= BLOCK
        plan = plan_staging(held, settings_)
        want_slot = np.zeros(plan.layout.total_bytes, np.uint8)
        want = stage_device(want_slot, plan.layout, params, settings_)
        slot = np.ones(plan.layout.total_bytes, np.uint8)
        assert stage_device(slot, plan.layout, held, settings_) == want
    assert slot.tobytes() == want_slot.tobytes()


@settings(max_examples=25, deadline=None)
@given(tensors=SMALL_TENSORS, weight_dtype=st.sampled_from(["", "bfloat16"]))
def test_blocks_of_live_arrays_pack_runs_of_small_shards_into_one_copy_each(
    tensors: list[tuple[int, str]], weight_dtype: str
) -> None:
    """Cut as the copies are issued (a blocking publish, `snapshot=False`), consecutive
    shards no larger than a block, of one staged dtype, come over in one program and one
    copy per pack of at most a block, as the snapshot packs them; each shard's block holds
    its bytes, cast on the device, in order."""
    params = small_tensors(tensors)
    with on_accelerator_branch(), recording_packs() as packed:
        blocks = list(device_blocks(params.items(), weight_dtype, Window(1 << 30, until_staged=False), BLOCK))
        held = held_params(params, snapshot=True, weight_dtype=weight_dtype, block_bytes=BLOCK)
    snapshot_packs = {id(b.pack) for v in held.values() for _, _, b in v.blocks if isinstance(b, PackSlice)}
    assert len(packed) == len(snapshot_packs) and all(n <= BLOCK for _, n in packed)
    got: dict[str, list[np.ndarray]] = {}
    for b in blocks:
        got.setdefault(b.shard.name, []).append(b.data)
    assert list(got) == list(params)
    for name, value in params.items():
        want = np.asarray(value).astype(ml_dtypes.bfloat16 if weight_dtype else value.dtype).reshape(-1)
        assert np.concatenate(got[name]).tobytes() == want.tobytes(), name


def test_warm_runs_each_program_a_publish_dispatches_and_leaves_snapshots_alone(accelerator_branch: None) -> None:
    """`warm` compiles what a publish of the arrays would (its slices and packs) without
    taking a snapshot's blocks: the snapshot stages whole afterwards."""
    params = values() | {"n1": jnp.ones((10,), jnp.float32), "n2": jnp.zeros((3, 5), jnp.float32)}
    with recording_packs() as made:
        snapshot = held_params({"big": params["big"]}, snapshot=True, block_bytes=BLOCK)
        warm([*params.items(), ("snap", snapshot["big"])], "", BLOCK)
    assert made and sum(n for n, _ in made) == sum(1 for v in params.values() if 0 < v.nbytes <= BLOCK)
    assert len(snapshot["big"].blocks) == 15 and not snapshot["big"].taken


def test_pack_runs_end_at_another_device_or_dtype_a_full_block_or_an_entry_not_packed() -> None:
    runs = PackRuns(100)
    assert not runs.takes(0) and runs.takes(1) and runs.takes(100) and not runs.takes(101)
    assert not PackRuns(0).takes(1)  # no blocks: nothing packed
    assert runs.add("a", 60, 1) == [] and runs.add("a", 40, 2) == []  # exactly a block
    assert runs.add("a", 1, 3) == [1, 2]  # full
    assert runs.add("b", 1, 4) == [3]  # another key
    assert runs.close() == [4] and runs.close() == []  # an entry not packed ends the run
    assert runs.add("b", 100, 5) == [] and runs.close() == [5]


def test_a_window_takes_the_heaps_its_blocks_lie_in_past_it_off_what_may_be_in_flight(
    caplog: pytest.LogCaptureFixture,
) -> None:
    heaps = BlockHeaps()
    limit = 4 * HEAP_BYTES
    window = Window(limit, heaps=heaps)
    for i in range(4):
        heaps.note(i * HEAP_BYTES, BLOCK)
    assert window.room_bytes == limit  # as many heaps as the window: all of it
    window.issued(3 * HEAP_BYTES)
    assert window.admits(HEAP_BYTES, inflight=True)
    buffer = np.zeros(BLOCK, np.uint8)  # from the heap: it lies in one, which is counted
    with caplog.at_level("INFO", logger="trainer_agent.device.device_blocks"):
        for i in range(4, 6):
            heaps.note(i * HEAP_BYTES, BLOCK)
        window.landed(BLOCK, buffer)
    assert heaps.count in (6, 7)  # the buffer's heap, unless one of those above
    assert window.room_bytes == limit - (heaps.count - 4) * HEAP_BYTES
    assert not window.admits(HEAP_BYTES, inflight=True)  # 3 in flight, at most 2 (or 1) allowed
    assert window.admits(HEAP_BYTES, inflight=False)  # nothing in flight, nothing pending: one goes
    assert (heaps.count == 7) == ("past its 256 MiB window" in caplog.text)
    heaps.steer = False  # counted only (a bench's control)
    assert window.room_bytes == limit and window.admits(HEAP_BYTES, inflight=True)


def test_with_its_heaps_past_the_window_the_device_path_holds_fewer_blocks_in_flight(accelerator_branch: None) -> None:
    params = {f"w{i}": jnp.full((64, 512), i, jnp.float32) for i in range(6)}  # 128 KiB each: 16 blocks
    layout = plan_layout([m for n, v in params.items() for m in shard_metas(n, v)])
    slot = np.zeros(layout.total_bytes, np.uint8)
    heaps = SetHeaps(13)  # three heaps past a window of ten blocks' room (a heap each)
    window = RecordingWindow(10 * HEAP_BYTES, room=lambda n: HEAP_BYTES, heaps=heaps)
    with ThreadPoolExecutor(2) as pool:
        blocks = device_blocks(params.items(), "", window, BLOCK)
        stage_blocks(slot, layout, blocks, CHUNK, batch_bytes=BLOCK, threads=1, pool=pool, window=window)
    assert heaps.landed == 6 * 16 and window.room_bytes == 7 * HEAP_BYTES  # every block noted
    # at most a block past what it allows; without the heaps (or with none past it) 10 in flight
    assert 2 * HEAP_BYTES <= window.most <= 8 * HEAP_BYTES
    assert window._used == 0
    for i, (off, n) in enumerate(zip(layout.offsets, layout.nbytes)):
        assert (slot[off : off + n].view(np.float32) == i).all()


def test_a_window_with_room_counts_each_block_as_the_memory_its_buffer_takes() -> None:
    room = lambda nbytes: 2 * nbytes  # noqa: E731
    window = Window(10 * BLOCK, room=room)
    assert window.admits(5 * BLOCK, inflight=True)
    assert not window.admits(6 * BLOCK, inflight=True)
    window.issued(4 * BLOCK)  # counts 8 blocks' room
    assert not window.admits(2 * BLOCK, inflight=True) and window.admits(BLOCK, inflight=True)
    window.submitted(4 * BLOCK)
    window.staged(4 * BLOCK)
    assert window._used == 0  # what was counted in comes out the same
