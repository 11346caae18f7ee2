"""Lease timing, in one place: agents and the coordinator derive it from the lease TTL."""

from __future__ import annotations

# Heartbeats per lease TTL: a lease survives nine lost beats (1 s beats at the default 10 s).
BEATS_PER_TTL = 10
# A relay that missed this many beats leaves new relay chains while its lease still holds.
RELAY_MISSED_BEATS = 3


def heartbeat_interval_s(lease_ttl_s: float) -> float:
    """Seconds between an agent's heartbeats for a lease of `lease_ttl_s`."""
    return max(0.05, lease_ttl_s / BEATS_PER_TTL)


def relay_fresh_s(lease_ttl_s: float) -> float:
    """How recently a relay must have renewed its lease to stay in relay chains."""
    return RELAY_MISSED_BEATS * heartbeat_interval_s(lease_ttl_s)
