"""SyncSettings: how a rollout follows a session and pulls its versions.

One source for every entry point: the sidecar's flags and WEIGHTSYNC_ROLLOUT_* variables
(`RolloutConfig` extends it), vLLM's `init_info` (the weight-transfer backend) and the
worker extension's attach dict (`InitInfo`, which names fields `init_info.<name>` in its
errors). `rollout_agent.wiring` builds the parts from it.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, ClassVar

from weightsync.addresses import inet_refused, inet_unusable, is_unix, unix_address, unix_among, unix_path
from weightsync.config import PeerConfig, check_bounds, check_positive, option, secret_option
from weightsync.errors import FailedPrecondition, InvalidArgument
from weightsync.failpoints import Failpoints
from weightsync.modes import normalize_mode
from weightsync.transports.fs import check_fs_root
from weightsync.transports.fs_options import parse_fs_options
from weightsync.validation import (
    MAX_INSTANCE_CHARS,
    check_address,
    check_agent_id,
    check_session_name,
    check_unix_address,
)

# What a rollout refused tcp or relay for want of inet sockets can take instead.
_INET_ALTERNATIVES = "use shm (same host) or grpc, or relay with --relay-host unix:DIR"

# Lanes, chunks per call and attempts a puller takes at most.
MAX_LANES = 1 << 20


def check_pull_args(holder: Any, mode: str, fs_root: str) -> None:
    """What a pull needs of its arguments, wherever they come from (a sidecar's settings, a
    library caller's `WeightPuller`): mode 'fs' names its store root, a root fsspec knows,
    and `holder`'s streams, window_chunks and max_attempts in [1, MAX_LANES]."""
    if mode == "fs" and not fs_root:
        raise InvalidArgument("mode 'fs' needs the store root it may read (--fs-root)", field="fs_root")
    if fs_root:
        check_fs_root(fs_root)
    check_bounds(holder, ("streams", "window_chunks", "max_attempts"), 1, MAX_LANES)


APPLY_MODES = ("atomic", "streaming")


@dataclass
class SyncSettings(PeerConfig):
    """A rollout's session, data-plane mode and limits, relay and credentials."""

    FIELD_PREFIX: ClassVar[str] = ""  # how errors name a field ("init_info." for vLLM's)
    AUTH_ROLE: ClassVar[str] = "rollout"

    coordinator: str = option("127.0.0.1:50051", "Coordinator address host:port or unix:/path.")
    session: str = option("demo", "Session name.")
    agent_id: str = option(
        "",
        "Unique rollout id (lowercase); default rollout-<pid> (vllm-<host>-<pid>-r<rank>). In a vLLM engine of "
        "several workers (TP, PP, DP) worker r > 0 registers <agent_id>-r<r>.",
    )
    host_id: str = option("", "Machine identity for same-host transports; default the hostname.")
    instance: str = option(
        "",
        "The secret this rollout registers its agent id with (while its lease is live, another process under the "
        "id is refused, and calls for the id need the agent key its registration answers); empty draws one. A "
        "sidecar hands its own to the vLLM engine it drives, which registers under the same id and key.",
    )
    weight_sync_mode: str = option(
        "",
        "grpc | tcp (native bulk path) | shm (map a same-host trainer's arena) | fs, alias filesystem or gcs "
        "(read parts under --fs-root) | relay (pull from the rollout before us in the coordinator's chain, "
        "re-serve to the next); empty: the session's mode, set by the trainer. Ranks not offering it are "
        "pulled over grpc.",
    )
    relay_host: str = option(
        "",
        "relay: address the chunk server re-serving pulled versions binds; default the server's --host "
        "(sidecar), else --advertise-host, else 127.0.0.1. unix:DIR (an existing directory): it listens on "
        "DIR/relay-<agent id>.sock and only rollouts on this host read from it, mapping its buffers: the first such "
        "relay of a host in the chain pulls each version, the host's others read it from there (no inet socket "
        "needed; docs/host-pull.md).",
    )
    relay_port: int = option(0, "relay: port of that chunk server; 0 picks a free one (none with a unix: host).")
    relay_wait_s: float = option(
        10.0,
        "relay: how long a downstream read waits for a chunk here before it is sent to the trainer; a read "
        "from a relay silent for this plus 5 s (frozen, cut off) goes to the trainer too.",
    )
    fs_root: str = option("", "fs transport: the fsspec root parts may be read from (e.g. /mnt/ckpt, gs://bucket/ws).")
    fs_option: tuple[str, ...] = secret_option(
        (),
        "fs transport: a storage option of --fs-root as key=value, passed to fsspec (e.g. "
        "endpoint_url=http://minio:9000); credentials come from the standard places (AWS_*, "
        "GOOGLE_APPLICATION_CREDENTIALS).",
    )
    streams: int = option(2, "Parallel streams per trainer rank.")
    window_chunks: int = option(
        32, "Chunks requested per call (the in-flight window per stream; measured best in docs/performance.md)."
    )
    max_attempts: int = option(3, "Fetches per chunk before giving up with DATA_LOSS.")
    timeout_s: float = option(120.0, "Deadline of each data-plane call.")
    apply_mode: str = option(
        "atomic",
        "atomic: verify every byte before the first weight changes; streaming: one layer group at a time "
        "(bounded memory, not atomic).",
        choices=list(APPLY_MODES),
    )
    prefetch: bool = option(
        True,
        "vLLM engines: pull and verify each new servable version in the background while the engine serves; "
        "an update of a prefetched version only applies (one receive buffer; atomic apply only).",
    )
    flip_wait_s: float = option(
        60.0,
        "vLLM engines, ATOMIC sessions: how long an update_weights of a version whose flip is not decided yet waits "
        "for the decision (the engine held), then refuses it (FAILED_PRECONDITION naming the flip state).",
    )
    prefetch_nice: int = option(
        10,
        "vLLM engines: the nice value (0-19) of the prefetch threads: the engine's threads win the cores and "
        "the pull takes what they leave (0: the same priority as the engine).",
    )
    host_memory_limit_bytes: int = option(
        0,
        "The most private host memory (RssAnon) this rollout may hold: a version whose receive buffer and apply "
        "staging would take it past this is refused before a byte of it is pulled (RESOURCE_EXHAUSTED, its "
        "handshake failed). 0: no limit. Reported in the status and weightsync_host_memory_bytes.",
    )
    audit_interval_s: float = option(
        60.0,
        "Seconds between audits of the weights the engine serves against the version it was last given "
        "(exact fingerprints, tensor by tensor; a mismatch re-applies the version); 0: only when asked. An audit "
        "also waits 100 times its own duration after the last one, so audits take at most 1% of the engine's "
        "time.",
    )
    failpoints: str = option("", "Testing only: name=count pairs, e.g. puller.corrupt_assembled=1.")

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """InvalidArgument naming the first bad field (with FIELD_PREFIX)."""
        try:
            if not self.coordinator:
                raise InvalidArgument("must name the coordinator (host:port)", field="coordinator")
            check_address(self.coordinator, "coordinator")
            check_session_name(self.session, "session")
            if self.agent_id:
                check_agent_id(self.agent_id, "agent_id")
            if len(self.instance) > MAX_INSTANCE_CHARS:
                raise InvalidArgument(f"longer than {MAX_INSTANCE_CHARS} characters", field="instance")
            if self.apply_mode not in APPLY_MODES:
                raise InvalidArgument(f"{self.apply_mode!r} is not 'atomic' or 'streaming'", field="apply_mode")
            self.weight_sync_mode = normalize_mode(self.weight_sync_mode, "weight_sync_mode", allow_empty=True)
            check_pull_args(self, self.weight_sync_mode, self.fs_root)
            parse_fs_options(self.fs_option)
            self._check_relay_flags()
            Failpoints(self.failpoints)  # refused at start
            check_bounds(self, ("relay_port",), 0, 65535)
            check_bounds(self, ("prefetch_nice",), 0, 19)
            check_bounds(self, ("host_memory_limit_bytes",), 0)
            check_bounds(self, ("relay_wait_s", "audit_interval_s", "flip_wait_s"), 0)
            check_positive(self, ("timeout_s",))
            self.check_peer()
            self.security()  # both halves of a key pair or neither
        except InvalidArgument as e:
            if not self.FIELD_PREFIX or e.field is None:
                raise
            raise InvalidArgument(e.message.partition(": ")[2], field=f"{self.FIELD_PREFIX}{e.field}") from None

    def server_host(self) -> str:
        """The host this process's own gRPC server binds ("": it has none)."""
        return ""

    def relay_unusable(self, server_host: str = "") -> str:
        """Why a relay cannot serve here ("" where it can): it listens at --relay-host (a
        unix socket directory always serves), else on an inet socket at the server's host
        (`server_host`, default `server_host()`)."""
        if is_unix(self.relay_host):
            return ""
        return inet_unusable(host=server_host or self.server_host()) if not self.relay_host else inet_refused()

    def relay_bind(self, agent_id: str, server_host: str = "") -> str:
        """Where this rollout's relay listens: `unix:DIR/relay-<agent_id>.sock` for a unix:DIR
        --relay-host (InvalidArgument naming relay_host where that path cannot be a socket's),
        else --relay-host, else `server_host`, else --advertise-host, else 127.0.0.1."""
        if not is_unix(self.relay_host):
            return self.relay_host or server_host or self.advertise_host or "127.0.0.1"
        address = unix_address(f"{unix_path(self.relay_host).rstrip('/')}/relay-{agent_id}.sock")
        check_unix_address(address, f"{self.FIELD_PREFIX}relay_host")
        return address

    def _check_relay_host(self) -> None:
        """A unix:DIR relay host: an absolute path of an existing directory, and no port."""
        if not is_unix(self.relay_host):
            return
        directory = unix_path(self.relay_host).rstrip("/")
        if not directory.startswith("/") or "\0" in directory:
            raise InvalidArgument(f"{self.relay_host!r}: unix:DIR names an absolute directory", field="relay_host")
        if not os.path.isdir(directory):
            raise InvalidArgument(
                f"{self.relay_host!r}: {directory} is not a directory (the relay makes its socket there)",
                field="relay_host",
            )
        if self.relay_port:
            raise InvalidArgument("a relay on a unix socket has no port (0)", field="relay_port")

    def _check_relay_flags(self) -> None:
        """InvalidArgument where relay mode would serve its relay on the unix --host: the
        settings contradict themselves, on any host."""
        self._check_relay_host()
        if self.weight_sync_mode == "relay" and not self.relay_host and (why := unix_among(host=self.server_host())):
            raise InvalidArgument(
                f"'relay' needs inet sockets, and {why}: {_INET_ALTERNATIVES}", field="weight_sync_mode"
            )

    def check_host(self, server_host: str = "") -> None:
        """FailedPrecondition naming weight_sync_mode where the mode needs inet sockets this
        host cannot open: tcp reads the trainer's native server, relay also serves the next
        rollout (unless on a unix socket, to rollouts on its host). Asked when a rollout is
        wired (`server_host` as there), not when settings are read: settings read the same
        on every host."""
        mode = self.weight_sync_mode
        why = inet_refused() if mode == "tcp" else self.relay_unusable(server_host) if mode == "relay" else ""
        if why:
            raise FailedPrecondition(
                f"{mode!r} needs inet sockets, and {why}: {_INET_ALTERNATIVES}", field="weight_sync_mode"
            )

    def wants_relay(self, server_host: str = "") -> bool:
        """Re-serve what we pull: in relay mode, or where the session's mode (unknown until
        the first manifest) may be relay and a relay can serve here. Streaming applies hold
        no whole version to serve."""
        if self.weight_sync_mode not in ("relay", "") or self.apply_mode != "atomic":
            return False
        return self.weight_sync_mode == "relay" or not self.relay_unusable(server_host)

    def init_info(self, **overrides: Any) -> dict[str, Any]:
        """These settings as vLLM's `init_info` (plain data: it crosses vLLM's RPCs)."""
        names = {f.name for f in dataclasses.fields(SyncSettings)}  # PeerConfig's included
        return {**{n: getattr(self, n) for n in names}, **overrides}


@dataclass
class InitInfo(SyncSettings):
    """SyncSettings as vLLM's init_info / the worker extension's attach dict."""

    FIELD_PREFIX: ClassVar[str] = "init_info."

    # Required here: the sidecar's defaults (a local coordinator, session "demo") would let a
    # worker silently sync the wrong thing.
    coordinator: str = option("", "Coordinator address host:port or unix:/path (required).")
    session: str = option("", "Session name (required).")
