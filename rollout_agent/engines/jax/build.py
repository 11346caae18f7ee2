"""Building one leaf in the sharding of the leaf it replaces, from the verified host bytes,
each device getting only its own slice: the host sends every device its box of the
transformed tensor (`host_build`), or the tensor goes over as it is, sharded to match,
and a jitted transform permutes and pads it on the devices (`device_build`). Nothing is
gathered onto one device. `JaxApply` chooses which, and checks what was built.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from functools import cache
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

from rollout_agent.engines.jax import groups as jax_groups
from rollout_agent.engines.jax.names import LeafPlan, Part, leaf_box


def host_build(plan: LeafPlan, cast: Mapping[str, np.ndarray], corrupt: bool) -> Any:
    """The leaf built on the host: every device is sent its box of the transformed tensor
    (one strided view where the leaf is the tensor as it lies); `corrupt` flips a bit."""
    # may_alias=False says what is meant, but JAX ignores it for NumPy input and a CPU
    # device may keep the host bytes as its memory (jax#37830): `owned` checks the result
    p = plan.parts[0]
    if len(plan.parts) == 1 and p.plain and not corrupt:
        # one strided view of the whole leaf: JAX slices it per device and copies each
        # slice (transposing as it copies) without a Python step per device
        return jax.device_put(p.view(cast[p.name]), plan.sharding, may_alias=False)
    devices, boxes = [], []
    for dev, index in plan.sharding.addressable_devices_indices_map(plan.shape).items():
        box = leaf_box(plan, cast, index)
        if corrupt and not boxes:
            box = flipped(box)
        devices.append(dev)
        boxes.append(box)
    arrays = jax.device_put(boxes, devices, may_alias=False)
    return jax.make_array_from_single_device_arrays(plan.shape, plan.sharding, arrays)


def device_build(plan: LeafPlan, cast: Mapping[str, np.ndarray], source: Any, donate: Any, corrupt: bool) -> Any:
    """The leaf built on the devices: the tensor goes over in `source` (`source_sharding`)
    and a jitted transform lays it out in the leaf's sharding, taking over `donate`'s
    buffer where given (the old leaf, in place); `corrupt` flips a bit."""
    p = plan.parts[0]
    src = cast[p.name].reshape(p.split)
    if corrupt:
        src = flipped(src)
    x = jax.device_put(src, source, may_alias=False)
    fn = _transform(p.perm, p.repeat, p.region, plan.sharding, donate is not None)
    return fn(x, donate) if donate is not None else fn(x)


def source_sharding(p: Part, target: Any) -> Any:
    """The sharding of the split tensor under which each device holds exactly what its
    target shard needs (each sharded leaf axis maps to the tensor axis it comes from); None
    where that does not exist (growth along a sharded axis, an unknown sharding kind)."""
    if isinstance(target, SingleDeviceSharding):
        return target
    if not isinstance(target, NamedSharding) or p.start != (0,) * len(p.start):
        return None
    spec = tuple(target.spec) + (None,) * (len(p.region) - len(target.spec))
    src: list[Any] = [None] * len(p.split)
    for t, axes in enumerate(spec):
        if axes is None:
            continue
        if not isinstance(axes, (str, tuple)) or p.repeat[t] != 1 or p.moved[t] != p.region[t]:
            return None
        src[p.perm[t]] = axes
    return NamedSharding(target.mesh, PartitionSpec(*src), memory_kind=target.memory_kind)


@cache
def _transform(
    perm: tuple[int, ...], repeat: tuple[int, ...], region: tuple[int, ...], out: Any, donate: bool
) -> Callable[..., Any]:
    """The jitted split -> leaf transform: permute, repeat, zero-pad, into `out`."""

    def f(x: Any, *old: Any) -> Any:
        return jax_groups.laid_out(x, perm, repeat, region)

    if donate:
        return jax.jit(f, out_shardings=out, donate_argnums=(1,), keep_unused=True)
    return jax.jit(f, out_shardings=out)


def owned(arr: Any, sources: Iterable[np.ndarray]) -> Any:
    """`arr`, or a copy of it on its devices where a shard's buffer lies inside the host
    bytes it was built from. A CPU device adopts an aligned, contiguous host array as its
    own buffer whatever device_put's `may_alias` says (jax#37830); the pulled bytes are
    overwritten by the next pull, and the engine would serve them as they change."""
    if all(d.platform != "cpu" for d in arr.sharding.device_set):
        return arr  # an accelerator's memory is never the host's
    ranges = [(a.ctypes.data, a.ctypes.data + a.nbytes) for a in sources if a.nbytes]
    for shard in arr.addressable_shards:
        ptr = shard.data.unsafe_buffer_pointer()
        if any(lo <= ptr < hi for lo, hi in ranges):
            return jnp.array(arr, copy=True)
    return arr


def flipped(a: np.ndarray) -> np.ndarray:
    """A copy of `a` with one bit flipped (the corruption the device check must catch)."""
    out = np.array(a, copy=True)
    if out.size:
        out.reshape(-1).view(np.uint8)[out.nbytes // 2] ^= 0x10
    return out


def all_on_cpu(sharding: Any) -> bool:
    return all(d.platform == "cpu" for d in sharding.device_set)


def is_identity(p: Part) -> bool:
    """Nothing to transform: the leaf is the tensor as it is."""
    return p.plain and p.perm == tuple(range(len(p.perm)))


def device_boxes(plan: LeafPlan) -> list[tuple[Any, int]]:
    """(device, elements of its box) for every device holding part of the leaf."""
    out = []
    for dev, index in plan.sharding.addressable_devices_indices_map(plan.shape).items():
        n = 1
        for s, size in zip(index, plan.shape):
            n *= len(range(*s.indices(size)))
        out.append((dev, n))
    return out
