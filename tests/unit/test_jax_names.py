"""Name maps and fingerprints against NumPy references written out here: tpu-inference's
own loading recipe (reshape, pad head_dim, transpose, repeat heads), every device box of
a leaf, fused leaves, and the host fingerprint against one taken over the built leaf."""

from __future__ import annotations

import itertools

import jax
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout_agent.engines.fingerprint import array_fingerprint, bits
from rollout_agent.engines.jax.fingerprint import host_fingerprint
from rollout_agent.engines.jax.model import padded_head_dim, padded_heads
from rollout_agent.engines.jax.names import NameMap, leaf_box, reference_leaf
from trainer_agent.convert.base import head_axes
from trainer_agent.convert.qwen3 import QWEN3 as QWEN3_CONVERTER
from weightsync.errors import InvalidArgument
from weightsync.model_families import FAMILIES, hf_shapes
from weightsync.model_shapes import ModelShape, param_shapes

BF16 = np.dtype(ml_dtypes.bfloat16)


def _bf16(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    return rng.standard_normal(shape, dtype=np.float32).astype(BF16)


def tpu_inference_recipe(name: str, w: np.ndarray, leaf: tuple[int, ...], h: int) -> np.ndarray:
    """What tpu-inference's loader does to an HF tensor (weight_utils: reshape, pad
    head_dim, transpose, repeat heads up to the model axis; vocab rows zero-padded)."""
    if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")):
        d, n, hp = leaf
        x = w.reshape(-1, h, w.shape[1])
        x = np.pad(x, ((0, 0), (0, hp - h), (0, 0)))
        x = np.transpose(x, (2, 0, 1))
        return np.repeat(x, n // x.shape[1], axis=1)
    if name.endswith("o_proj.weight"):
        n, hp, d = leaf
        x = w.reshape(w.shape[0], -1, h)
        x = np.pad(x, ((0, 0), (0, 0), (0, hp - h)))
        x = np.transpose(x, (1, 2, 0))
        return np.repeat(x, n // x.shape[0], axis=0)
    if name.endswith(("gate_proj.weight", "up_proj.weight", "down_proj.weight")):
        return w.T
    if name == "lm_head.weight":
        return np.pad(w.T, ((0, 0), (0, leaf[1] - w.shape[0])))
    if name == "model.embed_tokens.weight":
        return np.pad(w, ((0, leaf[0] - w.shape[0]), (0, 0)))
    return np.pad(w, (0, leaf[0] - w.shape[0]))  # norms


def _leaves(nm: NameMap, shape: ModelShape, model_axis: int, vocab_pad: int = 0) -> dict[str, jax.ShapeDtypeStruct]:
    """tpu-inference's leaf shapes for `shape` (no sharding: NumPy tests)."""
    hp = padded_head_dim(shape.head_dim)
    out = {}
    for name, s in param_shapes(shape).items():
        if name.endswith("q_proj.weight"):
            leaf = (s[1], padded_heads(shape.heads, model_axis), hp)
        elif name.endswith(("k_proj.weight", "v_proj.weight")):
            leaf = (s[1], padded_heads(shape.kv_heads, model_axis), hp)
        elif name.endswith("o_proj.weight"):
            leaf = (padded_heads(shape.heads, model_axis), hp, s[0])
        elif name.endswith(("q_norm.weight", "k_norm.weight")):
            leaf = (hp,)
        elif name == "model.embed_tokens.weight":
            leaf = (s[0] + vocab_pad, s[1])
        elif name == "lm_head.weight" or name.endswith("_proj.weight"):
            leaf = (s[1], s[0] + (vocab_pad if name == "lm_head.weight" else 0))
        else:
            leaf = s
        out[nm.leaf_path(name)] = jax.ShapeDtypeStruct(leaf, BF16)
    return out


def _version(shape: ModelShape, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {name: _bf16(rng, s) for name, s in param_shapes(shape).items()}


def test_the_family_tables_give_the_checkpoint_names_and_shapes() -> None:
    tiny = ModelShape(64, 2, 4, 2, 32, 128, 1024, tied=False)
    shapes = param_shapes(tiny)
    assert list(shapes)[:3] == ["model.embed_tokens.weight", "model.layers.0.input_layernorm.weight",
                                "model.layers.0.self_attn.q_proj.weight"]  # fmt: skip
    assert shapes["model.layers.1.self_attn.k_proj.weight"] == (64, 64)  # kv_heads x head_dim, hidden
    assert shapes["model.layers.1.self_attn.o_proj.weight"] == (64, 128)
    assert shapes["model.layers.0.self_attn.q_norm.weight"] == (32,)
    assert shapes["lm_head.weight"] == (1024, 64) and list(shapes)[-1] == "lm_head.weight"
    llama = hf_shapes(FAMILIES["llama3"], tiny, 1, tied=False)
    gemma3 = hf_shapes(FAMILIES["gemma3"], tiny, 1, tied=True)
    assert not any("q_norm" in n for n in llama) and "lm_head.weight" in llama
    assert "model.layers.0.self_attn.q_norm.weight" in gemma3 and "lm_head.weight" not in gemma3
    assert gemma3["model.layers.0.pre_feedforward_layernorm.weight"] == (64,)


def test_the_converter_reads_its_head_axes_from_the_family_table() -> None:
    assert head_axes(QWEN3_CONVERTER) == {
        "self_attention.query.kernel": ("heads", "head_dim"),
        "self_attention.key.kernel": ("kv_heads", "head_dim"),
        "self_attention.value.kernel": ("kv_heads", "head_dim"),
    }


@settings(max_examples=25, deadline=None)
@given(
    heads=st.sampled_from([1, 2, 4, 8]),
    kv_div=st.sampled_from([1, 2, 4]),
    head_dim=st.sampled_from([16, 64, 96, 128]),
    model_axis=st.sampled_from([1, 2, 4, 8]),
    hidden=st.sampled_from([8, 24]),
    vocab_pad=st.sampled_from([0, 8]),
    seed=st.integers(0, 2**16),
)
def test_every_leaf_is_tpu_inferences_recipe_and_the_fingerprints_agree(
    heads: int, kv_div: int, head_dim: int, model_axis: int, hidden: int, vocab_pad: int, seed: int
) -> None:
    kv = max(1, heads // kv_div)
    if (heads >= model_axis and heads % model_axis) or (kv >= model_axis and kv % model_axis):
        return  # tpu-inference refuses such a model axis
    shape = ModelShape(hidden, 1, heads, kv, head_dim, 16, 40, tied=False)
    nm = NameMap.of("qwen3", "tpu_inference", head_dim)
    version = _version(shape, seed)
    plans = nm.plan({n: (a.shape, "bfloat16") for n, a in version.items()}, _leaves(nm, shape, model_axis, vocab_pad))
    for path, plan in plans.items():
        (part,) = plan.parts
        want = tpu_inference_recipe(part.name, version[part.name], plan.shape, head_dim)
        got = reference_leaf(plan, version)
        assert got.shape == want.shape == plan.shape, path
        assert np.array_equal(got.view(np.uint16), want.view(np.uint16)), path
        assert host_fingerprint(plan, version) == array_fingerprint(bits(want)), path
        # any box a device may hold: halves and quarters of every axis
        for box in itertools.product(*[_cuts(n) for n in plan.shape]):
            b = leaf_box(plan, version, box)
            assert np.array_equal(np.asarray(b).view(np.uint16), want[box].view(np.uint16)), (path, box)


def _cuts(n: int) -> list[slice]:
    out = [slice(None)]
    for k in (2, 4):
        if n % k == 0 and n >= k:
            out += [slice(i * n // k, (i + 1) * n // k) for i in range(k)]
    return out


def test_gate_and_up_fuse_into_one_leaf_in_the_family_tables_order() -> None:
    shape = ModelShape(16, 1, 2, 2, 8, 24, 32, tied=True)
    nm = NameMap.of("qwen3", "tpu_inference", 8,
                    fused={"mlp.gate_proj.weight": ("mlp.gate_up_proj.weight", "f"),
                           "mlp.up_proj.weight": ("mlp.gate_up_proj.weight", "f")})  # fmt: skip
    version = _version(shape, 3)
    leaves = {n: v for n, v in _leaves(NameMap.of("qwen3", "tpu_inference", 8), shape, 1).items()
              if "gate_proj" not in n and "up_proj" not in n}  # fmt: skip
    leaves["model.layers.0.mlp.gate_up_proj.weight"] = jax.ShapeDtypeStruct((16, 48), BF16)
    plans = nm.plan({n: (a.shape, "bfloat16") for n, a in version.items()}, leaves)
    plan = plans["model.layers.0.mlp.gate_up_proj.weight"]
    want = np.concatenate([version["model.layers.0.mlp.gate_proj.weight"].T,
                           version["model.layers.0.mlp.up_proj.weight"].T], axis=1)  # fmt: skip
    assert [p.name.rsplit(".", 2)[-2] for p in plan.parts] == ["gate_proj", "up_proj"]
    assert np.array_equal(reference_leaf(plan, version).view(np.uint16), want.view(np.uint16))
    assert host_fingerprint(plan, version) == array_fingerprint(bits(want))
    for box in [(slice(0, 16), slice(16, 32)), (slice(8, 16), slice(0, 48)), (slice(None), slice(20, 28))]:
        assert np.array_equal(leaf_box(plan, version, box).view(np.uint16), want[box].view(np.uint16))


def test_the_hf_layout_keeps_fused_head_axes_whole_and_the_ndh_override_reorders_queries() -> None:
    shape = ModelShape(16, 1, 2, 2, 8, 24, 32, tied=True)
    version = _version(shape, 4)
    hf = NameMap.of("qwen3", "hf", 8)
    leaves = {n: jax.ShapeDtypeStruct(a.shape, BF16) for n, a in version.items()}
    plans = hf.plan({n: (a.shape, "bfloat16") for n, a in version.items()}, leaves)
    for plan in plans.values():
        assert np.array_equal(reference_leaf(plan, version), version[plan.parts[0].name])
    ndh = NameMap.of("qwen3", "tpu_inference", 8, overrides={"self_attn.q_proj.weight": "x d h"})
    q = "model.layers.0.self_attn.q_proj.weight"
    plan = ndh.plan({q: ((16, 16), "bfloat16")}, {q: jax.ShapeDtypeStruct((2, 16, 8), BF16)}, strict=False)[q]
    assert np.array_equal(reference_leaf(plan, version), version[q].reshape(2, 8, 16).transpose(0, 2, 1))


def test_a_cast_happens_on_the_host_and_the_fingerprint_is_of_the_cast_bits() -> None:
    name = "model.norm.weight"
    w = np.linspace(-1, 1, 24, dtype=np.float32)
    nm = NameMap.of("qwen3", "tpu_inference", 8)
    plan = nm.plan({name: (w.shape, "float32")}, {name: jax.ShapeDtypeStruct((24,), BF16)}, strict=False)[name]
    ref = reference_leaf(plan, {name: w})
    assert ref.dtype == BF16 and np.array_equal(ref, w.astype(BF16))
    assert host_fingerprint(plan, {name: w}) == array_fingerprint(bits(w.astype(BF16)))


def test_versions_that_do_not_map_are_refused_naming_what_and_where() -> None:
    shape = ModelShape(16, 1, 2, 2, 8, 24, 32, tied=True)
    nm = NameMap.of("qwen3", "tpu_inference", 8)
    version = _version(shape)
    specs = {n: (a.shape, "bfloat16") for n, a in version.items()}
    leaves = _leaves(nm, shape, 1)
    with pytest.raises(InvalidArgument, match="manifest.tensors: 'model.layers.0.mlp.fc.weight' is no qwen3"):
        nm.plan({**specs, "model.layers.0.mlp.fc.weight": ((4, 4), "bfloat16")}, leaves)
    with pytest.raises(InvalidArgument, match="which the engine does not have"):
        nm.plan(specs, {k: v for k, v in leaves.items() if "k_norm" not in k})
    with pytest.raises(InvalidArgument, match="does not fit leaf 'model.layers.0.self_attn.k_proj.weight'"):
        nm.plan({**specs, "model.layers.0.self_attn.k_proj.weight": ((24, 16), "bfloat16")}, leaves)
    with pytest.raises(InvalidArgument, match="writes the engine's leaf 'model.layers.0.mlp.up_proj.weight'"):
        nm.plan({k: v for k, v in specs.items() if "up_proj" not in k}, leaves)
    assert "model.layers.0.mlp.up_proj.weight" not in nm.plan(
        {k: v for k, v in specs.items() if "up_proj" not in k}, leaves, strict=False
    )
    with pytest.raises(InvalidArgument, match="unknown layout"):
        NameMap.of("qwen3", "tpu", 8)


@settings(max_examples=40, deadline=None)
@given(
    shape=st.lists(st.integers(1, 6), min_size=1, max_size=3).map(tuple),
    seed=st.integers(0, 2**16),
    dtype=st.sampled_from([BF16, np.dtype(np.float32), np.dtype(np.uint8)]),
)
def test_the_fingerprint_sees_any_flipped_bit_and_any_two_elements_swapped(
    shape: tuple[int, ...], seed: int, dtype: np.dtype
) -> None:
    rng = np.random.default_rng(seed)
    a = rng.integers(0, 256, size=(*shape, dtype.itemsize), dtype=np.uint8).view(dtype).reshape(shape)
    fp = array_fingerprint(bits(a))
    flipped = a.copy()
    i = int(rng.integers(0, flipped.nbytes))
    flipped.reshape(-1).view(np.uint8)[i] ^= np.uint8(1 << int(rng.integers(0, 8)))
    assert array_fingerprint(bits(flipped)) != fp
    flat = a.reshape(-1)
    if flat.size > 1:
        i, j = rng.choice(flat.size, 2, replace=False)
        if bits(flat[i : i + 1]).tobytes() != bits(flat[j : j + 1]).tobytes():
            swapped = a.copy().reshape(-1)
            swapped[[i, j]] = swapped[[j, i]]
            assert array_fingerprint(bits(swapped.reshape(shape))) != fp
