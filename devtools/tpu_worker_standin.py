"""Stand-ins for tpu-inference's `TPUWorker`, each holding a real JAX Qwen3: for CI, which
has no vLLM TPU engine (vllm-tpu and tpu-inference run on the TPU host from the kit,
docs/install-tpu.md#vllms-tpu-engine; `tests/unit/test_tpu_inference_layout.py` checks the
layout against the real tpu-inference where it is installed).

- `TPUWorker` copies tpu-inference 0.32's weight-update contract: `get_weights_state`,
  `start_weight_update(free_kv_cache=True)`, `update_weights` (a no-op),
  `finish_weight_update`, `refresh_model_state_leaves`;
- `TPUWorker025` copies 0.25's, the release the v5e host runs: no such methods, but
  `sync_weights(updated_weights, mappings, transpose_keys, reshard_fn=None)`,
  `delete_kv_cache()`, `reinitialize_kv_cache()` and a `model_runner` whose `state` is an
  NNX-style tree (each leaf a `Param` whose array is its `.value`) and whose
  `state_leaves`, the flat tuple the jitted model takes, is derived from it. As 0.25's
  loader, it refuses a head_dim it would have to pad (its norms are not padded:
  `k_norm.weight: torch (32,) vs jax (128,)`).

Both share `vllm_config.model_config.hf_config` and behave as documented: the state is a
live tree of sharded `jax.Array`s in tpu-inference's layouts (q/k/v kernels (D, N, H), o
(N, H, D), MLP and lm_head kernels [in, out], vocabulary rows padded; `TPUWorker` pads
head_dim to a multiple of 128); the KV cache is freed and reallocated around an update;
the jitted model takes the leaves as an argument, so it serves the leaves of the last
refresh, whatever the state holds now.

Its forward (`compute_logits`) is Qwen3's, written against those layouts with einsums as
tpu-inference's model is: logits from the applied leaves equal transformers' Qwen3 with
the same HF weights to fp32 rounding only if every transform put every value in its place.
"""

from __future__ import annotations

from functools import partial
from types import SimpleNamespace
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from rollout_agent.engines.jax.model import PROFILES, empty_leaves, family_map, padded_head_dim
from rollout_agent.engines.jax.targets import named_leaves
from weightsync.model_shapes import ModelShape
from weightsync.models.qwen3_jax import Qwen3Config


def nest(flat: dict[str, Any]) -> dict[str, Any]:
    """Dotted leaf paths -> nested dicts, layer indices as lists (an NNX state's shape)."""
    root: dict[str, Any] = {}
    for path, leaf in flat.items():
        node: Any = root
        keys = path.split(".")
        for key, nxt in zip(keys[:-1], keys[1:]):
            if isinstance(node, list):
                while len(node) <= int(key):
                    node.append({})
                node = node[int(key)]
                continue
            node = node.setdefault(key, [] if nxt.isdigit() else {})
        node[keys[-1]] = leaf
    return root


