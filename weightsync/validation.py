"""Validation of names, parts and merged manifests; every failure names its field."""

from __future__ import annotations

import functools
import ipaddress
import math
import operator
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from weightsync.addresses import SUN_PATH_MAX, is_unix, split_host_port, unix_path
from weightsync.dtypes import dtype_info
from weightsync.errors import InvalidArgument, ResourceExhausted
from weightsync.manifest import DELTA_ENCODINGS, Part, ShardSpec, TensorSpec

SESSION_NAME_RE = re.compile(r"^[a-z0-9]([a-z0-9._-]{0,61}[a-z0-9])?$")
AGENT_ID_RE = SESSION_NAME_RE
TENSOR_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.:/\-]{0,511}$")
DIGEST_HEX_RE = re.compile(r"^[0-9a-f]{64}$")
# A DNS label (RFC 1123; underscores too, which Docker's service names use).
HOST_LABEL_RE = re.compile(r"^[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?$")
INT64_MAX = (1 << 63) - 1  # SQLite's INTEGER; versions, generations and sequence numbers live there
MAX_KEY_CHARS = 256  # a publish's idempotency key
UINT32_MAX = (1 << 32) - 1  # a uint32 request field (min_rollouts, version_limit)
MAX_INSTANCE_CHARS = 64  # RegisterAgentRequest.instance: a secret a rollout process draws at start


@dataclass(frozen=True)
class Limits:
    """Size and count limits a coordinator enforces (RESOURCE_EXHAUSTED past them)."""

    max_tensors: int = 200_000
    max_shards: int = 400_000
    max_chunks: int = 1 << 20
    max_ndim: int = 8
    max_part_bytes: int = 1 << 40
    min_chunk_bytes: int = 4096
    max_chunk_bytes: int = 64 << 20
    max_trainer_ranks: int = 4096
    # Characters of a version's tensor names, all ranks together. A rollout's handshake
    # names every tensor twice (its digest, and the names the engine consumed), so with
    # `max_tensors` this keeps one inside a gRPC message (`handshake_bound_bytes`): 200,000
    # names of 500 characters, accepted, pulled and applied, would make a 205 MB handshake
    # that can never be sent, and the version would wait for good.
    max_name_chars: int = 32 << 20


DEFAULT_LIMITS = Limits()
# A handshake's bytes per tensor besides its names: a TensorDigest's tags, lengths, xxh3 and
# sum, and the consumed name's tag and length (protobuf varints of names up to 512 bytes).
HANDSHAKE_BYTES_PER_TENSOR = 32


def handshake_bound_bytes(limits: Limits) -> int:
    """The largest handshake a version within `limits` makes a rollout send (besides its
    fixed fields): what the message size limit must hold."""
    return 2 * limits.max_name_chars + HANDSHAKE_BYTES_PER_TENSOR * limits.max_tensors


def check_name_chars(total: int, max_name_chars: int, field: str) -> None:
    """ResourceExhausted when tensor names of `total` characters pass `max_name_chars`
    (`Limits.max_name_chars`; also checked as a publish stream arrives, `wire.PartBuilder`)."""
    if total > max_name_chars:
        raise ResourceExhausted(
            f"tensor names of {total} characters exceed the limit of {max_name_chars} "
            "(a rollout's handshake names each)",
            field=field,
        )


def check_session_name(name: str, field: str = "session") -> str:
    """A DNS-label-like session name (lowercase, digits, '.', '_', '-', max 63)."""
    if not name:
        raise InvalidArgument("must not be empty", field=field)
    if not SESSION_NAME_RE.fullmatch(name):
        raise InvalidArgument(f"{name!r} must match {SESSION_NAME_RE.pattern}", field=field)
    return name


def check_agent_id(agent_id: str, field: str = "agent_id") -> str:
    """Agent ids follow the session-name rules."""
    if not agent_id:
        raise InvalidArgument("must not be empty", field=field)
    if not AGENT_ID_RE.fullmatch(agent_id):
        raise InvalidArgument(f"{agent_id!r} must match {AGENT_ID_RE.pattern}", field=field)
    return agent_id


def check_tensor_name(name: str, field: str) -> None:
    """HF-style tensor names: no empty, '..', leading separator or odd characters."""
    if not good_tensor_name(name):
        raise InvalidArgument(
            f"tensor name {name!r} must match {TENSOR_NAME_RE.pattern} without '..' or '//'", field=field
        )


