"""Converters: exact round trips for every layout option, and logits against transformers."""

from __future__ import annotations

import numpy as np
import pytest

from tests.unit.maxtext_reference import forward, to_maxtext, with_style
from trainer_agent.convert import (
    ConvertOptions,
    ModelDims,
    UnknownKey,
    compute_padded_moe_mlp_dim,
    convert_maxtext,
    passthrough,
)
from trainer_agent.convert.qwen3_moe import pad_rows_per_shard
from weightsync.errors import InvalidArgument

L, N, K, H, D, F, V = 4, 4, 2, 16, 64, 96, 128


def hf_weights(family: str, seed: int = 0) -> dict[str, np.ndarray]:
    """Random HF-layout weights (norms perturbed away from 1 so swaps show)."""
    rng = np.random.default_rng(seed)
    w = {
        "model.embed_tokens.weight": rng.standard_normal((V, D)),
        "model.norm.weight": 1 + 0.1 * rng.standard_normal(D),
        "lm_head.weight": rng.standard_normal((V, D)),
    }
    for i in range(L):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = 1 + 0.1 * rng.standard_normal(D)
        w[p + "post_attention_layernorm.weight"] = 1 + 0.1 * rng.standard_normal(D)
        w[p + "self_attn.q_proj.weight"] = rng.standard_normal((N * H, D)) * 0.1
        w[p + "self_attn.k_proj.weight"] = rng.standard_normal((K * H, D)) * 0.1
        w[p + "self_attn.v_proj.weight"] = rng.standard_normal((K * H, D)) * 0.1
        w[p + "self_attn.o_proj.weight"] = rng.standard_normal((D, N * H)) * 0.1
        w[p + "mlp.gate_proj.weight"] = rng.standard_normal((F, D)) * 0.1
        w[p + "mlp.up_proj.weight"] = rng.standard_normal((F, D)) * 0.1
        w[p + "mlp.down_proj.weight"] = rng.standard_normal((D, F)) * 0.1
        if family == "qwen3":
            w[p + "self_attn.q_norm.weight"] = 1 + 0.1 * rng.standard_normal(H)
            w[p + "self_attn.k_norm.weight"] = 1 + 0.1 * rng.standard_normal(H)
    return {k: v.astype(np.float32) for k, v in w.items()}


def dims(**kw: object) -> ModelDims:
    return ModelDims(layers=L, heads=N, kv_heads=K, head_dim=H, vocab=V, **kw)  # type: ignore[arg-type]


def run(tree: dict, family: str, **opts: object) -> dict[str, np.ndarray]:
    return dict(convert_maxtext(tree, family, dims(), ConvertOptions(**opts)))  # type: ignore[arg-type]


@pytest.mark.parametrize("family", ["qwen3", "llama3"])
def test_jax_trees_convert_on_device_to_the_same_bytes(family: str) -> None:
    import jax.numpy as jnp

    hf = hf_weights(family)
    mt = to_maxtext(hf, family, layers=L, heads=N, kv_heads=K, head_dim=H, vocab_pad=8)
    out = run({k: jnp.asarray(v) for k, v in with_style(mt, "nnx").items()}, family, weight_dtype="bfloat16")
    for name, ref in hf.items():
        got = np.asarray(out[name])
        assert got.dtype.name == "bfloat16"
        np.testing.assert_array_equal(got.view(np.uint16), ref.astype(got.dtype).view(np.uint16), err_msg=name)


@pytest.mark.parametrize("family", ["qwen3", "llama3"])
@pytest.mark.parametrize("style", ["nnx", "linen", "nested"])
@pytest.mark.parametrize(("scanned", "axis"), [(True, 1), (True, 0), (False, 1)])
def test_round_trip_is_exact(family: str, style: str, scanned: bool, axis: int) -> None:
    hf = hf_weights(family)
    mt = to_maxtext(hf, family, layers=L, heads=N, kv_heads=K, head_dim=H, vocab_pad=8, scanned=scanned, axis=axis)
    tree = with_style(mt, style)
    out = run(tree, family, scanned=scanned, param_scan_axis=axis)
    assert tree == {}  # consumed: source leaves were popped
    assert set(out) == set(hf)
    for name, ref in hf.items():
        assert out[name].shape == ref.shape, name
        np.testing.assert_allclose(out[name], ref, rtol=1e-6, atol=0, err_msg=name)


@pytest.mark.parametrize("layout", ["slots", "local_global"])
def test_inhomogeneous_cycles(layout: str) -> None:
    hf = hf_weights("qwen3")
    mt = to_maxtext(hf, "qwen3", layers=L, heads=N, kv_heads=K, head_dim=H, cycle=2, cycle_layout=layout)
    out = run(with_style(mt, "nnx"), "qwen3", cycle_interval=2)
    for name, ref in hf.items():
        np.testing.assert_array_equal(out[name], ref, err_msg=name)


