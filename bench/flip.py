"""Flip benchmark: the skew of an atomic flip across a fleet, and what atomic costs against
independent from publish to COMMITTED, in the same run (docs/design.md "Atomic flips").

One coordinator, `--rollouts` rollout sidecars (`--engine` numpy or jax, `--mode` shm by
default) and a publisher in this process, one session. Rounds alternate the session's
flip policy (independent, atomic, independent, ...: the trainer opens it again as the
same incarnation with the other policy, which holds from the next version), so drift hits
both sides alike. Each round publishes a new version of a Qwen3-shaped bf16 model
(`--preset`) and waits for COMMITTED; after one warm-up round per policy, `--rounds`
rounds per policy are measured.

Per policy: publish -> COMMITTED seconds (median, and each round), the flip skew the
coordinator recorded (first to last rollout serving the version, by their own clocks:
p50, p99, max) and the slowest engine pause. `atomic_over_independent` is the median of
the per-pair ratios of publish -> COMMITTED. Targets: atomic skew p99 < 50 ms
and the ratio <= 1.10.

    python bench/flip.py --rollouts 16 --preset 0.6b --engine numpy --json --out docs/figures/flip-16.json
    python bench/flip.py --rollouts 4 --preset tiny --rounds 3          # a quick look
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import numpy as np  # noqa: E402
from common import emit_json, model  # noqa: E402

from devtools.cluster import Cluster  # noqa: E402
from trainer_agent.publish.publisher import WeightPublisher  # noqa: E402
from trainer_agent.settings import PublisherSettings  # noqa: E402
from weightsync._proto import types_pb2 as tpb  # noqa: E402

SESSION = "flip"
INCARNATION = "bench-flip"
POLICIES = ("independent", "atomic")
SKEW_TARGET_S = 0.050
COST_TARGET = 1.10


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (nearest rank) of `values`."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))]


def run(args: argparse.Namespace) -> dict[str, Any]:
    params = model(args.preset)
    odd = {name: (a.view(np.uint16) ^ np.uint16(1)).view(a.dtype) for name, a in params.items()}
    with tempfile.TemporaryDirectory(prefix="wsbench-flip-") as tmp, Cluster(tmp) as cluster:
        coord = cluster.start_coordinator()
        engine = ["--engine", args.engine] + (["--jax-preset", args.preset] if args.engine == "jax" else [])
        rollout_args = ["--weight-sync-mode", args.mode, "--audit-interval-s", "0", *engine]
        procs = [
            cluster.start_rollout(f"r{i}", coord.address, SESSION, rollout_args, wait=False)
            for i in range(args.rollouts)
        ]
        for p in procs:
            cluster.wait_ready(p, timeout_s=300)
        settings = PublisherSettings(
            coordinator=coord.address, session=SESSION, incarnation=INCARNATION, weight_sync_mode=args.mode,
            min_rollouts=args.rollouts, slots=3, slot_wait_s=300,
        )  # fmt: skip
        rounds: dict[str, list[dict[str, float]]] = {p: [] for p in POLICIES}
        with WeightPublisher(settings) as pub:
            client = pub.client
            deadline = time.monotonic() + 120
            while sum(a.alive for a in client.status(SESSION).agents if a.role == tpb.ROLLOUT) < args.rollouts:
                if time.monotonic() > deadline:
                    raise TimeoutError("the rollouts did not all register")
                time.sleep(0.2)
            version = 0
            for i in range(args.rounds + 1):
                for policy in POLICIES:
                    client.open_session(SESSION, trainer=True, incarnation=INCARNATION, flip_policy=policy)
                    version += 1
                    weights = odd if version % 2 else params  # each version differs from the one before
                    t = time.perf_counter()
                    pub.publish(weights, version)
                    v = client.wait_for_version(SESSION, version, timeout_s=600)
                    seconds = time.perf_counter() - t
                    if tpb.VersionState.Name(v.state) != "COMMITTED":
                        raise RuntimeError(
                            f"version {version} ({policy}) ended {tpb.VersionState.Name(v.state)}: {v.reason}"
                        )
                    st = client.status(SESSION, 2)
                    v = next(x for x in st.versions if x.version == version)
                    pause = max(h.timings.pause_seconds for h in st.handshakes if h.version == version)
                    if i > 0:  # the first round of each policy warms up
                        rounds[policy].append({"seconds": seconds, "skew_s": v.flip_skew_seconds, "pause_s": pause})
    result: dict[str, Any] = {
        "rollouts": args.rollouts, "preset": args.preset, "engine": args.engine, "mode": args.mode,
        "rounds": args.rounds, "model_bytes": sum(a.nbytes for a in params.values()),
    }  # fmt: skip
    for policy, rs in rounds.items():
        skews = [r["skew_s"] for r in rs]
        result[policy] = {
            "publish_to_committed_s": statistics.median(r["seconds"] for r in rs),
            "skew_p50_s": percentile(skews, 50),
            "skew_p99_s": percentile(skews, 99),
            "skew_max_s": max(skews),
            "pause_max_s": max(r["pause_s"] for r in rs),
            "rounds": rs,
        }
    ratio = statistics.median(a["seconds"] / b["seconds"] for a, b in zip(rounds["atomic"], rounds["independent"]))
    result["atomic_over_independent"] = ratio
    result["targets"] = {
        "atomic_skew_p99_below_50ms": "MET" if result["atomic"]["skew_p99_s"] < SKEW_TARGET_S else "MISS",
        "atomic_cost_at_most_10pct": "MET" if ratio <= COST_TARGET else "MISS",
    }
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rollouts", type=int, default=16)
    ap.add_argument("--preset", default="0.6b")
    ap.add_argument("--engine", choices=["numpy", "jax"], default="numpy")
    ap.add_argument("--mode", default="shm")
    ap.add_argument("--rounds", type=int, default=10, help="measured rounds per policy, after one warm-up each")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", default="", help="also write the JSON here")
    args = ap.parse_args()
    result = run(args)
    if args.json or args.out:
        emit_json(result, args.out)
    else:
        for policy in POLICIES:
            r = result[policy]
            print(
                f"{policy:12s} publish->COMMITTED {r['publish_to_committed_s']:.3f} s  "
                f"skew p50 {r['skew_p50_s'] * 1e3:.1f} ms p99 {r['skew_p99_s'] * 1e3:.1f} ms  "
                f"pause {r['pause_max_s'] * 1e3:.1f} ms"
            )
        print(f"atomic / independent {result['atomic_over_independent']:.3f}  {result['targets']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