@functools.lru_cache(maxsize=8192)  # a fleet's handshakes name one model's tensors 1,000 times
def good_tensor_name(name: str) -> bool:
    """True for a name `check_tensor_name` accepts."""
    return bool(TENSOR_NAME_RE.fullmatch(name)) and ".." not in name and "//" not in name


def check_version(version: int, field: str = "version") -> int:
    """Versions are positive integers (0 is reserved for 'latest' in reads)."""
    if version <= 0:
        raise InvalidArgument(f"must be > 0, got {version}", field=field)
    return version


def check_int_arg(value: Any, field: str, low: int, high: int) -> int:
    """An integer handed to the Python API (numpy's too, not a bool or a float) in
    [low, high], as an int; else InvalidArgument naming `field`."""
    if isinstance(value, bool):
        raise InvalidArgument(f"must be an integer, got {value!r}", field=field)
    try:
        number = operator.index(value)
    except TypeError:
        raise InvalidArgument(f"must be an integer, got {type(value).__name__} {value!r:.40}", field=field) from None
    if not low <= number <= high:
        top = "2^63-1" if high == INT64_MAX else str(high)
        raise InvalidArgument(f"must be in [{low}, {top}], got {number}", field=field)
    return number


def check_version_arg(version: Any, field: str = "version") -> int:
    """A version handed to the Python API: in [1, 2^63-1], what the coordinator stores.
    Checked before anything is staged: a version the request cannot carry (-1, 2^64)
    would otherwise fail as a ValueError only once the part is staged, leaving its slot
    held under that version, which breaks every later publish and the heartbeat."""
    return check_int_arg(version, field, 1, INT64_MAX)


def _is_host(host: str) -> bool:
    """An IP address (IPv6 with or without brackets) or a host name: DNS labels of letters,
    digits, '-' and '_', not starting or ending with '-', 253 characters at most."""
    try:
        ipaddress.ip_address(host[1:-1] if host.startswith("[") and host.endswith("]") else host)
        return True
    except ValueError:
        pass
    name = host[:-1] if host.endswith(".") else host  # a fully qualified name's root
    return bool(name) and len(name) <= 253 and all(HOST_LABEL_RE.fullmatch(label) for label in name.split("."))


def check_host(host: str, field: str) -> None:
    """InvalidArgument unless `host` is an IP address or a host name (`_is_host`)."""
    if not _is_host(host):
        raise InvalidArgument(f"{host!r} is neither an IP address nor a host name", field=field)


# A server binds its unix socket in a private directory beside the final path, then moves
# it into place (`weightsync.unix_sockets`): "/.XXXXXXXX/s" more than the directory's path.
UNIX_BIND_DIR_BYTES = 12


def check_unix_address(address: str, field: str) -> None:
    """`unix:/path` or `unix:///path`: an absolute path without NUL bytes that fits a
    socket address (sun_path: 107 bytes), in a directory whose path leaves room for the
    private directory the socket is first bound in."""
    path = unix_path(address)
    if not path:
        raise InvalidArgument(f"{address!r} names no socket path (unix:/path)", field=field)
    if "\0" in path:
        raise InvalidArgument(f"{address!r}: a socket path cannot hold a NUL byte", field=field)
    if not path.startswith("/"):
        raise InvalidArgument(
            f"{address!r}: the socket path must be absolute (unix:/path; other processes dial it)", field=field
        )
    if path.endswith("/"):
        raise InvalidArgument(f"{address!r} names a directory, not a socket file", field=field)
    size = len(path.encode("utf-8", "surrogateescape"))
    if size > SUN_PATH_MAX:
        raise InvalidArgument(
            f"{address!r}: the socket path is {size} bytes; a unix socket's takes at most {SUN_PATH_MAX}", field=field
        )
    directory = path.rpartition("/")[0] or "/"
    if len(directory.encode("utf-8", "surrogateescape")) + UNIX_BIND_DIR_BYTES > SUN_PATH_MAX:
        raise InvalidArgument(
            f"{address!r}: its directory's path must be at most {SUN_PATH_MAX - UNIX_BIND_DIR_BYTES} bytes (the socket "
            "is bound in a private directory inside it, then moved into place)",
            field=field,
        )


