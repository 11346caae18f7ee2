"""Stage: a rank's parameters staged into the slot claimed for them, as a `StagedPart` (its
specs, chunks and staging time), with a delta against the newest older version staged
with the same layout where one is worth sending."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from trainer_agent.publish.session_link import SessionLink
from trainer_agent.publish.stage_plan import StagePlan, Stager
from trainer_agent.serve.arena import Arena
from trainer_agent.serve.chunk_server import SlotTable
from trainer_agent.settings import PublisherSettings
from trainer_agent.stage.delta import StagedDelta, pack_delta
from trainer_agent.stage.params import device_stream
from trainer_agent.stage.staging import Layout
from trainer_agent.stage.stream_staging import stage_streamed
from weightsync import native
from weightsync.errors import WeightsyncError
from weightsync.manifest import ChunkSpec, ShardSpec, TensorSpec
from weightsync.metrics import Metrics

log = logging.getLogger("trainer_agent.publish.publisher")  # the publish path logs under one name


@dataclass
class StagedPart:
    """A rank's part staged into a slot and not yet taken by the coordinator: what is
    sealed and sent, again as it is while sending fails for a while (the bytes stay in
    their slot)."""

    version: int
    key: str
    slot: int
    tensors: tuple[TensorSpec, ...]
    shard_specs: list[ShardSpec]
    chunks: list[ChunkSpec]
    total_bytes: int
    stage_s: float
    path: str
    delta: StagedDelta | None = None
    fs_uri: str = ""  # the fs store's copy, once written
    fs_written: bool = False  # by this publish (not a copy of the same bytes found there)


class ManifestDigests:
    """The manifest digests of the newest versions this rank published (a delta names its
    base's), asked of the coordinator for one its publish did not make READY."""

    def __init__(self, link: SessionLink) -> None:
        self.link = link
        self.known: dict[int, str] = {}

    def remember(self, version: int, digest: str) -> None:
        """`digest` of `version`, just published; versions older than version - 4 are forgotten."""
        for old in [v for v in self.known if v < version - 4]:
            del self.known[old]
        self.known[version] = digest

    def of(self, version: int) -> str:
        """A version's manifest digest: from its publish when that made it READY, else asked."""
        digest = self.known.get(version, "")
        if not digest:
            try:
                found = [v for v in self.link.client.status(self.link.session, 8).versions if v.version == version]
            except WeightsyncError as e:
                log.info("cannot learn version %d's manifest digest: %s", version, e)
                return ""
            digest = found[0].manifest_digest if found else ""
            if digest:
                self.known[version] = digest
        return digest


class PartStager:
    """Stages one rank's versions into the slots of its arena; remembers the layout each
    slot's version was staged with (a delta's base must have this one's)."""

    def __init__(
        self,
        settings: PublisherSettings,
        arena: Arena,
        table: SlotTable,
        digests: ManifestDigests,
        agent_id: str,
        metrics: Metrics,
    ) -> None:
        self.settings = settings
        self.arena = arena
        self.table = table
        self.digests = digests
        self.agent_id = agent_id
        self.metrics = metrics
        self._stager = Stager(settings)
        self._layouts: dict[int, Layout] = {}  # slot -> layout its version was staged with

    def stage(
        self,
        plan: StagePlan,
        params: Mapping[str, Any] | Iterable[tuple[str, Any]],
        version: int,
        slot: int,
        idempotency_key: str | None,
        started: float,
    ) -> StagedPart:
        """Stages by `plan` into `slot` (claimed, and fitted to the layout), encoding a delta
        against the previous version where it can; `started` is when staging time began."""
        key = idempotency_key or f"{self.agent_id}:{version}"
        layout = plan.layout
        base = self._delta_base(plan, slot, version)
        path, shard_specs, chunks, encodings = self._stager.stage(
            plan,
            params,
            self.arena.buffer(),
            slot * self.arena.slot_bytes,
            self.arena.slot(slot),
            base=self.arena.slot(base[0]) if base is not None else None,
        )
        delta = None
        if base is not None:
            delta = pack_delta(chunks, encodings, base[1], base[2])
            if delta.wire_bytes > self.settings.delta_max_ratio * layout.total_bytes:
                log.info(
                    "version %d without a delta: it would move %.1f%% of the bytes (delta_max_ratio %.2f)",
                    version,
                    100 * delta.wire_bytes / max(1, layout.total_bytes),
                    self.settings.delta_max_ratio,
                )
                delta = None
        self._layouts[slot] = layout
        return self._staged(StagedPart(version, key, slot, layout.tensors, shard_specs, chunks, layout.total_bytes,
                                       time.perf_counter() - started, path, delta))  # fmt: skip

    def stage_stream(
        self, items: Iterable[tuple[str, Any]], version: int, slot: int, idempotency_key: str | None
    ) -> StagedPart:
        """Stages `items` into `slot` in arrival order (no layout planned: never a delta)."""
        key = idempotency_key or f"{self.agent_id}:{version}"
        started = time.perf_counter()
        self._layouts.pop(slot, None)  # staged in arrival order: never a delta base
        stream = device_stream(items, self.settings.weight_dtype, self.settings.d2h_window_bytes)
        staged, chunks = stage_streamed(self.arena.slot(slot), stream, self.settings.chunk_bytes)
        path = "stream-native" if native.available() else "stream-python"
        return self._staged(StagedPart(version, key, slot, tuple(staged.tensors.values()), staged.shards, chunks,
                                       staged.total_bytes, time.perf_counter() - started, path))  # fmt: skip

    def _staged(self, staged: StagedPart) -> StagedPart:
        self.metrics.observe_phase("stage", staged.stage_s)
        self.metrics.add_bytes("staged", staged.total_bytes)
        return staged

    def _delta_base(self, plan: StagePlan, slot: int, version: int) -> tuple[int, int, str] | None:
        """(slot, version, manifest digest) of the version to encode this one against: the
        newest older one in another slot, staged with the same layout; None with the
        reason logged when there is none or delta is off."""
        if self.settings.delta == "off":
            return None
        why = plan.can_delta(self.settings.chunk_bytes)
        if not why:
            older = {s: e for s, e in self.table.entries().items() if s != slot and e.version < version}
            if not older:
                why = "no older version in the arena"
            else:
                base_slot, entry = max(older.items(), key=lambda kv: kv[1].version)
                if self._layouts.get(base_slot) != plan.layout:
                    why = f"version {entry.version} was staged with another layout"
                elif digest := self.digests.of(entry.version):
                    return base_slot, entry.version, digest
                else:
                    why = f"version {entry.version} has no manifest digest (it never became READY)"
        log.info("version %d without a delta: %s", version, why)
        return None
