"""PublisherSettings: what a `WeightPublisher` is, for the library and the trainer entry point.

One source: a trainer builds `PublisherSettings(...)` in code; `TrainerConfig` (flags and
WEIGHTSYNC_TRAINER_* variables) extends it, so a default or a check lives here once.
Building settings does no I/O beyond reading the TLS and token files it names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from trainer_agent.device.device_blocks import DEFAULT_BLOCK_BYTES
from trainer_agent.stage.delta import DELTA_MODES
from trainer_agent.stage.params import DEFAULT_WINDOW_BYTES
from weightsync.addresses import inet_refused, unix_among
from weightsync.config import MAX_SECONDS, ServerConfig, check_bounds, check_positive, option, secret_option
from weightsync.dtypes import dtype_info
from weightsync.errors import FailedPrecondition, InvalidArgument
from weightsync.failpoints import Failpoints
from weightsync.layout import DEFAULT_CHUNK_BYTES
from weightsync.modes import normalize_mode
from weightsync.transports.fs import check_fs_root
from weightsync.transports.fs_options import parse_fs_options
from weightsync.validation import DEFAULT_LIMITS, UINT32_MAX, check_address, check_agent_id, check_session_name
from weightsync.version_states import FLIP_POLICIES, PREPARED_LOSSES

# Data planes served on inet sockets: the native tcp server (relay chains read it too).
INET_MODES = ("tcp", "relay")
MAX_SLOTS = 64  # each a whole version in shared memory; 2 double-buffer, more only hold older ones


@dataclass
class PublisherSettings(ServerConfig):
    """One trainer rank's publisher: its session, arena, staging and chunk servers.

    The inherited server fields (host, port, metrics_port, TLS, tokens) describe this
    rank's gRPC chunk server; `metrics_port` defaults to -1 here (no /metrics server: a
    trainer library exports into its own registry), the entry point serves one.
    """

    AUTH_ROLE: ClassVar[str] = "trainer"

    coordinator: str = option("127.0.0.1:50051", "Coordinator address host:port or unix:/path.")
    session: str = option("demo", "Session name.")
    rank: int = option(0, "This trainer rank.")
    world_size: int = option(
        1, "Number of publishing trainer ranks; each owns rows [r*n/W, (r+1)*n/W) of every tensor."
    )
    incarnation: str = option(
        "", "Shared by all ranks of one run (a new one fences the old); empty = a fresh one (single rank)."
    )
    agent_id: str = option("", "This rank's agent id; default trainer-<rank>-<random>.")
    host_id: str = option("", "Machine identity for same-host transports (shm); default the hostname.")
    metrics_port: int = option(-1, "Prometheus /metrics port; 0 picks a free one, -1 disables.")
    slots: int = option(2, "Arena slots; a slot is reused only after its version's leases end.")
    chunk_bytes: int = option(
        DEFAULT_CHUNK_BYTES, "Chunk size in bytes (3 MiB: measured best for grpc and tcp, below gRPC's 4 MiB limit)."
    )
    weight_dtype: str = option("", "Cast every tensor to this dtype while staging (e.g. bfloat16); empty keeps each.")
    min_rollouts: int = option(0, "OK handshakes needed to commit; 0 keeps the session's value.")
    flip_policy: str = option(
        "",
        "How the session's rollouts take each version: independent (each applies it when its own pull verifies) | "
        "atomic (every rollout prepares it, then all flip together or none does: docs/design.md, Atomic flips); "
        "empty keeps the session's (a new session's: independent).",
        choices=["", *(p.lower() for p in FLIP_POLICIES)],
    )
    prepare_timeout_s: float = option(
        0.0,
        "atomic: seconds from a version's READY within which every rollout must prepare it, else it fails; 0 keeps "
        "the session's (a new session's: 300).",
    )
    prepared_loss: str = option(
        "",
        "atomic: a rollout lost after it prepared a version, before the flip was decided: flip_without (the others "
        "flip; it comes back at that version) | abort_flip (the version fails); empty keeps the session's.",
        choices=["", *(p.lower() for p in PREPARED_LOSSES)],
    )
    rollout_ids: tuple[str, ...] = option(
        (),
        "A rollout id that may join the session (register); given, only these may (and only their failed "
        "handshakes can turn a version PARTIAL). None given keeps the session's (a new one: any id).",
    )
    max_rollouts: int = option(
        0, "A new rollout id joins only while fewer rollouts are live; 0 keeps the session's (a new one: any number)."
    )
    tcp_port: int = option(
        0,
        "Port of the native tcp data-plane server; 0 picks a free one. Not served where --host is a unix "
        "socket or the host has no usable inet sockets.",
    )
    weight_sync_mode: str = option(
        "",
        "The session's default mode for rollouts without their own: grpc | tcp | shm | fs "
        "(aliases filesystem, gcs; needs --fs-root) | relay; empty keeps the session's.",
    )
    fs_root: str = option(
        "",
        "Also write every part under this fsspec root for the fs mode (e.g. /mnt/ckpt, gs://b/ws); old versions "
        "are removed when their slot is reused.",
    )
    fs_option: tuple[str, ...] = secret_option(
        (),
        "A storage option of --fs-root as key=value, passed to fsspec (e.g. endpoint_url=http://minio:9000, "
        "requester_pays=true); credentials come from the standard places (AWS_*, GOOGLE_APPLICATION_CREDENTIALS).",
    )
    use_ffi: bool | None = option(
        None,
        "Stage JAX arrays through the FFI handler: unset = when built, true = required (fails naming what is "
        "missing), false = through host pointers.",
    )
    staging_threads: int = option(
        0, "Threads of the native staging pass (on an accelerator: threads staging landed blocks); 0 = every core."
    )
    d2h_window_bytes: int = option(
        DEFAULT_WINDOW_BYTES,
        "Device arrays (and casts): bytes of device-to-host copies issued and not yet staged; host memory "
        "above the arena stays within about this (on an accelerator each block counts as the room its host "
        "buffer takes in a thread's 64 MiB malloc heaps, three 18 MiB blocks to a heap, and once the heaps the "
        "blocks landed in hold more than this, the excess is taken off what may be in flight).",
    )
    d2h_block_bytes: int = option(
        DEFAULT_BLOCK_BYTES,
        "Device arrays on an accelerator: larger shards are cut on their device into blocks of about this many "
        "bytes (rounded to a multiple of chunk_bytes), each staged as it lands; 0 copies shards whole.",
    )
    d2h_hold_freed_heap: bool = option(
        True,
        "Device arrays on an accelerator: before the first blocks' copies, fix glibc's trim and mmap thresholds "
        "(2 GiB, 32 MiB) and its top pad (64 MiB, so no free unmaps a thread arena's heap; process-wide, once) "
        "so each block's host buffer reuses memory the blocks before it freed instead of faulting in fresh "
        "pages, in whichever thread publishes; false leaves malloc's settings alone.",
    )
    d2h_one_thread: bool = option(
        True,
        "Device arrays on an accelerator: every publish's block copies are issued and land on one thread of the "
        "process (weightsync-d2h), whichever thread publishes, so glibc keeps their freed host buffers in one "
        "arena (about a window) instead of one per publishing thread; false copies on the publishing thread.",
    )
    delta: str = option(
        "off",
        "auto: also publish each version as a delta against the previous one (rollouts holding it pull only "
        "the changed elements) when its bytes on the wire are at most delta_max_ratio of the part's; off.",
    )
    delta_max_ratio: float = option(0.5, "Largest delta worth publishing, as a fraction of the part's bytes.")
    timeout_s: float = option(30.0, "Deadline of each call to the coordinator.")
    attach_wait_s: float = option(
        120.0, "How long start() waits for a coordinator that is not reachable yet (pods start in any order)."
    )
    slot_wait_s: float = option(60.0, "How long a publish waits for rollouts' leases to free the oldest slot.")
    publish_wait_s: float = option(
        120.0,
        "How long a publish keeps trying while its failure may pass by itself (the coordinator unreachable, "
        "a full disk, every slot leased past slot_wait_s) before it raises; 0 raises at once.",
    )
    failpoints: str = option("", "Testing only: name=count pairs, e.g. chunk_server.corrupt_chunk=2.")

    def __post_init__(self) -> None:
        super().__post_init__()
        self.check()

    def check(self) -> None:
        """InvalidArgument naming the first bad field; normalizes the mode's aliases."""
        if not self.coordinator:
            raise InvalidArgument("must name the coordinator (host:port)", field="coordinator")
        check_address(self.coordinator, "coordinator")
        check_session_name(self.session, "session")
        if self.agent_id:
            check_agent_id(self.agent_id, "agent_id")
        for rollout_id in self.rollout_ids:
            check_agent_id(rollout_id, "rollout_ids")
        check_bounds(self, ("max_rollouts",), 0, 100_000)
        if self.weight_dtype:
            dtype_info(self.weight_dtype, "weight_dtype")
        self.weight_sync_mode = normalize_mode(self.weight_sync_mode, "weight_sync_mode", allow_empty=True)
        if self.weight_sync_mode in INET_MODES and (why := unix_among(host=self.host)):
            raise InvalidArgument(
                f"{self.weight_sync_mode!r} needs inet sockets, and {why}: use shm (same host) or grpc",
                field="weight_sync_mode",
            )
        if self.weight_sync_mode == "fs" and not self.fs_root:
            raise InvalidArgument("weight_sync_mode 'fs' needs fs_root: where parts are written", field="fs_root")
        if self.fs_root:
            check_fs_root(self.fs_root)
        parse_fs_options(self.fs_option)
        # what a coordinator on default limits accepts: refused here, not after staging
        check_bounds(self, ("world_size",), 1, DEFAULT_LIMITS.max_trainer_ranks)
        if not 0 <= self.rank < self.world_size:
            raise InvalidArgument(f"{self.rank} is not in [0, world_size={self.world_size})", field="rank")
        check_bounds(self, ("slots",), 1, MAX_SLOTS)
        check_bounds(self, ("d2h_window_bytes",), 1, 1 << 62)
        check_bounds(self, ("d2h_block_bytes",), 0, 1 << 40)
        check_bounds(self, ("chunk_bytes",), DEFAULT_LIMITS.min_chunk_bytes, DEFAULT_LIMITS.max_chunk_bytes)
        check_bounds(self, ("min_rollouts",), 0, UINT32_MAX)  # OpenSessionRequest.min_rollouts
        for name, allowed in (("flip_policy", FLIP_POLICIES), ("prepared_loss", PREPARED_LOSSES)):
            if getattr(self, name).upper() not in ("", *allowed):
                raise InvalidArgument(f"{getattr(self, name)!r} is not one of {', '.join(allowed)}", field=name)
        check_bounds(self, ("prepare_timeout_s",), 0, 7 * 86400)  # the coordinator's bound
        check_bounds(self, ("staging_threads",), 0, 1024)
        check_bounds(self, ("slot_wait_s", "attach_wait_s", "publish_wait_s"), 0, MAX_SECONDS)
        Failpoints(self.failpoints)  # refused at start, not once the session is attached
        if self.delta not in DELTA_MODES:
            raise InvalidArgument(f"{self.delta!r} is not one of {', '.join(DELTA_MODES)}", field="delta")
        if not 0 < self.delta_max_ratio <= 1:
            raise InvalidArgument(f"must be in (0, 1], got {self.delta_max_ratio}", field="delta_max_ratio")
        check_positive(self, ("timeout_s",))
        check_bounds(self, ("tcp_port",), 0, 65535)

    def check_host(self) -> None:
        """FailedPrecondition naming weight_sync_mode where the mode needs inet sockets and
        this host has no usable ones. Asked when the publisher starts, not when settings are
        read: settings read the same on every host."""
        if self.weight_sync_mode in INET_MODES and (why := inet_refused()):
            raise FailedPrecondition(
                f"{self.weight_sync_mode!r} needs inet sockets, and {why}: use shm (same host) or grpc",
                field="weight_sync_mode",
            )
