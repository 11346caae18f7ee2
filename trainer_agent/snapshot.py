"""An on-device copy of a parameter tree: new buffers, at the device's memory bandwidth.

With a block size, single-device arrays on an accelerator are copied straight into the
device path's packs (`trainer_agent.cut_array`), in the same program as the rest: the
arrays end to end, cut into packs of a block."""

from __future__ import annotations

import math
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from trainer_agent import params as params_module
from trainer_agent.cut_array import CutArray, PackSlice
from trainer_agent.device_blocks import PackStream, Piece, pack_elements, pack_pieces
from weightsync.dtypes import dtype_info

# per pack: its pieces (array name, first element, elements) and its elements (padded to a block)
_Plan = tuple[tuple[tuple[tuple[str, int, int], ...], int], ...]


@partial(jax.jit, static_argnums=(1, 2, 3))
def _copy(
    arrays: dict[str, jax.Array], weight_dtype: str, plan: _Plan, cut: tuple[str, ...]
) -> tuple[dict[str, Any], tuple[jax.Array, ...]]:
    cast = dtype_info(weight_dtype).numpy if weight_dtype else None

    def pack(pieces: tuple[tuple[str, int, int], ...], elements: int) -> jax.Array:  # one staged dtype (a key)
        xs = [arrays[name] for name, _, _ in pieces]
        return pack_pieces(
            xs, [(start, count) for _, start, count in pieces], cast if cast is not None else xs[0].dtype, elements
        )

    packed = tuple(pack(pieces, elements) for pieces, elements in plan)
    # jnp.copy: an output that is an input unchanged would be the same buffer, which the
    # caller's next donating step deletes
    out = {
        k: jnp.copy(x.astype(cast) if cast is not None and x.dtype != cast else x)
        for k, x in arrays.items()
        if k not in cut
    }
    return out, packed


def device_copy(arrays: dict[str, Any], weight_dtype: str = "", block_bytes: int = 0) -> dict[str, Any]:
    """Copies of `arrays` in new buffers on the same devices and shardings (cast to
    `weight_dtype` on the way when set), dispatched without waiting for them. With
    `block_bytes` (whole chunks: `device_blocks.block_size`), an array on one device of an
    accelerator comes back as a `CutArray`: its pieces in the packs of `block_bytes` that
    the arrays (consecutive, on one device, of one staged dtype) are cut into end to end
    (`device_blocks.PackStream`), each a `PackSlice` of its pack. So a version's
    device-to-host copies are its bytes over `block_bytes`, each of one size."""
    stream = PackStream(block_bytes)
    packs: list[list[Piece]] = []
    held: dict[str, CutArray] = {}
    for name, x in arrays.items():
        devices = x.sharding.device_set
        platform = next(iter(devices)).platform
        if not block_bytes or len(devices) != 1 or platform in params_module.HOST_MEMORY_PLATFORMS:
            packs.append(stream.close())
            continue
        dtype = dtype_info(weight_dtype).numpy if weight_dtype else np.dtype(x.dtype)
        held[name] = CutArray(tuple(x.shape), dtype, platform, [])
        if size := math.prod(x.shape):  # an empty one: no blocks
            packs += stream.add((next(iter(devices)), dtype), name, size, dtype.itemsize)
    packs = [pieces for pieces in [*packs, stream.close()] if pieces]
    plan = tuple(
        (
            tuple((p.entry, p.start, p.count) for p in pieces),
            pack_elements(pieces, held[pieces[0].entry].dtype.itemsize, block_bytes),
        )
        for pieces in packs
    )
    out, packed = _copy(arrays, weight_dtype, plan, tuple(held))
    for pieces, pack in zip(packs, packed, strict=True):
        at = 0
        for p in pieces:
            item = held[p.entry].dtype.itemsize
            held[p.entry].blocks.append((p.start * item, p.count * item, PackSlice(pack, at, p.count)))
            at += p.count
    return out | held
