"""Lease timing, in one place: agents and the coordinator derive it from the lease TTL."""

from __future__ import annotations

# Heartbeats per lease TTL: a lease survives three lost beats (2.5 s beats at the default
# 10 s). Not more: a unary RPC costs the coordinator ~1 ms of CPU in grpc-python
# (bench/control.py), so 1,000 rollouts at ten beats per TTL would take a core for
# heartbeats alone; at four they take ~0.4 core.
BEATS_PER_TTL = 4
# A relay that missed this many beats leaves new relay chains while its lease still holds.
RELAY_MISSED_BEATS = 2


def heartbeat_interval_s(lease_ttl_s: float) -> float:
    """Seconds between an agent's heartbeats for a lease of `lease_ttl_s`."""
    return max(0.05, lease_ttl_s / BEATS_PER_TTL)


def relay_fresh_s(lease_ttl_s: float) -> float:
    """How recently a relay must have renewed its lease to stay in relay chains."""
    return RELAY_MISSED_BEATS * heartbeat_interval_s(lease_ttl_s)
