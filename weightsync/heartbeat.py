"""Agent lease keeper: registers, heartbeats at the TTL's pace, re-registers when the lease was lost."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from weightsync.client import CoordinatorClient
from weightsync.errors import AgentNotFound, WeightsyncError
from weightsync.lease import heartbeat_interval_s

log = logging.getLogger(__name__)


class Heartbeat:
    """A daemon thread renewing one agent's lease.

    The interval derives from the lease TTL the coordinator returns with every
    registration and beat (`weightsync.lease`), so agents follow `--lease-ttl-s`.

    Args:
        current_version: what the agent holds now (reported with every beat).
        register: registers the agent (again) and returns the lease TTL in seconds;
            called by `start()` and whenever the coordinator forgot the agent (expired
            lease, a coordinator outage longer than the TTL).
        on_generation: called with the session generation every answer carries (a
            trainer learns from it that a newer incarnation fenced it).
    """

    def __init__(
        self,
        client: CoordinatorClient,
        session: str,
        agent_id: str,
        *,
        current_version: Callable[[], int],
        register: Callable[[], float],
        on_generation: Callable[[int], None] | None = None,
    ) -> None:
        self._client = client
        self._session = session
        self._agent_id = agent_id
        self._current_version = current_version
        self._register = register
        self._on_generation = on_generation
        self._interval_s = heartbeat_interval_s(10.0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"heartbeat-{agent_id}", daemon=True)
        self._failing = False

    @property
    def interval_s(self) -> float:
        return self._interval_s

    def start(self) -> Heartbeat:
        """Registers (raises what registration raises) and starts beating."""
        self._set_ttl(self._register())
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=timeout_s)

    def _set_ttl(self, ttl_s: float) -> None:
        if ttl_s > 0:
            self._interval_s = heartbeat_interval_s(ttl_s)

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                try:
                    resp = self._client.heartbeat(
                        self._session, self._agent_id, self._current_version(), timeout_s=max(1.0, 2 * self._interval_s)
                    )
                    self._set_ttl(resp.lease_ttl_seconds)
                    generation = resp.generation
                except AgentNotFound:
                    log.warning(
                        "agent %s: lease lost (expired or coordinator restarted); registering again", self._agent_id
                    )
                    self._set_ttl(self._register())
                    generation = 0
                if self._failing:
                    log.info("agent %s: lease renewed", self._agent_id)
                    self._failing = False
                if generation and self._on_generation is not None:
                    self._on_generation(generation)
            except WeightsyncError as e:
                if not self._failing:  # once per outage, not every beat
                    log.warning(
                        "agent %s: heartbeat failed (%s); retrying every %.2fs", self._agent_id, e, self._interval_s
                    )
                self._failing = True
