"""RolloutConfig: the rollout sidecar's flags and WEIGHTSYNC_ROLLOUT_* variables."""

from __future__ import annotations

from dataclasses import dataclass

from weightsync.config import ServerConfig, option
from weightsync.modes import normalize_mode
from weightsync.validation import AGENT_ID_RE


@dataclass
class RolloutConfig(ServerConfig):
    """A rollout agent: follows the session and syncs every new READY version."""

    coordinator: str = option("127.0.0.1:50051", "Coordinator address host:port.")
    session: str = option("demo", "Session name.")
    agent_id: str = option("", "Unique rollout id (lowercase); default rollout-<pid>.")
    host_id: str = option("", "Machine identity for same-host transports; default the hostname.")
    weight_sync_mode: str = option(
        "",
        "grpc | tcp (native bulk path) | shm (map a same-host trainer's arena) | fs, alias filesystem or gcs "
        "(read parts under --fs-root) | relay (pull from the rollout before us in the coordinator's chain, re-serve "
        "to the next); empty: the session's mode, set by the trainer. Ranks not offering it are pulled over grpc.",
    )
    relay_port: int = option(
        0, "relay: port of the tcp server re-serving chunks to the next rollout; 0 picks a free one."
    )
    relay_wait_s: float = option(
        10.0, "relay: how long a downstream read waits for a chunk here before it is sent to the trainer."
    )
    fs_root: str = option("", "fs transport: the fsspec root parts may be read from (e.g. /mnt/ckpt, gs://bucket/ws).")
    streams: int = option(2, "Parallel streams per trainer rank.")
    window_chunks: int = option(
        32, "Chunks requested per call (the in-flight window per stream; tuned in bench/, see README)."
    )
    max_attempts: int = option(3, "Fetches per chunk before giving up with DATA_LOSS.")
    timeout_s: float = option(120.0, "Deadline of each data-plane call.")
    apply_mode: str = option(
        "atomic",
        "atomic: verify every byte before the first weight changes; streaming: one layer group at a time "
        "(bounded memory, not atomic).",
        choices=["atomic", "streaming"],
    )
    follow: bool = option(True, "Watch the coordinator and sync each new READY version.")
    dump_dir: str = option("", "Write each applied version to <dump_dir>/v<N>.safetensors.")
    failpoints: str = option("", "Testing only: name=count pairs, e.g. puller.corrupt_assembled=1.")
    engine: str = option(
        "numpy", "What applies the weights: a NumPy dict, or an in-process vLLM engine.", choices=["numpy", "vllm"]
    )
    model: str = option("", "vLLM engine: the model directory to start from (config, tokenizer, weights).")
    dtype: str = option("bfloat16", "vLLM engine: serving dtype.")
    kv_cache_bytes: int = option(64 << 20, "vLLM engine: KV cache size (bounded; vLLM takes ~90% of RAM otherwise).")
    prompt: str = option("w1 w2 w3 w4", "vLLM engine: the prompt completed after each applied version.")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.agent_id and not AGENT_ID_RE.match(self.agent_id):
            raise ValueError(f"agent_id {self.agent_id!r} must match {AGENT_ID_RE.pattern}")
        self.weight_sync_mode = normalize_mode(self.weight_sync_mode, allow_empty=True)
        if self.weight_sync_mode == "fs" and not self.fs_root:
            raise ValueError("--weight-sync-mode fs needs --fs-root")
        if self.engine == "vllm" and not self.model:
            raise ValueError("--engine vllm needs --model DIR")
        if min(self.streams, self.window_chunks, self.max_attempts) < 1:
            raise ValueError("streams, window_chunks and max_attempts must be >= 1")
