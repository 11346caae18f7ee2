"""RolloutConfig: the rollout sidecar's flags and WEIGHTSYNC_ROLLOUT_* variables."""

from __future__ import annotations

from dataclasses import dataclass

from rollout_agent.settings import SyncSettings
from weightsync.config import ServerConfig, check_bounds, check_positive, option
from weightsync.errors import InvalidArgument


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
        "numpy", "What applies the weights: a NumPy dict, or an in-process vLLM engine.", choices=["numpy", "vllm"]
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