def test_missing_slot_prefix_is_a_descriptive_error() -> None:
    hf = hf_weights("qwen3")
    mt = to_maxtext(hf, "qwen3", layers=L, heads=N, kv_heads=K, head_dim=H)
    with pytest.raises(ValueError, match=r"key .decoder\.layers\.[a-z_.]+. has no slot prefix.*layer_<slot>"):
        run(with_style(mt, "nnx"), "qwen3", cycle_interval=2)


def test_unknown_keys_raise_with_path_unless_ignored() -> None:
    mt = to_maxtext(hf_weights("qwen3"), "qwen3", layers=L, heads=N, kv_heads=K, head_dim=H)
    mt["decoder.layers.self_attention.mystery.kernel"] = np.zeros((D, L))
    with pytest.raises(UnknownKey, match="decoder.layers.self_attention.mystery.kernel") as exc:
        run(with_style(dict(mt), "nnx"), "qwen3")
    assert isinstance(exc.value, InvalidArgument)  # in the hierarchy: INVALID_ARGUMENT over gRPC
    opts = ConvertOptions(ignore_unknown=True)
    out = dict(convert_maxtext(with_style(mt, "nnx"), "qwen3", dims(), opts))
    assert opts.skipped == ["decoder.layers.self_attention.mystery.kernel"] and "lm_head.weight" in out


def test_tied_embeddings_weight_dtype_and_passthrough() -> None:
    hf = hf_weights("qwen3")
    del hf["lm_head.weight"]
    mt = to_maxtext(hf, "qwen3", layers=L, heads=N, kv_heads=K, head_dim=H)
    out = dict(
        convert_maxtext(with_style(mt, "nnx"), "qwen3", dims(tied=True), ConvertOptions(weight_dtype="bfloat16"))
    )
    assert "lm_head.weight" not in out and all(str(a.dtype) == "bfloat16" for a in out.values())
    same = dict(passthrough(hf))
    assert all(same[k] is hf[k] or np.array_equal(same[k], hf[k]) for k in hf)


def test_moe_unstacking_and_lane_padding() -> None:
    assert compute_padded_moe_mlp_dim(512, 2) == 512 and compute_padded_moe_mlp_dim(512, 4) == 1024
    assert compute_padded_moe_mlp_dim(768, 3) == 768 and compute_padded_moe_mlp_dim(96, 2) == 512
    rng = np.random.default_rng(0)
    e, f = 3, 96
    base = to_maxtext(hf_weights("qwen3"), "qwen3", layers=L, heads=N, kv_heads=K, head_dim=H)
    base = {k: v for k, v in base.items() if ".mlp." not in k}
    router = rng.standard_normal((D, L, e)).astype(np.float32)
    wi0 = rng.standard_normal((e, L, D, f)).astype(np.float32)
    wi1 = rng.standard_normal((e, L, D, f)).astype(np.float32)
    wo = rng.standard_normal((e, L, f, D)).astype(np.float32)
    mt = {
        **base,
        "decoder.layers.moe_block.gate.kernel": router,
        "decoder.layers.moe_block.wi_0": wi0,
        "decoder.layers.moe_block.wi_1": wi1,
        "decoder.layers.moe_block.wo": wo,
    }
    out = dict(convert_maxtext(with_style(dict(mt), "nnx"), "qwen3_moe", dims(experts=e)))
    np.testing.assert_array_equal(out["model.layers.2.mlp.gate.weight"], router[:, 2].T)
    np.testing.assert_array_equal(out["model.layers.1.mlp.experts.2.gate_proj.weight"], wi0[2, 1].T)
    np.testing.assert_array_equal(out["model.layers.3.mlp.experts.0.down_proj.weight"], wo[0, 3].T)
    padded = dict(convert_maxtext(with_style(dict(mt), "nnx"), "qwen3_moe", dims(experts=e, moe_pad_tp=2)))
    fp = compute_padded_moe_mlp_dim(f, 2)
    g = padded["model.layers.1.mlp.experts.2.gate_proj.weight"]
    dn = padded["model.layers.1.mlp.experts.2.down_proj.weight"]
    assert g.shape == (fp, D) and dn.shape == (D, fp)
    half, per = f // 2, fp // 2
    np.testing.assert_array_equal(g[:half], wi0[2, 1].T[:half])
    np.testing.assert_array_equal(g[per : per + half], wi0[2, 1].T[half:])
    assert not g[half:per].any() and not g[per + half :].any() and not dn[:, half:per].any()
    assert np.isclose(g.sum(dtype=np.float64), wi0[2, 1].sum(dtype=np.float64))  # zeros keep sums
    with pytest.raises(ValueError, match="divide by tp"):
        pad_rows_per_shard(np.ones((5, 2)), 2, 8)


