"""Target-free, streaming MaxText -> HF conversion: path normalisation, unscanning, rules.

A converter is a declarative `ConverterSpec` (global rules + per-layer rules). The engine
pops each source leaf as it converts it, so the source tree and the converted tree never
coexist in full (keeping both roughly doubles host memory: an upstream OOMKill).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from weightsync.dtypes import dtype_info
from weightsync.errors import InvalidArgument
from weightsync.model_families import Family, Role, Tensor

Array = Any  # np.ndarray or jax.Array: transforms keep the input's kind


def xp_of(a: Any) -> Any:
    """jax.numpy for JAX arrays (XLA does the transposes, tiled), numpy otherwise."""
    return jnp if isinstance(a, jax.Array) else np


# A transform maps one per-layer slice (or a global leaf) to {hf_name_suffix: array}.
Emit = Callable[[Array, "ModelDims"], dict[str, Array]]


@dataclass(frozen=True)
class ModelDims:
    """What the transforms need to know about the model (no target model required)."""

    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int = 0  # HF vocab size; MaxText may pad the embedding beyond it (0 = keep)
    tied: bool = False
    experts: int = 0
    moe_pad_tp: int = 0  # pad each expert's mlp dim per tensor-parallel shard (0 = no padding)


@dataclass(frozen=True)
class Rule:
    """MaxText key (dotted, relative to the decoder layer or the root) -> HF outputs;
    `tensor` is the family table's entry of the HF tensor it makes (None: several)."""

    key: str
    emit: Emit
    tensor: Tensor | None = None


@dataclass(frozen=True)
class ConverterSpec:
    """A model family's mapping table."""

    family: str
    global_rules: tuple[Rule, ...]
    layer_rules: tuple[Rule, ...]
    layer_prefix: str = "model.layers.{i}."


@dataclass
class ConvertOptions:
    """How the source tree is laid out and what to produce.

    Args:
        scanned: layers stacked on `param_scan_axis` (else `layers_{i}` subtrees).
        param_scan_axis: the stacked layer axis of scanned leaves.
        cycle_interval: MaxText's inhomogeneous_layer_cycle_interval C.
        weight_dtype: cast every output to this dtype (fp32 masters -> "bfloat16").
        ignore_unknown: skip keys no rule claims instead of raising.
    """

    scanned: bool = True
    param_scan_axis: int = 1
    cycle_interval: int = 1
    weight_dtype: str | None = None
    ignore_unknown: bool = False
    skipped: list[str] = field(default_factory=list)


_PREFIXES = ("params", "base", "model")
_LAYER_N = re.compile(r"^layers_(\d+)$")
_SLOT = re.compile(r"^layer_(\d+)$")


def flatten(tree: Mapping[str, Any], prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], Any]:
    """Nested dicts or flat dicts with '.'/'-'-joined keys -> {path tuple: leaf}."""
    out: dict[tuple[str, ...], Any] = {}
    for key, value in tree.items():
        parts = tuple(p for p in re.split(r"[.\-/]", str(key)) if p)
        if isinstance(value, Mapping):
            out.update(flatten(value, prefix + parts))
        else:
            out[prefix + parts] = value
    return out


def normalise(path: tuple[str, ...]) -> tuple[str, ...]:
    """Drops Linen's `params` and NNX's `base` / `model` roots and `.value` wrappers."""
    while path and path[0] in _PREFIXES:
        path = path[1:]
    if path and path[-1] == "value":
        path = path[:-1]
    return path


def _cast(a: Array, weight_dtype: str | None) -> Array:
    if weight_dtype is None or a.dtype == dtype_info(weight_dtype).numpy:
        return a
    return a.astype(dtype_info(weight_dtype).numpy)


def _leaf(value: Any) -> Array:
    return value if isinstance(value, jax.Array) else np.asarray(value)


class UnknownKey(InvalidArgument, ValueError):
    """A source key no rule claims (an InvalidArgument; still a ValueError for callers
    that caught it as one)."""


