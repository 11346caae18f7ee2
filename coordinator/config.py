"""CoordinatorConfig: flags --db-path etc. and WEIGHTSYNC_COORDINATOR_* variables."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from weightsync.addresses import is_unix
from weightsync.config import MAX_SECONDS, ServerConfig, check_bounds, option
from weightsync.credentials import CREDENTIAL_NAME
from weightsync.errors import InvalidArgument
from weightsync.failpoints import Failpoints

MAX_COUNT = 1 << 31


@dataclass
class CoordinatorConfig(ServerConfig):
    """Coordinator settings."""

    db_path: str = option(".weightsync/coordinator.db", "SQLite database file (created if missing).")
    auth: str = option(
        "credential",
        "credential: without --auth-tokens-file or --tls-require-client-cert, a TCP server requires the bearer "
        "tokens of --credential-file (made for this user, mode 0600; its clients find it); a unix socket relies on "
        "its file mode. none: take calls without a credential (every local user may attach as the trainer).",
        choices=["credential", "none"],
    )
    credential_file: str = option(
        "", "Where --auth credential keeps its tokens (JSON, mode 0600); default credential.json beside --db-path."
    )
    lease_ttl_s: float = option(10.0, "Agent lease lifetime; agents heartbeat four times per lease (weightsync.lease).")
    max_workers: int = option(
        8, "Threads for the blocking handlers (watch streams need none). More threads only contend for the GIL."
    )
    retain_versions: int = option(
        50, "Per session, the newest versions kept whole; older RELEASED/FAILED ones keep a summary row only."
    )
    forget_agents_after_s: float = option(
        3600.0,
        "An agent whose lease lapsed this long ago is forgotten: its row deleted, GetStatus stops listing it "
        "(pods that come and go under new names leave no trail forever). It registers again if it comes back. "
        "A session no trainer opened is forgotten this long after it was made once no agent or version is left.",
    )
    max_sessions: int = option(
        1000, "Sessions that may exist at once; a new one past it is refused (wsctl delete-session frees room)."
    )
    failpoints: str = option("", "Testing only: name=count pairs, e.g. coordinator.exit_after_flip_decision=1.")
    gc_refresh_s: float = option(
        900.0,
        "Survivors of a full garbage collection are frozen (weightsync.gc_freeze); this often, "
        "everything is collected once. 0 keeps CPython's collector as it is.",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        try:
            # Upper bounds keep every value inside what SQLite and the clock take: a
            # retain_versions past 2^63 would fail every housekeeping round at its prune
            # (OverflowError), a lease of 1e20 s end the coordinator as it starts.
            check_bounds(self, ("lease_ttl_s",), 0.001, MAX_SECONDS)
            check_bounds(self, ("forget_agents_after_s", "gc_refresh_s"), 0, MAX_SECONDS)
            check_bounds(self, ("retain_versions", "max_sessions"), 1, MAX_COUNT)
            check_bounds(self, ("max_workers",), 4, 1024)
            Failpoints(self.failpoints)  # refused at start
        except InvalidArgument as e:
            raise ValueError(e.message) from None
        if self.auth not in ("credential", "none"):
            raise ValueError(f"auth must be credential or none, got {self.auth!r}")

    def requires_credential(self) -> bool:
        """Whether this coordinator requires its default credential (see --auth)."""
        return (
            self.auth == "credential"
            and not (self.auth_tokens_file or self.tls_require_client_cert)
            and not is_unix(self.host)
        )

    def credential_path(self) -> str:
        """Where the default credential is kept ("" for an in-memory database without
        --credential-file: the caller draws a private directory)."""
        if self.credential_file:
            return self.credential_file
        return "" if self.db_path == ":memory:" else str(Path(self.db_path).parent / CREDENTIAL_NAME)
