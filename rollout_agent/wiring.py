"""The one assembly of a rollout's parts, for every entry point.

The sidecar (`python -m rollout_agent`, NumPy or its own vLLM engine), the vLLM
weight-transfer backend and the worker extension all build their coordinator client,
puller, relay, report outbox, advertised endpoint and heartbeat here, from one
`SyncSettings`, so a rule (which modes relay, which host a relay binds and advertises)
has one owner.
"""

from __future__ import annotations

import logging
import secrets
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from rollout_agent.audit.auditor import Auditor
from rollout_agent.pull.puller import WeightPuller
from rollout_agent.pull.relay import Relay, relay_stall_s
from rollout_agent.settings import SyncSettings
from rollout_agent.sync.outbox import ReportOutbox
from weightsync.client import CoordinatorClient
from weightsync.config import advertised
from weightsync.errors import AlreadyExists
from weightsync.failpoints import Failpoints
from weightsync.heartbeat import Heartbeat
from weightsync.manifest import Endpoint
from weightsync.metrics import Metrics
from weightsync.transports.fs_options import parse_fs_options

log = logging.getLogger(__name__)
Verdict = Callable[[int, bool, str], None]  # (version, ok, mismatch) of a late handshake
# How long a rollout waits for another process's live lease on its agent id, in lease
# TTLs (the coordinator's, from OpenSession): past the old container's last beat, so a
# container restarted after `kill -9` gets its id back; 30 s where a coordinator does not
# say its TTL.
ID_HELD_WAIT_LEASES = 3.0
ID_HELD_WAIT_S = 30.0
ID_HELD_RETRY_S = 1.0


@dataclass
class RolloutWiring:
    """A rollout's parts; `server_address` is its own gRPC server's, once it serves."""

    settings: SyncSettings
    agent_id: str
    client: CoordinatorClient
    puller: WeightPuller | None  # None: the engine pulls (a sidecar driving its own vLLM)
    relay: Relay | None
    outbox: ReportOutbox | None
    failpoints: Failpoints
    server_address: str = ""
    # This rollout, to the coordinator: another process under the same agent id is refused
    # while this one's lease is live (it would beat this lease and answer for its handshakes).
    instance: str = ""
    # The session's identity at the last registration, and what to call when a registration
    # finds another (the session deleted and made again, a coordinator's database lost).
    session_uid: str = ""
    on_new_session: list[Callable[[], None]] = field(default_factory=list)

    def endpoint(self) -> Endpoint:
        """What the coordinator hands to trainers and downstream relays: addresses as
        other hosts dial them (`advertise_host`), and "relay" only where one serves."""
        s = self.settings
        relay_address = advertised(self.relay.address, s.advertise_host) if self.relay else ""
        return Endpoint(
            advertised(self.server_address, s.advertise_host) if self.server_address else "",
            ("grpc", "relay") if relay_address else ("grpc",),
            s.host_id or socket.gethostname(),
            tcp_address=relay_address,
        )

    def register(self) -> float:
        """Opens the session (creating it if needed) and registers; returns the lease TTL.

        While another process holds this agent id's live lease (AlreadyExists), waits up to
        `ID_HELD_WAIT_LEASES` lease TTLs for it to lapse (this pod's previous container,
        killed without deregistering), then raises: two live processes under one id is a
        misconfiguration."""
        opened = self.client.open_session(self.settings.session, trainer=False)
        wait_s = ID_HELD_WAIT_LEASES * opened.lease_ttl_seconds or ID_HELD_WAIT_S
        deadline, warned = time.monotonic() + wait_s, False
        while True:
            try:
                registered = self.client.register_agent(
                    self.settings.session,
                    self.agent_id,
                    trainer=False,
                    endpoint=self.endpoint(),
                    instance=self.instance,
                )
                self._note_session(registered.session_uid)
                return registered.lease_ttl_seconds
            except AlreadyExists as e:
                if e.field != "agent_id" or time.monotonic() >= deadline:
                    raise
                if not warned:
                    log.warning("%s; waiting up to %.0fs for its lease to lapse", e.message, wait_s)
                    warned = True
                time.sleep(ID_HELD_RETRY_S)

    def _note_session(self, uid: str) -> None:
        """Version numbers belong to one session: when the coordinator names another under
        the same name, what this rollout applied, leased or reported is of the old one.
        Kept, a rollout at version N of a deleted session would wait for the new one's
        version N + 1 and hold every version before it from committing."""
        previous, self.session_uid = self.session_uid, uid or self.session_uid
        if not previous or not uid or uid == previous:
            return
        log.warning(
            "session %r was made again (deleted, or the coordinator lost its database): its versions start over; "
            "syncing its newest",
            self.settings.session,
        )
        if self.outbox is not None:
            self.outbox.discard()
        if self.puller is not None:
            self.puller.forget_versions()
        for react in self.on_new_session:
            react()

    def heartbeat(self, current_version: Callable[[], int], auditor: Auditor | None = None) -> Heartbeat:
        """A started lease keeper that registers (again) through `register`; the client
        carries the rollout's leases and handshakes on its stream, and its beats the
        `auditor`'s last audit (and bring it the coordinator's audit requests)."""
        beat = Heartbeat(
            self.client, self.settings.session, self.agent_id, current_version=current_version, register=self.register,
            audit=auditor.summary if auditor is not None else None,
            on_audit_request=auditor.requested if auditor is not None else None,
        ).start()  # fmt: skip
        if auditor is not None:
            auditor.beat_soon = beat.beat_soon
        self.client.carrier = beat
        return beat

    def close_data_plane(self) -> None:
        """Stops the puller's connections and the relay (the client stays open for the
        deregistration that follows)."""
        if self.puller is not None:
            self.puller.close()
        if self.relay is not None:
            self.relay.close()


