"""From a parameter tree to host shards: which staging path a publish takes (the use_ffi
contract, per platform) and the replica-0 shards each host owns, moved to host memory
through a bounded window of device-to-host transfers.

Paths: "ffi" (the shim's XLA FFI handler stages XLA's own buffers; CPU arrays, one device
each), "host" (host-addressable arrays staged in place: CPU or NumPy, no cast needed) and
"device" (everything else: the runtime's device-to-host copies are issued ahead of use,
`window_bytes` in flight and landed, each staged as it lands and its host copy dropped;
casts run on the device. JAX arrays on an accelerator travel in blocks,
`trainer_agent.device.device_blocks`; on CPU devices whole shards, read in place). No path makes
a second host copy of the whole model. Torch tensors take the same paths
(`trainer_agent.stage.torch_tensors`): CPU ones staged from zero-copy views, others copied to
pinned host memory through the window.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from trainer_agent.stage import torch_tensors
from trainer_agent.stage.cut_array import CutArray
from trainer_agent.stage.staging import HostShard
from weightsync.dtypes import ALLOWED, dtype_info
from weightsync.errors import InvalidArgument

# Measured on a TPU v5e host (bench/stage.py --devices 1 --model-size 4b, 2026-12-06, one run
# each, docs/performance.md): with 12 MiB blocks a 1 GiB window staged at 11.07 GB/s; with 9 MiB
# blocks windows of 128 MiB, 256 MiB, 1 GiB and 2 GiB staged at 8.01, 8.06, 7.08 and 6.53. On
# CPU devices the window changes nothing (no bytes move). The window is host memory above the
# arena; d2h_window_bytes sets it per trainer.
DEFAULT_WINDOW_BYTES = 1 << 30
# Platforms whose device memory is host memory: their arrays are staged in place (the host
# path, or whole shards read in place on the device path), never cut into blocks. A test
# may empty it to take an accelerator's branch with CPU devices.
HOST_MEMORY_PLATFORMS = frozenset({"cpu"})
FFI_PLATFORMS = frozenset({"cpu"})  # where the shim's handler is registered
# Why a platform has no FFI path (use_ffi=True names it).
NO_FFI = {
    "tpu": "XLA TPU custom calls are not open to user code; the device path (use_ffi=None or False) is the TPU path",
    "cuda": "the FFI staging handler is registered for cpu only; the CUDA staging library is a separate build",
    "rocm": "the FFI staging handler is registered for cpu only",
}


@dataclass(frozen=True)
class ArrayMeta:
    """Shape, dtype and size of an array as it will be staged (after any cast)."""

    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _platforms(value: Any) -> set[str]:
    if isinstance(value, CutArray):
        return {value.platform}
    if hasattr(value, "addressable_shards"):
        return {getattr(s.device, "platform", "cpu") for s in value.addressable_shards}
    if torch_tensors.is_tensor(value):
        return {torch_tensors.platform(value)}
    return {"cpu"}


def _dtype(value: Any, name: str = "") -> np.dtype:
    """The dtype a value stages with before any cast (lists and scalars as NumPy reads them)."""
    data = value.data if isinstance(value, HostShard) else value
    if torch_tensors.is_tensor(data):
        return torch_tensors.numpy_dtype(name, data.dtype)
    dt = getattr(data, "dtype", None)
    return np.dtype(dt) if dt is not None else np.asarray(data).dtype


def check_param(name: str, value: Any) -> None:
    """InvalidArgument naming `params[name]` for a value that is no array of real numbers,
    before any cast to `weight_dtype` (which would fail a nested tree or None as a
    TypeError mid-staging, and drop complex values' imaginary part without a word).
    A torch tensor of a dtype weightsync cannot carry (complex, float8, ...) is refused
    the same way, as is one whose bytes cannot be read (sparse, meta, a DTensor)."""
    field = f"params[{name!r:.200}]"
    if isinstance(value, Mapping):
        raise InvalidArgument(
            "is a mapping: params maps flat tensor names (the checkpoint's, e.g. 'model.norm.weight') to arrays; "
            "flatten a nested tree first",
            field=field,
        )
    if torch_tensors.is_tensor(value):
        torch_tensors.checked(name, value)
        return
    dt = _dtype(value)
    if dt.kind not in "biuf" and dt.name not in ALLOWED:
        raise InvalidArgument(f"dtype {dt} is not a real number type (one of {', '.join(ALLOWED)})", field=field)


def _needs_cast(value: Any, weight_dtype: str) -> bool:
    return bool(weight_dtype) and _dtype(value) != dtype_info(weight_dtype).numpy


def choose_staging_path(
    values: Sequence[Any], use_ffi: bool | None, *, ffi_built: bool, ffi_missing: str, weight_dtype: str = ""
) -> str:
    """ "ffi", "host" or "device", by the use_ffi contract (docs/design.md; `PublisherSettings.use_ffi`).

    None: the best path for the arrays' platform: FFI for single-device CPU arrays when it
    is built, "host" for host-addressable values that need no cast, else "device".
    True: the FFI path, or RuntimeError naming what is missing for that platform.
    False: never FFI ("host" where the bytes are already host memory, else "device").
    """
    platforms = set().union(*(_platforms(v) for v in values)) if values else {"cpu"}
    single = bool(values) and all(hasattr(v, "addressable_shards") and len(v.addressable_shards) == 1 for v in values)
    if use_ffi is True:
        if not ffi_built:
            raise RuntimeError(f"use_ffi=True but the FFI staging handler is unavailable: {ffi_missing}")
        for platform in sorted(platforms - FFI_PLATFORMS):
            why = NO_FFI.get(platform, "the FFI staging handler is registered for cpu only")
            raise RuntimeError(f"use_ffi=True but arrays live on {platform}: {why}")
        if not single:
            raise RuntimeError(
                "use_ffi=True but the FFI path stages single-device JAX arrays; sharded or NumPy values take the "
                "host or device path (use_ffi=None)"
            )
        return "ffi"
    if use_ffi is None and ffi_built and single and platforms <= FFI_PLATFORMS:
        return "ffi"
    if platforms <= HOST_MEMORY_PLATFORMS and not any(_needs_cast(v, weight_dtype) for v in values):
        return "host"
    return "device"


def shard_metas(name: str, value: Any, weight_dtype: str = "") -> list[HostShard]:
    """The HostShards `host_shards` / `device_stream` will yield, with ArrayMeta instead of
    bytes: the layout is planned before any byte moves."""
    dt = dtype_info(weight_dtype).numpy if weight_dtype else _dtype(value, name)
    if isinstance(value, HostShard):
        return [HostShard(name, ArrayMeta(tuple(value.data.shape), dt), value.global_shape, value.start)]
    if isinstance(value, CutArray):
        return [HostShard(name, ArrayMeta(value.shape, dt), value.shape, (0,) * value.ndim)]
    if hasattr(value, "addressable_shards"):
        return [
            HostShard(name, ArrayMeta(tuple(s.data.shape), dt), tuple(value.shape), shard_start(s.index, value.ndim))
            for s in value.addressable_shards
            if s.replica_id == 0
        ]
    shape = tuple(np.shape(value))
    return [HostShard(name, ArrayMeta(shape, dt), shape, (0,) * len(shape))]


def shard_start(index: tuple[slice, ...], ndim: int) -> tuple[int, ...]:
    """A shard's first element in its global array, from its index."""
    start = tuple(0 if sl.start is None else sl.start for sl in index)
    return start + (0,) * (ndim - len(start))


def device_stream(
    items: Iterable[tuple[str, Any]], weight_dtype: str = "", window_bytes: int = DEFAULT_WINDOW_BYTES
) -> Iterator[HostShard]:
    """Host shards of `items` in order, with at most ~`window_bytes` of device-to-host
    copies in flight ahead of the one being consumed.

    A JAX array is cast on its device (if `weight_dtype` differs), then each replica-0
    shard's `copy_to_host_async` is issued; the consumer gets the shard's host bytes when
    its turn comes and the reference is dropped as soon as it asks for the next. Items
    are pulled lazily, so a converter feeding this runs a window ahead, not a model ahead.
    """
    pending = _shards(items, weight_dtype)
    inflight: deque[tuple[HostShard, Any]] = deque()  # (metadata, device shard or host array)
    inflight_bytes = 0
    while True:
        while not inflight or inflight_bytes < window_bytes:  # shard by shard: a tensor of
            nxt = next(pending, None)  # many shards is not brought over whole
            if nxt is None:
                break
            meta, data = nxt
            if not isinstance(data, np.ndarray):
                data.copy_to_host_async()
            inflight.append((meta, data))
            inflight_bytes += meta.data.nbytes
            del nxt, data
        if not inflight:
            return
        meta, data = inflight.popleft()
        inflight_bytes -= meta.data.nbytes
        host = host_array(meta.name, data)
        shard = HostShard(meta.name, host, meta.global_shape, meta.start)
        del data, host
        yield shard
        del shard  # the consumer holds the only reference now; dropped when it moves on


def _shards(items: Iterable[tuple[str, Any]], weight_dtype: str) -> Iterator[tuple[HostShard, Any]]:
    """Each item's replica-0 shards, lazily: (metadata, device shard) for JAX arrays, cast on
    their device one tensor at a time; host values pass through as host shards."""
    for name, value in items:
        check_param(name, value)
        if torch_tensors.is_tensor(value) and torch_tensors.platform(value) != "cpu":
            if weight_dtype:
                value = torch_tensors.cast(name, value, dtype_info(weight_dtype).numpy)  # on its device
            pending = torch_tensors.PendingCopy(name, value)
            shape = pending.shape
            yield HostShard(name, ArrayMeta(shape, pending.dtype), shape, (0,) * len(shape)), pending
            continue
        if not hasattr(value, "addressable_shards"):
            yield from ((s, s.data) for s in host_shards(name, value, weight_dtype))
            continue
        if weight_dtype and str(value.dtype) != weight_dtype:
            value = value.astype(dtype_info(weight_dtype).numpy)  # on the device, this tensor only
        for s in value.addressable_shards:
            if s.replica_id == 0:
                data = s.data
                meta = ArrayMeta(tuple(data.shape), np.dtype(data.dtype))
                yield HostShard(name, meta, tuple(value.shape), shard_start(s.index, value.ndim)), data


def host_array(name: str, data: Any) -> np.ndarray:
    """`data`'s bytes in host memory (waiting for its copy), or InvalidArgument naming `params[name]`."""
    if isinstance(data, np.ndarray):
        return data
    try:
        return np.asarray(data)  # waits for this shard's transfer; zero-copy on CPU
    except Exception as e:  # noqa: BLE001 - re-raised naming the parameter
        raise InvalidArgument(f"cannot bring a shard to host memory: {e}", field=f"params[{name!r}]") from e


def host_shards(name: str, value: Any, weight_dtype: str = "") -> list[HostShard]:
    """Host shards of one parameter: NumPy arrays, HostShards, or host-addressable JAX
    arrays (their replica-0 shards, so each host of a multi-host trainer publishes only
    what it owns). Views where no cast is needed; device arrays go through `device_stream`.
    """
    cast = dtype_info(weight_dtype).numpy if weight_dtype else None
    if isinstance(value, HostShard):
        data = value.data if cast is None else value.data.astype(cast, copy=False)
        return [HostShard(name, data, value.global_shape, value.start)]
    if hasattr(value, "addressable_shards"):  # jax.Array
        if cast is not None and value.dtype != cast:
            value = value.astype(cast)
        return [
            HostShard(name, host_array(name, s.data), tuple(value.shape), shard_start(s.index, value.ndim))
            for s in value.addressable_shards
            if s.replica_id == 0
        ]
    if torch_tensors.is_tensor(value):
        arr = torch_tensors.host_array(name, value if cast is None else torch_tensors.cast(name, value, cast))
    else:
        arr = np.asarray(value)
    if cast is not None:
        arr = arr.astype(cast, copy=False)
    return [HostShard(name, arr, tuple(arr.shape), (0,) * arr.ndim)]
