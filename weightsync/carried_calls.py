"""Calls a rollout carries on its Heartbeats stream instead of opening an RPC each.

On every READY a fleet makes two calls per rollout (the leased GetManifest, the handshake);
as new RPCs they queue in grpc.aio's accept path, one per event-loop turn, ahead of an
operator's GetStatus. Carried on the stream each agent already holds, they open nothing.
Each is named here by its `HeartbeatRequest.call` field and the RPC it stands for: the
coordinator answers it as that RPC would, and authorizes it as that RPC (`security`).
"""

from __future__ import annotations

from typing import Any

# HeartbeatRequest.call oneof field -> the Coordinator method it stands for
CARRIED_METHODS = {"get_manifest": "GetManifest", "report_applied": "ReportApplied"}


def carried_call(request: Any) -> tuple[str, Any] | None:
    """(method name, request message) of the call a HeartbeatRequest carries; None for a beat."""
    which = request.WhichOneof("call")
    return None if which is None else (CARRIED_METHODS[which], getattr(request, which))


COORDINATOR = "/weightsync.v1.Coordinator/"  # the prefix of the coordinator's method paths
# Methods whose request names an agent (`agent_id`): what checks of who may act for an
# agent look at (`security.BearerAuth`, the coordinator's agent keys).
AGENT_METHODS = frozenset(
    COORDINATOR + m
    for m in ("RegisterAgent", "DeregisterAgent", "Heartbeat", "Heartbeats", "ReportApplied", "GetManifest")
)


def calls_in(method: str, request: Any) -> list[tuple[str, Any]]:
    """(method, message) for what one request message asks: itself, and for a Heartbeats
    message that carries a call, that call as its own RPC's. A client stream's iterator
    (seen before its messages) asks nothing yet."""
    if not hasattr(request, "ListFields"):
        return []
    if method == COORDINATOR + "Heartbeats":
        carried = carried_call(request)
        if carried is not None:
            return [(COORDINATOR + carried[0], carried[1])]
    return [(method, request)]