def wire_rollout(
    settings: SyncSettings,
    agent_id: str,
    *,
    on_verdict: Verdict | None,
    server_host: str = "",
    metrics: Metrics | None = None,
) -> RolloutWiring:
    """Builds a rollout's parts. `server_host`: the address its own server binds, where it
    has one (the sidecar); a relay binds `relay_host` (a unix:DIR one, a socket there named
    after `agent_id`), else that, else `advertise_host` (so a relay inside a vLLM worker is
    reachable from other hosts), else loopback.
    `on_verdict` None: no data plane here (a sidecar whose vLLM engine pulls itself).
    FailedPrecondition naming weight_sync_mode where the data plane needs inet sockets this
    host has none of (`SyncSettings.check_host`)."""
    if on_verdict is not None:
        settings.check_host(server_host)
    security = settings.security()
    failpoints = Failpoints(settings.failpoints)
    client = CoordinatorClient(settings.coordinator, security=security)
    instance = settings.instance or secrets.token_hex(16)  # a secret: it registers the id again
    if on_verdict is None:
        return RolloutWiring(settings, agent_id, client, None, None, None, failpoints, instance=instance)
    relay = None
    if settings.wants_relay(server_host):
        relay = Relay(
            settings.session,
            host=settings.relay_bind(agent_id, server_host),
            port=settings.relay_port,
            wait_s=settings.relay_wait_s,
            failpoints=failpoints,
        )
    puller = WeightPuller(
        client,
        settings.session,
        agent_id,
        mode=settings.weight_sync_mode,
        host_id=settings.host_id,
        fs_root=settings.fs_root,
        fs_options=parse_fs_options(settings.fs_option),
        streams=settings.streams,
        window_chunks=settings.window_chunks,
        max_attempts=settings.max_attempts,
        timeout_s=settings.timeout_s,
        relay_stall_s=relay_stall_s(settings.relay_wait_s),
        metrics=metrics,
        relay=relay.source if relay else None,
        security=security,
        host_memory_limit_bytes=settings.host_memory_limit_bytes,
    )
    outbox = ReportOutbox(client, on_verdict)
    return RolloutWiring(settings, agent_id, client, puller, relay, outbox, failpoints, instance=instance)
