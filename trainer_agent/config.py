"""TrainerConfig: the trainer entry point's flags and WEIGHTSYNC_TRAINER_* variables."""

from __future__ import annotations

from dataclasses import dataclass

from trainer_agent.settings import PublisherSettings
from trainer_agent.synthetic import PRESETS
from weightsync.config import MAX_SECONDS, check_bounds, check_positive, option
from weightsync.dtypes import ALLOWED
from weightsync.errors import InvalidArgument
from weightsync.validation import INT64_MAX, UINT32_MAX


@dataclass
class TrainerConfig(PublisherSettings):
    """A JAX trainer process (synthetic Qwen3-shaped model) publishing every step."""

    metrics_port: int = option(0, "Prometheus /metrics port; 0 picks a free one, -1 disables.")
    weight_dtype: str = option(
        "bfloat16", "Dtype served to rollouts (the masters are cast: fp32, bf16 at 4b).", choices=list(ALLOWED)
    )
    weight_sync_mode: str = option(
        "tcp",
        "The session's default mode for rollouts: grpc | tcp | shm | fs "
        "(aliases filesystem, gcs; needs --fs-root) | relay.",
    )
    model_size: str = option("small", "Synthetic model preset.", choices=sorted(PRESETS))
    seed: int = option(0, "Seed of the initial weights and of every step's update.")
    lr: float = option(
        1e-3, "Step size of the stand-in update (lr x N(0,1) per element); RL-like steps are 1e-6..1e-5."
    )
    steps: int = option(5, "Training steps; each publishes version start_version + step - 1.")
    start_version: int = option(
        1, "Version number of the first published step (an attach whose start version is not new is refused)."
    )
    step_interval_s: float = option(0.0, "Pause between steps (paces a trainer that does not wait for commits).")
    wait_commit: bool = option(
        True, "Wait for each version to be COMMITTED before the next step (training goes on if it is not)."
    )
    commit_timeout_s: float = option(120.0, "How long to wait for a commit (a PARTIAL version may still commit).")
    hold: bool = option(False, "Keep serving after the last step until SIGTERM.")
    stay_fenced: bool = option(
        False, "Keep running when a newer trainer incarnation fenced this one (default: exit 3)."
    )

    def __post_init__(self) -> None:
        try:
            super().__post_init__()
            check_bounds(self, ("step_interval_s",), 0, MAX_SECONDS)
            check_positive(self, ("commit_timeout_s",))
            check_bounds(self, ("seed",), 0, UINT32_MAX)
            check_bounds(self, ("start_version",), 1, INT64_MAX)
            check_bounds(self, ("lr",), 0, 1)
        except InvalidArgument as e:
            raise ValueError(e.message) from None
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if self.steps < 0 or self.start_version < 1:
            raise ValueError("steps must be >= 0 and start_version >= 1")