def check_address(address: str, field: str, *, unix: bool = True) -> None:
    """host:port (an IPv6 literal in brackets) with a numeric port and a host `check_host`
    takes, or (with `unix`) a unix socket address `check_unix_address` takes."""
    if is_unix(address):
        if not unix:
            raise InvalidArgument(f"{address!r}: this address must be host:port, not a unix socket", field=field)
        check_unix_address(address, field)
        return
    host, port = split_host_port(address)
    bare_v6 = ":" in host and not address.startswith("[")  # "::1:80": which colon ends the host?
    if not host or bare_v6 or not port.isdigit():
        raise InvalidArgument(f"{address!r} is not host:port", field=field)
    if not 0 < int(port) < 65536:  # gRPC would take 99999 as 34463 (the port modulo 2^16)
        raise InvalidArgument(f"{address!r}: port {port} is not in [1, 65535]", field=field)
    if not _is_host(host):  # other agents would dial it and fail, version after version
        raise InvalidArgument(f"{address!r}: {host!r} is neither an IP address nor a host name", field=field)


def _check_tensor(t: TensorSpec, field: str, limits: Limits) -> None:
    check_tensor_name(t.name, f"{field}.name")
    dtype_info(t.dtype, f"{field}.dtype")
    if len(t.shape) > limits.max_ndim:
        raise InvalidArgument(f"{len(t.shape)} dims exceed the limit of {limits.max_ndim}", field=f"{field}.shape")
    if any(d < 0 for d in t.shape):
        raise InvalidArgument(f"negative dimension in {list(t.shape)}", field=f"{field}.shape")
    if t.nbytes > limits.max_part_bytes:
        raise ResourceExhausted(
            f"{field}.shape: {t.nbytes} bytes exceed {limits.max_part_bytes}", field=f"{field}.shape"
        )


def _boxes_overlap(a: ShardSpec, b: ShardSpec) -> bool:
    return all(max(s1, s2) < min(e1, e2) for s1, e1, s2, e2 in zip(a.start, a.stop, b.start, b.stop))


def _check_counts(part: Part, limits: Limits) -> None:
    for what, n, cap in (
        ("tensors", len(part.tensors), limits.max_tensors),
        ("shards", len(part.shards), limits.max_shards),
        ("chunks", len(part.chunks), limits.max_chunks),
    ):
        if n > cap:
            raise ResourceExhausted(f"part.{what}: {n} exceed the limit of {cap}", field=f"part.{what}")
    if part.total_bytes > limits.max_part_bytes:
        raise ResourceExhausted(
            f"part.total_bytes: {part.total_bytes} exceed the limit of {limits.max_part_bytes}",
            field="part.total_bytes",
        )


def _check_chunks(part: Part) -> None:
    cursor = 0
    for i, c in enumerate(part.chunks):
        f = f"part.chunks[{i}]"
        if c.index != i:
            raise InvalidArgument(f"expected {i}, got {c.index} (chunks are sent in index order)", field=f"{f}.index")
        if c.offset != cursor:
            what = "overlaps the previous chunk" if c.offset < cursor else "leaves a gap"
            raise InvalidArgument(f"{c.offset} {what}; expected {cursor}", field=f"{f}.offset")
        if not 0 < c.length <= part.chunk_bytes:
            raise InvalidArgument(f"{c.length} must be in (0, chunk_bytes={part.chunk_bytes}]", field=f"{f}.length")
        cursor += c.length
    if cursor != part.total_bytes:
        raise InvalidArgument(f"cover [0, {cursor}) but total_bytes is {part.total_bytes}", field="part.chunks")


