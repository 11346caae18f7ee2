"""The rollout agent as it lives inside a vLLM worker: shared by the weight-transfer
backend and the worker extension. Only plain data crosses vLLM's RPCs: the worker pulls
the bytes itself."""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import asdict, dataclass
from typing import Any

from rollout_agent.outbox import ReportOutbox
from rollout_agent.puller import WeightPuller
from rollout_agent.relay import Relay
from rollout_agent.sync import SyncResult, sync_version
from rollout_agent.vllm_applier import VllmApplier
from weightsync.client import CoordinatorClient
from weightsync.errors import InvalidArgument, WeightsyncError
from weightsync.heartbeat import Heartbeat
from weightsync.manifest import Endpoint
from weightsync.modes import normalize_mode
from weightsync.security import Security
from weightsync.validation import check_agent_id, check_session_name

log = logging.getLogger("vllm.plugins.weightsync")


@dataclass
class RolloutInitInfo:
    """Init info (vLLM `init_weight_transfer_engine({"init_info": ...})`)."""

    coordinator: str
    session: str
    agent_id: str = ""
    weight_sync_mode: str = ""  # grpc | tcp | shm | fs (aliases filesystem, gcs) | relay; "" = the session's
    streams: int = 2
    window_chunks: int = 32
    max_attempts: int = 3
    timeout_s: float = 120.0
    apply_mode: str = "atomic"  # or "streaming": bounded host memory, not atomic
    fs_root: str = ""  # transport "fs": the store parts may be read from
    tls_ca_file: str = ""  # TLS: the CA of the coordinator's and trainers' certificates
    tls_cert_file: str = ""  # mTLS: this worker's client certificate and key
    tls_key_file: str = ""
    auth_token: str = ""  # the rollout role's bearer token, when servers require tokens

    def __post_init__(self) -> None:
        check_session_name(self.session, "init_info.session")
        if self.agent_id:
            check_agent_id(self.agent_id, "init_info.agent_id")
        if self.apply_mode not in ("atomic", "streaming"):
            raise InvalidArgument(f"{self.apply_mode!r} is not 'atomic' or 'streaming'", field="init_info.apply_mode")
        self.weight_sync_mode = normalize_mode(self.weight_sync_mode, "init_info.weight_sync_mode", allow_empty=True)
        self.security()  # both halves of a key pair or neither
        if self.weight_sync_mode == "fs" and not self.fs_root:
            raise InvalidArgument("weight_sync_mode 'fs' needs the store root", field="init_info.fs_root")

    def security(self) -> Security:
        """TLS / mTLS and the bearer token for this worker's channels."""
        try:
            return Security(self.tls_cert_file, self.tls_key_file, self.tls_ca_file, token=self.auth_token)
        except InvalidArgument as e:
            raise InvalidArgument(e.message.partition(": ")[2], field=f"init_info.{e.field}") from None


def parse_version(version: Any) -> int:
    """`latest` (or 0) -> 0, else a positive integer."""
    if version in ("latest", 0, "0", None):
        return 0
    try:
        v = int(version)
    except (TypeError, ValueError):
        raise InvalidArgument(f"{version!r} is neither 'latest' nor an integer", field="update_info.version") from None
    if v < 0:
        raise InvalidArgument(f"{v} must be >= 0", field="update_info.version")
    return v


class VllmRollout:
    """Coordinator registration, heartbeats, pull + verify + apply, handshake."""

    def __init__(self, info: RolloutInitInfo, model: Any, model_config: Any, rank: int = 0) -> None:
        self.info = info
        self.agent_id = info.agent_id or f"vllm-{socket.gethostname().lower()}-{os.getpid()}-r{rank}"
        check_agent_id(self.agent_id, "init_info.agent_id")
        security = info.security()
        self.client = CoordinatorClient(info.coordinator, timeout_s=info.timeout_s, security=security)
        # relay mode: this worker re-serves what it pulls to the next rollout in the chain.
        self.relay = Relay(info.session) if info.weight_sync_mode == "relay" and info.apply_mode == "atomic" else None
        self.puller = WeightPuller(
            self.client,
            info.session,
            self.agent_id,
            transport=info.weight_sync_mode,
            fs_root=info.fs_root,
            streams=info.streams,
            window_chunks=info.window_chunks,
            max_attempts=info.max_attempts,
            timeout_s=info.timeout_s,
            relay=self.relay.source if self.relay else None,
            security=security,
        )
        self.applier = VllmApplier(model, model_config)
        self.current_version = 0
        self.last: SyncResult | None = None
        self.outbox = ReportOutbox(self.client, self._on_verdict)
        self._heartbeat = Heartbeat(
            self.client,
            info.session,
            self.agent_id,
            current_version=lambda: self.current_version,
            register=self._attach,
        ).start()

    def _attach(self) -> float:
        self.client.open_session(self.info.session, trainer=False)
        endpoint = Endpoint(
            "",
            ("grpc", "relay") if self.relay else ("grpc",),
            socket.gethostname(),
            tcp_address=self.relay.address if self.relay else "",
        )
        return self.client.register_agent(
            self.info.session, self.agent_id, trainer=False, endpoint=endpoint
        ).lease_ttl_seconds

    def _on_verdict(self, version: int, ok: bool, mismatch: str) -> None:
        if ok:
            self.current_version = max(self.current_version, version)
            log.info("weightsync version %d: handshake delivered late, ok", version)
        else:
            log.error("weightsync version %d: handshake delivered late, refused: %s", version, mismatch)

    def sync(self, version: Any = "latest") -> SyncResult:
        """Pulls, verifies, applies and reports; the live weights change only when every
        chunk and tensor verified and every name matched the model."""
        result = sync_version(
            self.puller, self.applier, parse_version(version), apply_mode=self.info.apply_mode, outbox=self.outbox
        )
        self.last = result
        if result.ok:
            self.current_version = result.version
            log.info("weightsync applied version %d (%d bytes)", result.version, result.bytes_pulled)
        else:
            log.error("weightsync version %d not applied: %s", result.version, result.mismatch)
        return result

    def status(self) -> dict[str, Any]:
        return {
            "agent_id": self.agent_id,
            "session": self.info.session,
            "current_version": self.current_version,
            "last": asdict(self.last) if self.last else None,
        }

    def close(self) -> None:
        self._heartbeat.stop()
        self.outbox.close()
        try:
            self.client.deregister_agent(self.info.session, self.agent_id)
        except WeightsyncError as e:
            log.info("weightsync: deregistering %s: %s", self.agent_id, e)
        self.puller.close()
        if self.relay is not None:
            self.relay.close()
        self.client.close()
