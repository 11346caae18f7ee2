"""Seal: a staged part made servable and described: its copy in the fs store (written once),
its slot served under the version's access token (its delta after its chunks), and the
`Part` the coordinator is sent; `withdraw` undoes that where the part is not published."""

from __future__ import annotations

import dataclasses
import logging
import time

from trainer_agent.publish.session_link import SessionLink
from trainer_agent.publish.staged_part import StagedPart
from trainer_agent.serve.arena import Arena
from trainer_agent.serve.chunk_server import SlotEntry, SlotTable
from weightsync.digests import access_token, canonical_json
from weightsync.manifest import Endpoint, Part
from weightsync.metrics import Metrics
from weightsync.transports.fs import FsStore, content_id

log = logging.getLogger("trainer_agent.publish.publisher")  # the publish path logs under one name


def part_content_id(staged: StagedPart) -> str:
    """Names the fs store directory of a staged part by what it holds (`fs.content_id`)."""
    chunks = [c.to_dict() for c in staged.chunks]
    delta = staged.delta.part.to_dict() if staged.delta is not None else None
    return content_id(canonical_json({"chunks": chunks, "delta": delta}))


@dataclasses.dataclass
class Sealer:
    """Seals one rank's staged parts: `endpoint` is where its chunk servers listen."""

    arena: Arena
    table: SlotTable
    link: SessionLink
    endpoint: Endpoint
    rank: int
    chunk_bytes: int
    fs_store: FsStore | None
    metrics: Metrics

    def seal(self, staged: StagedPart) -> Part:
        """Serves the staged slot (and its delta, fetch indices after its chunks; the fs
        store gets both, once) and describes it: the part to publish."""
        version, slot, total_bytes, delta = staged.version, staged.slot, staged.total_bytes, staged.delta
        endpoint = dataclasses.replace(
            # Same-host rollouts may map this slot of the arena directly ("shm" transport).
            self.endpoint,
            shm_path=str(self.arena.path),
            shm_offset=slot * self.arena.slot_bytes,
        )
        if self.fs_store is not None:
            if not staged.fs_uri:
                t_fs = time.perf_counter()
                staged.fs_uri, staged.fs_written = self.fs_store.write_part(
                    self.link.session,
                    version,
                    self.rank,
                    memoryview(self.arena.slot(slot)[:total_bytes]),
                    delta=memoryview(delta.data) if delta is not None else None,
                    content=part_content_id(staged),
                )
                self.metrics.observe_phase("fs_write", time.perf_counter() - t_fs)
            endpoint = dataclasses.replace(endpoint, transports=(*endpoint.transports, "fs"), fs_uri=staged.fs_uri)
        entry = SlotEntry(version, tuple(staged.chunks), total_bytes, access_token(self.link.token_key, version))
        if delta is not None:
            entry.delta_chunks = tuple(c.as_chunk() for c in delta.part.chunks)
            entry.delta_bytes = delta.data
        self.table.set(slot, entry)
        return Part(
            rank=self.rank,
            total_bytes=total_bytes,
            chunk_bytes=self.chunk_bytes,
            tensors=staged.tensors,
            shards=tuple(staged.shard_specs),
            chunks=tuple(staged.chunks),
            endpoint=endpoint,
            stage_seconds=staged.stage_s,
            delta=delta.part if delta is not None else None,
        )

    def withdraw(self, staged: StagedPart, *, refused: bool) -> None:
        """Stops serving a part that was not published (a slot left set would be served, and
        released, as that version). Where the coordinator `refused` its content for good
        (other bytes under an existing version, a version not newer than the session's),
        the fs copy this publish wrote goes too: it would stay in the store for good where
        its version number is never the coordinator's."""
        self.table.set(staged.slot, None)
        if not (refused and staged.fs_written):
            return
        assert self.fs_store is not None
        try:
            self.fs_store.remove_content(self.link.session, staged.version, self.rank, staged.fs_uri.rsplit("/", 1)[-1])
        except OSError as e:
            log.warning("version %d: the refused publish's fs copy was not removed (%s)", staged.version, e)
        staged.fs_uri, staged.fs_written = "", False
