"""Apply benchmark: a preset Qwen3 version into an engine's sharded jax.Arrays, against a
plain device_put of the same bytes into the same shardings, measured in the same run.

The version's tensors are views of one receive buffer, aligned as a puller's, so the
apply meets the bytes as a rollout does.

The engine holds the model in tpu-inference's layout (`--layout`), sharded over a
("data", "model") mesh (`--mesh`, `--profile`); the version is the preset's HF-named bf16
tensors on the host. Each round runs the bound (every leaf's final bytes, already laid
out, `device_put` into its sharding, the same in-flight window, each freed as it lands)
and an apply (`JaxApply`: build, fingerprint check, swap, refresh), alternating
(ABAB...); medians are reported, with each side's CPU seconds (all threads: on a shared
machine the wall clock also measures the neighbours). `ratio` is the bound's time over
the whole apply's (the device check and the swap included), `transfer_ratio` over the
leaf builds' alone. The host fingerprints run before the apply's clock
starts, as a rollout takes them in its prefetch right after the digest check
(`host_fingerprint_seconds`). The first apply, before any timed round, gives the HBM
high-water mark (memory_stats is a process-lifetime peak: the bound's rounds would hide
it). Then every leaf is read back and compared bit for bit with the NumPy reference, and
one more version, with a bit flipped on its way to the device, must be caught
(`corrupt_caught`): refused with the old leaves still serving in swap mode; in place, the
damaged leaf built again from the host bytes and the version then exact.

    python bench/apply.py --devices 8 --mesh 2x4 --json        # 8 CPU devices
    python bench/apply.py --preset 0.6b --json                 # a TPU host: JAX's default platform
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
if "--devices" in sys.argv:  # XLA reads the device count once, at import
    n = sys.argv[sys.argv.index("--devices") + 1]
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={n}"
    os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import numpy as np  # noqa: E402
from common import model  # noqa: E402

from devtools.receive_buffer import as_received  # noqa: E402
from rollout_agent.engines.jax.apply import JaxApply  # noqa: E402
from rollout_agent.engines.jax.build import owned  # noqa: E402
from rollout_agent.engines.jax.model import PROFILES, empty_leaves, family_map, mesh_of  # noqa: E402
from rollout_agent.engines.jax.names import reference_leaf  # noqa: E402
from rollout_agent.engines.jax.targets import WeightsHolder  # noqa: E402
from weightsync.errors import DataLoss  # noqa: E402
from weightsync.model_shapes import PRESETS  # noqa: E402


class Spec:
    """A manifest TensorSpec's fields, without the manifest module (a bare JAX host has
    no xxhash)."""

    def __init__(self, name: str, shape: tuple[int, ...]) -> None:
        self.name, self.shape, self.dtype = name, shape, "bfloat16"


def bound_round(refs: dict[str, np.ndarray], shardings: dict[str, object], window: int) -> float:
    """Every leaf's final bytes device_put into its sharding, `window` bytes in flight,
    each freed once it landed (so the bound needs no second copy of the model)."""
    t0 = time.perf_counter()
    inflight: list[tuple[int, jax.Array]] = []
    for path, ref in refs.items():
        # owned: a copy, as the apply must make one (a CPU device may adopt the host array)
        inflight.append((ref.nbytes, owned(jax.device_put(ref, shardings[path], may_alias=False), [ref])))
        while sum(n for n, _ in inflight) > window and len(inflight) > 1:
            arr = inflight.pop(0)[1]
            arr.block_until_ready()
            arr.delete()
    for _, arr in inflight:
        arr.block_until_ready()
    elapsed = time.perf_counter() - t0
    for _, arr in inflight:
        arr.delete()
    return elapsed


def apply_once(applier: JaxApply, version: int, tensors: dict[str, np.ndarray], specs: dict[str, Spec]) -> float:
    applier.prepare(version, tensors)  # a rollout's prefetch does this, off the apply
    t0 = time.perf_counter()
    applier.begin_update(version, specs)
    try:
        applier.apply(list(tensors.items()))
    except Exception:
        applier.abort_update()
        raise
    applier.commit_update(version)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="medium", choices=sorted(PRESETS))
    ap.add_argument("--devices", type=int, default=0, help="CPU devices (XLA's host platform); 0: JAX's default")
    ap.add_argument("--mesh", default="", help="data x model, e.g. 2x4 (default 1 x every device)")
    ap.add_argument("--profile", default="tpu_inference", choices=sorted(PROFILES), help="which axes are sharded")
    ap.add_argument("--layout", default="tpu_inference", choices=["tpu_inference", "hf"])
    ap.add_argument("--mode", default="auto", choices=["auto", "swap", "inplace"])
    ap.add_argument("--transfer", default="auto", choices=["auto", "host", "device"])
    ap.add_argument("--fingerprint", default="auto", choices=["auto", "jit", "view"])
    ap.add_argument("--repeats", type=int, default=5, help="timed rounds (each a bound and an apply)")
    ap.add_argument("--window-mib", type=int, default=256, help="leaf bytes in flight, apply and bound alike")
    ap.add_argument(
        "--no-group",
        action="store_true",
        help="a transfer, a transform and a fingerprint program per leaf, not a layer's leaves at once",
    )
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)

    devices = jax.devices()
    rows, cols = (int(x) for x in args.mesh.split("x")) if args.mesh else (1, len(devices))
    mesh = mesh_of((rows, cols), devices)
    shape = PRESETS[args.preset]
    name_map = family_map("qwen3", args.layout, shape)
    _, tensors = as_received(model(args.preset))  # where a rollout's puller leaves them
    specs = {n: Spec(n, a.shape) for n, a in tensors.items()}
    holder = WeightsHolder(empty_leaves(name_map, shape, shape.layers, shape.tied, mesh, PROFILES[args.profile]))
    window = args.window_mib << 20
    refreshed: list[int] = []
    applier = JaxApply(
        holder, name_map, mode=args.mode, transfer=args.transfer, fingerprint=args.fingerprint,
        refresh=lambda: refreshed.append(len(jax.tree_util.tree_leaves(holder.get()))), window_bytes=window,
        group=not args.no_group,
    )  # fmt: skip
    plans = applier._plan({n: (s.shape, s.dtype) for n, s in specs.items()})
    refs = {path: reference_leaf(plan, tensors) for path, plan in plans.items()}
    shardings = {path: plan.sharding for path, plan in plans.items()}
    model_bytes = sum(plan.nbytes for plan in plans.values())
    largest = max(plan.nbytes for plan in plans.values())

    version = 1
    first = apply_once(applier, version, tensors, specs)  # compiles; its HBM peak is the apply's own
    report = applier.last
    assert report is not None
    hbm_peak = report.hbm_peak_bytes
    bounds, applies, pauses, host_fps, builds, waits = [], [], [], [], [], []
    cpu = {"bound": 0.0, "apply": 0.0}  # CPU seconds of every thread: what a busy machine cannot skew
    for _ in range(args.repeats):
        version += 1
        c0 = time.process_time()
        bounds.append(bound_round(refs, shardings, window))
        c1 = time.process_time()
        applies.append(apply_once(applier, version, tensors, specs))
        c2 = time.process_time()
        cpu["bound"] += c1 - c0
        cpu["apply"] += c2 - c1
        assert applier.last is not None
        pauses.append(applier.last.pause_seconds or 0.0)
        host_fps.append(applier.last.host_fingerprint_seconds)
        builds.append(applier.last.build_seconds)
        waits.append(applier.last.wait_seconds)
    report = applier.last

    def exact() -> bool:
        got = holder.get()
        return all(np.array_equal(np.asarray(got[path]).view(np.uint8), refs[path].view(np.uint8)) for path in plans)

    bit_exact = exact()
    # one more version, a bit flipped on its way to the device, after the host fingerprint:
    # swap refuses it with the old leaves serving on; in place builds the leaf again from
    # the host bytes, and the version must then serve whole and exact
    before = holder.get()
    applier.corrupt_next = lambda: True
    repaired: tuple[str, ...] = ()
    try:
        apply_once(applier, version + 1, tensors, specs)
        assert applier.last is not None
        repaired = applier.last.repaired_leaves
        corrupt_caught = applier.last.mode == "inplace" and len(repaired) == 1 and exact()
    except DataLoss:
        corrupt_caught = report.mode == "swap" and all(holder.get()[p] is before[p] for p in plans)
    applier.corrupt_next = None

    bound_s, apply_s = statistics.median(bounds), statistics.median(applies)
    mode = report.mode
    budget = 2 * model_bytes + (256 << 20) if mode == "swap" else model_bytes + largest + (256 << 20)
    out = {
        "preset": args.preset,
        "platform": devices[0].platform,
        "devices": len(devices),
        "mesh": f"{rows}x{cols}",
        "profile": args.profile,
        "layout": args.layout,
        "mode": mode,
        "transfer": report.transfer,
        "fingerprint": report.fingerprint,
        "leaves": report.leaves,
        "bytes": model_bytes,
        "device_bytes": report.device_bytes,
        "apply_seconds": apply_s,
        "gbps": model_bytes / apply_s / 1e9,
        "device_put_bound_seconds": bound_s,
        "device_put_bound_gbps": model_bytes / bound_s / 1e9,
        "ratio": bound_s / apply_s,
        "build_seconds": statistics.median(builds),
        "transfer_ratio": bound_s / statistics.median(builds),
        "wait_seconds": statistics.median(waits),  # of build_seconds: waiting on transfers (the rest dispatches)
        "groups": report.groups,
        "fingerprint_seconds": report.fingerprint_seconds,
        "host_fingerprint_seconds": statistics.median(host_fps),
        "pause_seconds": statistics.median(pauses),
        "bound_cpu_seconds": cpu["bound"] / args.repeats,
        "apply_cpu_seconds": cpu["apply"] / args.repeats,  # the host fingerprints (prepare) included
        "first_apply_seconds": first,
        "hbm_peak_bytes": hbm_peak,
        "hbm_before_bytes": report.hbm_before_bytes,
        "hbm_limit_bytes": report.hbm_limit_bytes,
        "hbm_budget_bytes": budget,
        "hbm_ok": None if hbm_peak is None else hbm_peak <= budget,
        "largest_leaf_bytes": largest,
        "bit_exact": bit_exact,
        "fingerprint_ok": True,  # every apply above passed its device check (a mismatch raises)
        "corrupt_caught": corrupt_caught,
        "repaired_leaves": list(repaired),
        "repeats": args.repeats,
        "rounds": [{"bound_seconds": b, "apply_seconds": a} for b, a in zip(bounds, applies)],
    }
    applier.close()
    if args.json:
        print(json.dumps(out))
    else:
        for key, value in out.items():
            if key != "rounds":
                print(f"{key:26s} {value}")
    return 0 if bit_exact and corrupt_caught else 1


if __name__ == "__main__":
    sys.exit(main())
