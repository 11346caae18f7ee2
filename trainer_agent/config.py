"""TrainerConfig: the trainer entry point's flags and WEIGHTSYNC_TRAINER_* variables."""

from __future__ import annotations

from dataclasses import dataclass

from trainer_agent.synthetic import PRESETS
from weightsync.config import ServerConfig, option
from weightsync.dtypes import ALLOWED
from weightsync.layout import DEFAULT_CHUNK_BYTES
from weightsync.modes import normalize_mode


@dataclass
class TrainerConfig(ServerConfig):
    """A JAX trainer process (synthetic Qwen3-shaped model) publishing every step."""

    coordinator: str = option("127.0.0.1:50051", "Coordinator address host:port.")
    session: str = option("demo", "Session name.")
    rank: int = option(0, "This trainer rank.")
    world_size: int = option(
        1, "Number of publishing trainer ranks; each owns rows [r*n/W, (r+1)*n/W) of every tensor."
    )
    incarnation: str = option("", "Shared by all ranks of one run; empty = a fresh one (single rank).")
    model_size: str = option("small", "Synthetic model preset.", choices=sorted(PRESETS))
    seed: int = option(0, "Seed of the initial weights and of every step's update.")
    steps: int = option(5, "Training steps; each publishes version start_version + step - 1.")
    start_version: int = option(1, "Version number of the first published step.")
    step_interval_s: float = option(0.0, "Pause between steps (paces a trainer that does not wait for commits).")
    weight_dtype: str = option("bfloat16", "Dtype served to rollouts (fp32 masters are cast).", choices=list(ALLOWED))
    slots: int = option(2, "Arena slots.")
    tcp_port: int = option(0, "Port of the native tcp data-plane server; 0 picks a free one.")
    chunk_bytes: int = option(
        DEFAULT_CHUNK_BYTES, "Chunk size in bytes (3 MiB: measured best for grpc and tcp, below gRPC's 4 MiB limit)."
    )
    min_rollouts: int = option(0, "OK handshakes needed to commit; 0 keeps the session's value.")
    wait_commit: bool = option(True, "Wait for each version to be COMMITTED before the next step.")
    commit_timeout_s: float = option(120.0, "How long to wait for a commit.")
    hold: bool = option(False, "Keep serving after the last step until SIGTERM.")
    stay_fenced: bool = option(
        False, "Keep running when a newer trainer incarnation fenced this one (default: exit 3)."
    )
    weight_sync_mode: str = option(
        "tcp",
        "The session's default mode for rollouts: grpc | tcp | shm | fs "
        "(aliases filesystem, gcs; needs --fs-root) | relay.",
    )
    fs_root: str = option(
        "", "Also write every part under this fsspec root for the fs mode (e.g. /mnt/ckpt, gs://b/ws)."
    )
    failpoints: str = option("", "Testing only: name=count pairs, e.g. chunk_server.corrupt_chunk=2.")

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} must be in [0, world_size={self.world_size})")
        self.weight_sync_mode = normalize_mode(self.weight_sync_mode)
        if self.weight_sync_mode == "fs" and not self.fs_root:
            raise ValueError("--weight-sync-mode fs needs --fs-root")
        if self.steps < 0 or self.start_version < 1:
            raise ValueError("steps must be >= 0 and start_version >= 1")
