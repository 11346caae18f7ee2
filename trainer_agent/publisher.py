"""WeightPublisher: the library a trainer calls after each step (`publish(params, version)`)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import socket
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import numpy as np

from trainer_agent.arena import Arena
from trainer_agent.chunk_server import (
    SERVICE_NAME,
    SlotEntry,
    SlotTable,
    TrainerAgentServicer,
    add_trainer_agent_service,
)
from trainer_agent.staging import HostShard, chunk_specs, plan_layout, stage_shards, stage_stream
from weightsync import native
from weightsync._proto import types_pb2 as _tpb
from weightsync.arena_files import reclaim_orphans
from weightsync.client import CoordinatorClient
from weightsync.config import advertised
from weightsync.digests import access_token
from weightsync.dtypes import dtype_info
from weightsync.errors import (
    FailedPrecondition,
    InvalidArgument,
    SlotBusy,
    StaleGeneration,
    WeightsyncError,
    WrongState,
)
from weightsync.failpoints import Failpoints
from weightsync.heartbeat import Heartbeat
from weightsync.layout import DEFAULT_CHUNK_BYTES
from weightsync.manifest import ChunkSpec, Endpoint, Part, ShardSpec, TensorSpec
from weightsync.metrics import Metrics, build_metrics
from weightsync.modes import normalize_mode
from weightsync.security import Security
from weightsync.server import RunningServer, Service, start_server
from weightsync.transports.fs import FsStore
from weightsync.transports.tcp import TcpChunkServer
from weightsync.validation import check_session_name

log = logging.getLogger(__name__)


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


def choose_staging_path(values: Sequence[Any], use_ffi: bool | None, *, ffi_built: bool, ffi_missing: str) -> str:
    """ "ffi" or "host", by the use_ffi contract (DESIGN.md "Native shim and FFI").

    None: FFI when built and every value is a single-device JAX array. True: FFI, and
    RuntimeError naming what is missing when it is not built. False: host pointers.
    Arrays that are not host-addressable without FFI fail fast (never a silent slow path).
    """
    if use_ffi is True and not ffi_built:
        raise RuntimeError(f"use_ffi=True but the FFI staging handler is unavailable: {ffi_missing}")
    jax_values = [v for v in values if hasattr(v, "addressable_shards")]
    ffi_eligible = (
        bool(values) and len(jax_values) == len(values) and all(len(v.addressable_shards) == 1 for v in jax_values)
    )
    if ffi_built and use_ffi is not False and ffi_eligible:
        return "ffi"
    for v in jax_values:
        for shard in v.addressable_shards:
            platform = getattr(shard.device, "platform", "cpu")
            if platform != "cpu":
                why = (
                    "use_ffi=False" if use_ffi is False else (ffi_missing or "the FFI path needs single-device arrays")
                )
                raise RuntimeError(
                    f"array on {shard.device} is not host-addressable and the FFI path is not taken ({why}); "
                    "build the shim with FFI and pass use_ffi=None/True, or copy the arrays to host first"
                )
    return "host"


def _to_host_shards(name: str, value: Any, weight_dtype: str | None) -> list[HostShard]:
    """Host shards of one parameter: NumPy arrays, HostShards, or JAX arrays (replica 0).

    A JAX array contributes its addressable replica-0 shards, so each host of a
    multi-host trainer publishes only what it owns.
    """
    if isinstance(value, HostShard):
        data = value.data if weight_dtype is None else value.data.astype(dtype_info(weight_dtype).numpy)
        return [HostShard(name, data, value.global_shape, value.start)]
    if hasattr(value, "addressable_shards"):  # jax.Array
        if weight_dtype is not None and str(value.dtype) != weight_dtype:
            value = value.astype(dtype_info(weight_dtype).numpy)
        out = []
        for shard in value.addressable_shards:
            if shard.replica_id != 0:
                continue
            start = tuple(0 if sl.start is None else sl.start for sl in shard.index)
            start = start + (0,) * (value.ndim - len(start))
            try:
                host = np.asarray(shard.data)  # zero-copy for CPU-resident arrays
            except Exception as e:  # noqa: BLE001 - re-raised with the fix
                raise InvalidArgument(
                    f"shard on {shard.device} is not host-addressable ({e}); the native FFI path stages device "
                    "buffers, or pass host copies as HostShard",
                    field=f"params[{name!r}]",
                ) from e
            out.append(HostShard(name, host, tuple(value.shape), start))
        return out
    arr = np.asarray(value)
    if weight_dtype is not None:
        arr = arr.astype(dtype_info(weight_dtype).numpy, copy=False)
    return [HostShard(name, arr, tuple(arr.shape), (0,) * arr.ndim)]


class WeightPublisher:
    """Stages parameters into a persistent arena, publishes descriptors, serves chunks.

    One publisher per trainer rank. All ranks of one trainer run pass the same
    `incarnation`; a new incarnation bumps the session generation (fencing older
    writers). The chunk server runs in this process on `host:port`.

    Args:
        coordinator: coordinator address (host:port).
        session: session name.
        rank, world_size: this trainer rank and the number of publishing ranks.
        incarnation: shared by all ranks of one run; default: a fresh id (single rank).
        slots: arena slots; a slot is reused only after its version's leases end.
        chunk_bytes: chunk size (travels in the manifest).
        weight_dtype: cast every tensor to this dtype while staging (e.g. "bfloat16").
        min_rollouts: OK handshakes needed to commit (0 keeps the session's setting).
        use_ffi: None uses the JAX FFI handler when built; True requires it (RuntimeError
            naming what is missing); False stages through host pointers.
        staging_threads: threads of the native staging pass (0 = every core).
        advertise_host: the host rollouts dial (e.g. the pod IP) when `host` is 0.0.0.0.
        tcp_port: the native tcp data-plane server's port (0: a free one).
        fs_root: also write every part under this fsspec root (`fs` transport: rollouts
            need only the store, not a route to this process); old versions are removed
            when their slot is reused.
        weight_sync_mode: the session's default mode for rollouts without their own
            (grpc | tcp | shm | fs | relay; "" keeps the session's). fs needs fs_root.
        security: TLS / mTLS and bearer tokens for the coordinator channel and this
            rank's gRPC server (`weightsync.security`; plaintext without).
        next_version: the first version this publisher will publish (0: not said); a new
            incarnation whose next_version is not newer than the session's latest is
            refused (FailedPrecondition) before it fences anyone.

    A newer incarnation fences this one: its writes are refused (StaleGeneration), and
    the heartbeat notices within one beat: `fenced` turns True, it is logged once and
    the `weightsync_fenced` gauge reads 1.
    """

    def __init__(
        self,
        coordinator: str,
        session: str,
        *,
        rank: int = 0,
        world_size: int = 1,
        incarnation: str | None = None,
        slots: int = 2,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        weight_dtype: str | None = None,
        min_rollouts: int = 0,
        host: str = "127.0.0.1",
        port: int = 0,
        metrics_port: int = -1,
        advertise_host: str = "",
        tcp_port: int = 0,
        host_id: str | None = None,
        agent_id: str | None = None,
        timeout_s: float = 30.0,
        slot_wait_s: float = 60.0,
        metrics: Metrics | None = None,
        failpoints: str = "",
        use_ffi: bool | None = None,
        staging_threads: int = 0,
        fs_root: str = "",
        weight_sync_mode: str = "",
        security: Security | None = None,
        next_version: int = 0,
    ) -> None:
        check_session_name(session)
        if use_ffi is True and not native.ffi_available():
            raise RuntimeError(
                f"use_ffi=True but the FFI staging handler is unavailable: {native.ffi_missing_reason()}"
            )
        if weight_dtype is not None:
            dtype_info(weight_dtype, "weight_dtype")
        mode = normalize_mode(weight_sync_mode, allow_empty=True)
        if mode == "fs" and not fs_root:
            raise InvalidArgument("weight_sync_mode 'fs' needs fs_root: where parts are written", field="fs_root")
        if not 0 <= rank < world_size:
            raise InvalidArgument(f"{rank} is not in [0, world_size={world_size})", field="rank")
        self.session = session
        self.rank = rank
        self.chunk_bytes = chunk_bytes
        self.weight_dtype = weight_dtype
        self.slot_wait_s = slot_wait_s
        self.use_ffi = use_ffi
        self.staging_threads = staging_threads
        self.last_path = ""
        self.fs_store = FsStore(fs_root) if fs_root else None
        self._ffi: Any = None
        self.agent_id = agent_id or f"trainer-{rank}-{uuid.uuid4().hex[:8]}"
        self.metrics = metrics or build_metrics("trainer")
        self._client = CoordinatorClient(coordinator, timeout_s=timeout_s, security=security)
        opened = self._client.open_session(
            session,
            trainer=True,
            incarnation=incarnation or uuid.uuid4().hex,
            trainer_ranks=world_size,
            min_rollouts=min_rollouts,
            weight_sync_mode=mode,
            next_version=next_version,
        )
        self.generation = opened.generation
        self.fenced_by = 0  # the newer generation that fenced this publisher
        self._token_key = opened.token_key
        reclaim_orphans()  # arenas of trainers killed on this host before they could clean up
        self.arena = Arena(f"{session}-r{rank}", slots=slots)
        fps = Failpoints(failpoints)
        self.table = SlotTable(self.arena, session, rank, fps)
        self._servicer = TrainerAgentServicer(self.table, self.metrics, fps, lambda: self.generation)
        self.server: RunningServer = start_server(
            [Service(add_trainer_agent_service, self._servicer, SERVICE_NAME)],
            host=host,
            port=port,
            metrics=self.metrics,
            metrics_port=metrics_port,
            security=security,
        )
        transports = ("grpc", "shm")
        self.tcp_server: TcpChunkServer | None = None
        if native.available():  # the native bulk path ("tcp"): sendfile from the arena
            self.tcp_server = TcpChunkServer(
                self.table, host=host, port=tcp_port, on_sent=self._servicer.count_served, failpoints=fps
            )
            transports += ("tcp",)
        else:
            log.warning("native shim missing (%s): the tcp transport is not offered", native.missing_reason())
        self.endpoint = Endpoint(
            advertised(self.server.address, advertise_host),
            transports,
            host_id or socket.gethostname(),
            tcp_address=advertised(self.tcp_server.address, advertise_host) if self.tcp_server else "",
        )
        self._closed = False
        self._heartbeat = Heartbeat(
            self._client,
            session,
            self.agent_id,
            current_version=self._latest_version,
            register=self._register,
            on_generation=self._notice_generation,
        ).start()
        log.info(
            "publisher rank=%d session=%s generation=%d serving %s", rank, session, self.generation, self.server.address
        )

    # -- lifecycle ------------------------------------------------------------------
    def close(self) -> None:
        """Stops serving, heartbeats and frees the arena; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._heartbeat.stop()
        self.server.enter_graceful_shutdown()  # health first: nobody new is sent here
        if not self.fenced:
            try:
                self._client.deregister_agent(self.session, self.agent_id)
            except WeightsyncError as e:
                log.info("deregistering %s: %s (its lease ends by itself)", self.agent_id, e)
        self.server.stop(grace_s=1.0)
        if self.tcp_server is not None:
            self.tcp_server.close()
        self.table.close()
        self.arena.close()
        self._client.close()

    def __enter__(self) -> WeightPublisher:
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def _latest_version(self) -> int:
        return max((e.version for e in self.table.entries().values()), default=0)

    @property
    def fenced(self) -> bool:
        """True once a newer incarnation attached: every write of this publisher is refused."""
        return self.fenced_by > 0

    def _register(self) -> float:
        with self._refused_as_stale_means_fenced():
            resp = self._client.register_agent(
                self.session,
                self.agent_id,
                trainer=True,
                endpoint=self.endpoint,
                rank=self.rank,
                generation=self.generation,
            )
        return resp.lease_ttl_seconds

    @contextlib.contextmanager
    def _refused_as_stale_means_fenced(self) -> Iterator[None]:
        """A write refused with StaleGeneration: a newer incarnation fenced this publisher."""
        try:
            yield
        except StaleGeneration:
            self._notice_generation(self.generation + 1)
            raise

    def _notice_generation(self, generation: int) -> None:
        if generation > self.generation and not self.fenced:
            self.fenced_by = generation
            self.metrics.fenced.set(1)
            log.error(
                "fenced: session %s moved to generation %d, this publisher holds %d; its writes are refused "
                "(another incarnation of the trainer attached)",
                self.session,
                generation,
                self.generation,
            )

    # -- publishing -----------------------------------------------------------------
    def publish(self, params: Mapping[str, Any], version: int, *, idempotency_key: str | None = None) -> PublishResult:
        """Stages `params` (HF name -> array or HostShard) into a free slot and publishes it.

        Re-publishing the same version with the same key returns the first result.

        Raises:
            InvalidArgument: bad names, dtypes or shapes (nothing is published).
            StaleGeneration: another incarnation attached since; this publisher is fenced.
            SlotBusy (FailedPrecondition): no slot could be freed within slot_wait_s.
        """
        if not params:
            raise InvalidArgument("must contain at least one tensor", field="params")
        key = idempotency_key or f"{self.agent_id}:{version}"
        started = time.perf_counter()
        path = choose_staging_path(
            list(params.values()),
            self.use_ffi,
            ffi_built=native.ffi_available(),
            ffi_missing=native.ffi_missing_reason(),
        )
        if path == "ffi":
            from trainer_agent.ffi_staging import staged_meta

            shards = [
                HostShard(n, staged_meta(v, self.weight_dtype), tuple(v.shape), (0,) * v.ndim)
                for n, v in params.items()
            ]
        else:
            shards = [s for name, value in params.items() for s in _to_host_shards(name, value, self.weight_dtype)]
        layout = plan_layout(shards)
        claim_started = time.perf_counter()
        slot = self._claim_slot(version)  # may wait for leases: not staging time
        started += time.perf_counter() - claim_started
        if self.arena.ensure_slot_bytes(layout.total_bytes):
            for other in range(self.arena.slots):  # reallocated: every slot's bytes are gone
                self.table.set(other, None)
        if path == "ffi":
            shard_specs, chunks = self._ffi_stager().stage(
                self.arena.buffer(),
                slot * self.arena.slot_bytes,
                list(params.values()),
                layout,
                self.chunk_bytes,
                self.weight_dtype,
            )
        else:
            path = "native" if native.available() else "python"
            shard_specs, chunks = stage_shards(
                self.arena.slot(slot), shards, layout, self.chunk_bytes, engine=path, threads=self.staging_threads
            )
        stage_s = time.perf_counter() - started
        return self._seal(version, key, slot, layout.tensors, shard_specs, chunks, layout.total_bytes, stage_s, path)

    def publish_stream(
        self,
        items: Iterable[tuple[str, Any]],
        version: int,
        *,
        capacity_bytes: int,
        idempotency_key: str | None = None,
    ) -> PublishResult:
        """Stages tensors one by one as `items` yields them (e.g. a MaxText converter).

        Peak host memory is the arena plus one converted tensor: nothing is collected
        first. Chunk digests are computed in a second read pass over the slot.

        Args:
            capacity_bytes: slot size to reserve (the converted model's bytes, padded by
                256 per tensor); ResourceExhausted when the stream outgrows it.
        """
        key = idempotency_key or f"{self.agent_id}:{version}"
        slot = self._claim_slot(version)
        if self.arena.ensure_slot_bytes(capacity_bytes):
            for other in range(self.arena.slots):
                self.table.set(other, None)
        started = time.perf_counter()
        buf = self.arena.slot(slot)
        shards = (hs for name, value in items for hs in _to_host_shards(name, value, self.weight_dtype))
        staged = stage_stream(buf, shards, self.chunk_bytes)
        chunks = chunk_specs(buf, staged.total_bytes, self.chunk_bytes, staged.spans, staged.known)
        stage_s = time.perf_counter() - started
        path = "stream-native" if native.available() else "stream-python"
        return self._seal(
            version, key, slot, tuple(staged.tensors.values()), staged.shards, chunks, staged.total_bytes, stage_s, path
        )

    def _seal(
        self,
        version: int,
        key: str,
        slot: int,
        tensors: tuple[TensorSpec, ...],
        shard_specs: list[ShardSpec],
        chunks: list[ChunkSpec],
        total_bytes: int,
        stage_s: float,
        path: str,
    ) -> PublishResult:
        """Serves the staged slot (and writes it to the fs store) and streams its descriptors."""
        self.last_path = path
        endpoint = dataclasses.replace(
            # Same-host rollouts may map this slot of the arena directly ("shm" transport).
            self.endpoint,
            shm_path=str(self.arena.path),
            shm_offset=slot * self.arena.slot_bytes,
        )
        if self.fs_store is not None:
            t_fs = time.perf_counter()
            uri = self.fs_store.write_part(
                self.session, version, self.rank, memoryview(self.arena.slot(slot)[:total_bytes])
            )
            endpoint = dataclasses.replace(endpoint, transports=(*endpoint.transports, "fs"), fs_uri=uri)
            self.metrics.observe_phase("fs_write", time.perf_counter() - t_fs)
        self.table.set(slot, SlotEntry(version, tuple(chunks), total_bytes, access_token(self._token_key, version)))
        self.metrics.observe_phase("stage", stage_s)
        self.metrics.add_bytes("staged", total_bytes)
        part = Part(
            rank=self.rank,
            total_bytes=total_bytes,
            chunk_bytes=self.chunk_bytes,
            tensors=tensors,
            shards=tuple(shard_specs),
            chunks=tuple(chunks),
            endpoint=endpoint,
            stage_seconds=stage_s,
        )
        t0 = time.perf_counter()
        try:
            resp = self._client.publish_part(
                self.session, generation=self.generation, version=version, idempotency_key=key, part=part
            )
        except WeightsyncError:
            self.table.set(slot, None)
            raise
        publish_s = time.perf_counter() - t0
        self.metrics.observe_phase("publish", publish_s)
        self.metrics.current_version.labels(role="trainer").set(version)
        state = _tpb.VersionState.Name(resp.version.state)
        log.info(
            "published version=%d rank=%d bytes=%d path=%s stage_s=%.3f publish_s=%.3f state=%s slot=%d",
            version,
            self.rank,
            total_bytes,
            path,
            stage_s,
            publish_s,
            state,
            slot,
        )
        return PublishResult(version, state, resp.duplicate, total_bytes, stage_s, publish_s, slot)

    def _ffi_stager(self) -> Any:
        if self._ffi is None:
            from trainer_agent.ffi_staging import FfiStager  # imports jax; host-only users skip it

            self._ffi = FfiStager(self.staging_threads)
        return self._ffi

    def _claim_slot(self, version: int) -> int:
        """A slot to stage into: an empty one, else the oldest whose version is released.

        A slot holding `version` itself is never chosen, so a retried or conflicting
        publish cannot overwrite bytes rollouts may be reading. The old version is
        released at the coordinator first, which is refused while a rollout holds a lease
        on it; we wait (bounded) rather than tear its bytes.
        """
        if self.fenced:  # refused before any byte of the arena is touched
            raise StaleGeneration(
                f"this publisher (generation {self.generation}) was fenced by generation {self.fenced_by}; "
                "a newer incarnation of the trainer owns the session"
            )
        entries = self.table.entries()
        for slot in range(self.arena.slots):
            if slot not in entries:
                return slot
        candidates = {s: e for s, e in entries.items() if e.version != version}
        if not candidates:
            raise FailedPrecondition(f"every slot holds version {version}; use slots >= 2")
        slot, entry = min(candidates.items(), key=lambda kv: kv[1].version)
        deadline = time.monotonic() + self.slot_wait_s
        with self._refused_as_stale_means_fenced():
            while True:
                try:
                    self._client.release_version(self.session, entry.version, generation=self.generation)
                    break
                except StaleGeneration:  # before FailedPrecondition, its base: never waited out
                    raise
                except WrongState:
                    # Still STAGING (another rank never sealed) or otherwise unreleasable: abort it.
                    try:
                        self._client.abort_version(
                            self.session, generation=self.generation, version=entry.version, reason="slot reused"
                        )
                    except StaleGeneration:
                        raise
                    except WeightsyncError:
                        break
                except FailedPrecondition as e:
                    if time.monotonic() > deadline:
                        raise SlotBusy(f"cannot reuse slot {slot}: {e.message}; raise slots or slot_wait_s") from None
                    time.sleep(0.05)
                except WeightsyncError as e:  # NOT_FOUND etc.: nothing to protect
                    log.info("releasing version %d: %s", entry.version, e)
                    break
        self.table.set(slot, None)
        if self.fs_store is not None:
            self.fs_store.remove_part(self.session, entry.version, self.rank)
        return slot

    def wait_committed(self, version: int, timeout_s: float = 120.0) -> str:
        """Blocks until the version is COMMITTED/PARTIAL/FAILED/RELEASED; returns the state name."""
        info = self._client.wait_for_version(self.session, version, timeout_s=timeout_s)
        return _tpb.VersionState.Name(info.state)

    @property
    def client(self) -> CoordinatorClient:
        return self._client
