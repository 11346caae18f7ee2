"""An on-device copy of a parameter tree: new buffers, at the device's memory bandwidth.

With a block size, single-device arrays on an accelerator are copied straight into the
device path's blocks (`trainer_agent.stage.cut_array`), in the same program as the rest: large
ones cut, small ones packed."""

from __future__ import annotations

import math
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from trainer_agent.device.device_blocks import PackRuns, block_elements, pack_flat
from trainer_agent.stage import params as params_module
from trainer_agent.stage.cut_array import CutArray, PackSlice
from weightsync.dtypes import dtype_info

# per array cut into blocks: (elements per block, blocks of that many, elements left after them)
_Cuts = tuple[tuple[str, int, int, int], ...]
# per pack: the arrays (no larger than a block, one device, one staged dtype) it holds, in order
_Packs = tuple[tuple[str, ...], ...]


@partial(jax.jit, static_argnums=(1, 2, 3))
def _copy(
    arrays: dict[str, jax.Array], weight_dtype: str, cuts: _Cuts, packs: _Packs
) -> tuple[dict[str, Any], tuple[jax.Array, ...]]:
    cast = dtype_info(weight_dtype).numpy if weight_dtype else None

    def staged(x: jax.Array) -> jax.Array:
        return x.astype(cast) if cast is not None and x.dtype != cast else x

    out: dict[str, Any] = {}
    for name, per, count, rest in cuts:
        flat = staged(arrays[name]).reshape(-1)
        tail = (flat[count * per :],) if rest else ()
        out[name] = tuple(flat[j * per : (j + 1) * per] for j in range(count)) + tail

    def pack(names: tuple[str, ...]) -> jax.Array:  # its arrays share one staged dtype (the run's key)
        return pack_flat([arrays[n] for n in names], cast if cast is not None else arrays[names[0]].dtype)

    packed = tuple(map(pack, packs))
    done = {name for name, *_ in cuts} | {n for names in packs for n in names}
    # jnp.copy: an output that is an input unchanged would be the same buffer, which the
    # caller's next donating step deletes
    out |= {k: jnp.copy(staged(x)) for k, x in arrays.items() if k not in done}
    return out, packed


def device_copy(arrays: dict[str, Any], weight_dtype: str = "", block_bytes: int = 0) -> dict[str, Any]:
    """Copies of `arrays` in new buffers on the same devices and shardings (cast to
    `weight_dtype` on the way when set), dispatched without waiting for them. With
    `block_bytes` (whole chunks: `device_blocks.block_size`), an array on one device of an
    accelerator comes back as a `CutArray`: a larger one in blocks of that size, and runs
    of smaller ones (consecutive, on one device, of one staged dtype) packed together into
    blocks of at most that size, each array a `PackSlice` of its pack. So a version's
    device-to-host copies are about its bytes over `block_bytes`, not one per tensor."""
    cuts: list[tuple[str, int, int, int]] = []
    packs: list[list[str]] = []
    held: dict[str, CutArray] = {}
    runs = PackRuns(block_bytes)
    for name, x in arrays.items():
        devices = x.sharding.device_set
        platform = next(iter(devices)).platform
        if not block_bytes or len(devices) != 1 or platform in params_module.HOST_MEMORY_PLATFORMS:
            packs.append(runs.close())
            continue
        dtype = dtype_info(weight_dtype).numpy if weight_dtype else np.dtype(x.dtype)
        size = math.prod(x.shape)
        held[name] = CutArray(tuple(x.shape), dtype, platform, [])
        if runs.takes(size * dtype.itemsize):
            packs.append(runs.add((next(iter(devices)), dtype), size * dtype.itemsize, name))
            continue
        packs.append(runs.close())
        per = block_elements(size, dtype.itemsize, block_bytes)
        cuts.append((name, per, *divmod(size, per)))  # an empty one: no blocks
    packs = [run for run in [*packs, runs.close()] if run]
    out, packed = _copy(arrays, weight_dtype, tuple(cuts), tuple(map(tuple, packs)))
    for name, per, _, _ in cuts:
        item = held[name].dtype.itemsize
        held[name].blocks = [(j * per * item, int(b.size) * item, b) for j, b in enumerate(out[name])]
    for names, pack in zip(packs, packed):
        start = 0
        for name in names:
            cut = held[name]
            count = cut.nbytes // cut.dtype.itemsize
            cut.blocks = [(0, cut.nbytes, PackSlice(pack, start, count))]
            start += count
    return out | held
