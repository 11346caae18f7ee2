"""Audit benchmark: the audit of a preset's live weights against the apply of the same
version, in the same run, for a JAX engine (its leaves fingerprinted on their devices)
and the NumPy engine (its arrays fingerprinted on the host).

Per engine: one apply to compile and warm, then `--repeats` rounds of an apply of a new
version and `--audits` audits of it; medians are reported, with each side's CPU seconds
(all threads). `audit_over_apply` is the audit's median over the apply's;
`share_at_default_interval` the audit's share of the engine's time at the sidecar's
default `--audit-interval-s` (60 s; the auditor also waits 100 audits' time between two).
Every audit must be exact, and two faults written into the live weights afterwards (one
bit of one leaf flipped, a whole leaf overwritten: through a CPU device's own buffer, or
as a leaf rebuilt on the accelerator) must each be named (`faults_caught`).

It imports only JAX, NumPy, ml_dtypes and weightsync's pure modules, so it runs on a bare
TPU host from a checkout; the NumPy engine needs the package's dependencies (its applier
copies with the native shim) and is skipped where they are missing (`numpy.skipped`).

    python bench/audit.py --devices 8 --mesh 2x4 --preset 0.6b --json   # 8 CPU devices
    python bench/audit.py --preset 0.6b --json                          # a TPU host: JAX's default platform
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
# isort: off
# first: the apply bench's import sets XLA's CPU device count from --devices before JAX loads
from apply import Spec, apply_once  # noqa: E402

# isort: on
import jax  # noqa: E402
import numpy as np  # noqa: E402
from common import model  # noqa: E402

from devtools.receive_buffer import as_received  # noqa: E402
from rollout_agent.engines.audit_reading import AuditReading  # noqa: E402
from rollout_agent.engines.jax.audit import JaxAudit  # noqa: E402
from rollout_agent.engines.jax.model import PROFILES, empty_leaves, family_map, mesh_of  # noqa: E402
from rollout_agent.engines.jax.targets import WeightsHolder  # noqa: E402
from weightsync.model_shapes import PRESETS  # noqa: E402

DEFAULT_INTERVAL_S = 60.0  # the sidecar's --audit-interval-s


def measure(
    applier: Any, audit: Callable[[], AuditReading], tensors: dict[str, np.ndarray], repeats: int, audits: int
) -> dict[str, Any]:
    """Apply then audit, `repeats` rounds (after a warm one): medians, CPU seconds, and
    whether every audit was exact and of the version just applied."""
    specs = {n: Spec(n, a.shape) for n, a in tensors.items()}
    apply_once(applier, 1, tensors, specs)
    audit()  # compiles (jit) and warms
    applies, audit_times, exact = [], [], True
    cpu = {"apply": 0.0, "audit": 0.0}
    for version in range(2, repeats + 2):
        c0 = time.process_time()
        applies.append(apply_once(applier, version, tensors, specs))
        c1 = time.process_time()
        for _ in range(audits):
            t0 = time.perf_counter()
            found = audit()
            audit_times.append(time.perf_counter() - t0)
            exact &= found.exact and found.version == version and found.compared == len(tensors)
        cpu["apply"] += c1 - c0
        cpu["audit"] += time.process_time() - c1
    apply_s, audit_s = statistics.median(applies), statistics.median(audit_times)
    return {
        "apply_seconds": apply_s,
        "audit_seconds": audit_s,
        "audit_seconds_min": min(audit_times),
        "audit_over_apply": audit_s / apply_s,
        "share_at_default_interval": audit_s / max(DEFAULT_INTERVAL_S, 100 * audit_s),
        "apply_cpu_seconds": cpu["apply"] / repeats,
        "audit_cpu_seconds": cpu["audit"] / (repeats * audits),
        "audits_exact": exact,
        "audits": repeats * audits,
    }


def faults_caught(inject: Callable[[str], str], audit: Callable[[], AuditReading]) -> bool:
    """A flipped bit, then a whole tensor overwritten: each named by the next audit."""
    flipped = inject("flip")
    first = set(audit().mismatched)
    overwritten = inject("overwrite")
    return first == {flipped} and set(audit().mismatched) == {flipped, overwritten}


def jax_engine(args: argparse.Namespace, tensors: dict[str, np.ndarray]) -> dict[str, Any]:
    devices = jax.devices()
    rows, cols = (int(x) for x in args.mesh.split("x")) if args.mesh else (1, len(devices))
    shape = PRESETS[args.preset]
    name_map = family_map("qwen3", "tpu_inference", shape)
    mesh = mesh_of((rows, cols), devices)
    leaves = empty_leaves(name_map, shape, shape.layers, shape.tied, mesh, PROFILES["tpu_inference"])
    applier = JaxAudit(WeightsHolder(leaves), name_map, mode=args.mode)
    out = measure(applier, applier.audit, tensors, args.repeats, args.audits)
    assert applier.last is not None
    out.update(
        platform=devices[0].platform, devices=len(devices), mesh=f"{rows}x{cols}", mode=applier.last.mode,
        fingerprint=applier.audit().method, faults_caught=faults_caught(applier.inject, applier.audit),
    )  # fmt: skip
    applier.close()
    return out


def numpy_engine(args: argparse.Namespace, tensors: dict[str, np.ndarray]) -> dict[str, Any]:
    try:
        from rollout_agent.engines.dict_applier import DictApplier
    except ImportError as e:  # a bare host: no xxhash for the native shim's module
        return {"skipped": f"{type(e).__name__}: {e}"}
    applier = DictApplier()
    out = measure(applier, applier.audit, tensors, args.repeats, args.audits)
    out["faults_caught"] = faults_caught(applier.inject, applier.audit)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="0.6b", choices=sorted(PRESETS))
    ap.add_argument("--devices", type=int, default=0, help="CPU devices (XLA's host platform); 0: JAX's default")
    ap.add_argument("--mesh", default="", help="data x model, e.g. 2x4 (default 1 x every device)")
    ap.add_argument("--mode", default="auto", choices=["auto", "swap", "inplace"])
    ap.add_argument("--repeats", type=int, default=3, help="timed rounds: an apply and --audits audits each")
    ap.add_argument("--audits", type=int, default=5)
    ap.add_argument("--engines", default="jax,numpy", help="comma-separated: jax, numpy")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)

    _, tensors = as_received(model(args.preset))  # where a rollout's puller leaves them
    out: dict[str, Any] = {"preset": args.preset, "bytes": sum(a.nbytes for a in tensors.values())}
    engines = set(args.engines.split(","))
    if "jax" in engines:
        out["jax"] = jax_engine(args, tensors)
    if "numpy" in engines:
        out["numpy"] = numpy_engine(args, tensors)
    if args.json:
        print(json.dumps(out))
    else:
        for engine in ("jax", "numpy"):
            if engine in out:
                print(engine, json.dumps(out[engine], indent=1))
    ok = all(r.get("skipped") or (r["audits_exact"] and r["faults_caught"]) for k, r in out.items() if k in engines)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
