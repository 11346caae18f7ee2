"""How one publish stages its parameters: the path (`params.choose_staging_path`), the
layout planned before a slot is claimed (from the parameters, or from the specs of a
stream not read yet), and the staging run into that slot."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from trainer_agent.device.d2h_thread import blocks_on_d2h_thread
from trainer_agent.device.device_blocks import Window, block_size, cuts, device_blocks, heap_window
from trainer_agent.device.staging_pool import staging_pool
from trainer_agent.settings import PublisherSettings
from trainer_agent.stage import torch_tensors
from trainer_agent.stage.delta import CHUNK_CAP
from trainer_agent.stage.params import (
    ArrayMeta,
    check_param,
    choose_staging_path,
    device_stream,
    host_shards,
    shard_metas,
)
from trainer_agent.stage.staging import (
    DeltaTarget,
    HostShard,
    Layout,
    plan_layout,
    stage_batched_delta,
    stage_blocks,
    stage_shards,
    stage_shards_delta,
)
from weightsync import native
from weightsync.dtypes import dtype_info
from weightsync.errors import InvalidArgument
from weightsync.manifest import ChunkSpec, ShardSpec

# (name, dtype, shape) of one tensor a stream will yield; the dtype as NumPy reads it
# (np.dtype, a NumPy type or a name such as "bfloat16").
StreamSpec = tuple[str, Any, Sequence[int]]


@dataclass
class StagePlan:
    """A publish's path and layout; `shards` hold host bytes on the host path only."""

    path: str  # "ffi", "host" or "device"
    layout: Layout
    shards: list[HostShard]

    def can_delta(self, chunk_bytes: int) -> str:
        """Why this plan cannot be staged with a delta ("" when it can): the host and device
        paths with the native shim, and 16-bit words never straddle two chunks."""
        if self.path == "ffi" or not native.available():
            return "the ffi path stages without a delta" if native.available() else native.missing_reason()
        if any(n % 2 for _, n in self.layout.chunk_plan(chunk_bytes)):
            return "a chunk has an odd length"
        return ""


def plan_staging(params: Mapping[str, Any], settings: PublisherSettings) -> StagePlan:
    """The path for these params and their layout (no byte moves on the ffi and device paths)."""
    dtype = settings.weight_dtype
    for name, value in params.items():
        check_param(name, value)
    path = choose_staging_path(
        list(params.values()),
        # a delta is encoded in the host and device paths' staging pass, not in the FFI call
        False if settings.delta == "auto" and settings.use_ffi is None else settings.use_ffi,
        ffi_built=native.ffi_available(),
        ffi_missing=native.ffi_missing_reason(),
        weight_dtype=dtype,
    )
    if path == "ffi":
        from trainer_agent.stage.ffi_staging import staged_meta

        shards = [HostShard(n, staged_meta(v, dtype), tuple(v.shape), (0,) * v.ndim) for n, v in params.items()]
    elif path == "device":  # planned from shapes; the bytes move through the window later
        shards = [s for name, value in params.items() for s in shard_metas(name, value, dtype)]
    else:
        shards = [s for name, value in params.items() for s in host_shards(name, value, dtype)]
    return StagePlan(path, plan_layout(shards), shards)


def plan_stream(specs: Sequence[StreamSpec], settings: PublisherSettings) -> StagePlan:
    """The layout of a stream whose tensors are known before any is read (`specs`: name,
    dtype, shape of each, in the stream's order): staged as they arrive, through the
    device path's window and fused batches (no byte moves here).

    Raises:
        InvalidArgument: no specs, or a name or dtype the coordinator would refuse.
    """
    if not specs:
        raise InvalidArgument("must name at least one tensor", field="specs")
    shards = []
    for name, dtype, shape in specs:
        shape = tuple(int(n) for n in shape)
        staged = dtype_info(settings.weight_dtype).numpy if settings.weight_dtype else _numpy_dtype(name, dtype)
        shards.append(HostShard(name, ArrayMeta(shape, staged), shape, (0,) * len(shape)))
    return StagePlan("device", plan_layout(shards), shards)


def _numpy_dtype(name: str, dtype: Any) -> np.dtype:
    if type(dtype).__module__ == "torch":  # a torch.dtype (vLLM's ParamMeta carries one)
        return torch_tensors.numpy_dtype(name, dtype)
    try:
        return dtype_info(dtype).numpy if isinstance(dtype, str) else np.dtype(dtype)
    except (TypeError, InvalidArgument):
        raise InvalidArgument(
            f"{dtype!r:.60} is not a NumPy dtype, a torch dtype or a dtype name", field=f"params[{name!r:.200}]"
        ) from None


def follow_plan(items: Iterable[tuple[str, Any]], plan: StagePlan, weight_dtype: str) -> Iterator[tuple[str, Any]]:
    """`items`, each checked against the tensor `plan` has in its place before it is staged:
    InvalidArgument naming the first that differs (name, shape or dtype), and one naming
    what is missing when the stream ends early or runs on."""
    it = iter(items)
    for i, planned in enumerate(plan.shards):
        pair = next(it, None)
        if pair is None:
            raise InvalidArgument(
                f"the stream ended after {i} of {len(plan.shards)} tensors; {planned.name!r} and the rest never came",
                field="items",
            )
        name, value = pair
        check_param(name, value)
        got = shard_metas(name, value, weight_dtype)
        if got != [planned]:
            seen = ", ".join(f"{s.name!r} {list(s.global_shape)} {s.data.dtype}" for s in got)
            raise InvalidArgument(
                f"item {i} is {seen}; the specs put {planned.name!r} {list(planned.global_shape)} "
                f"{planned.data.dtype} there (one whole tensor per item, in the specs' order)",
                field=f"params[{name!r:.200}]",
            )
        yield name, value
        del pair, value
    extra = next(it, None)
    if extra is not None:
        raise InvalidArgument(
            f"the stream runs on past the {len(plan.shards)} tensors of its specs ({extra[0]!r:.200} is one more)",
            field="items",
        )


