"""An on-device copy of a parameter tree: new buffers, at the device's memory bandwidth.

With a block size, single-device arrays on an accelerator are copied straight into the
device path's blocks (`trainer_agent.cut_array`), in the same program as the rest."""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from trainer_agent import params as params_module
from trainer_agent.cut_array import CutArray
from trainer_agent.device_blocks import block_elements
from weightsync.dtypes import dtype_info

# per array cut into blocks: (elements per block, blocks of that many, elements left after them)
_Cuts = tuple[tuple[str, int, int, int], ...]


@partial(jax.jit, static_argnums=(1, 2))
def _copy(arrays: dict[str, jax.Array], weight_dtype: str, cuts: _Cuts) -> dict[str, Any]:
    cast = dtype_info(weight_dtype).numpy if weight_dtype else None

    def staged(x: jax.Array) -> jax.Array:
        return x.astype(cast) if cast is not None and x.dtype != cast else x

    out: dict[str, Any] = {}
    for name, per, count, rest in cuts:
        flat = staged(arrays[name]).reshape(-1)
        tail = (flat[count * per :],) if rest else ()
        out[name] = tuple(flat[j * per : (j + 1) * per] for j in range(count)) + tail
    cut = {name for name, *_ in cuts}
    # jnp.copy: an output that is an input unchanged would be the same buffer, which the
    # caller's next donating step deletes
    out |= {k: jnp.copy(staged(x)) for k, x in arrays.items() if k not in cut}
    return out


def device_copy(arrays: dict[str, Any], weight_dtype: str = "", block_bytes: int = 0) -> dict[str, Any]:
    """Copies of `arrays` in new buffers on the same devices and shardings (cast to
    `weight_dtype` on the way when set), dispatched without waiting for them. With
    `block_bytes` (whole chunks: `device_blocks.block_size`), an array on one device of an
    accelerator comes back as a `CutArray` of blocks of that size instead."""
    cuts, held = [], {}
    for name, x in arrays.items():
        devices = x.sharding.device_set
        platform = next(iter(devices)).platform
        if block_bytes and len(devices) == 1 and platform not in params_module.HOST_MEMORY_PLATFORMS:
            dtype = dtype_info(weight_dtype).numpy if weight_dtype else np.dtype(x.dtype)
            size = int(np.prod(x.shape, dtype=np.int64))
            per = block_elements(size, dtype.itemsize, block_bytes)
            cuts.append((name, per, *divmod(size, per)))
            held[name] = CutArray(tuple(x.shape), dtype, platform, [])
    out = _copy(arrays, weight_dtype, tuple(cuts))
    for (name, per, _, _), cut in zip(cuts, held.values()):
        item = cut.dtype.itemsize
        cut.blocks = [(j * per * item, int(b.size) * item, b) for j, b in enumerate(out[name])]
        out[name] = cut
    return out
