"""RolloutConfig: the rollout sidecar's flags and WEIGHTSYNC_ROLLOUT_* variables."""

from __future__ import annotations

import re
from dataclasses import dataclass

from rollout_agent.settings import SyncSettings
from weightsync.config import ServerConfig, check_bounds, check_positive, option
from weightsync.errors import InvalidArgument
from weightsync.model_shapes import PRESETS


@dataclass
class RolloutConfig(SyncSettings, ServerConfig):
    """A rollout agent: follows the session and syncs every new READY version."""

    follow: bool = option(True, "Watch the coordinator and sync each new READY version.")
    no_version_warn_s: float = option(
        60.0,
        "Following: seconds without a version of the session to sync before a warning says why (no trainer "
        "has opened it: a --session the trainer does not publish under; or it has published nothing yet).",
    )
    dump_dir: str = option("", "Write each applied version to <dump_dir>/v<N>.safetensors.")
    engine: str = option(
        "numpy",
        "What applies the weights: a NumPy dict, an in-process vLLM engine, or a JAX model's sharded arrays "
        "(--jax-preset, over every local device).",
        choices=["numpy", "vllm", "jax"],
    )
    jax_preset: str = option("small", "jax engine: the model shape it holds (the trainer's --model-size).",
                             choices=sorted(PRESETS))  # fmt: skip
    jax_layout: str = option(
        "tpu_inference", "jax engine: how its leaves are laid out.", choices=["tpu_inference", "hf"]
    )
    jax_mesh: str = option("", "jax engine: data x model mesh over the local devices, e.g. 2x4 (default 1 x all).")
    jax_mode: str = option(
        "auto",
        "jax engine: swap (build aside, swap at once), inplace (leaf by leaf, for memory that cannot hold two "
        "copies), auto (swap where memory_stats says two copies fit).",
        choices=["auto", "swap", "inplace"],
    )
    model: str = option("", "vLLM engine: the model directory to start from (config, tokenizer, weights).")
    dtype: str = option("bfloat16", "vLLM engine: serving dtype.")
    kv_cache_bytes: int = option(64 << 20, "vLLM engine: KV cache size (bounded; vLLM takes ~90% of RAM otherwise).")
    prompt: str = option("w1 w2 w3 w4", "vLLM engine: the prompt completed after each applied version.")

    def server_host(self) -> str:
        return self.host

    def __post_init__(self) -> None:
        ServerConfig.__post_init__(self)
        try:
            self.check()
            check_bounds(self, ("kv_cache_bytes",), 1)
            check_positive(self, ("no_version_warn_s",))
        except InvalidArgument as e:
            raise ValueError(e.message) from None
        if self.engine == "vllm" and not self.model:
            raise ValueError("--engine vllm needs --model DIR")
        if self.jax_mesh and not re.fullmatch(r"[1-9]\d*x[1-9]\d*", self.jax_mesh):
            raise ValueError(f"--jax-mesh: {self.jax_mesh!r} is not ROWSxCOLS, e.g. 2x4")