@dataclass
class Stager:
    """Runs a StagePlan into an arena slot; keeps the FFI call compiled and the delta
    scratch buffer between publishes."""

    settings: PublisherSettings
    _ffi: Any = field(default=None, repr=False)
    _scratch: np.ndarray | None = field(default=None, repr=False)

    def stage(
        self,
        plan: StagePlan,
        params: Mapping[str, Any] | Iterable[tuple[str, Any]],
        arena: np.ndarray,
        slot_offset: int,
        slot: np.ndarray,
        base: np.ndarray | None = None,
    ) -> tuple[str, list[ShardSpec], list[ChunkSpec], list[bytes | None]]:
        """(the path as logged, shard specs, chunk specs, per chunk its delta encoding) of
        staging `params` (on the device path also (name, value) pairs, read once) into
        `slot` (at `slot_offset` of the whole `arena`, which the FFI call addresses). With
        `base` (the previous version, same layout; a plan that `can_delta`), each chunk is
        also encoded against it in the same pass (None: the chunk goes raw); without, there
        are no encodings."""
        s = self.settings
        if plan.path == "ffi":
            assert isinstance(params, Mapping)
            specs, chunks = self._ffi_stager().stage(
                arena, slot_offset, list(params.values()), plan.layout, s.chunk_bytes, s.weight_dtype
            )
            return "ffi", specs, chunks, []
        delta = None
        if base is not None:
            need = int(plan.layout.total_bytes * CHUNK_CAP) + 1
            if self._scratch is None or self._scratch.nbytes < need:
                self._scratch = np.empty(need, np.uint8)
            delta = DeltaTarget(base, self._scratch, CHUNK_CAP)
        suffix = "+delta" if delta is not None else ""
        if plan.path == "device":
            return "device" + suffix, *stage_device(slot, plan.layout, params, s, delta)
        if delta is not None:
            specs, chunks, encodings = stage_shards_delta(
                slot, plan.shards, plan.layout, s.chunk_bytes, delta, threads=s.staging_threads
            )
            return "host" + suffix, specs, chunks, encodings
        engine = "native" if native.available() else "python"
        specs, chunks = stage_shards(
            slot, plan.shards, plan.layout, s.chunk_bytes, engine=engine, threads=s.staging_threads
        )
        return engine, specs, chunks, []

    def _ffi_stager(self) -> Any:
        if self._ffi is None:
            from trainer_agent.stage.ffi_staging import FfiStager  # imports jax; host-only users skip it

            self._ffi = FfiStager(self.settings.staging_threads)
        return self._ffi


def device_window(settings: PublisherSettings, *, until_staged: bool = True) -> Window:
    """The window of the device path's block copies (`d2h_window_bytes`), glibc's freed
    heap held first where `d2h_hold_freed_heap` says so (`device_blocks.heap_window`)."""
    return heap_window(
        settings.d2h_window_bytes, hold_freed_heap=settings.d2h_hold_freed_heap, until_staged=until_staged
    )


def stage_device(
    slot: np.ndarray,
    layout: Layout,
    params: Mapping[str, Any] | Iterable[tuple[str, Any]],
    settings: PublisherSettings,
    delta: DeltaTarget | None = None,
) -> tuple[list[ShardSpec], list[ChunkSpec], list[bytes | None]]:
    """The device path into `slot` (planned as `layout`) of `params` (or of (name, value)
    pairs, read once): (shard specs, chunk specs, per chunk its encoding against
    `delta.base` when given).

    JAX arrays on an accelerator (for pairs: when the first one is): large shards are cut
    on their device into blocks (`device_blocks`), and a pool of `staging_threads` threads
    (0: every core) stages each run of landed blocks into its place while the next copies
    land; `d2h_window_bytes` bounds what was issued and is not yet staged, each block
    counted as the heap room its host buffer takes. With `d2h_one_thread` the copies are
    issued, and pairs read, on the process's D2H thread (`d2h_thread`). Else (CPU
    devices, torch tensors, or `d2h_block_bytes` 0) whole shards come through the window:
    half in flight, half landed and waiting for their fused pass (CPU devices' shards are
    read in place, nothing is copied but into the slot).
    """
    s = settings
    if isinstance(params, Mapping):
        items: Iterable[tuple[str, Any]] = params.items()
        on_accelerator = cuts(params.values())
    else:
        pairs = iter(params)
        first = next(pairs, None)
        items = pairs if first is None else itertools.chain([first], pairs)
        on_accelerator = first is not None and cuts([first[1]])
    block = block_size(s.d2h_block_bytes, s.chunk_bytes)
    if not block or not on_accelerator:
        half = max(1, s.d2h_window_bytes // 2)
        stream = device_stream(items, s.weight_dtype, half)
        return stage_batched_delta(
            slot, layout, stream, s.chunk_bytes, delta, batch_bytes=half, threads=s.staging_threads
        )
    window = device_window(s)
    engine = "native" if native.available() else "python"
    pool = staging_pool(s.staging_threads or native.default_threads())
    copies = functools.partial(device_blocks, items, s.weight_dtype, window, block)
    blocks = blocks_on_d2h_thread(copies, window.close) if s.d2h_one_thread else copies()
    return stage_blocks(
        slot,
        layout,
        blocks,
        s.chunk_bytes,
        delta,
        batch_bytes=block,
        engine=engine,
        threads=1,
        pool=pool,
        window=window,
    )
