"""Fleet gauges read from the coordinator's store at scrape time (a custom collector):
agents alive and expired, leases held, and each session's newest published and committed
versions. Read when Prometheus asks, so they are never stale and cost nothing between
scrapes."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from coordinator.store import SessionStore

AGENTS = "weightsync_agents"
LEASES = "weightsync_leases"
SESSION_VERSION = "weightsync_session_version"


class FleetCollector(Collector):
    """Registers on a metrics registry; `collect` runs one grouped read of the store."""

    def __init__(self, store: SessionStore) -> None:
        self._store = store

    def describe(self) -> Iterator[GaugeMetricFamily]:
        return iter(self._families())  # names only: registering reads nothing

    def collect(self) -> Iterator[GaugeMetricFamily]:
        agents, leases, versions = self._families()
        for g in self._store.fleet_gauges():
            for role in ("trainer", "rollout"):
                for alive in (True, False):
                    count = g.agents.get((role, alive), 0)
                    agents.add_metric([g.session, role, "alive" if alive else "expired"], count)
            leases.add_metric([g.session], g.leases)
            versions.add_metric([g.session, "published"], g.published)
            versions.add_metric([g.session, "committed"], g.committed)
        yield from (agents, leases, versions)

    @staticmethod
    def _families() -> tuple[GaugeMetricFamily, GaugeMetricFamily, GaugeMetricFamily]:
        return (
            GaugeMetricFamily(
                AGENTS,
                "Registered agents by role and lease state (alive, or expired and not yet forgotten).",
                labels=["session", "role", "state"],
            ),
            GaugeMetricFamily(LEASES, "Version leases held by live rollouts.", labels=["session"]),
            GaugeMetricFamily(
                SESSION_VERSION,
                "Newest version by kind: published (past STAGING) or committed.",
                labels=["session", "kind"],
            ),
        )
