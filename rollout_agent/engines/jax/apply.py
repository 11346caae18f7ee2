"""JaxApply: a verified version into an engine's sharded jax.Arrays, checked on the device.

Each leaf is built in the sharding of the leaf it replaces, each device getting only its
own slice of the host bytes: either the host sends every device its box of the
transformed tensor (a strided view where it can be; `transfer="host"`), or the tensor
goes over as it is, sharded to match, and one jitted transform per leaf permutes and pads
it on the devices (`transfer="device"`: no host transpose, for accelerators;
`engines.jax.build`). Nothing is gathered onto one device.

Mode "swap" builds every new leaf aside while the engine keeps serving the old ones, then
swaps them in at once and calls the engine's `refresh`: the pause. Mode "inplace" is for
memory that cannot hold two copies: inside the pause, leaf by leaf, the new leaf takes
the old one's buffer (donated to the jitted transform, or the old one deleted once the
new one stands). "auto" picks swap where every device's free memory (`memory_stats()`)
holds the new leaves plus `margin_bytes`, in place otherwise.

Before the swap, every new leaf's fingerprint on the device must equal the one the host
computes from the verified bytes through the transform (`engines.jax.fingerprint`). In
swap mode a mismatch leaves the old leaves serving and fails the round naming the leaf. In
place the old leaf is already gone, so a mismatching leaf is built once more from the host
bytes and checked again: bits damaged on their way to the device never serve, and the
version commits whole (`ApplyReport.repaired_leaves`). Only bytes that no longer match the
host fingerprint (changed on the host after the check) fail the round there, with the
engine holding a mix (`torn`) that must not serve until a version applies whole.
"""

from __future__ import annotations

import collections
import concurrent.futures
import math
import os
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np

from rollout_agent.engines.apply_report import ApplyReport
from rollout_agent.engines.audit_reading import VerifiedDigests
from rollout_agent.engines.fingerprint import Fingerprint
from rollout_agent.engines.jax import groups as jax_groups
from rollout_agent.engines.jax.build import (
    all_on_cpu,
    device_boxes,
    device_build,
    flipped,
    host_build,
    is_identity,
    owned,
    source_sharding,
)
from rollout_agent.engines.jax.fingerprint import ShardCheck, device_fingerprint, host_fingerprint
from rollout_agent.engines.jax.groups import groupable
from rollout_agent.engines.jax.names import LeafPlan, NameMap, shapes_of
from rollout_agent.engines.jax.targets import Target, as_target
from weightsync.errors import DataLoss, FailedPrecondition, InternalError, InvalidArgument

MODES = ("auto", "swap", "inplace")
_LAYER_RE = re.compile(r"^(.*?\.layers\.\d+)\.")
TRANSFERS = ("auto", "host", "device")
FINGERPRINTS = ("auto", "jit", "view")


@dataclass
class _Round:
    version: int
    plans: dict[str, LeafPlan]
    mode: str
    by_name: dict[str, str]  # HF name -> leaf path
    waiting: dict[str, set[str]]  # leaf path -> HF names not yet applied
    started: float = field(default_factory=time.perf_counter)
    cast: dict[str, np.ndarray] = field(default_factory=dict)
    new: dict[str, Any] = field(default_factory=dict)
    checks: dict[str, ShardCheck] = field(default_factory=dict)
    host: dict[str, Any] = field(default_factory=dict)  # leaf path -> Fingerprint or a Future of one
    transfers: set[str] = field(default_factory=set)
    inflight: collections.deque[tuple[int, Any]] = field(default_factory=collections.deque)
    pending: list[str] = field(default_factory=list)  # leaves waiting for their group's dispatch
    groups: int = 0
    consumed: list[str] = field(default_factory=list)
    build_seconds: float = 0.0
    wait_seconds: float = 0.0  # of build_seconds: waiting for leaves in flight to land
    host_seconds: float = 0.0
    device_bytes: int = 0
    hbm_before: int | None = None
    corrupt_next: bool = False
    sources: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)  # in place: to build a leaf again
    repaired: list[str] = field(default_factory=list)


