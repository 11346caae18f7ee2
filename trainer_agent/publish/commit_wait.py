"""Waiting for a published version to end (COMMITTED, FAILED or RELEASED), and, where it does
not in time, who it waits for."""

from __future__ import annotations

from weightsync import version_states
from weightsync._proto import types_pb2 as _tpb
from weightsync.client import CoordinatorClient
from weightsync.errors import DeadlineExceeded, WeightsyncError

FINAL_STATES = tuple(sorted(version_states.FINAL))


def wait_final(client: CoordinatorClient, session: str, version: int, timeout_s: float) -> str:
    """The state `version` ended in; DeadlineExceeded after `timeout_s` says what it waits for."""
    try:
        info = client.wait_for_version(session, version, states=FINAL_STATES, timeout_s=timeout_s)
    except DeadlineExceeded as e:
        raise DeadlineExceeded(f"{e.message}: {waiting_for(client, session, version)}") from None
    return _tpb.VersionState.Name(info.state)


def waiting_for(client: CoordinatorClient, session: str, version: int) -> str:
    """Who a version that has not committed waits for, from the session's status: no
    rollout at all (none started, or they follow another session), or the live rollouts
    that have not reported it."""
    try:
        st = client.status(session, 20)
    except WeightsyncError as e:
        return f"the session's status could not be read ({e.message})"
    info = next((v for v in st.versions if v.version == version), None)
    state = _tpb.VersionState.Name(info.state) if info is not None else "not among the newest 20"
    live = sorted(a.agent_id for a in st.agents if a.role == _tpb.ROLLOUT and a.alive)
    if not live:
        return (
            f"it is {state} and no live rollout is registered in session {session!r} "
            "(none started, or they follow another session)"
        )
    reports = {h.agent_id: h for h in st.handshakes if h.version == version}
    waiting = [a for a in live if a not in reports]
    failed = [a for a in live if a in reports and not reports[a].ok]
    leases = info.leases if info is not None else 0
    return (
        f"it is {state}; {len(live) - len(waiting)} of {len(live)} live rollouts reported it"
        + (f", not yet {_some(waiting)}" if waiting else "")
        + (
            f"; failed on {_some(failed)} (first: {reports[failed[0]].mismatch[:200]}), retried by them"
            if failed
            else ""
        )
        + f" ({leases} hold a lease on it; min_rollouts {st.min_rollouts})"
    )


def _some(agents: list[str], shown: int = 5) -> str:
    """Up to `shown` agent ids, quoted, and how many more."""
    more = f" and {len(agents) - shown} more" if len(agents) > shown else ""
    return ", ".join(repr(a) for a in agents[:shown]) + more
