"""Agent lease keeper: heartbeats every interval, re-registers when the lease was lost."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from weightsync.client import CoordinatorClient
from weightsync.errors import AgentNotFound, WeightsyncError

log = logging.getLogger(__name__)


class Heartbeat:
    """A daemon thread renewing one agent's lease.

    Args:
        current_version: what the agent holds now (reported with every beat).
        reattach: called when the coordinator forgot the agent (expired lease, restart
            with a lost lease): it registers again.
    """

    def __init__(
        self,
        client: CoordinatorClient,
        session: str,
        agent_id: str,
        *,
        current_version: Callable[[], int],
        reattach: Callable[[], None],
        interval_s: float = 1.0,
    ) -> None:
        self._client = client
        self._session = session
        self._agent_id = agent_id
        self._current_version = current_version
        self._reattach = reattach
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"heartbeat-{agent_id}", daemon=True)

    def start(self) -> Heartbeat:
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=timeout_s)

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                self._client.heartbeat(self._session, self._agent_id, self._current_version())
            except AgentNotFound:
                try:
                    self._reattach()
                except WeightsyncError as e:
                    log.warning("agent %s: re-register failed: %s", self._agent_id, e)
            except WeightsyncError as e:
                log.warning("agent %s: heartbeat failed: %s", self._agent_id, e)