class HfConfig(dict):  # type: ignore[type-arg]
    """An HF config's fields for a worker where transformers is not installed (a TPU host):
    attributes and `to_dict()`, as `transformers.PretrainedConfig` has them."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None

    def to_dict(self) -> dict[str, Any]:
        return dict(self)


def hf_config_of(shape: ModelShape, *, rope_theta: float = 1_000_000.0, rms_norm_eps: float = 1e-6) -> HfConfig:
    """The HF config of a Qwen3 of `shape` (a preset's)."""
    return HfConfig(
        model_type="qwen3", vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim, rope_theta=rope_theta, rms_norm_eps=rms_norm_eps, tie_word_embeddings=shape.tied,
    )  # fmt: skip


def vllm_extended(worker_cls: type, extension: type) -> Any:
    """The worker class as vLLM's `WorkerWrapperBase.init_worker` leaves it: the
    `worker_extension_cls` appended to the worker class's own bases (the class itself is
    changed there, not subclassed; here a copy of it, so the stand-in stays as it is)."""
    own = {k: v for k, v in vars(worker_cls).items() if k not in ("__dict__", "__weakref__")}
    cls = type(worker_cls.__name__, worker_cls.__bases__, own)
    cls.__bases__ = (*cls.__bases__, extension)
    return cls


class WorkerBase:
    """vLLM's WorkerBase, the base of tpu-inference's TPUWorker: vLLM appends a
    `worker_extension_cls` to the worker class's own bases, which needs a base other than
    `object` to take it."""


class TPUWorker(WorkerBase):
    """tpu-inference's TPUWorker as the weight-update contract sees it (see the module)."""

    def __init__(
        self,
        hf_config: Any,
        mesh: jax.sharding.Mesh,
        *,
        profile: str = "tpu_inference",
        kv_tokens: int = 256,
        dtype: Any = np.float32,
    ) -> None:
        """`dtype`: the weights' (float32, or bfloat16 as vLLM serves on TPU); the forward
        computes in float32 either way."""
        self.vllm_config = SimpleNamespace(model_config=SimpleNamespace(hf_config=hf_config))
        self.rank = 0
        self.mesh = mesh
        self.shape = Qwen3Config.from_hf(hf_config.to_dict())
        name_map = family_map("qwen3", "tpu_inference", self.shape)
        flat = empty_leaves(name_map, self.shape, self.shape.layers, self.shape.tied, mesh, PROFILES[profile],
                            dtype=dtype)  # fmt: skip
        self.state = nest(flat)
        self._kv_shape = (self.shape.layers, 2, kv_tokens, self.shape.kv_heads, self.shape.head_dim)
        self.kv_cache: jax.Array | None = jnp.zeros(self._kv_shape, jnp.float32)
        self.events: list[str] = []
        self._leaves: dict[str, jax.Array] = {}
        self.refresh_model_state_leaves()

    # -- the methods an RL weight sync calls (tpu-inference's names and signatures) ------
    def get_weights_state(self) -> Any:
        """The live state: writing its leaves changes what the next refresh serves."""
        return self.state

    def start_weight_update(self, free_kv_cache: bool = True) -> None:
        self.events.append(f"start_weight_update(free_kv_cache={free_kv_cache})")
        if free_kv_cache and self.kv_cache is not None:
            self.kv_cache.delete()
            self.kv_cache = None

    def update_weights(self, update_info: dict[str, Any] | None = None) -> None:
        """A no-op on TPU: the weights are written out of band into the state."""
        self.events.append("update_weights")

    def finish_weight_update(self) -> None:
        self.events.append("finish_weight_update")
        if self.kv_cache is None:
            self.kv_cache = jnp.zeros(self._kv_shape, jnp.float32)

    def refresh_model_state_leaves(self) -> None:
        self.events.append("refresh_model_state_leaves")
        named, _ = named_leaves(self.state)
        self._leaves = {name: leaf for name, (_, leaf) in named.items()}

    # -- serving --------------------------------------------------------------------------
    def compute_logits(self, token_ids: np.ndarray) -> np.ndarray:
        """[batch, tokens, vocab] float32 logits of `token_ids` [batch, tokens] from the
        leaves of the last refresh; refused while the KV cache is freed (mid-update)."""
        if self.kv_cache is None:
            raise RuntimeError("the engine cannot serve: its KV cache is freed (a weight update is open)")
        s = self.shape
        logits = _forward(self._leaves, jnp.asarray(token_ids, jnp.int32), s.layers, s.heads, s.kv_heads,
                          s.head_dim, s.vocab, s.tied, s.rms_norm_eps, s.rope_theta)  # fmt: skip
        return np.asarray(logits)


@jax.tree_util.register_pytree_with_keys_class
class Param:
    """An NNX variable as a pytree: one child, its array, under the key `.value`."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def tree_flatten_with_keys(self) -> tuple[tuple[tuple[Any, Any], ...], None]:
        return ((jax.tree_util.GetAttrKey("value"), self.value),), None

    @classmethod
    def tree_unflatten(cls, aux: None, children: Any) -> Param:
        return cls(children[0])


@jax.tree_util.register_pytree_with_keys_class
class State(dict):  # type: ignore[type-arg]
    """An `nnx.State` as the runner holds it: keyed children, and not the plain dict
    `_sync_weights` takes for a torchax-path model's params."""

    def tree_flatten_with_keys(self) -> tuple[tuple[tuple[Any, Any], ...], tuple[Any, ...]]:
        keys = tuple(self)
        return tuple((jax.tree_util.DictKey(k), self[k]) for k in keys), keys

    @classmethod
    def tree_unflatten(cls, keys: tuple[Any, ...], children: Any) -> State:
        return cls(zip(keys, children))


def _params(tree: Any) -> Any:
    """Every array of a nested dict/list tree wrapped in a `Param`."""
    if isinstance(tree, dict):
        return {k: _params(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_params(v) for v in tree]
    return Param(tree)


class TPUWorker025(WorkerBase):
    """tpu-inference 0.25's TPUWorker as an RL weight sync sees it (see the module)."""

    def __init__(
        self, hf_config: Any, mesh: jax.sharding.Mesh, *, kv_tokens: int = 256, dtype: Any = np.float32
    ) -> None:
        self.vllm_config = SimpleNamespace(model_config=SimpleNamespace(hf_config=hf_config))
        self.rank = 0
        self.shape = Qwen3Config.from_hf(hf_config.to_dict())
        if padded_head_dim(self.shape.head_dim) != self.shape.head_dim:
            h = self.shape.head_dim
            raise ValueError(f"Shape mismatch in non-vocab layer 'k_norm.weight': torch ({h},) vs jax "
                             f"({padded_head_dim(h)},)")  # fmt: skip
        name_map = family_map("qwen3", "tpu_inference", self.shape)
        flat = empty_leaves(name_map, self.shape, self.shape.layers, self.shape.tied, mesh, PROFILES["tpu_inference"],
                            dtype=dtype)  # fmt: skip
        state = State(_params(nest(flat)))
        self._treedef = jax.tree_util.tree_structure(state)
        self._names = list(named_leaves(state)[0])
        self.model_runner = SimpleNamespace(state=state, state_leaves=tuple(jax.tree_util.tree_leaves(state)))
        self._kv_shape = (self.shape.layers, 2, kv_tokens, self.shape.kv_heads, self.shape.head_dim)
        self.kv_cache: jax.Array | None = jnp.zeros(self._kv_shape, jnp.float32)
        self.events: list[str] = []

    def sync_weights(self, updated_weights: Any, mappings: Any, transpose_keys: Any, reshard_fn: Any = None) -> None:
        """0.25's RL hook (`model_runner._sync_weights`: a source state transferred through
        `mappings`); weightsync writes the state itself and does not call it."""
        raise NotImplementedError("the stand-in does not transfer states through mappings")

    def delete_kv_cache(self) -> None:
        self.events.append("delete_kv_cache")
        if self.kv_cache is not None:
            self.kv_cache.delete()
            self.kv_cache = None

    def reinitialize_kv_cache(self) -> None:
        self.events.append("reinitialize_kv_cache")
        if self.kv_cache is None:
            self.kv_cache = jnp.zeros(self._kv_shape, jnp.float32)

    def compute_logits(self, token_ids: np.ndarray) -> np.ndarray:
        """As `TPUWorker.compute_logits`, from the runner's `state_leaves` (what the jitted
        model is given), whatever `state` holds."""
        if self.kv_cache is None:
            raise RuntimeError("the engine cannot serve: its KV cache is freed (a weight update is open)")
        leaves = dict(zip(self._names, self.model_runner.state_leaves))
        s = self.shape
        logits = _forward(leaves, jnp.asarray(token_ids, jnp.int32), s.layers, s.heads, s.kv_heads, s.head_dim,
                          s.vocab, s.tied, s.rms_norm_eps, s.rope_theta)  # fmt: skip
        return np.asarray(logits)


def _rms(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rope(x: jax.Array, theta: float) -> jax.Array:
    """HF's rotary embedding (rotate_half) over [batch, tokens, heads, head_dim]."""
    h = x.shape[-1]
    inv = 1.0 / (theta ** (jnp.arange(0, h, 2, dtype=jnp.float32) / h))
    freqs = jnp.arange(x.shape[1], dtype=jnp.float32)[:, None] * inv[None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)[None, :, None, :]
    rotated = jnp.concatenate([-x[..., h // 2 :], x[..., : h // 2]], axis=-1)
    return x * jnp.cos(emb) + rotated * jnp.sin(emb)


@partial(jax.jit, static_argnums=(2, 3, 4, 5, 6, 7, 8, 9))
def _forward(
    p: dict[str, jax.Array], tokens: jax.Array, layers: int, heads: int, kv_heads: int, head_dim: int,
    vocab: int, tied: bool, eps: float, theta: float,
) -> jax.Array:  # fmt: skip
    hp = jax.lax.Precision.HIGHEST
    embed = p["model.embed_tokens.weight"]  # (V padded, D)
    x = embed[tokens].astype(jnp.float32)  # float32 activations: bfloat16 weights are promoted in every einsum
    t = tokens.shape[1]
    causal = jnp.tril(jnp.ones((t, t), bool))
    for i in range(layers):
        pre = f"model.layers.{i}."
        a = _rms(x, p[pre + "input_layernorm.weight"], eps)
        # kernels hold head_dim zero-padded (tpu-inference's rule): the model's own head_dim is read
        q = jnp.einsum("btd,dnh->btnh", a, p[pre + "self_attn.q_proj.weight"], precision=hp)[..., :head_dim]
        k = jnp.einsum("btd,dnh->btnh", a, p[pre + "self_attn.k_proj.weight"], precision=hp)[..., :head_dim]
        v = jnp.einsum("btd,dnh->btnh", a, p[pre + "self_attn.v_proj.weight"], precision=hp)[..., :head_dim]
        q = _rope(_rms(q, p[pre + "self_attn.q_norm.weight"][:head_dim], eps), theta)
        k = _rope(_rms(k, p[pre + "self_attn.k_norm.weight"][:head_dim], eps), theta)
        n, kv = q.shape[2], k.shape[2]  # the engine's head counts (kv heads repeated up to the mesh)
        k = jnp.repeat(k, n // kv, axis=2)
        v = jnp.repeat(v, n // kv, axis=2)
        scores = jnp.einsum("bqnh,bknh->bnqk", q, k, precision=hp) / np.sqrt(head_dim)
        scores = jnp.where(causal[None, None], scores, -jnp.inf)
        attn = jnp.einsum("bnqk,bknh->bqnh", jax.nn.softmax(scores, axis=-1), v, precision=hp)
        o = p[pre + "self_attn.o_proj.weight"][:, :head_dim, :]  # (N, H padded, D)
        x = x + jnp.einsum("btnh,nhd->btd", attn, o, precision=hp)
        m = _rms(x, p[pre + "post_attention_layernorm.weight"], eps)
        gate = jnp.einsum("btd,df->btf", m, p[pre + "mlp.gate_proj.weight"], precision=hp)
        up = jnp.einsum("btd,df->btf", m, p[pre + "mlp.up_proj.weight"], precision=hp)
        x = x + jnp.einsum("btf,fd->btd", jax.nn.silu(gate) * up, p[pre + "mlp.down_proj.weight"], precision=hp)
    x = _rms(x, p["model.norm.weight"], eps)
    if tied:
        return jnp.einsum("btd,vd->btv", x, embed, precision=hp)[..., :vocab]
    return jnp.einsum("btd,dv->btv", x, p["lm_head.weight"], precision=hp)[..., :vocab]
