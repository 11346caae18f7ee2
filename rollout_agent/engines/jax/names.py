"""Name maps: HF-named tensors -> the leaves of a JAX engine's weight pytree, as data.

A `NameMap` is a family's tensor table (`weightsync.model_families`) and a `Layout` per
role: the engine's axis order for that role's tensors, written with the role's axis
letters (v vocab, d hidden, x heads of the tensor's own count, h head_dim, f intermediate,
w a norm's width). From a version's tensors and the engine's leaves, `NameMap.plan` works
out each leaf's `Part`s: the HF tensor, split into its axes (`(x h) d` -> x, h, d),
permuted into the engine's order, grown where the engine's leaf is larger (head_dim and
vocab zero-padded, a head count below the model axis repeated, as tpu-inference does),
cast, and placed at an offset of a fused leaf. NumPy only: the reference transform, the
per-device slices of it the apply sends, and the fingerprint of it the device must match
(`host_fingerprint`) all come from here.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import ml_dtypes
import numpy as np

from weightsync.dtypes import dtype_info
from weightsync.errors import InvalidArgument
from weightsync.model_families import FAMILIES, Family, Role, Tensor

# A role's HF axes with fused ones split ("(x h) d": the first HF axis is x·h).
SOURCE_AXES: dict[Role, str] = {
    Role.EMBEDDING: "v d",
    Role.LM_HEAD: "v d",
    Role.NORM: "w",
    Role.HEADS_IN: "(x h) d",
    Role.HEADS_OUT: "d (x h)",
    Role.MLP_IN: "f d",
    Role.MLP_OUT: "d f",
}

# The engine layouts weightsync knows, role -> the engine's axis order.
LAYOUTS: dict[str, dict[Role, str]] = {
    # The engine keeps HF's layouts (a dict of HF-named arrays, as the NumPy applier).
    "hf": {Role.EMBEDDING: "v d", Role.LM_HEAD: "v d", Role.NORM: "w", Role.HEADS_IN: "(x h) d",
           Role.HEADS_OUT: "d (x h)", Role.MLP_IN: "f d", Role.MLP_OUT: "d f"},
    # vLLM's TPU backend (tpu-inference's JAX models: JaxEinsum "TD,DNH->TNH" for q/k/v,
    # "TNH,NHD->TD" for o, JaxLinear kernels [in, out], lm_head "TD,DV->TV").
    "tpu_inference": {Role.EMBEDDING: "v d", Role.LM_HEAD: "d v", Role.NORM: "w", Role.HEADS_IN: "d x h",
                      Role.HEADS_OUT: "x h d", Role.MLP_IN: "d f", Role.MLP_OUT: "f d"},
}  # fmt: skip

# How an engine's leaf may be larger than the tensor along an axis: tpu-inference pads
# head_dim to a multiple of 128 and vocabulary rows with zeros, and repeats each head
# where a head count is below its `model` mesh axis.
DEFAULT_GROW: dict[str, str] = {"h": "pad", "v": "pad", "x": "repeat"}


def _axes(pattern: str) -> list[tuple[str, ...]]:
    """'(x h) d' -> [('x', 'h'), ('d',)]."""
    out: list[tuple[str, ...]] = []
    for m in re.finditer(r"\(([^)]*)\)|(\S+)", pattern):
        out.append(tuple(m.group(1).split()) if m.group(1) is not None else (m.group(2),))
    return out


@dataclass(frozen=True)
class Part:
    """One HF tensor's place in a leaf, and how it gets there (all shapes in elements).

    The tensor (`source`, dtype `source_dtype`) is reshaped to `split`, transposed by
    `perm` (leaf axis t takes split axis perm[t]), grown (`repeat[t]` copies of each index
    along t, then zeros up to `region[t]`), cast to the leaf's dtype, and written at
    `start` in the leaf: the box [start, start + region).
    """

    name: str
    source: tuple[int, ...]
    source_dtype: np.dtype
    split: tuple[int, ...]
    perm: tuple[int, ...]
    repeat: tuple[int, ...]
    region: tuple[int, ...]
    start: tuple[int, ...]
    dtype: np.dtype

    @property
    def moved(self) -> tuple[int, ...]:
        """The shape after the permutation and the repeats, before any padding."""
        return tuple(self.split[k] * r for k, r in zip(self.perm, self.repeat))

    @property
    def plain(self) -> bool:
        """No growth: every element of the region comes from the tensor exactly once."""
        return self.moved == self.region

    def cast(self, a: np.ndarray) -> np.ndarray:
        """The tensor in the leaf's dtype (itself when it already is)."""
        a = np.asarray(a)
        if a.shape != self.source:
            raise InvalidArgument(
                f"{self.name!r} has shape {list(a.shape)}, the plan {list(self.source)}", field="tensors"
            )
        return a if a.dtype == self.dtype else a.astype(self.dtype)

    def view(self, a: np.ndarray) -> np.ndarray:
        """The cast tensor split and permuted (a view: no copy)."""
        return a.reshape(self.split).transpose(self.perm)

    def reference(self, a: np.ndarray) -> np.ndarray:
        """The whole region, materialised (the transform's NumPy reference; moved as
        unsigned integers of the same width: NumPy copies bfloat16 element by element)."""
        v = self.view(_raw(self.cast(a)))
        for t, r in enumerate(self.repeat):
            if r > 1:
                v = np.repeat(v, r, axis=t)
        if v.shape != self.region:
            v = np.pad(v, [(0, g - n) for n, g in zip(v.shape, self.region)])
        return np.ascontiguousarray(v).view(self.dtype)

    def box(self, a: np.ndarray, box: Sequence[slice]) -> np.ndarray:
        """The sub-box `box` (region coordinates, unit steps) of the transformed tensor `a`
        (already cast): a strided view of it where no growth falls inside the box, else
        a small array built for it."""
        v = self.view(a)
        src: list[slice] = []
        grown = False
        for t, (s, r) in enumerate(zip(box, self.repeat)):
            lo, hi = s.start or 0, s.stop if s.stop is not None else self.region[t]
            real = self.split[self.perm[t]] * r
            if hi > real or r > 1:
                grown = True
            src.append(slice(lo // r, min(-(-min(hi, real) // r), real // r)) if lo < real else slice(0, 0))
        if not grown:
            return v[tuple(src)]
        out = np.zeros(tuple((s.stop if s.stop is not None else g) - (s.start or 0) for s, g in zip(box, self.region)),
                       _raw(a).dtype)  # fmt: skip
        piece = _raw(v[tuple(src)])
        dst = []
        for t, (s, r) in enumerate(zip(box, self.repeat)):
            lo = s.start or 0
            if r > 1:
                piece = np.repeat(piece, r, axis=t)
                skip = lo - src[t].start * r
                piece = piece[(slice(None),) * t + (slice(skip, skip + out.shape[t]),)]
            dst.append(slice(0, piece.shape[t]))
        out[tuple(dst)] = piece
        return out.view(self.dtype)


@dataclass
class LeafPlan:
    """A leaf of the engine's tree and the parts that fill it (their regions tile it)."""

    path: str
    shape: tuple[int, ...]
    dtype: np.dtype
    sharding: Any
    parts: list[Part] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class NameMap:
    """HF names -> leaf paths and transforms for one family and engine layout.

    Args:
        family: the HF tensor table (`weightsync.model_families`).
        layout: role -> the engine's axis order (`LAYOUTS`).
        head_dim: splits the attention projections into heads.
        prefix: put before every leaf path (`base.` for MaxText models in tpu-inference).
        overrides: HF name suffix -> axis order, for one tensor (`"self_attn.q_proj.weight":
            "x d h"`: tpu-inference's LAYOUT_Q_PROJ_AS_NDH).
        fused: HF name suffix -> (leaf suffix, axis letter): tensors concatenated along that
            axis into one leaf, in the family table's order (gate, up -> gate_up).
        grow: axis letter -> "pad" or "repeat", where a leaf may be larger than its tensor.
        ignore: leaves whose path has one of these dotted segments are never expected to
            be written (the KV cache, RNG state).
    """

    family: Family
    layout: Mapping[Role, str]
    head_dim: int
    prefix: str = ""
    overrides: Mapping[str, str] = field(default_factory=dict)
    fused: Mapping[str, tuple[str, str]] = field(default_factory=dict)
    grow: Mapping[str, str] = field(default_factory=lambda: dict(DEFAULT_GROW))
    ignore: tuple[str, ...] = ("cache", "kv_cache", "rngs", "rng")

    @classmethod
    def of(cls, family: str, layout: str, head_dim: int, **options: Any) -> NameMap:
        """A name map by family and layout name ('qwen3', 'tpu_inference')."""
        if family not in FAMILIES:
            raise InvalidArgument(f"unknown family {family!r}; known: {', '.join(sorted(FAMILIES))}", field="family")
        if layout not in LAYOUTS:
            raise InvalidArgument(f"unknown layout {layout!r}; known: {', '.join(sorted(LAYOUTS))}", field="layout")
        return cls(FAMILIES[family], LAYOUTS[layout], head_dim, **options)

    def _entry(self, name: str) -> tuple[Tensor, str, str]:
        """(table entry, layer prefix or '', suffix) of an HF name."""
        m = re.fullmatch(self.family.layer_prefix.replace(".", r"\.").replace("{i}", r"(\d+)") + "(.*)", name)
        if m:
            prefix, suffix = name[: len(name) - len(m.group(2))], m.group(2)
        else:
            prefix, suffix = "", name
        try:
            return self.family.tensor(suffix), prefix, suffix
        except KeyError:
            raise InvalidArgument(
                f"{name!r} is no {self.family.name} tensor this name map knows", field="manifest.tensors"
            ) from None

    def leaf_path(self, name: str) -> str:
        """The leaf an HF name is written to (a fused leaf for fused tensors)."""
        _, prefix, suffix = self._entry(name)
        fused = self.fused.get(suffix)
        return self.prefix + prefix + (fused[0] if fused else suffix)

    def plan(
        self, tensors: Mapping[str, tuple[tuple[int, ...], Any]], leaves: Mapping[str, Any], *, strict: bool = True
    ) -> dict[str, LeafPlan]:
        """Every written leaf's plan, by leaf path, from the version's tensors (name ->
        (shape, dtype)) and the engine's leaves (path -> anything with shape, dtype and
        sharding: jax.Array, jax.ShapeDtypeStruct).

        Raises:
            InvalidArgument (field manifest.tensors): a tensor the family does not have, or
            no leaf takes; a shape that does not map onto its leaf; with `strict`, a
            floating leaf no tensor writes (outside `ignore`).
        """
        order = {t.name: i for i, t in enumerate(self.family.head + self.family.layer + self.family.tail)}
        plans: dict[str, LeafPlan] = {}
        fused: dict[str, list[tuple[int, str]]] = {}
        for name, (shape, dtype) in tensors.items():
            entry, _, suffix = self._entry(name)
            path = self.leaf_path(name)
            leaf = leaves.get(path)
            if leaf is None:
                raise InvalidArgument(
                    f"{name!r} goes to leaf {path!r}, which the engine does not have", field="manifest.tensors"
                )
            if path not in plans:
                plans[path] = LeafPlan(path, tuple(leaf.shape), np.dtype(leaf.dtype), getattr(leaf, "sharding", None))
            if suffix in self.fused:
                fused.setdefault(path, []).append((order[suffix], name))
            else:
                plans[path].parts.append(self._part(name, tuple(shape), dtype, plans[path]))
        for path, names in fused.items():
            self._fuse(plans[path], [name for _, name in sorted(names)], tensors)
        if strict:
            self._check_all_written(plans, leaves)
        return plans

    def axes_of(self, name: str, shape: tuple[int, ...]) -> tuple[list[int], list[str], tuple[int, ...]]:
        """(split shape, the engine's axes, perm) of an HF tensor. A fused HF axis the
        engine keeps whole (`(x h)` in both) stays one axis, named by its letters joined."""
        entry, _, suffix = self._entry(name)
        width = {"head_dim": "h", "hidden": "d"}.get(entry.width, "w")  # a norm's axis is the one it scales
        src = [tuple(width if a == "w" else a for a in g) for g in _axes(SOURCE_AXES[entry.role])]
        dst_groups = [tuple(width if a == "w" else a for a in g)
                      for g in _axes(self.overrides.get(suffix, self.layout[entry.role]))]  # fmt: skip
        if len(shape) != len(src):
            raise InvalidArgument(
                f"{name!r} has shape {list(shape)}; a {entry.role.value} tensor has {len(src)} axes",
                field="manifest.tensors",
            )
        tokens: list[str] = []
        split: list[int] = []
        for group, n in zip(src, shape):
            if len(group) == 1 or group in dst_groups:
                tokens.append("".join(group))
                split.append(n)
                continue
            if n % self.head_dim:  # (x h): heads of head_dim each
                raise InvalidArgument(
                    f"{name!r} has {n} on its head axis, not a multiple of head_dim {self.head_dim}",
                    field="manifest.tensors",
                )
            tokens += list(group)
            split += [n // self.head_dim, self.head_dim]
        dst = ["".join(g) for g in dst_groups]
        if sorted(tokens) != sorted(dst):
            raise InvalidArgument(
                f"layout {' '.join(dst)!r} for {name!r} does not hold the axes {' '.join(tokens)}", field="layout"
            )
        return split, dst, tuple(tokens.index(a) for a in dst)

    def _part(
        self, name: str, shape: tuple[int, ...], dtype: Any, leaf: LeafPlan,
        start: tuple[int, ...] | None = None, region: tuple[int, ...] | None = None,
    ) -> Part:  # fmt: skip
        split, dst, perm = self.axes_of(name, shape)
        region = region or leaf.shape
        if len(region) != len(dst):
            raise InvalidArgument(
                f"{name!r} maps to {len(dst)} axes ({' '.join(dst)}), leaf {leaf.path!r} has shape {list(leaf.shape)}",
                field="manifest.tensors",
            )
        repeat = []
        for t, a in enumerate(dst):
            n, g = split[perm[t]], region[t]
            how = self.grow.get(a, "")
            if g == n or (g > n and how == "pad"):
                repeat.append(1)
            elif g > n and how == "repeat" and g % n == 0:
                repeat.append(g // n)
            else:
                raise InvalidArgument(
                    f"{name!r} (shape {list(shape)}, as {' '.join(dst)}: {[split[k] for k in perm]}) does not fit "
                    f"leaf {leaf.path!r} of shape {list(leaf.shape)}: its axis {a!r} is {g}",
                    field="manifest.tensors",
                )
        return Part(
            name, shape, _np_dtype(dtype), tuple(split), perm, tuple(repeat), tuple(region),
            start or (0,) * len(region), leaf.dtype,
        )  # fmt: skip

    def _fuse(self, leaf: LeafPlan, names: list[str], tensors: Mapping[str, tuple[Any, Any]]) -> None:
        """Parts concatenated along the fused axis, in the family table's order."""
        at, axis = 0, 0
        for name in names:
            shape, dtype = tensors[name]
            split, dst, perm = self.axes_of(name, tuple(shape))
            axis = dst.index(self.fused[self._entry(name)[2]][1])
            size = split[perm[axis]]
            if at + size > leaf.shape[axis]:
                break
            leaf.parts.append(
                self._part(name, tuple(shape), dtype, leaf, start=_with((0,) * len(leaf.shape), axis, at),
                           region=_with(leaf.shape, axis, size))
            )  # fmt: skip
            at += size
        else:
            if at == leaf.shape[axis]:
                return
        raise InvalidArgument(
            f"leaf {leaf.path!r} has {leaf.shape[axis]} on its fused axis; its parts {names} do not fill it",
            field="manifest.tensors",
        )

    def _check_all_written(self, plans: Mapping[str, LeafPlan], leaves: Mapping[str, Any]) -> None:
        for path, leaf in leaves.items():
            if path in plans or not _floating(leaf.dtype):
                continue
            if any(seg in self.ignore for seg in path.split(".")):
                continue
            raise InvalidArgument(
                f"no tensor of the version writes the engine's leaf {path!r} (pass strict=False to leave it)",
                field="manifest.tensors",
            )


def _raw(a: np.ndarray) -> np.ndarray:
    """The same bytes as unsigned integers of the element's width (a view)."""
    return a.view(f"u{a.dtype.itemsize}") if a.dtype.itemsize in (1, 2, 4, 8) else a


def _floating(dtype: Any) -> bool:
    """A float dtype, bfloat16 and the other ml_dtypes included."""
    try:
        ml_dtypes.finfo(np.dtype(dtype))
    except ValueError:
        return False
    return True


def _with(t: tuple[int, ...], i: int, v: int) -> tuple[int, ...]:
    return t[:i] + (v,) + t[i + 1 :]


def _np_dtype(dtype: Any) -> np.dtype:
    return dtype_info(dtype).numpy if isinstance(dtype, str) else np.dtype(dtype)


def reference_leaf(plan: LeafPlan, tensors: Mapping[str, np.ndarray]) -> np.ndarray:
    """The whole leaf a version makes, in NumPy (for tests and read-back checks)."""
    if len(plan.parts) == 1 and plan.parts[0].region == plan.shape:
        return plan.parts[0].reference(tensors[plan.parts[0].name])
    out = _raw(np.zeros(plan.shape, plan.dtype))
    for p in plan.parts:
        out[tuple(slice(s, s + n) for s, n in zip(p.start, p.region))] = _raw(p.reference(tensors[p.name]))
    return out.view(plan.dtype)


def leaf_box(plan: LeafPlan, cast: Mapping[str, np.ndarray], index: Sequence[slice]) -> np.ndarray:
    """The box `index` (a device's slice, leaf coordinates) of the leaf, from the cast
    tensors: a strided view of one tensor where one part holds the whole box, else
    assembled from the parts it crosses."""
    box = [(s.start or 0, s.stop if s.stop is not None else n) for s, n in zip(index, plan.shape)]
    for p in plan.parts:
        if all(s <= a and b <= s + n for (a, b), s, n in zip(box, p.start, p.region)):
            return p.box(cast[p.name], [slice(a - s, b - s) for (a, b), s in zip(box, p.start)])
    out = _raw(np.zeros(tuple(b - a for a, b in box), plan.dtype))
    for p in plan.parts:
        lo = [max(a, s) for (a, _), s in zip(box, p.start)]
        hi = [min(b, s + n) for (_, b), s, n in zip(box, p.start, p.region)]
        if all(x < y for x, y in zip(lo, hi)):
            out[tuple(slice(x - a, y - a) for x, y, (a, _) in zip(lo, hi, box))] = _raw(
                p.box(cast[p.name], [slice(x - s, y - s) for x, y, s in zip(lo, hi, p.start)])
            )
    return out.view(plan.dtype)


def shapes_of(specs: Iterable[Any]) -> dict[str, tuple[tuple[int, ...], Any]]:
    """name -> (shape, dtype) from manifest `TensorSpec`s (or anything with those fields)."""
    return {s.name: (tuple(s.shape), s.dtype) for s in specs}
