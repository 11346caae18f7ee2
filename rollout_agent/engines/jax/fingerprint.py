"""Exact fingerprints of a leaf's bits: on the device, and from the host bytes through the
transform, so a leaf is served only when the two agree.

A leaf's fingerprint is its bits' (`engines.fingerprint`): modulo 2^32, T = sum(b) and
per axis F_k = sum(b · index_k). Both are linear in position, so the host works them out
from per-axis sums of the tensor in its own (HF) layout, through the transform's
permutation, repeats and offset (`host_fingerprint`), without building the leaf; padding
is zeros and adds nothing. The device side sums each device's shard where it lives (a
jitted reduction, or NumPy over the shard's memory on CPU devices, where it is host
memory), then shifts each shard's F_k by its offset in the leaf.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from functools import cache
from typing import Any

import numpy as np

from rollout_agent.engines.fingerprint import MASK, Fingerprint, add, array_fingerprint, bits, shifted
from rollout_agent.engines.jax.names import LeafPlan, Part


def part_fingerprint(p: Part, cast: np.ndarray) -> Fingerprint:
    """The fingerprint a part's region of its leaf must have, from the cast tensor in its
    own layout: F along leaf axis t comes from the tensor's axis perm[t], stretched by
    that axis' repeats and shifted by the part's start."""
    b = bits(cast.reshape(p.split))
    g = array_fingerprint(b)
    total = g[0]
    copies = 1
    for r in p.repeat:
        copies *= r
    out = [copies * total]
    for t, k in enumerate(p.perm):
        r, o = p.repeat[t], p.start[t]
        out.append((copies // r) * (r * o * total + r * r * g[1 + k] + r * (r - 1) // 2 * total))
    out += [copies * x for x in g[1 + len(p.split) :]]  # the 8-byte elements' two halves
    return tuple(x & MASK for x in out)


def host_fingerprint(plan: LeafPlan, tensors: Mapping[str, np.ndarray]) -> Fingerprint:
    """The leaf's fingerprint from the host bytes (tensors by name, cast to the leaf's
    dtype here where they are not) through the plan."""
    return add(part_fingerprint(p, p.cast(tensors[p.name])) for p in plan.parts)


@dataclass
class ShardCheck:
    """The device-side fingerprint of one leaf, shard by shard (replicas compared)."""

    path: str
    blocks: dict[tuple[int, ...], list[tuple[Any, Callable[[], Fingerprint]]]]  # start -> [(device, its fp)]

    def result(self) -> tuple[Fingerprint, str]:
        """(the leaf's fingerprint, a problem: replicas of one block that differ, or '')."""
        total: list[Fingerprint] = []
        for start, held in self.blocks.items():
            seen = [(dev, fp()) for dev, fp in held]
            first = seen[0][1]
            for dev, fp in seen[1:]:
                if fp != first:
                    return (), f"replicas of the block at {list(start)} differ on {dev}"
            total.append(shifted(first, start))
        return add(total), ""


def device_fingerprint(path: str, arr: Any, method: str, pool: Executor | None = None) -> ShardCheck:
    """Starts the fingerprint of every shard of `arr` where it lives: "jit" (dispatched,
    not waited for: one program over the mesh for a NamedSharding, one per shard
    otherwise) or "view" (NumPy over a CPU device's memory: on `pool`'s threads, beside
    the next leaves' copies, or here without one)."""
    if method == "jit" and on_one_mesh(arr.sharding):
        return mesh_fingerprints([[(path, arr)]])[path]
    blocks: dict[tuple[int, ...], list[tuple[Any, Callable[[], Fingerprint]]]] = {}
    starts = _starts(arr.sharding, tuple(arr.shape))
    shards = arr.addressable_shards
    if method == "view":  # one job per leaf: a job per shard costs more than small shards' sums
        data = [shard.data for shard in shards]
        if pool is not None:
            job = pool.submit(lambda: [_view_fingerprint(d) for d in data])
            done: Callable[[], list[Fingerprint]] = job.result
        else:
            fps = [_view_fingerprint(d) for d in data]
            done = lambda: fps  # noqa: E731
        for i, shard in enumerate(shards):
            blocks.setdefault(starts[shard.device], []).append((shard.device, lambda i=i: done()[i]))
        return ShardCheck(path, blocks)
    for shard in shards:
        pending = _jitted_fingerprint(shard.data.ndim, shard.data.dtype.itemsize)(shard.data)
        pending.copy_to_host_async()
        blocks.setdefault(starts[shard.device], []).append((shard.device, lambda p=pending: _tuple(p)))
    return ShardCheck(path, blocks)


def on_one_mesh(sharding: Any) -> bool:
    """Whether one program over a mesh can fingerprint a leaf of this sharding: a
    NamedSharding whose every device is this process's."""
    from jax.sharding import NamedSharding

    return isinstance(sharding, NamedSharding) and sharding.is_fully_addressable


def mesh_fingerprints(groups: Sequence[Sequence[tuple[str, Any]]]) -> dict[str, ShardCheck]:
    """Starts the fingerprints of groups of leaves (path, array), each device summing its
    own shards: one program per group and mesh (dispatched, its rows copied to the host
    as they come: read at the commit, every group's in flight by then). Groups alike in
    shapes, shardings and dtypes (a model's layers) share one compiled program. Every leaf
    must be `on_one_mesh` by its sharding."""
    out: dict[str, ShardCheck] = {}
    for group in groups:
        by_mesh: dict[Any, list[tuple[str, Any]]] = {}
        for path, arr in group:
            by_mesh.setdefault(arr.sharding.mesh, []).append((path, arr))
        for mesh, held in by_mesh.items():
            signature = tuple((arr.sharding.spec, arr.dtype.itemsize) for _, arr in held)
            rows = _leaves_fingerprint(mesh, signature)(*(arr for _, arr in held))
            rows.copy_to_host_async()
            lengths = [fingerprint_length(arr.ndim, arr.dtype.itemsize) for _, arr in held]
            out |= rows_checks(mesh, rows, [(path, arr.sharding, arr.shape) for path, arr in held], lengths)
    return out


@cache
def _leaves_fingerprint(mesh: Any, signature: tuple[tuple[Any, int], ...]) -> Any:
    """One program over the mesh: for each device, the block fingerprints of every leaf
    (spec, itemsize in `signature`) side by side in its row."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec

    every = tuple(mesh.axis_names)

    def local(*xs: Any) -> Any:
        return jnp.concatenate([local_fingerprint(x, size) for x, (_, size) in zip(xs, signature)])[None, :]

    f = jax.shard_map(
        local, mesh=mesh, in_specs=tuple(spec for spec, _ in signature), out_specs=PartitionSpec(every),
        check_vma=False,
    )  # fmt: skip
    return jax.jit(f)


def _view_fingerprint(data: Any) -> Fingerprint:
    return array_fingerprint(bits(np.asarray(data)))


def fingerprint_length(ndim: int, itemsize: int) -> int:
    """How many numbers a leaf's fingerprint has: T, one F per axis, and one more for the
    second half of 8-byte elements."""
    return ndim + 1 + (itemsize == 8)


def rows_checks(
    mesh: Any, rows: Any, leaves: Sequence[tuple[str, Any, tuple[int, ...]]], lengths: Sequence[int]
) -> dict[str, ShardCheck]:
    """The device checks of leaves (path, sharding, shape) whose block fingerprints one
    program wrote side by side (`lengths` each, in order) into `rows`: a row per device in
    `mesh`'s order, read from the device once, by the first check that needs it."""
    table = _Rows(rows)
    devices = list(mesh.devices.flat)
    out = {}
    at = 0
    for (path, sharding, shape), n in zip(leaves, lengths):
        starts = _starts(sharding, tuple(shape))
        blocks: dict[tuple[int, ...], list[tuple[Any, Callable[[], Fingerprint]]]] = {}
        for i, dev in enumerate(devices):
            blocks.setdefault(starts[dev], []).append((dev, lambda i=i, lo=at, hi=at + n: table.row(i, lo, hi)))
        out[path] = ShardCheck(path, blocks)
        at += n
    return out


@cache
def _starts(sharding: Any, shape: tuple[int, ...]) -> dict[Any, tuple[int, ...]]:
    return {dev: tuple(s.start or 0 for s in index) for dev, index in sharding.devices_indices_map(shape).items()}


class _Rows:
    """Per-device fingerprints from one program, read from the device once."""

    def __init__(self, pending: Any) -> None:
        self._pending = pending
        self._rows: np.ndarray | None = None

    def row(self, i: int, lo: int = 0, hi: int | None = None) -> Fingerprint:
        if self._rows is None:
            self._rows = np.asarray(self._pending)
        return _tuple(self._rows[i, lo:hi])


def _tuple(fp: Any) -> Fingerprint:
    return tuple(int(x) & MASK for x in np.asarray(fp).reshape(-1))


def local_fingerprint(x: Any, itemsize: int) -> Any:
    """[T, F_0, ...] of one block, traced: a wrapping uint32 sum of the bits, plain and
    weighted by each axis' index."""
    import jax.numpy as jnp
    from jax import lax

    uint = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[itemsize]
    b = x.astype(jnp.uint8) if x.dtype == jnp.bool_ else lax.bitcast_convert_type(x, uint)
    b = b.astype(jnp.uint32)
    out = [jnp.sum(b, dtype=jnp.uint32)]
    for k in range(b.ndim):
        out.append(jnp.sum(b * lax.broadcasted_iota(jnp.uint32, b.shape, k), dtype=jnp.uint32))
    return jnp.stack(out)


@cache
def _jitted_fingerprint(ndim: int, itemsize: int) -> Any:
    import jax

    return jax.jit(lambda x: local_fingerprint(x, itemsize))