def convert(
    tree: MutableMapping[str, Any] | Mapping[str, Any],
    spec: ConverterSpec,
    dims: ModelDims,
    options: ConvertOptions | None = None,
) -> Iterator[tuple[str, Array]]:
    """Yields (hf_name, array) pairs, popping source leaves as they are converted.

    Raises:
        UnknownKey (ValueError): a key no rule claims (unless ignore_unknown), naming it.
        ValueError: a key without the slot prefix when cycle_interval > 1; or, before
            anything is converted, options or dims that do not fit the tree (the
            stacked layer axis, `ModelDims.layers`, head counts, `vocab`, `tied`, a layer key the
            family needs and the tree lacks), naming the option.
    """
    opts = options or ConvertOptions()
    flat = flatten(tree)
    check_tree(flat, spec, dims, opts)
    if isinstance(tree, MutableMapping):
        tree.clear()  # the flat view holds the leaves now; drop the caller's references
    globals_by_key = {r.key: r for r in spec.global_rules}
    layer_by_key = {r.key: r for r in spec.layer_rules}
    for path in list(flat):
        norm = normalise(path)
        dotted = ".".join(norm)
        if norm and norm[0] == "decoder" and len(norm) > 1 and (norm[1] == "layers" or _LAYER_N.fullmatch(norm[1])):
            leaf = flat.pop(path)
            yield from _convert_layer_leaf(norm[1:], _leaf(leaf), spec, layer_by_key, dims, opts, dotted)
            del leaf
            continue
        key = ".".join(norm[1:]) if norm and norm[0] == "decoder" else dotted
        rule = globals_by_key.get(key)
        if rule is None:
            if opts.ignore_unknown:
                opts.skipped.append(dotted)
                flat.pop(path)
                continue
            raise UnknownKey(
                f"no {spec.family} rule for MaxText key {'.'.join(path)!r} (normalised {dotted!r}); "
                "pass ignore_unknown=True to skip it"
            )
        leaf = _leaf(flat.pop(path))
        for name, arr in rule.emit(leaf, dims).items():
            yield name, _cast(arr, opts.weight_dtype)
        del leaf


_LOGITS_KEY = "logits_dense.kernel"
_VOCAB_AXIS = {"token_embedder.embedding": 0, _LOGITS_KEY: 1}  # global key -> its vocab axis


def head_axes(spec: ConverterSpec) -> dict[str, tuple[str, str]]:
    """Per-layer kernels whose head axes must match ModelDims: MaxText key -> (dims field
    of axis -2, of axis -1). MaxText keeps q/k/v as [D, count, H], the count being the one
    the family table gives the HF projection the kernel becomes."""
    return {
        r.key: (r.tensor.count, "head_dim")
        for r in spec.layer_rules
        if r.tensor is not None and r.tensor.role is Role.HEADS_IN
    }