def _check_delta(part: Part) -> None:
    """A delta's own bounds: a known encoding; delta chunks indexed after the part's
    chunks, tiling the delta bytes in order, each smaller than the distinct chunk it
    rebuilds; raw chunks ascending, none also rebuilt from a delta chunk."""
    d = part.delta
    assert d is not None
    if d.encoding not in DELTA_ENCODINGS:
        raise InvalidArgument(
            f"{d.encoding!r} is not one of {', '.join(DELTA_ENCODINGS)}", field="header.delta.encoding"
        )
    if not d.base_version:
        raise InvalidArgument("must name the base version (>= 1)", field="header.delta.base_version")
    if not DIGEST_HEX_RE.fullmatch(d.base_manifest_digest):
        raise InvalidArgument("must be a sha256 hex digest", field="header.delta.base_manifest_digest")
    n = len(part.chunks)
    cursor, last = 0, -1
    for i, c in enumerate(d.chunks):
        f = f"part.delta.chunks[{i}]"
        if c.index != n + i:
            raise InvalidArgument(f"expected {n + i} (chunk_count + {i}), got {c.index}", field=f"{f}.index")
        if not last < c.target < n:
            raise InvalidArgument(f"{c.target} must be ascending and < chunk_count {n}", field=f"{f}.target")
        if c.offset != cursor:
            raise InvalidArgument(
                f"{c.offset}: delta chunks tile the delta bytes; expected {cursor}", field=f"{f}.offset"
            )
        if not 0 < c.length < part.chunks[c.target].length:
            raise InvalidArgument(
                f"{c.length} must be in (0, {part.chunks[c.target].length}): smaller than the chunk it rebuilds",
                field=f"{f}.length",
            )
        cursor += c.length
        last = c.target
    if cursor != d.total_bytes:
        raise InvalidArgument(
            f"delta chunks cover {cursor} bytes, not {d.total_bytes}", field="header.delta.total_bytes"
        )
    targets = {c.target for c in d.chunks}
    last = -1
    for i, r in enumerate(d.raw):
        if not last < r < n or r in targets:
            raise InvalidArgument(
                f"{r} must be ascending, < chunk_count {n} and not rebuilt from a delta chunk",
                field=f"part.delta.raw[{i}]",
            )
        last = r


def _check_shards(part: Part, specs: dict[str, TensorSpec]) -> None:
    by_tensor: dict[str, list[ShardSpec]] = {}
    for i, s in enumerate(part.shards):
        f = f"part.shards[{i}]"
        spec = specs.get(s.tensor_name)
        if spec is None:
            raise InvalidArgument(f"{s.tensor_name!r} is not among this part's tensors", field=f"{f}.tensor_name")
        nd = len(spec.shape)
        if len(s.start) != nd or len(s.stop) != nd:
            raise InvalidArgument(f"box has {len(s.start)}/{len(s.stop)} dims, tensor has {nd}", field=f"{f}.start")
        for d, (a, b, n) in enumerate(zip(s.start, s.stop, spec.shape)):
            if not 0 <= a <= b <= n:
                raise InvalidArgument(f"dim {d}: need 0 <= start {a} <= stop {b} <= {n}", field=f"{f}.stop")
        expected = s.element_count * dtype_info(spec.dtype).itemsize
        if s.nbytes != expected:
            raise InvalidArgument(
                f"{s.nbytes} != prod(box {list(s.shape)}) * itemsize = {expected}", field=f"{f}.nbytes"
            )
        if s.offset < 0 or s.offset + s.nbytes > part.total_bytes:
            raise InvalidArgument(
                f"[{s.offset}, {s.offset + s.nbytes}) is outside the part [0, {part.total_bytes})", field=f"{f}.offset"
            )
        by_tensor.setdefault(s.tensor_name, []).append(s)
    # Byte ranges must not overlap inside the part.
    ranges = sorted((s.offset, s.offset + s.nbytes, s.tensor_name) for s in part.shards if s.nbytes)
    for (a0, a1, an), (b0, _, bn) in zip(ranges, ranges[1:]):
        if b0 < a1:
            raise InvalidArgument(f"bytes of {an!r} [{a0}, {a1}) overlap those of {bn!r} at {b0}", field="part.shards")
    for name, shards in by_tensor.items():
        _check_no_box_overlap(name, shards, "part.shards")
    for name in specs:
        if name not in by_tensor:
            raise InvalidArgument(f"{name!r} has no shard in this part", field="part.tensors")


def _check_no_box_overlap(name: str, shards: Sequence[ShardSpec], field: str) -> None:
    """A sweep along the dimension with the most distinct box starts: boxes sorted by
    their start there are only compared with those still open at that point. Shards of
    a tensor split along one axis (or a grid) meet O(1) (or one grid row of) open boxes,
    so n shards cost O(n log n), not the n^2 pairs of comparing every two."""
    nonempty = [s for s in shards if s.element_count]
    if len(nonempty) < 2:
        return
    ndim = len(nonempty[0].start)
    axis = max(range(ndim), key=lambda d: len({s.start[d] for s in nonempty})) if ndim else 0
    open_boxes: list[ShardSpec] = []  # started, not yet ended along `axis`
    for b in sorted(nonempty, key=lambda s: s.start[axis] if ndim else 0):
        open_boxes = [a for a in open_boxes if not ndim or a.stop[axis] > b.start[axis]]
        for a in open_boxes:
            if _boxes_overlap(a, b):
                raise InvalidArgument(
                    f"boxes of {name!r} overlap: {list(a.start)}..{list(a.stop)} and {list(b.start)}..{list(b.stop)}",
                    field=field,
                )
        open_boxes.append(b)


