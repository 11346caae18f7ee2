"""How one publish stages its parameters: the path (`params.choose_staging_path`), the
layout planned before a slot is claimed, and the staging run into that slot."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from trainer_agent.delta import CHUNK_CAP
from trainer_agent.params import check_param, choose_staging_path, device_stream, host_shards, shard_metas
from trainer_agent.settings import PublisherSettings
from trainer_agent.staging import (
    DeltaTarget,
    HostShard,
    Layout,
    plan_layout,
    stage_batched_delta,
    stage_shards,
    stage_shards_delta,
)
from weightsync import native
from weightsync.manifest import ChunkSpec, ShardSpec


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
        from trainer_agent.ffi_staging import staged_meta

        shards = [HostShard(n, staged_meta(v, dtype), tuple(v.shape), (0,) * v.ndim) for n, v in params.items()]
    elif path == "device":  # planned from shapes; the bytes move through the window later
        shards = [s for name, value in params.items() for s in shard_metas(name, value, dtype)]
    else:
        shards = [s for name, value in params.items() for s in host_shards(name, value, dtype)]
    return StagePlan(path, plan_layout(shards), shards)


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
        params: Mapping[str, Any],
        arena: np.ndarray,
        slot_offset: int,
        slot: np.ndarray,
        base: np.ndarray | None = None,
    ) -> tuple[str, list[ShardSpec], list[ChunkSpec], list[bytes | None]]:
        """(the path as logged, shard specs, chunk specs, per chunk its delta encoding) of
        staging `params` into `slot` (at `slot_offset` of the whole `arena`, which the FFI
        call addresses). With `base` (the previous version, same layout; a plan that
        `can_delta`), each chunk is also encoded against it in the same pass (None: the
        chunk goes raw); without, there are no encodings."""
        s = self.settings
        if plan.path == "ffi":
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
        if plan.path == "device":  # half the window in flight, half landed and waiting for its fused pass
            half = max(1, s.d2h_window_bytes // 2)
            stream = device_stream(params.items(), s.weight_dtype, half)
            specs, chunks, encodings = stage_batched_delta(
                slot, plan.layout, stream, s.chunk_bytes, delta, batch_bytes=half, threads=s.staging_threads
            )
            return "device" + suffix, specs, chunks, encodings
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
            from trainer_agent.ffi_staging import FfiStager  # imports jax; host-only users skip it

            self._ffi = FfiStager(self.settings.staging_threads)
        return self._ffi
