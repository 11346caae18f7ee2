"""From a parameter tree to host shards: which staging path a publish takes and the
replica-0 shards each host owns."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from trainer_agent.staging import HostShard
from weightsync.dtypes import dtype_info
from weightsync.errors import InvalidArgument


def choose_staging_path(values: Sequence[Any], use_ffi: bool | None, *, ffi_built: bool, ffi_missing: str) -> str:
    """ "ffi" or "host", by the use_ffi contract (DESIGN.md "Native shim and FFI").

    None: FFI when built and every value is a single-device JAX array. True: FFI, and
    RuntimeError naming what is missing when it is not built. False: host pointers.
    Arrays that are not host-addressable without FFI fail fast (never a silent slow path).
    """
    if use_ffi is True and not ffi_built:
        raise RuntimeError(f"use_ffi=True but the FFI staging handler is unavailable: {ffi_missing}")
    jax_values = [v for v in values if hasattr(v, "addressable_shards")]
    ffi_eligible = (
        bool(values) and len(jax_values) == len(values) and all(len(v.addressable_shards) == 1 for v in jax_values)
    )
    if ffi_built and use_ffi is not False and ffi_eligible:
        return "ffi"
    for v in jax_values:
        for shard in v.addressable_shards:
            platform = getattr(shard.device, "platform", "cpu")
            if platform != "cpu":
                why = (
                    "use_ffi=False" if use_ffi is False else (ffi_missing or "the FFI path needs single-device arrays")
                )
                raise RuntimeError(
                    f"array on {shard.device} is not host-addressable and the FFI path is not taken ({why}); "
                    "build the shim with FFI and pass use_ffi=None/True, or copy the arrays to host first"
                )
    return "host"


def host_shards(name: str, value: Any, weight_dtype: str = "") -> list[HostShard]:
    """Host shards of one parameter: NumPy arrays, HostShards, or JAX arrays (replica 0).

    A JAX array contributes its addressable replica-0 shards, so each host of a
    multi-host trainer publishes only what it owns.
    """
    if isinstance(value, HostShard):
        data = value.data if not weight_dtype else value.data.astype(dtype_info(weight_dtype).numpy)
        return [HostShard(name, data, value.global_shape, value.start)]
    if hasattr(value, "addressable_shards"):  # jax.Array
        if weight_dtype and str(value.dtype) != weight_dtype:
            value = value.astype(dtype_info(weight_dtype).numpy)
        out = []
        for shard in value.addressable_shards:
            if shard.replica_id != 0:
                continue
            start = tuple(0 if sl.start is None else sl.start for sl in shard.index)
            start = start + (0,) * (value.ndim - len(start))
            try:
                host = np.asarray(shard.data)  # zero-copy for CPU-resident arrays
            except Exception as e:  # noqa: BLE001 - re-raised with the fix
                raise InvalidArgument(
                    f"shard on {shard.device} is not host-addressable ({e}); the native FFI path stages device "
                    "buffers, or pass host copies as HostShard",
                    field=f"params[{name!r}]",
                ) from e
            out.append(HostShard(name, host, tuple(value.shape), start))
        return out
    arr = np.asarray(value)
    if weight_dtype:
        arr = arr.astype(dtype_info(weight_dtype).numpy, copy=False)
    return [HostShard(name, arr, tuple(arr.shape), (0,) * arr.ndim)]
