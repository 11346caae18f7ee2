"""JAX applies over a mesh of CPU devices, in a process of its own: XLA fixes the device
count when JAX starts, and the suite's JAX has one device. Run by test_jax_mesh.py:

    python tests/unit/jax_mesh_worker.py '{"devices": 8, "mesh": [2, 4], "cases": [...]}'

Each case (layout, profile, transfer, mode) applies two versions of a tiny Qwen3 into
zero leaves sharded by the profile (the second from one aligned buffer, overwritten right
after, as the next pull would), then checks every device's shard of every leaf
against the NumPy reference of its slice; "corrupt" cases flip a bit on its way to the
device and expect the version refused with the old leaves serving. Prints one JSON line:
case name -> what it found.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

SPEC = json.loads(sys.argv[1])
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={SPEC['devices']}"
os.environ["JAX_PLATFORMS"] = SPEC.get("platforms", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import jax  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402

from devtools.receive_buffer import as_received  # noqa: E402
from rollout_agent.engines.jax.apply import JaxApply  # noqa: E402
from rollout_agent.engines.jax.model import PROFILES, empty_leaves, family_map, mesh_of  # noqa: E402
from rollout_agent.engines.jax.names import reference_leaf  # noqa: E402
from rollout_agent.engines.jax.targets import WeightsHolder  # noqa: E402
from weightsync.errors import DataLoss  # noqa: E402
from weightsync.model_shapes import ModelShape, param_shapes  # noqa: E402

# 4 query heads, 2 KV heads: below a model axis of 4 or 8 they are repeated; head_dim 32
# is padded to 128; every other axis divides by 8.
SHAPE = ModelShape(64, 2, 4, 2, 32, 128, 256, tied=False)


class Spec:
    def __init__(self, name: str, shape: tuple[int, ...]) -> None:
        self.name, self.shape, self.dtype = name, shape, "bfloat16"


def version(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {n: rng.standard_normal(s, dtype=np.float32).astype(ml_dtypes.bfloat16)
            for n, s in param_shapes(SHAPE).items()}  # fmt: skip


def apply(applier: JaxApply, v: int, tensors: dict[str, np.ndarray]) -> None:
    specs = {n: Spec(n, a.shape) for n, a in tensors.items()}
    applier.prepare(v, tensors)
    applier.begin_update(v, specs)
    applier.apply(list(tensors.items()))
    applier.commit_update(v)


def mismatches(
    holder: WeightsHolder, leaves: dict[str, Any], plans: dict[str, Any], tensors: dict[str, np.ndarray]
) -> list[str]:
    """Each leaf whose sharding or any device's shard differs from the reference."""
    tree = holder.get()
    wrong = []
    for path, plan in plans.items():
        ref = reference_leaf(plan, tensors)
        arr = tree[path]
        if arr.sharding != leaves[path].sharding:
            wrong.append(f"{path}: sharding {arr.sharding}")
        for shard in arr.addressable_shards:
            if not np.array_equal(np.asarray(shard.data).view(np.uint8), ref[shard.index].view(np.uint8)):
                wrong.append(f"{path} on {shard.device}")
    return wrong


def run(case: dict[str, Any], mesh: Any) -> dict[str, Any]:
    name_map = family_map("qwen3", case["layout"], SHAPE)
    leaves = empty_leaves(name_map, SHAPE, SHAPE.layers, SHAPE.tied, mesh, PROFILES[case["profile"]])
    holder = WeightsHolder(leaves)
    applier = JaxApply(holder, name_map, mode=case["mode"], transfer=case["transfer"],
                       fingerprint=case.get("fingerprint", "auto"))  # fmt: skip
    out: dict[str, Any] = {"sharded_leaves": sum(1 for a in leaves.values() if not a.sharding.is_fully_replicated)}
    apply(applier, 1, version(1))
    tensors = version(2)
    received, views = as_received(tensors)  # where a puller's bytes land
    apply(applier, 2, views)
    received[:] = 0xFF  # the next pull: the engine's leaves must not change with it
    plans = applier._plan({n: (a.shape, "bfloat16") for n, a in tensors.items()})
    out["wrong"] = mismatches(holder, leaves, plans, tensors)
    out["leaves"] = len(plans)
    report = applier.last_report()
    assert report is not None
    out.update(transfer=report.transfer, fingerprint=report.fingerprint, mode=report.mode, groups=report.groups)
    if case.get("corrupt"):
        served = holder.get()
        applier.corrupt_next = lambda: True
        try:
            apply(applier, 3, version(3))
        except DataLoss as e:
            # swap: refused, the old leaves serve on
            out["corrupt_caught"] = "does not match the verified bytes" in e.message and holder.get() is served
        else:
            # in place: the damaged leaf built again from the host bytes; the version exact
            report = applier.last_report()
            repaired = report is not None and report.version == 3 and len(report.repaired_leaves) == 1
            out["corrupt_caught"] = case["mode"] == "inplace" and repaired
            out["wrong"] += mismatches(holder, leaves, plans, version(3))
    applier.close()
    return out


def main() -> int:
    mesh = mesh_of(tuple(SPEC["mesh"]), jax.devices())
    results = {}
    for case in SPEC["cases"]:
        key = "/".join(str(case[k]) for k in ("layout", "profile", "transfer", "mode"))
        t0 = time.perf_counter()
        results[key] = run(case, mesh)
        results[key]["seconds"] = time.perf_counter() - t0
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
