"""The rollout agent as it lives inside a vLLM worker: shared by the weight-transfer
backend and the worker extension. Only plain data crosses vLLM's RPCs: the worker pulls
the bytes itself."""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import asdict
from typing import Any

from rollout_agent.settings import InitInfo
from rollout_agent.sync import SyncResult, sync_version
from rollout_agent.vllm_applier import VllmApplier
from rollout_agent.wiring import wire_rollout
from weightsync.errors import InvalidArgument, WeightsyncError
from weightsync.validation import check_agent_id

log = logging.getLogger("vllm.plugins.weightsync")


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
    """Coordinator registration, heartbeats, pull + verify + apply, handshake; its parts
    come from `rollout_agent.wiring`, as the sidecar's do."""

    def __init__(self, info: InitInfo, model: Any, model_config: Any, rank: int = 0) -> None:
        self.info = info
        agent_id = info.agent_id or f"vllm-{socket.gethostname().lower()}-{os.getpid()}-r{rank}"
        check_agent_id(agent_id, "init_info.agent_id")
        self.wiring = wire_rollout(info, agent_id, on_verdict=self._on_verdict)
        self.agent_id = agent_id
        self.applier = VllmApplier(model, model_config)
        self.current_version = 0
        self.last: SyncResult | None = None
        self._heartbeat = self.wiring.heartbeat(lambda: self.current_version)

    def _on_verdict(self, version: int, ok: bool, mismatch: str) -> None:
        if ok:
            self.current_version = max(self.current_version, version)
            log.info("weightsync version %d: handshake delivered late, ok", version)
        else:
            log.error("weightsync version %d: handshake delivered late, refused: %s", version, mismatch)

    def sync(self, version: Any = "latest") -> SyncResult:
        """Pulls, verifies, applies and reports; the live weights change only when every
        chunk and tensor verified and every name matched the model."""
        w = self.wiring
        assert w.puller is not None
        result = sync_version(
            w.puller,
            self.applier,
            parse_version(version),
            apply_mode=self.info.apply_mode,
            failpoints=w.failpoints,
            outbox=w.outbox,
            engine_blocked=True,  # update_weights / collective_rpc hold the engine for the round
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
        w = self.wiring
        self._heartbeat.stop()
        if w.outbox is not None:
            w.outbox.close()
        try:
            w.client.deregister_agent(self.info.session, self.agent_id)
        except WeightsyncError as e:
            log.info("weightsync: deregistering %s: %s", self.agent_id, e)
        w.close_data_plane()
        w.client.close()
