"""weightsync.models.qwen3_jax against transformers' Qwen3ForCausalLM with the same weights.

Bound: |logit difference| <= 1e-4 x max(1, max |logit|) over every real (non-pad) position.
Both sides compute in float32 and differ only in the order of their sums (matmul blocking,
softmax, RMSNorm reductions), which moves a logit of this model by ~1e-6 of the logit
scale; a mistake in the math moves it by a good fraction of it: RoPE's halves
interleaved instead of rotated, q_norm and k_norm skipped, kv heads grouped
the wrong way, a projection's rows read in the wrong head order, a pad attended to,
RoPE left out. Each of those is checked to break the bound here.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from weightsync.models import qwen3_jax  # noqa: E402

BOUND = 1e-4


def _hf_model(tied: bool, rope_theta: float = 10000.0, seed: int = 0):
    cfg = transformers.Qwen3Config(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=128,
        rms_norm_eps=1e-6,
        rope_theta=rope_theta,
        tie_word_embeddings=tied,
        attn_implementation="eager",
    )
    torch.manual_seed(seed)
    model = transformers.Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))  # far from 1: a swapped or skipped norm shows
            else:
                p.normal_(0.0, 0.2)
    return model


def _params(model) -> dict[str, np.ndarray]:
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items() if k in _names(model)}


def _names(model) -> set[str]:
    cfg = qwen3_jax.Qwen3Config.from_hf(model.config.to_dict())
    return set(cfg.param_shapes())


def _batch() -> tuple[np.ndarray, np.ndarray]:
    """Three rows: full, right-padded, left-padded (pad id 0, which the model never attends to)."""
    rng = np.random.default_rng(1)
    tokens = rng.integers(1, 96, size=(3, 11))
    mask = np.ones((3, 11), np.int64)
    mask[1, 7:] = 0
    mask[2, :4] = 0
    tokens[mask == 0] = 0
    return tokens, mask


def _hf_logits(model, tokens: np.ndarray, mask: np.ndarray) -> np.ndarray:
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    with torch.no_grad():
        out = model(
            input_ids=torch.from_numpy(tokens),
            attention_mask=torch.from_numpy(mask),
            position_ids=torch.from_numpy(positions),
        )
    return out.logits.float().numpy()


def _ours(params, cfg, tokens, mask) -> np.ndarray:
    return np.asarray(jax.jit(qwen3_jax.forward, static_argnums=1)(params, cfg, tokens, mask))


def _error(ours: np.ndarray, ref: np.ndarray, mask: np.ndarray) -> float:
    real = mask.astype(bool)
    return float(np.max(np.abs(ours[real] - ref[real])) / max(1.0, np.max(np.abs(ref[real]))))


@pytest.mark.parametrize("tied", [True, False])
def test_logits_match_transformers_on_a_padded_batch(tied: bool) -> None:
    model = _hf_model(tied, rope_theta=10000.0)
    cfg = qwen3_jax.Qwen3Config.from_hf(model.config.to_dict())
    assert cfg.tied is tied and cfg.rope_theta == 10000.0
    params = _params(model)
    qwen3_jax.check_params(params, cfg)
    tokens, mask = _batch()
    ref = _hf_logits(model, tokens, mask)
    ours = _ours(params, cfg, tokens, mask)
    assert np.abs(ref[mask.astype(bool)]).max() > 1.0  # the scale the bound is relative to
    assert _error(ours, ref, mask) <= BOUND


def test_token_logprobs_are_log_softmax_of_the_next_token() -> None:
    model = _hf_model(tied=False)
    cfg = qwen3_jax.Qwen3Config.from_hf(model.config.to_dict())
    tokens, mask = _batch()
    ref = torch.log_softmax(torch.from_numpy(_hf_logits(model, tokens, mask)), dim=-1).numpy()
    want = np.take_along_axis(ref[:, :-1], tokens[:, 1:, None], axis=-1)[..., 0]
    got = np.asarray(qwen3_jax.token_logprobs(_params(model), cfg, tokens, mask))
    targets = mask[:, 1:].astype(bool) & mask[:, :-1].astype(bool)  # a real token predicted from a real one
    assert got.shape == (3, 10)
    assert np.max(np.abs(got[targets] - want[targets])) <= 1e-4
    assert np.all(got[mask[:, 1:] == 0] == 0)


def test_a_changed_rope_theta_is_read_from_the_config_and_changes_the_logits() -> None:
    model = _hf_model(tied=True, rope_theta=500.0)
    cfg = qwen3_jax.Qwen3Config.from_hf(model.config.to_dict())
    tokens, mask = _batch()
    params = _params(model)
    ref = _hf_logits(model, tokens, mask)
    assert cfg.rope_theta == 500.0 and _error(_ours(params, cfg, tokens, mask), ref, mask) <= BOUND
    wrong = qwen3_jax.Qwen3Config(**{**cfg.__dict__, "rope_theta": 10000.0})
    assert _error(_ours(params, wrong, tokens, mask), ref, mask) > 100 * BOUND


def _interleaved_rope(x, positions, theta):
    half = x.shape[-1] // 2
    inv_freq = 1.0 / (theta ** (jnp.arange(0, half, dtype=jnp.float32) / half))
    angles = positions[..., None].astype(jnp.float32) * inv_freq
    cos, sin = jnp.cos(angles)[:, :, None, :], jnp.sin(angles)[:, :, None, :]
    even, odd = x[..., 0::2], x[..., 1::2]
    return jnp.stack([even * cos - odd * sin, even * sin + odd * cos], axis=-1).reshape(x.shape)


@pytest.mark.parametrize(
    "mistake",
    ["interleaved_rope", "no_qk_norm", "q_rows_dim_major", "kv_heads_tiled", "pads_attended", "no_rope"],
)
def test_each_mistake_breaks_the_bound(mistake: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The bound is tight enough to catch a wrong transform: each broken variant fails it."""
    model = _hf_model(tied=False)
    cfg = qwen3_jax.Qwen3Config.from_hf(model.config.to_dict())
    params = _params(model)
    tokens, mask = _batch()
    ref = _hf_logits(model, tokens, mask)
    mask_in, positions = mask, None
    if mistake == "interleaved_rope":
        monkeypatch.setattr(qwen3_jax, "_rope", _interleaved_rope)
    elif mistake == "no_qk_norm":
        for i in range(cfg.layers):
            for n in ("q_norm", "k_norm"):
                params[f"model.layers.{i}.self_attn.{n}.weight"] = np.ones(cfg.head_dim, np.float32)
    elif mistake == "q_rows_dim_major":  # [N*H, D] read as [H, N, D]: same shape, wrong heads
        w = params["model.layers.0.self_attn.q_proj.weight"]
        rows = w.reshape(cfg.heads, cfg.head_dim, cfg.hidden).transpose(1, 0, 2).reshape(w.shape)
        params["model.layers.0.self_attn.q_proj.weight"] = np.ascontiguousarray(rows)
    elif mistake == "kv_heads_tiled":  # query head n reading kv head n % kv_heads
        monkeypatch.setattr(qwen3_jax, "_repeat_kv", lambda x, c: jnp.tile(x, (1, 1, c.heads // c.kv_heads, 1)))
    elif mistake == "pads_attended":
        mask_in = np.ones_like(mask)
        positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    elif mistake == "no_rope":  # (a constant shift of every position changes nothing: RoPE is relative)
        positions = np.zeros_like(tokens)
    ours = np.asarray(qwen3_jax.forward(params, cfg, tokens, mask_in, positions))
    assert _error(ours, ref, mask) > 100 * BOUND, mistake


def test_load_checkpoint_reads_what_transformers_saved(tmp_path: Path) -> None:
    model = _hf_model(tied=False, rope_theta=20000.0)
    model.save_pretrained(tmp_path, safe_serialization=True)
    cfg, params = qwen3_jax.load_checkpoint(tmp_path)
    assert cfg.rope_theta == 20000.0 and not cfg.tied and cfg.vocab == 96
    tokens, mask = _batch()
    assert _error(_ours(params, cfg, tokens, mask), _hf_logits(model, tokens, mask), mask) <= BOUND
    json.loads((tmp_path / "config.json").read_text())  # (the file the config came from)


def test_check_params_names_the_bad_tensor() -> None:
    cfg = qwen3_jax.Qwen3Config(vocab=96, hidden=64, layers=1, heads=4, kv_heads=2, head_dim=32, intermediate=128)
    params = {k: np.zeros(s, np.float32) for k, s in cfg.param_shapes().items()}
    qwen3_jax.check_params(params, cfg)
    bad = dict(params, **{"model.layers.0.mlp.up_proj.weight": np.zeros((128, 63), np.float32)})
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.up_proj\.weight: shape \(128, 63\)"):
        qwen3_jax.check_params(bad, cfg)
    with pytest.raises(ValueError, match="model.norm.weight: missing"):
        qwen3_jax.check_params({k: v for k, v in params.items() if k != "model.norm.weight"}, cfg)
    with pytest.raises(ValueError, match="lm_head.weight: not a parameter"):
        qwen3_jax.check_params({**params, "lm_head.weight": np.zeros((96, 64))}, cfg)
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        qwen3_jax.Qwen3Config(vocab=96, hidden=64, layers=1, heads=4, kv_heads=3, head_dim=32, intermediate=128)
