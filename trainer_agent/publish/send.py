"""Send: a staged part sealed and published to the coordinator, sent again as it is while a
failure may pass; a delta the coordinator refuses is dropped, a duplicate is served from the
slot that held it first, and the part is withdrawn where sending gives up. What one publish
did: `PublishResult`."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from trainer_agent.publish.retry import refuses_content, ride_out
from trainer_agent.publish.seal import Sealer
from trainer_agent.publish.session_link import SessionLink
from trainer_agent.publish.staged_part import ManifestDigests, StagedPart
from trainer_agent.serve.chunk_server import SlotTable
from weightsync._proto import types_pb2 as _tpb
from weightsync.errors import FailedPrecondition, WeightsyncError
from weightsync.metrics import Metrics

log = logging.getLogger("trainer_agent.publish.publisher")  # the publish path logs under one name


@dataclass(frozen=True)
class PublishResult:
    """What one publish did."""

    version: int
    state: str
    duplicate: bool
    total_bytes: int
    stage_seconds: float
    publish_seconds: float
    slot: int
    delta_bytes: int = 0  # bytes a rollout holding the base pulls (0: published without a delta)
    delta_base: int = 0  # the base version of the delta


@dataclass
class Sender:
    """Publishes one rank's staged parts; `may_pass` says which failures are tried again."""

    sealer: Sealer
    table: SlotTable
    link: SessionLink
    digests: ManifestDigests
    metrics: Metrics
    may_pass: Callable[[WeightsyncError], bool]

    def send(self, staged: StagedPart, deadline: float) -> PublishResult:
        """Publishes a staged part, sending it again as it is (its bytes, slot and
        idempotency key) while a failure may pass, until `deadline`; withdraws it (its slot
        freed) when it gives up."""
        try:
            return ride_out(
                f"publishing version {staged.version}",
                deadline - time.monotonic(),
                lambda: self._publish(staged),
                self.may_pass,
            )
        except Exception as e:  # any: a slot left set would be served, and released, as that version
            self.sealer.withdraw(staged, refused=isinstance(e, WeightsyncError) and refuses_content(e))
            raise

    def _publish(self, staged: StagedPart) -> PublishResult:
        """Seals the staged part and streams its descriptors. A delta the coordinator
        refuses (its base unknown there, e.g. pruned) is dropped and the part published
        without it."""
        version, slot, total_bytes = staged.version, staged.slot, staged.total_bytes
        part = self.sealer.seal(staged)
        t0 = time.perf_counter()
        try:
            resp = self.link.publish_part(version, staged.key, part)
        except FailedPrecondition as e:
            if part.delta is None or not e.message.startswith("header.delta"):
                raise
            log.warning("version %d: the delta was refused (%s); publishing it without one", version, e.message)
            staged.delta = None  # (a try after this one sends none either)
            resp = self.link.publish_part(version, staged.key, dataclasses.replace(part, delta=None))
        delta = staged.delta
        if resp.duplicate:
            # The same version and bytes again (a retried call): the slot that held them
            # first serves them (the manifest names it); this copy goes, or both slots held
            # one version and the next publish released it from under the other.
            held = [s for s, e in self.table.entries().items() if s != slot and e.version == version]
            if held:
                self.table.set(slot, None)
                slot = held[0]
        if resp.version.manifest_digest:
            self.digests.remember(version, resp.version.manifest_digest)
        publish_s = time.perf_counter() - t0
        self.metrics.observe_phase("publish", publish_s)
        self.metrics.current_version.labels(role="trainer", session=self.link.session).set(version)
        state = _tpb.VersionState.Name(resp.version.state)
        log.info(
            "published version=%d rank=%d bytes=%d path=%s stage_s=%.3f publish_s=%.3f state=%s slot=%d%s",
            version,
            self.sealer.rank,
            total_bytes,
            staged.path,
            staged.stage_s,
            publish_s,
            state,
            slot,
            f" delta_bytes={delta.wire_bytes} base={delta.part.base_version}" if delta is not None else "",
        )
        return PublishResult(
            version, state, resp.duplicate, total_bytes, staged.stage_s, publish_s, slot,
            delta.wire_bytes if delta is not None else 0, delta.part.base_version if delta is not None else 0,
        )  # fmt: skip
