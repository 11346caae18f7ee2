"""A group of leaves (a layer's worth) built at once, for leaves on a mesh checked by a
jitted fingerprint: one batched `device_put` of the group's host bytes, then one program
that lays out every leaf that needs it (permute, repeat, pad: `Part`'s transform) and
fingerprints every leaf of the group, each device summing its own shards.

Leaf by leaf, an apply dispatches a transfer, a transform and a fingerprint program and
waits for each fingerprint's row: three dispatches and a host round trip per leaf, where
a transfer of the same bytes dispatches once. Here a layer of eleven leaves costs one
`device_put` call and one program; the fingerprint rows of the whole group come back in
one read at the commit. Host bytes go over as they lie in the receive buffer (views: no
host copy); a leaf that nothing transforms goes over as the leaf itself and is only read
by the program. In place, each transformed leaf's old buffer is donated to the program
(the output takes its memory: no second copy, no wait per leaf).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from rollout_agent.engines.jax.fingerprint import (
    ShardCheck,
    fingerprint_length,
    local_fingerprint,
    on_one_mesh,
    rows_checks,
)
from rollout_agent.engines.jax.names import LeafPlan

TRANSFORM, PUT, BUILT = "transform", "put", "built"


@dataclass
class GroupLeaf:
    """One leaf of a group and how it gets to the devices.

    kind: TRANSFORM (`src`, the tensor split into its axes, goes over in `src_sharding`
    and the program lays it out), PUT (`src` is the leaf's own bytes, sent in the leaf's
    sharding) or BUILT (`leaf` already stands on the devices: the host built it).
    `old`: in place, the leaf it replaces (a TRANSFORM's is donated to the program).
    """

    path: str
    plan: LeafPlan
    kind: str
    src: np.ndarray | None = None
    src_sharding: Any = None
    leaf: Any = None
    old: Any = None

    @property
    def sharding(self) -> NamedSharding:
        return self.plan.sharding  # type: ignore[no-any-return]


def groupable(plan: LeafPlan) -> bool:
    """A leaf whose sharding one program over its mesh can fingerprint."""
    return on_one_mesh(plan.sharding)


def dispatch(leaves: Sequence[GroupLeaf], *, donate: bool) -> tuple[dict[str, Any], dict[str, ShardCheck]]:
    """Sends the group over and starts its program; returns the new leaves by path (not
    waited for) and each leaf's device check (its rows copied to the host as they come).
    Every leaf must be on one mesh; `donate`: the TRANSFORM leaves' `old` buffers become
    the new leaves' memory."""
    mesh = leaves[0].sharding.mesh
    sent = [leaf for leaf in leaves if leaf.kind in (TRANSFORM, PUT)]
    arrays = jax.device_put([leaf.src for leaf in sent], [leaf.src_sharding for leaf in sent], may_alias=False)
    landed = dict(zip((leaf.path for leaf in sent), arrays))
    transformed = [leaf for leaf in leaves if leaf.kind == TRANSFORM]
    read = [leaf for leaf in leaves if leaf.kind != TRANSFORM]
    signature = _Signature(
        mesh,
        tuple((p.perm, p.repeat, p.region, leaf.sharding) for leaf in transformed for p in leaf.plan.parts[:1]),
        tuple((leaf.sharding.spec, leaf.plan.dtype.itemsize) for leaf in read),
        tuple(leaf.plan.dtype.itemsize for leaf in transformed),
        donate,
    )
    program = _program(signature)
    extra = tuple(landed[leaf.path] if leaf.kind == PUT else leaf.leaf for leaf in read)
    sources = tuple(landed[leaf.path] for leaf in transformed)
    if donate:
        outs, rows = program(sources, extra, tuple(leaf.old for leaf in transformed))
    else:
        outs, rows = program(sources, extra)
    rows.copy_to_host_async()  # read at the commit: the group's rows in one transfer
    new = dict(zip((leaf.path for leaf in transformed), outs))
    new.update((leaf.path, arr) for leaf, arr in zip(read, extra))
    order = transformed + read
    lengths = [fingerprint_length(len(leaf.plan.shape), leaf.plan.dtype.itemsize) for leaf in order]
    checks = rows_checks(mesh, rows, [(leaf.path, leaf.sharding, leaf.plan.shape) for leaf in order], lengths)
    return new, checks


@dataclass(frozen=True)
class _Signature:
    """What a group's program depends on beyond its inputs' shapes (its cache key)."""

    mesh: Any
    transforms: tuple[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], Any], ...]  # perm, repeat, region, out
    reads: tuple[tuple[Any, int], ...]  # spec, itemsize of each leaf only fingerprinted
    itemsizes: tuple[int, ...]  # of the transformed leaves
    donate: bool


@cache
def _program(sig: _Signature) -> Callable[..., Any]:
    """The jitted group program: (sources, leaves only read[, old leaves donated]) ->
    (transformed leaves, fingerprint rows: one row per device in the mesh's order, each
    leaf's block fingerprint in turn)."""
    every = tuple(sig.mesh.axis_names)
    specs = tuple(out.spec for _, _, _, out in sig.transforms) + tuple(spec for spec, _ in sig.reads)
    itemsizes = sig.itemsizes + tuple(size for _, size in sig.reads)

    def local(*xs: Any) -> Any:
        return jnp.concatenate([local_fingerprint(x, size) for x, size in zip(xs, itemsizes)])[None, :]

    fingerprints = jax.shard_map(
        local, mesh=sig.mesh, in_specs=specs, out_specs=PartitionSpec(every), check_vma=False
    )  # fmt: skip

    def run(sources: tuple[Any, ...], extra: tuple[Any, ...], *old: Any) -> tuple[tuple[Any, ...], Any]:
        outs = tuple(
            jax.lax.with_sharding_constraint(laid_out(x, perm, repeat, region), out)
            for x, (perm, repeat, region, out) in zip(sources, sig.transforms)
        )
        return outs, fingerprints(*outs, *extra)

    out_shardings = (tuple(out for *_, out in sig.transforms), NamedSharding(sig.mesh, PartitionSpec(every)))
    if sig.donate:
        return jax.jit(run, out_shardings=out_shardings, donate_argnums=(2,), keep_unused=True)
    return jax.jit(run, out_shardings=out_shardings)


def laid_out(x: Any, perm: tuple[int, ...], repeat: tuple[int, ...], region: tuple[int, ...]) -> Any:
    """The split tensor permuted, repeated and zero-padded into its leaf's region (traced)."""
    y = jnp.transpose(x, perm)
    for t, r in enumerate(repeat):
        if r > 1:
            y = jnp.repeat(y, r, axis=t)
    if y.shape != region:
        y = jnp.pad(y, [(0, g - n) for n, g in zip(y.shape, region)])
    return y
