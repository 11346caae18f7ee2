"""CoordinatorConfig: flags --db-path etc. and WEIGHTSYNC_COORDINATOR_* variables."""

from __future__ import annotations

from dataclasses import dataclass

from weightsync.config import ServerConfig, option


@dataclass
class CoordinatorConfig(ServerConfig):
    """Coordinator settings."""

    db_path: str = option(".weightsync/coordinator.db", "SQLite database file (created if missing).")
    lease_ttl_s: float = option(10.0, "Agent lease lifetime; agents heartbeat four times per lease (weightsync.lease).")
    max_workers: int = option(
        8, "Threads for the blocking handlers (watch streams need none). More threads only contend for the GIL."
    )
    retain_versions: int = option(
        50, "Per session, the newest versions kept whole; older RELEASED/FAILED ones keep a summary row only."
    )
    forget_agents_after_s: float = option(
        3600.0,
        "An agent whose lease lapsed this long ago is forgotten: no longer listed by GetStatus, its row deleted "
        "(pods that come and go under new names leave no trail forever). It registers again if it comes back.",
    )
    max_sessions: int = option(
        1000, "Sessions that may exist at once; a new one past it is refused (wsctl delete-session frees room)."
    )
    gc_refresh_s: float = option(
        900.0,
        "Survivors of a full garbage collection are frozen (weightsync.gc_freeze); this often, "
        "everything is collected once. 0 keeps CPython's collector as it is.",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.lease_ttl_s <= 0:
            raise ValueError(f"lease_ttl_s must be > 0, got {self.lease_ttl_s}")
        if self.retain_versions < 1:
            raise ValueError(f"retain_versions must be >= 1, got {self.retain_versions}")
        if not self.forget_agents_after_s >= 0:
            raise ValueError(f"forget_agents_after_s must be >= 0, got {self.forget_agents_after_s}")
        if self.max_sessions < 1:
            raise ValueError(f"max_sessions must be >= 1, got {self.max_sessions}")
        if self.gc_refresh_s < 0:
            raise ValueError(f"gc_refresh_s must be >= 0, got {self.gc_refresh_s}")
        if self.max_workers < 4:
            raise ValueError(f"max_workers must be >= 4, got {self.max_workers}")