@pytest.mark.parametrize("family", ["qwen3", "llama3"])
def test_converted_weights_give_maxtext_logits_in_transformers(family: str) -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    common = dict(
        vocab_size=V,
        hidden_size=D,
        intermediate_size=F,
        num_hidden_layers=L,
        num_attention_heads=N,
        num_key_value_heads=K,
        head_dim=H,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        max_position_embeddings=64,
    )
    if family == "qwen3":
        model_cls, cfg = transformers.Qwen3ForCausalLM, transformers.Qwen3Config(**common)
    else:
        model_cls, cfg = transformers.LlamaForCausalLM, transformers.LlamaConfig(**common)
    cfg._attn_implementation = "eager"
    hf = hf_weights(family, seed=3)
    mt = to_maxtext(hf, family, layers=L, heads=N, kv_heads=K, head_dim=H, vocab_pad=8)
    tokens = np.array([3, 17, 99, 5, 64, 2, 120, 7, 7, 33])
    want = forward(mt, family, tokens, layers=L, vocab=V, eps=1e-6, theta=10000.0)
    converted = dict(convert_maxtext(with_style(mt, "linen"), family, dims()))
    model = model_cls(cfg).eval()
    missing, unexpected = model.load_state_dict(
        {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in converted.items()}, strict=False
    )
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    with torch.no_grad():
        got = model(torch.from_numpy(tokens)[None]).logits[0].numpy()
    # fp32 both sides, different op order: agreement to 1e-4 absolute on logits of size ~1-10
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    ("family", "layout", "options", "model_dims", "refusal"),
    [
        (
            "qwen3",
            {},
            {"param_scan_axis": 0},
            dims(),
            r"param_scan_axis=0, which makes \d+ layers, but ModelDims.layers=4; is param_scan_axis 1\?",
        ),
        ("qwen3", {}, {}, ModelDims(layers=3, heads=N, kv_heads=K, head_dim=H, vocab=V), r"ModelDims.layers=3"),
        (
            "qwen3",
            {"scanned": False},
            {"scanned": False},
            ModelDims(layers=2, heads=N, kv_heads=K, head_dim=H, vocab=V),
            r"is layer [23], but ModelDims.layers=2",
        ),
        ("qwen3", {}, {}, dims(tied=True), r"ModelDims.tied=True, but the tree has 'logits_dense.kernel'"),
        (
            "llama3",
            {},
            {},
            dims(),
            r"family 'qwen3' needs 'self_attention.query_norm.scale' in every layer.*another family",
        ),
        (
            "qwen3",
            {},
            {},
            ModelDims(layers=L, heads=2 * N, kv_heads=K, head_dim=H, vocab=V),
            r"query.kernel.*on the heads axis, but ModelDims.heads=8",
        ),
        (
            "qwen3",
            {},
            {},
            ModelDims(layers=L, heads=N, kv_heads=K, head_dim=2 * H, vocab=V),
            r"on the head_dim axis, but ModelDims.head_dim=32",
        ),
        (
            "qwen3",
            {},
            {},
            ModelDims(layers=L, heads=N, kv_heads=K, head_dim=H, vocab=V + 1),  # kept whole: refused at apply
            rf"token_embedder.embedding' \(shape \({V}, \d+\)\) has {V} vocab rows, but ModelDims.vocab={V + 1}",
        ),
    ],
    ids=["scan-axis", "layers", "unscanned-layers", "tied", "family", "heads", "head-dim", "vocab"],
)
def test_options_that_do_not_fit_the_tree_are_refused_naming_the_option(
    family: str, layout: dict, options: dict, model_dims: ModelDims, refusal: str
) -> None:
    """Before anything converts, since each would otherwise pass silently: a wrong scan
    axis emits bogus layers (128 here), a wrong `tied` drops the LM head, and a Llama tree
    converted as Qwen3 loses nothing visibly."""
    mt = to_maxtext(hf_weights(family), family, layers=L, heads=N, kv_heads=K, head_dim=H, **layout)
    stream = convert_maxtext(mt, "qwen3", model_dims, ConvertOptions(**options))
    with pytest.raises(ValueError, match=refusal):
        next(stream)


def test_untied_dims_on_a_tied_tree_are_refused() -> None:
    mt = to_maxtext(hf_weights("qwen3"), "qwen3", layers=L, heads=N, kv_heads=K, head_dim=H)
    mt = {k: v for k, v in mt.items() if "logits_dense" not in k}
    with pytest.raises(ValueError, match="tied=False, but the tree has no 'logits_dense.kernel'"):
        next(convert_maxtext(mt, "qwen3", dims(), ConvertOptions()))
