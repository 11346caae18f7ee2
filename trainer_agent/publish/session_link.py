"""A rank's standing in its session at the coordinator: attaching (waiting for a coordinator
not up yet), attaching again where the coordinator lost the session, registering with a
heartbeat and leaving, and the generation that fences it. Every write it makes carries the generation of
the moment."""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import Callable, Iterator

from trainer_agent.publish.retry import ride_out
from trainer_agent.settings import PublisherSettings
from weightsync._proto import coordinator_pb2 as _cpb
from weightsync.client import CoordinatorClient
from weightsync.errors import TRANSIENT_ERRORS, SessionNotFound, StaleGeneration, WeightsyncError
from weightsync.heartbeat import Heartbeat
from weightsync.manifest import Endpoint, Part
from weightsync.metrics import Metrics

log = logging.getLogger("trainer_agent.publish.publisher")  # the publish path logs under one name


class SessionLink:
    """One publisher's session at the coordinator; `client` is set by `attach`."""

    client: CoordinatorClient

    def __init__(self, settings: PublisherSettings, metrics: Metrics) -> None:
        self.settings = settings
        self.metrics = metrics
        self.session = settings.session
        self.generation = 0
        self.attached_latest_version = 0  # the session's newest version when it attached
        self.fenced_by = 0  # the newer generation that fenced this publisher
        self.token_key = ""
        self.incarnation = ""

    @property
    def fenced(self) -> bool:
        """True once a newer incarnation attached: every write of this publisher is refused."""
        return self.fenced_by > 0

    def attach(self, client: CoordinatorClient, next_version: int) -> None:
        """Opens the session, waiting up to `attach_wait_s` for a coordinator that is not
        reachable yet: pods start in any order, and giving up after the client's few
        retries (~9 s) would end a sidecar before its coordinator is up. The
        incarnation makes the attach idempotent, so trying it again bumps nothing twice."""
        self.client = client
        self.incarnation = self.settings.incarnation or uuid.uuid4().hex
        ride_out(
            f"attaching to coordinator {self.settings.coordinator}",
            self.settings.attach_wait_s,
            lambda: self._open_session(next_version),
            lambda e: isinstance(e, TRANSIENT_ERRORS),
        )
        self.metrics.fenced.labels(session=self.session).set(0)

    def _open_session(self, next_version: int) -> None:
        s = self.settings
        opened = self.client.open_session(
            s.session,
            trainer=True,
            incarnation=self.incarnation,
            trainer_ranks=s.world_size,
            min_rollouts=s.min_rollouts,
            weight_sync_mode=s.weight_sync_mode,
            next_version=next_version,
            flip_policy=s.flip_policy,
            prepare_timeout_s=s.prepare_timeout_s,
            prepared_loss=s.prepared_loss,
            rollout_ids=s.rollout_ids,
            max_rollouts=s.max_rollouts,
        )
        self.generation = opened.generation
        self.attached_latest_version = opened.latest_version
        self.token_key = opened.token_key

    def reattach(self, next_version: int) -> None:
        """Opens the session again, as the same incarnation, where the coordinator does not
        know it: it lost its database (a volume gone, a pod rescheduled with emptyDir). No
        session can be deleted otherwise, so this fences nobody; the rollouts register again
        once it exists, and versions go on from `next_version`. A fenced publisher never does:
        a newer incarnation may have opened the session there since."""
        if self.fenced:
            raise StaleGeneration(f"this publisher was fenced by generation {self.fenced_by}; it does not re-attach")
        log.warning(
            "the coordinator does not know session %s (its database was lost?); opening it again as incarnation %s",
            self.session,
            self.incarnation,
        )
        self._open_session(next_version)

    def start_heartbeat(self, agent_id: str, endpoint: Endpoint, rank: int, latest: Callable[[], int]) -> Heartbeat:
        """Registers this rank's endpoint and keeps its lease with a heartbeat (`latest()`:
        the newest version it serves), which also notices a newer generation. Where the
        coordinator lost the session, registering opens it again, versions going on from
        `latest() + 1`."""

        def register() -> float:
            with self.fencing():
                try:
                    resp = once()
                except SessionNotFound:
                    self.reattach(latest() + 1)
                    resp = once()
            return resp.lease_ttl_seconds

        def once() -> _cpb.RegisterAgentResponse:
            return self.client.register_agent(
                self.session, agent_id, trainer=True, endpoint=endpoint, rank=rank, generation=self.generation
            )

        return Heartbeat(
            self.client,
            self.session,
            agent_id,
            current_version=latest,
            register=register,
            on_generation=self.notice_generation,
        ).start()

    def leave(self, agent_id: str) -> None:
        """Deregisters, unless fenced (the session is another incarnation's now)."""
        if not self.fenced:
            try:
                self.client.deregister_agent(self.session, agent_id)
            except WeightsyncError as e:
                log.info("deregistering %s: %s (its lease ends by itself)", agent_id, e)

    @contextlib.contextmanager
    def fencing(self) -> Iterator[None]:
        """A write refused with StaleGeneration: a newer incarnation fenced this publisher."""
        try:
            yield
        except StaleGeneration:
            self.notice_generation(self.generation + 1)
            raise

    def notice_generation(self, generation: int) -> None:
        """The session's generation as a heartbeat saw it: a newer one fences this publisher
        (logged once, and the `weightsync_fenced` gauge reads 1)."""
        if generation > self.generation and not self.fenced:
            self.fenced_by = generation
            self.metrics.fenced.labels(session=self.session).set(1)
            log.error(
                "fenced: session %s moved to generation %d, this publisher holds %d; its writes are refused "
                "(another incarnation of the trainer attached)",
                self.session,
                generation,
                self.generation,
            )

    def check_not_fenced(self) -> None:
        """StaleGeneration where fenced: refused before any byte of the arena is touched."""
        if self.fenced:
            raise StaleGeneration(
                f"this publisher (generation {self.generation}) was fenced by generation {self.fenced_by}; "
                "a newer incarnation of the trainer owns the session"
            )

    def publish_part(self, version: int, key: str, part: Part) -> _cpb.PublishResponse:
        """Sends this rank's part of `version`; where the session is gone, opens it again
        (versions going on from `version`) and sends it once more."""

        def once() -> _cpb.PublishResponse:  # with the generation of the moment
            return self.client.publish_part(
                self.session, generation=self.generation, version=version, idempotency_key=key, part=part
            )

        try:
            return once()
        except SessionNotFound:
            self.reattach(version)
            return once()

    def release(self, version: int, *, unpin: bool) -> None:
        self.client.release_version(self.session, version, generation=self.generation, unpin=unpin)

    def abort(self, version: int, reason: str) -> None:
        self.client.abort_version(self.session, generation=self.generation, version=version, reason=reason)