class JaxApply:
    """Applies versions into `target` (a `targets.Target`, or any pytree, written in
    place) through `name_map`. The Applier protocol's methods, plus `prepare`.

    Args:
        mode: "swap", "inplace" or "auto" (module docstring).
        transfer: "host" (every device's box sent from the host), "device" (the tensor
            sent sharded, transformed by a jitted function on the devices), or "auto"
            (device on accelerators where a leaf's sharding maps onto the tensor's axes,
            host otherwise and on CPU devices).
        fingerprint: "jit" (a jitted reduction per shard), "view" (NumPy over a CPU
            device's memory: it is host memory, and XLA's CPU integer reductions are
            slow), or "auto" (view on CPU devices, jit elsewhere).
        refresh: called right after the swap (the engine re-points what it derived from
            the old leaves, e.g. tpu-inference's `refresh_model_state_leaves`).
        strict: refuse a version that leaves a floating leaf unwritten (NameMap.plan).
        margin_bytes: free memory a device keeps beyond the new leaves for "auto" to swap.
        window_bytes: leaf bytes in flight to the devices before the apply waits for the
            oldest (bounds transient buffers: the sharded tensors the device transform reads).
        group: leaves on a mesh checked by a jitted fingerprint (accelerators) go over a
            layer at a time, one transfer call and one program per group (`jax_groups`);
            False: a transfer, a transform and a fingerprint program per leaf.
        corrupt_next: testing only: a callable asked once per apply whether to flip one
            bit of the first leaf's bytes on their way to the device (after the host
            fingerprint was taken from the bytes as verified).
    """

    def __init__(
        self,
        target: Target | Any,
        name_map: NameMap,
        *,
        mode: str = "auto",
        transfer: str = "auto",
        fingerprint: str = "auto",
        refresh: Callable[[], None] | None = None,
        strict: bool = True,
        margin_bytes: int = 256 << 20,
        window_bytes: int = 256 << 20,
        group: bool = True,
        threads: int = 0,
        corrupt_next: Callable[[], bool] | None = None,
    ) -> None:
        for value, allowed, name in ((mode, MODES, "mode"), (transfer, TRANSFERS, "transfer"),
                                     (fingerprint, FINGERPRINTS, "fingerprint")):  # fmt: skip
            if value not in allowed:
                raise InvalidArgument(f"{value!r} is not one of {', '.join(allowed)}", field=name)
        self.target = as_target(target)
        self.name_map = name_map
        self.mode, self.transfer, self.fingerprint = mode, transfer, fingerprint
        self.refresh = refresh
        self.strict = strict
        self.margin_bytes, self.window_bytes = margin_bytes, window_bytes
        self.group = group
        self.corrupt_next = corrupt_next
        self.last: ApplyReport | None = None
        self.torn = False  # an in-place apply failed part way: the engine holds a mix until the next one
        # the last version applied whole: (version, leaf path -> its verified fingerprint,
        # leaf path -> the tensors in it), the reference of an audit (`engines.jax.audit`)
        self.verified: tuple[int, dict[str, Fingerprint], dict[str, tuple[str, ...]]] | None = None
        self._threads = threads or min(8, os.cpu_count() or 1)
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._plans: dict[Any, dict[str, LeafPlan]] = {}
        self._prepared: tuple[int, dict[str, Fingerprint], float] | None = None
        self._round: _Round | None = None
        self._old: dict[str, Any] = {}  # the open round's leaves as they were

    # -- the Applier protocol ----------------------------------------------------------
    def check(self, version: int, tensors: Mapping[str, Any]) -> None:
        """Refuses a version whose tensors do not map onto the engine's leaves."""
        self._plan(shapes_of(tensors.values()))

    def prepare(self, version: int, tensors: Mapping[str, np.ndarray], check: VerifiedDigests | None = None) -> None:
        """Takes the host fingerprint of every leaf from the verified bytes (call it right
        after the digest check, while the engine serves): bytes that change after this,
        on the host or on their way to the device, fail the device check (which compares
        fingerprints: `check`'s digests are not used)."""
        t0 = time.perf_counter()
        plans = self._plan({n: (a.shape, a.dtype) for n, a in tensors.items()})
        jobs = {path: self._pool_().submit(host_fingerprint, plan, tensors) for path, plan in plans.items()}
        fps = {path: job.result() for path, job in jobs.items()}
        self._prepared = (version, fps, time.perf_counter() - t0)

    def host_bytes(self, tensors: Mapping[str, Any], *, aside: bool = False) -> int:
        """Host memory an apply takes beyond the pulled bytes, at most (its mode says
        whether it builds aside, whatever `aside` says): on CPU devices the
        new leaves themselves (host memory; a swap builds all of them aside the old); on
        accelerators the tensors cast to their leaf's dtype (kept to the check in place,
        a window's worth in flight in a swap) and the largest leaf the host assembles
        (grown or fused boxes). A leaf that goes over as its tensor lies takes none."""
        plans = self._plan(shapes_of(tensors.values()))
        inplace = self.mode == "inplace"
        on_cpu, cast, assembled = [], 0, 0
        for plan in plans.values():
            nbytes = sum(box for _, box in device_boxes(plan)) * plan.dtype.itemsize
            if all_on_cpu(plan.sharding):
                on_cpu.append(nbytes)
                continue
            cast += sum(math.prod(p.source) * plan.dtype.itemsize for p in plan.parts if p.source_dtype != p.dtype)
            if self._device_source(plan) is None and (len(plan.parts) > 1 or not plan.parts[0].plain):
                assembled = max(assembled, nbytes)  # boxes the host fills (`leaf_box`), one leaf at a time
        cpu = max(on_cpu, default=0) if inplace else sum(on_cpu)
        return cpu + (cast if inplace else min(cast, self.window_bytes)) + assembled

    def stage(
        self, version: int, tensors: Mapping[str, Any], groups: Sequence[Sequence[tuple[str, np.ndarray]]]
    ) -> bool:
        """Builds every new leaf aside and waits for them to land, where the round swaps
        (the engine serves the old leaves meanwhile); the round stays open, so the apply
        is then `commit_update` alone: the device check, the swap and the refresh. A round
        that would write in place is not opened (False): its apply writes the live leaves."""
        self.begin_update(version, tensors)
        r = self._open()
        if r.mode != "swap":
            self.abort_update()
            return False
        try:
            for group in groups:
                self.apply(group)
            t0 = time.perf_counter()
            jax.block_until_ready(list(r.new.values()))
            r.build_seconds += time.perf_counter() - t0
            r.wait_seconds += time.perf_counter() - t0
        except BaseException:
            self.abort_update()
            raise
        return True

    def begin_update(self, version: int, tensors: Mapping[str, Any]) -> None:
        if self._round is not None:
            raise FailedPrecondition("an update is already open", field="version")
        plans = self._plan(shapes_of(tensors.values()))
        leaves = self.target.leaves()
        by_name = {p.name: path for path, plan in plans.items() for p in plan.parts}
        r = _Round(version, plans, "", by_name, {path: {p.name for p in plan.parts} for path, plan in plans.items()})
        r.hbm_before = _max_stat(_devices(plans.values()), "bytes_in_use")
        r.mode = self._choose_mode(plans)
        r.corrupt_next = bool(self.corrupt_next and self.corrupt_next())
        self._old = {path: leaves[path] for path in plans}
        self._round = r

    def apply(self, group: Sequence[tuple[str, np.ndarray]]) -> None:
        r = self._open()
        for name, arr in group:
            path = r.by_name.get(name)
            if path is None:
                raise KeyError(f"{name!r} is not part of this update")
            part = next(p for p in r.plans[path].parts if p.name == name)
            r.cast[name] = part.cast(arr)
            r.waiting[path].discard(name)
            r.consumed.append(name)
            if not r.waiting[path]:
                self._ready(r, path)
        self._flush(r)  # a group (a layer's worth, as sync hands them) goes over as one

    def commit_update(self, version: int) -> list[str]:
        r = self._open()
        try:
            self._flush(r)
            waiting = sorted(n for names in r.waiting.values() for n in names)
            if waiting:
                raise InternalError(f"version {version}: {len(waiting)} tensor(s) never applied, first {waiting[0]!r}")
            t0 = time.perf_counter()
            jax.block_until_ready(list(r.new.values()))
            r.build_seconds += time.perf_counter() - t0
            r.wait_seconds += time.perf_counter() - t0
            t1 = time.perf_counter()
            bad = self._compare(r, r.checks)
            if bad and r.mode == "inplace":
                bad = self._repair(r, bad)
            fp_seconds = time.perf_counter() - t1
            if bad:
                if r.mode == "inplace":
                    self.torn = True
                    raise DataLoss(
                        f"version {version}: {_mismatch(bad)}, built twice from the host bytes; applied in place, "
                        "the engine holds a mix of versions and must not serve until a version applies whole"
                    )
                raise DataLoss(f"version {version}: {_mismatch(bad)}; the old weights keep serving")
            t2 = time.perf_counter()
            if r.mode == "swap":
                self.target.replace(r.new)
            t3 = time.perf_counter()
            if self.refresh is not None:
                self.refresh()
            t4 = time.perf_counter()
            self.torn = False
            self.verified = (r.version, {path: r.host[path] for path in r.plans},
                             {path: tuple(p.name for p in plan.parts) for path, plan in r.plans.items()})  # fmt: skip
            self.last = self._report(r, fp_seconds, swap=t3 - t2, refresh=t4 - t3,
                                     pause=(t4 - t2) if r.mode == "swap" else (t4 - r.started))  # fmt: skip
            return list(r.consumed)
        except BaseException:
            self._discard(r)
            raise
        finally:
            self._round = None
            self._old = {}

    def abort_update(self) -> None:
        r = self._round
        if r is None:
            return
        self._discard(r)
        if r.mode == "inplace" and r.new:
            self.torn = True
        self._round = None
        self._old = {}

    def last_report(self) -> ApplyReport | None:
        """The last committed apply's report."""
        return self.last

    def close(self) -> None:
        """Stops the fingerprint threads."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    # -- planning ----------------------------------------------------------------------
    def _plan(self, shapes: Mapping[str, tuple[Any, Any]]) -> dict[str, LeafPlan]:
        key = tuple(sorted((n, tuple(s), str(np.dtype(d) if not isinstance(d, str) else d))
                           for n, (s, d) in shapes.items()))  # fmt: skip
        plans = self._plans.get(key)
        if plans is None:
            leaves = {n: a for n, a in self.target.leaves().items() if isinstance(a, jax.Array)}
            plans = self.name_map.plan(shapes, leaves, strict=self.strict)
            self._plans = {key: plans}  # one model: the newest shape set is the one that matters
        return plans

    def _choose_mode(self, plans: Mapping[str, LeafPlan]) -> str:
        if self.mode != "auto":
            return self.mode
        need: dict[Any, int] = collections.Counter()
        for plan in plans.values():
            for dev, box in device_boxes(plan):
                need[dev] += box * plan.dtype.itemsize
        for dev, n in need.items():
            stats = _stats(dev)
            if stats and "bytes_limit" in stats:
                free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
                if free < n + min(self.window_bytes, n) + self.margin_bytes:
                    return "inplace"
        return "swap"

    # -- building ----------------------------------------------------------------------
    def _ready(self, r: _Round, path: str) -> None:
        """A leaf whose tensors are all in: built now, or queued for its group (leaves on
        a mesh checked by a jitted fingerprint: `jax_groups`). A group goes over when the
        next leaf belongs to another layer or it holds half the in-flight window."""
        plan = r.plans[path]
        if not self._grouped(plan):
            self._build(r, path)
            return
        if r.pending:
            first = r.plans[r.pending[0]]
            if _layer(first.path) != _layer(path) or first.sharding.mesh != plan.sharding.mesh:
                self._flush(r)
        r.pending.append(path)
        if sum(r.plans[p].nbytes for p in r.pending) >= self.window_bytes // 2:
            self._flush(r)

    def _grouped(self, plan: LeafPlan) -> bool:
        return self.group and groupable(plan) and self._method_for(plan.sharding) == "jit"

    def _flush(self, r: _Round) -> None:
        """Sends the queued group over and starts its program (`jax_groups.dispatch`)."""
        paths, r.pending = r.pending, []
        if not paths:
            return
        t0 = time.perf_counter()
        leaves = [self._group_leaf(r, path) for path in paths]
        nbytes = sum(r.plans[p].nbytes for p in paths)
        self._wait_inflight(r, nbytes)
        new, checks = jax_groups.dispatch(leaves, donate=r.mode == "inplace")
        r.groups += 1
        r.new.update(new)
        r.checks.update(checks)
        r.inflight.append((nbytes, list(new.values())))
        if r.mode == "inplace":
            self.target.replace(new)  # the group's leaves in one call; the engine does not run until the refresh
            for leaf in leaves:
                if leaf.old is not None and not leaf.old.is_deleted():
                    leaf.old.delete()
        r.build_seconds += time.perf_counter() - t0

    def _group_leaf(self, r: _Round, path: str) -> jax_groups.GroupLeaf:
        """How a queued leaf goes over: its tensor as it lies, transformed by the group's
        program where it needs a transform and its sharding maps onto the tensor's axes;
        the leaf's own bytes where nothing transforms it; built by the host otherwise."""
        plan = r.plans[path]
        cast = self._take(r, path)
        corrupt, r.corrupt_next = r.corrupt_next, False
        old = self._old[path] if r.mode == "inplace" else None
        leaf = jax_groups.GroupLeaf(path, plan, jax_groups.BUILT, old=old)
        p = plan.parts[0]
        source = self._device_source(plan)
        if source is not None:
            src = cast[p.name].reshape(p.split)
            leaf.kind, leaf.src, leaf.src_sharding = jax_groups.TRANSFORM, flipped(src) if corrupt else src, source
            r.transfers.add("device")
        elif len(plan.parts) == 1 and is_identity(p) and not all_on_cpu(plan.sharding):  # (CPU: adopts the bytes)
            src = p.view(cast[p.name])
            leaf.kind, leaf.src, leaf.src_sharding = jax_groups.PUT, flipped(src) if corrupt else src, plan.sharding
            r.transfers.add("host")
        else:
            leaf.leaf = owned(host_build(plan, cast, corrupt), cast.values())
            r.transfers.add("host")
        r.device_bytes += sum(box for _, box in device_boxes(plan)) * plan.dtype.itemsize
        return leaf

    def _take(self, r: _Round, path: str) -> dict[str, np.ndarray]:
        """A complete leaf's cast tensors, taken from the round, and its host fingerprint
        (taken in `prepare`, or computed beside the build); in place they are kept to build
        the leaf again should its device check fail."""
        plan = r.plans[path]
        cast = {p.name: r.cast.pop(p.name) for p in plan.parts}
        prepared = self._prepared
        if prepared is not None and prepared[0] == r.version and path in prepared[1]:
            r.host[path] = prepared[1][path]
        else:
            r.host[path] = self._pool_().submit(host_fingerprint, plan, cast)
        if r.mode == "inplace":
            r.sources[path] = cast  # views of the pulled bytes unless cast: kept until the check
        return cast

    def _wait_inflight(self, r: _Round, nbytes: int) -> None:
        """At most window_bytes (or one leaf or group) in flight: bounds the sharded
        tensors a device transform reads, beside the leaves themselves."""
        t0 = time.perf_counter()
        while r.inflight and sum(n for n, _ in r.inflight) + nbytes > self.window_bytes:
            jax.block_until_ready(r.inflight.popleft()[1])
        r.wait_seconds += time.perf_counter() - t0

    def _build(self, r: _Round, path: str) -> None:
        plan = r.plans[path]
        cast = self._take(r, path)
        corrupt, r.corrupt_next = r.corrupt_next, False
        old = self._old[path]
        t0 = time.perf_counter()
        self._wait_inflight(r, plan.nbytes)
        source = self._device_source(plan)
        if source is not None:
            new = device_build(plan, cast, source, old if r.mode == "inplace" else None, corrupt)
            r.transfers.add("device")
        else:
            new = host_build(plan, cast, corrupt)
            r.transfers.add("host")
        new = owned(new, cast.values())
        r.new[path] = new
        r.device_bytes += sum(box for _, box in device_boxes(plan)) * plan.dtype.itemsize
        if r.mode == "inplace":
            self.target.replace({path: new})
            if not old.is_deleted():
                old.delete()
        r.checks[path] = device_fingerprint(path, new, self._fingerprint_method(new), self._pool_())
        r.inflight.append((plan.nbytes, new))
        r.build_seconds += time.perf_counter() - t0

    def _device_source(self, plan: LeafPlan) -> Any:
        """The sharding the tensor goes over in, for a device transform; None where the
        host builds the leaf (chosen so, a fused leaf, or a sharding that does not map)."""
        if self.transfer == "host" or len(plan.parts) != 1:
            return None
        p = plan.parts[0]
        if self.transfer == "auto" and (all_on_cpu(plan.sharding) or is_identity(p)):  # identity: no device copy
            return None
        return source_sharding(p, plan.sharding)

    def _fingerprint_method(self, arr: Any) -> str:
        return self._method_for(arr.sharding)

    def _method_for(self, sharding: Any) -> str:
        if self.fingerprint != "auto":
            return self.fingerprint
        return "view" if all_on_cpu(sharding) else "jit"

    # -- checking and reporting --------------------------------------------------------
    def _compare(self, r: _Round, checks: Mapping[str, ShardCheck]) -> list[tuple[str, str]]:
        """(leaf path, why) of every leaf in `checks` whose device fingerprint differs from
        the host's."""
        t0 = time.perf_counter()
        host = {path: fp.result() if isinstance(fp, concurrent.futures.Future) else fp for path, fp in r.host.items()}
        r.host.update(host)
        r.host_seconds += time.perf_counter() - t0
        bad = []
        for path, check in checks.items():
            got, problem = check.result()
            want = host[path]
            if problem or got != want:
                bad.append((path, problem or f"device fingerprint {list(got)}, host {list(want)}"))
        return bad

    def _repair(self, r: _Round, bad: list[tuple[str, str]]) -> list[tuple[str, str]]:
        """In place: builds each mismatching leaf once more from the host bytes, over its
        bad copy, and checks it again; returns those that still do not match."""
        checks = {}
        for path, _ in bad:
            plan = r.plans[path]
            new = owned(host_build(plan, r.sources[path], corrupt=False), r.sources[path].values())
            old, r.new[path] = r.new[path], new
            self.target.replace({path: new})
            if not old.is_deleted():
                old.delete()
            checks[path] = device_fingerprint(path, new, self._fingerprint_method(new), self._pool_())
        jax.block_until_ready([r.new[path] for path in checks])
        r.checks.update(checks)
        still = self._compare(r, checks)
        r.repaired = [path for path in checks if path not in dict(still)]
        return still

    def _report(self, r: _Round, fp_seconds: float, *, swap: float, refresh: float, pause: float) -> ApplyReport:
        devices = _devices(r.plans.values())
        prepared = self._prepared
        host_seconds = r.host_seconds + (prepared[2] if prepared is not None and prepared[0] == r.version else 0.0)
        methods = {c: self._fingerprint_method(a) for c, a in r.new.items()}
        return ApplyReport(
            version=r.version,
            mode=r.mode,
            transfer="+".join(sorted(r.transfers)),
            fingerprint="+".join(sorted(set(methods.values()))),
            leaves=len(r.new),
            bytes=sum(plan.nbytes for plan in r.plans.values()),
            device_bytes=r.device_bytes,
            build_seconds=r.build_seconds,
            wait_seconds=r.wait_seconds,
            groups=r.groups,
            fingerprint_seconds=fp_seconds,
            host_fingerprint_seconds=host_seconds,
            swap_seconds=swap,
            refresh_seconds=refresh,
            pause_seconds=pause,
            hbm_before_bytes=r.hbm_before,
            hbm_peak_bytes=_max_stat(devices, "peak_bytes_in_use"),
            hbm_limit_bytes=_max_stat(devices, "bytes_limit"),
            repaired_leaves=tuple(r.repaired),
        )

    # -- plumbing ----------------------------------------------------------------------
    def _open(self) -> _Round:
        if self._round is None:
            raise FailedPrecondition("no update is open (begin_update first)", field="version")
        return self._round

    def _discard(self, r: _Round) -> None:
        if r.mode == "swap":
            for arr in r.new.values():
                if not arr.is_deleted():
                    arr.delete()
        r.new.clear()
        r.pending.clear()
        r.cast.clear()
        r.sources.clear()
        r.inflight.clear()

    def _pool_(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(self._threads, thread_name_prefix="fingerprint")
        return self._pool


def _mismatch(bad: Sequence[tuple[str, str]]) -> str:
    path, why = bad[0]
    more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
    return f"leaf {path!r} on the device does not match the verified bytes ({why}){more}"


def _layer(path: str) -> str:
    """The layer a leaf path belongs to (`...layers.N`), or "" outside the layers."""
    m = _LAYER_RE.match(path)
    return m.group(1) if m else ""


def _devices(plans: Any) -> list[Any]:
    seen: dict[Any, None] = {}
    for plan in plans:
        for dev in plan.sharding.addressable_devices:
            seen[dev] = None
    return list(seen)


def _stats(dev: Any) -> dict[str, int] | None:
    try:
        return dev.memory_stats()  # type: ignore[no-any-return]
    except Exception:  # noqa: BLE001 - a backend without memory stats
        return None


def _max_stat(devices: Sequence[Any], key: str) -> int | None:
    values = [s[key] for s in (_stats(d) for d in devices) if s and key in s]
    return max(values) if values else None