def check_tree(flat: Mapping[tuple[str, ...], Any], spec: ConverterSpec, dims: ModelDims, opts: ConvertOptions) -> None:
    """Refuses options and dims that do not fit the tree before anything converts (shapes
    only, no data is read): a wrong scan axis would otherwise emit bogus layers, a
    wrong `tied` drop the LM head, a wrong family miss weights, all silently."""
    layer_keys: dict[str, set[int]] = {}  # layer rule key -> layer indices that carry it
    global_keys = set()
    heads = head_axes(spec)
    for path, leaf in flat.items():
        norm = normalise(path)
        dotted = ".".join(norm)
        shape = tuple(getattr(leaf, "shape", np.shape(leaf)))
        if not (
            norm and norm[0] == "decoder" and len(norm) > 1 and (norm[1] == "layers" or _LAYER_N.fullmatch(norm[1]))
        ):
            key = ".".join(norm[1:]) if norm and norm[0] == "decoder" else dotted
            global_keys.add(key)
            # MaxText pads the vocab, never cuts it: a larger ModelDims.vocab would pass
            # without a word, and the rollouts' model refuse the shape at apply.
            axis = _VOCAB_AXIS.get(key)
            if axis is not None and dims.vocab and len(shape) == 2 and shape[axis] < dims.vocab:
                raise ValueError(
                    f"key {dotted!r} (shape {shape}) has {shape[axis]} vocab rows, but ModelDims.vocab={dims.vocab}"
                )
            continue
        m = _LAYER_N.fullmatch(norm[1])
        if m:  # unscanned: layers_<i>.<key>
            i, key, layer_shape = int(m.group(1)), ".".join(norm[2:]), shape
            if i >= dims.layers:
                raise ValueError(f"key {dotted!r} is layer {i}, but ModelDims.layers={dims.layers}")
            layer_keys.setdefault(key, set()).add(i)
        else:
            body = norm[2:]
            c, axis = opts.cycle_interval, opts.param_scan_axis
            if not -len(shape) <= axis < len(shape):
                raise ValueError(f"param_scan_axis={axis} is not an axis of {dotted!r} (shape {shape})")
            if c > 1:
                if not body or not (_SLOT.fullmatch(body[0]) or body[0] in ("local_layers", "global_layer")):
                    raise ValueError(
                        f"key {dotted!r} has no slot prefix: with inhomogeneous_layer_cycle_interval={c} "
                        f"every layer key needs 'layer_<slot>.' (0..{c - 1}) or 'local_layers.' / "
                        "'global_layer.' after 'layers.'"
                    )
                body = body[1:]
            stacked = shape[axis] * (c if c > 1 else 1)
            if stacked != dims.layers:
                hint = [a for a, n in enumerate(shape) if n * (c if c > 1 else 1) == dims.layers]
                raise ValueError(
                    f"key {dotted!r} (shape {shape}) has {shape[axis]} entries on param_scan_axis={axis}, "
                    f"which makes {stacked} layers, but ModelDims.layers={dims.layers}"
                    + (f"; is param_scan_axis {hint[0]}?" if hint else "; check ModelDims.layers")
                )
            key = ".".join(body)
            layer_keys.setdefault(key, set()).update(range(dims.layers))
            layer_shape = shape[: axis % len(shape)] + shape[axis % len(shape) + 1 :]
            if c > 1 and norm[2] == "local_layers":
                layer_shape = layer_shape[: axis % len(shape)] + layer_shape[axis % len(shape) + 1 :]
        if key in heads and len(layer_shape) >= 2:
            for field_name, got in zip(heads[key], layer_shape[-2:]):
                if got != getattr(dims, field_name):
                    raise ValueError(
                        f"key {dotted!r}: per-layer shape {layer_shape} has {got} on the {field_name} axis, "
                        f"but ModelDims.{field_name}={getattr(dims, field_name)}"
                    )
    if any(r.key == _LOGITS_KEY for r in spec.global_rules):
        if dims.tied and _LOGITS_KEY in global_keys:
            raise ValueError(
                f"ModelDims.tied=True, but the tree has {_LOGITS_KEY!r} (an untied LM head); set tied=False"
            )
        if not dims.tied and _LOGITS_KEY not in global_keys:
            raise ValueError(
                f"ModelDims.tied=False, but the tree has no {_LOGITS_KEY!r}; set tied=True for tied embeddings"
            )
    if layer_keys:
        for rule in spec.layer_rules:
            have = layer_keys.get(rule.key, set())
            if len(have) < dims.layers:
                missing = sorted(set(range(dims.layers)) - have)
                raise ValueError(
                    f"family {spec.family!r} needs {rule.key!r} in every layer; the tree lacks it in layer(s) "
                    f"{missing[:8]}{'…' if len(missing) > 8 else ''}: is the tree of another family?"
                )


