"""An engine's weight leaves for a model shape, laid out and sharded as the engine would:
for the bench, the tests and a rollout that holds a JAX model of a preset (`--engine jax`).

tpu-inference's rules (`utils.get_padded_head_dim`, `get_padded_num_heads`): head_dim is
padded to a multiple of 128 (64 stays 64); a head count below the mesh's `model` axis is
padded up to it (each head repeated). Which mesh axes shard a leaf is a `profile`: axis
letter -> mesh axis; tpu-inference's own puts heads, the MLP's intermediate axis and the
vocabulary on `model`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import ml_dtypes
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from rollout_agent.engines.jax.names import NameMap
from weightsync.model_families import FAMILIES, Dims, role_shape

PROFILES: dict[str, dict[str, str]] = {
    "none": {},
    "heads": {"x": "model"},
    "hidden": {"d": "data"},
    "vocab": {"v": "model"},
    "tpu_inference": {"x": "model", "f": "model", "v": "model"},
    "2d": {"d": "data", "x": "model", "f": "model", "v": "model"},
}


def padded_head_dim(h: int) -> int:
    """tpu-inference's head_dim: a multiple of 128, except 64."""
    return h if h == 64 else -(-h // 128) * 128


def padded_heads(n: int, model_axis: int) -> int:
    """tpu-inference's head count: at least the `model` axis (which then divides by it)."""
    if n >= model_axis:
        if n % model_axis:
            raise ValueError(f"{n} heads do not divide over a model axis of {model_axis}")
        return n
    if model_axis % n:
        raise ValueError(f"a model axis of {model_axis} does not divide by {n} heads")
    return model_axis


def mesh_of(shape: tuple[int, int], devices: Any = None) -> Mesh:
    """A ("data", "model") mesh of `shape` over `devices` (default: all)."""
    devs = np.array(devices if devices is not None else jax.devices())
    if devs.size != shape[0] * shape[1]:
        raise ValueError(f"a {shape[0]}x{shape[1]} mesh needs {shape[0] * shape[1]} devices, there are {devs.size}")
    return Mesh(devs.reshape(shape), ("data", "model"))


def leaf_layouts(
    name_map: NameMap, dims: Dims, layers: int, tied: bool, mesh: Mesh, profile: Mapping[str, str]
) -> dict[str, tuple[tuple[int, ...], PartitionSpec]]:
    """Leaf path -> (shape, spec) of every leaf the engine holds for a model of `dims`."""
    fam = name_map.family
    pad = name_map.grow.get("h") == "pad"
    out: dict[str, tuple[tuple[int, ...], PartitionSpec]] = {}
    for name, t in fam.names(layers, tied):
        split, axes, perm = name_map.axes_of(name, role_shape(t, dims))
        shape = []
        for a, k in zip(axes, perm):
            n = split[k]
            if a == "h" and pad:
                n = padded_head_dim(n)
            elif a == "x" and name_map.grow.get("x") == "repeat":
                n = padded_heads(n, mesh.shape["model"])
            shape.append(n)
        spec = PartitionSpec(*(profile.get(a) if len(a) == 1 else None for a in axes))
        out[name_map.leaf_path(name)] = (tuple(shape), spec)
    return out


def empty_leaves(
    name_map: NameMap, dims: Dims, layers: int, tied: bool, mesh: Mesh, profile: Mapping[str, str],
    dtype: Any = ml_dtypes.bfloat16,
) -> dict[str, jax.Array]:  # fmt: skip
    """Zero leaves in their shardings (each device gets its slice of zeros: no program to
    compile per leaf shape)."""
    out = {}
    for path, (shape, spec) in leaf_layouts(name_map, dims, layers, tied, mesh, profile).items():
        out[path] = jax.device_put(np.zeros(shape, dtype), NamedSharding(mesh, spec), may_alias=False)
    return out


def family_map(family: str, layout: str, dims: Dims, **options: Any) -> NameMap:
    """The name map of `family` in `layout` for a model of `dims`."""
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; known: {', '.join(sorted(FAMILIES))}")
    return NameMap.of(family, layout, dims.head_dim, **options)