def validate_part(part: Part, *, trainer_ranks: int, limits: Limits = DEFAULT_LIMITS) -> None:
    """Checks one rank's part on its own: counts, tensors, shards, chunk cover.

    Raises:
        InvalidArgument: naming the first bad field.
        ResourceExhausted: a count or size limit is exceeded.
    """
    if not 0 <= part.rank < trainer_ranks:
        raise InvalidArgument(f"{part.rank} is not in [0, trainer_ranks={trainer_ranks})", field="header.rank")
    if not limits.min_chunk_bytes <= part.chunk_bytes <= limits.max_chunk_bytes:
        raise InvalidArgument(
            f"{part.chunk_bytes} must be in [{limits.min_chunk_bytes}, {limits.max_chunk_bytes}]",
            field="header.chunk_bytes",
        )
    _check_counts(part, limits)
    check_name_chars(sum(len(t.name) for t in part.tensors), limits.max_name_chars, "part.tensors")
    specs: dict[str, TensorSpec] = {}
    for i, t in enumerate(part.tensors):
        _check_tensor(t, f"part.tensors[{i}]", limits)
        if t.name in specs:
            raise InvalidArgument(f"duplicate tensor {t.name!r}", field=f"part.tensors[{i}].name")
        specs[t.name] = t
    _check_shards(part, specs)
    _check_chunks(part)
    if part.delta is not None:
        _check_delta(part)


def validate_against_parts(part: Part, others: Sequence[Part], *, final: bool, limits: Limits = DEFAULT_LIMITS) -> None:
    """Cross-rank checks of a new part against the parts already sealed.

    Tensor specs must agree and shard boxes must not overlap; the version's tensors (each
    name once, whichever ranks hold its shards) stay within the count and name limits;
    when `final` (this part completes the version) every tensor's boxes must tile its
    global shape exactly.
    """
    specs: dict[str, TensorSpec] = {}
    shards: dict[str, list[ShardSpec]] = {}
    for other in others:
        if other.chunk_bytes != part.chunk_bytes:
            raise InvalidArgument(
                f"{part.chunk_bytes} differs from rank {other.rank}'s {other.chunk_bytes}", field="header.chunk_bytes"
            )
        for t in other.tensors:
            specs[t.name] = t
        for s in other.shards:
            shards.setdefault(s.tensor_name, []).append(s)
    for i, t in enumerate(part.tensors):
        prior = specs.get(t.name)
        if prior is not None and prior != t:
            raise InvalidArgument(
                f"{t.name!r} is {t.dtype}{list(t.shape)} here but {prior.dtype}{list(prior.shape)} on another rank",
                field=f"part.tensors[{i}]",
            )
        specs[t.name] = t
    if len(specs) > limits.max_tensors:
        raise ResourceExhausted(
            f"the version's tensors, all ranks together: {len(specs)} exceed the limit of {limits.max_tensors}",
            field="part.tensors",
        )
    if others:
        check_name_chars(sum(map(len, specs)), limits.max_name_chars, "part.tensors")
    for s in part.shards:
        shards.setdefault(s.tensor_name, []).append(s)
    for name, group in shards.items():
        _check_no_box_overlap(name, group, "part.shards")
    if final:
        for name, spec in specs.items():
            covered = sum(s.element_count for s in shards.get(name, []))
            if covered != spec.element_count:
                raise InvalidArgument(
                    f"shards of {name!r} cover {covered} of {spec.element_count} elements across all ranks",
                    field="part.shards",
                )


def values_close(a: float, b: float, element_count: int) -> bool:
    """Aggregate comparison used by the handshake.

    Float64 sums of the same values in another order differ by about
    n * eps * sum|x|; the tolerance is rel 1e-9 or abs 1e-9 * max(1, n). Byte digests
    carry the exact check; sums are the layout-invariant cross-check.
    """
    if math.isnan(a) and math.isnan(b):
        return True
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9 * max(1, element_count))