def _convert_layer_leaf(
    rel: tuple[str, ...],
    leaf: Array,
    spec: ConverterSpec,
    rules: Mapping[str, Rule],
    dims: ModelDims,
    opts: ConvertOptions,
    dotted: str,
) -> Iterator[tuple[str, Array]]:
    """One source leaf under decoder.layers*: every physical layer's outputs from it."""
    head = rel[0]
    m = _LAYER_N.fullmatch(head)
    if m:  # unscanned: layers_{i}.<key>
        yield from _emit_layer(int(m.group(1)), rel[1:], leaf, spec, rules, dims, opts, dotted)
        return
    body = rel[1:]  # after "layers"
    xp = xp_of(leaf)
    c = opts.cycle_interval
    axis = opts.param_scan_axis
    if c > 1:  # check_tree refused keys without a slot prefix
        repeats = leaf.shape[axis]
        if body[0] == "local_layers":  # slots 0..C-2 stacked on scan_axis + 1
            for r in range(repeats):
                per_repeat = xp.take(leaf, r, axis=axis)
                for slot in range(per_repeat.shape[axis]):
                    yield from _emit_layer(
                        r * c + slot, body[1:], xp.take(per_repeat, slot, axis=axis), spec, rules, dims, opts, dotted
                    )
            return
        slot = c - 1 if body[0] == "global_layer" else int(_SLOT.fullmatch(body[0]).group(1))  # type: ignore[union-attr]
        for r in range(repeats):
            yield from _emit_layer(r * c + slot, body[1:], xp.take(leaf, r, axis=axis), spec, rules, dims, opts, dotted)
        return
    if not opts.scanned:
        raise ValueError(f"key {dotted!r} looks scanned ('layers.') but scanned=False; expected 'layers_<i>.'")
    for i in range(leaf.shape[axis]):
        yield from _emit_layer(i, body, xp.take(leaf, i, axis=axis), spec, rules, dims, opts, dotted)


def _emit_layer(
    i: int,
    key_parts: tuple[str, ...],
    layer_slice: Array,
    spec: ConverterSpec,
    rules: Mapping[str, Rule],
    dims: ModelDims,
    opts: ConvertOptions,
    dotted: str,
) -> Iterator[tuple[str, Array]]:
    key = ".".join(key_parts)
    rule = rules.get(key)
    if rule is None:
        if opts.ignore_unknown:
            if dotted not in opts.skipped:  # once per source leaf, not once per layer
                opts.skipped.append(dotted)
            return
        raise UnknownKey(
            f"no {spec.family} layer rule for MaxText key {dotted!r} (layer key {key!r}); "
            "pass ignore_unknown=True to skip it"
        )
    prefix = spec.layer_prefix.format(i=i)
    for suffix, arr in rule.emit(layer_slice, dims).items():
        yield prefix + suffix, _cast(arr, opts.weight_dtype)


# -- transforms shared by families ------------------------------------------------------
def by_role(key: str, fam: Family, name: str) -> Rule:
    """MaxText `key` -> HF tensor `name`, transformed as the family table's role for `name`
    says: MaxText keeps every matrix [in, out] (attention kernels with their head axes
    split), HF [out, in] with heads fused."""
    t = fam.tensor(name)
    return Rule(key, _ROLE_EMITS[t.role](name), t)


def same(name: str) -> Emit:
    return lambda a, d: {name: a}


def transposed(name: str) -> Emit:
    return lambda a, d: {name: a.T}


def heads_in(name: str) -> Emit:
    """[D, N, H] -> reshape [D, N*H] -> .T (query/key/value kernels)."""
    return lambda a, d: {name: a.reshape(a.shape[0], -1).T}


def heads_out(name: str) -> Emit:
    """[N, H, D] -> reshape [N*H, D] -> .T (attention out kernel)."""
    return lambda a, d: {name: a.reshape(-1, a.shape[-1]).T}


def embedding(name: str) -> Emit:
    """[V, D], trimmed to the HF vocab when MaxText padded it."""
    return lambda a, d: {name: a[: d.vocab] if d.vocab else a}


def lm_head(name: str) -> Emit:
    """logits_dense [D, V] -> [V, D]; nothing when embeddings are tied."""
    return lambda a, d: {} if d.tied else {name: (a[:, : d.vocab] if d.vocab else a).T}


def passthrough(tree: Mapping[str, Any], weight_dtype: str | None = None) -> Iterator[tuple[str, Array]]:
    """A plain HF-named dict passes through unchanged (optionally cast)."""
    for name, value in tree.items():
        yield name, _cast(_leaf(value), weight_dtype)


_ROLE_EMITS: dict[Role, Callable[[str], Emit]] = {
    Role.EMBEDDING: embedding,
    Role.LM_HEAD: lm_head,
    Role.NORM: same,
    Role.HEADS_IN: heads_in,
    Role.HEADS_OUT: heads_out,
    Role.MLP_IN: transposed,
    Role.MLP_OUT: transposed,
}
