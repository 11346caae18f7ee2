"""Host pull (`make bench-host-pull`): N rollout processes on one host, one pull per host.

Everything listens on unix sockets in a private directory, so it runs where no inet
socket exists (a TPU host, `unshare -n`): a coordinator, N rollout sidecars (`--engine
numpy --follow false`) and the trainer in this process (grpc: the only way to reach it
over a unix socket), publishing a `--size` model (bf16) once per round. Two phases, in
one run:
- `separate`: every rollout pulls each version from the trainer (N pulls per host); the
  N syncs run at once, as following rollouts would.
- `host`: `--weight-sync-mode relay --relay-host unix:DIR`: the host's puller (the first
  relay of the host in the chain) pulls each version; then each other rollout syncs alone,
  mapping the puller's buffers and copying and checking every chunk into its own.
Per phase: the trainer's bytes served per version over the version's bytes
(`egress_ratio`), and every rollout's pull seconds (median over rounds, from the syncs'
timings). The bound, measured in this run just before each reader's pull: a warm memcpy
of the model's bytes over as many threads as a reader copies with (`memcpy_seconds`,
median of 3); `reader_ratio_to_memcpy` is the median over rounds of that bound over the
reader's pull seconds (1.0: as fast as a local copy of the same bytes; its pull also
hashes them and asks the host's puller where they lie). Prints one JSON object; exits 1
when a sync fails (a byte that did not verify included).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import model  # noqa: E402

from devtools.cluster import Cluster  # noqa: E402
from rollout_agent.settings import SyncSettings  # noqa: E402
from trainer_agent.publish.publisher import WeightPublisher  # noqa: E402
from trainer_agent.settings import PublisherSettings  # noqa: E402
from weightsync._proto import rollout_agent_pb2 as rpb  # noqa: E402
from weightsync._proto import rollout_agent_pb2_grpc as rpb_grpc  # noqa: E402
from weightsync.model_shapes import PRESETS  # noqa: E402

SESSION = "hostpull"
NO_METRICS = ["--metrics-port", "-1"]
LANES = SyncSettings.streams  # a rollout's lanes per trainer rank: its copying threads


class Memcpy:
    """A warm copy of `nbytes` split over `threads` threads (a reader copies with one
    thread per lane; NumPy releases the GIL)."""

    def __init__(self, nbytes: int, threads: int) -> None:
        self.src, self.dst = np.ones(nbytes, np.uint8), np.zeros(nbytes, np.uint8)
        cuts = np.linspace(0, nbytes, threads + 1, dtype=np.int64)
        self.pieces = [(self.dst[a:b], self.src[a:b]) for a, b in zip(cuts[:-1], cuts[1:])]
        self.pool = ThreadPoolExecutor(threads)
        self.seconds(1)  # populates the destination

    def seconds(self, reps: int = 3) -> float:
        """Median wall seconds of `reps` copies."""
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            list(self.pool.map(lambda pair: np.copyto(*pair), self.pieces))
            times.append(time.perf_counter() - t0)
        return statistics.median(times)


def served(pub: WeightPublisher) -> float:
    """Chunk bytes the trainer has served (every transport)."""
    labels = {"role": "trainer", "direction": "served"}
    return pub.metrics.registry.get_sample_value("weightsync_transfer_bytes_total", labels) or 0.0


def sync(address: str, version: int) -> rpb.SyncResponse:
    with grpc.insecure_channel(address) as channel:
        reply = rpb_grpc.RolloutAgentStub(channel).Sync(rpb.SyncRequest(version=version), timeout=600)
    if not reply.ok:
        raise SystemExit(f"{address}: version {version} failed: {reply.mismatch}")
    return reply


def run_phase(phase: str, args: argparse.Namespace, tmp: Path, memcpy: Memcpy) -> dict:
    """One phase's rollouts, trainer and rounds; its row. In the host phase the bound is
    timed again just before each reader's pull (this machine's speed drifts)."""
    sockets = tmp / phase
    sockets.mkdir()
    mode = ["--weight-sync-mode", "grpc"]
    if phase == "host":
        mode = ["--weight-sync-mode", "relay", "--relay-host", f"unix:{sockets}"]
    with Cluster(tmp / f"{phase}-cluster") as cluster:
        coord = cluster.start_coordinator(host=f"unix:{sockets}/c.sock", args=NO_METRICS)
        names = [f"r{i}" for i in range(args.rollouts)]  # chain order: r0 is the host's puller
        rollouts = [
            cluster.start_rollout(
                n, coord.address, SESSION, ["--host", f"unix:{sockets}/{n}.sock", *NO_METRICS, "--follow=false", *mode]
            )
            for n in names
        ]
        settings = PublisherSettings(
            coordinator=coord.address, session=SESSION, host=f"unix:{sockets}/t.sock", weight_sync_mode="grpc"
        )
        pulls: dict[str, list[float]] = {n: [] for n in names}
        bounds: dict[str, list[float]] = {n: [] for n in names[1:]}
        egress = []
        with WeightPublisher(settings) as pub, ThreadPoolExecutor(args.rollouts) as pool:
            for version in range(1, args.rounds + 1):
                total = pub.publish(model(args.size, seed=version), version).total_bytes
                before = served(pub)
                if phase == "separate":
                    replies = list(pool.map(sync, [p.address for p in rollouts], [version] * len(rollouts)))
                else:  # the host's puller, then each reader alone: its pull is its own work
                    replies = [sync(rollouts[0].address, version)]
                    for name, proc in zip(names[1:], rollouts[1:]):
                        bounds[name].append(memcpy.seconds())
                        replies.append(sync(proc.address, version))
                egress.append((served(pub) - before) / total)
                for n, reply in zip(names, replies):
                    pulls[n].append(reply.timings.pull_seconds)
                pub.wait_committed(version, timeout_s=120)
        row = {
            "phase": phase,
            "rollouts": args.rollouts,
            "version_bytes": total,
            "egress_ratio": [round(e, 3) for e in egress],
            "pull_seconds": {n: round(statistics.median(p), 4) for n, p in pulls.items()},
        }
        if phase == "host":
            row["memcpy_seconds"] = {n: round(statistics.median(b), 4) for n, b in bounds.items()}
            row["reader_ratio_to_memcpy"] = {
                n: round(statistics.median(b / s for b, s in zip(bounds[n], pulls[n])), 3) for n in bounds
            }
        return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="medium", choices=sorted(PRESETS), help="model shape (bf16)")
    p.add_argument("--rollouts", type=int, default=4, help="rollout processes on this host (>= 2)")
    p.add_argument("--rounds", type=int, default=3, help="versions per phase")
    args = p.parse_args(argv)
    if args.rollouts < 2 or args.rounds < 1:
        p.error("--rollouts must be at least 2 and --rounds at least 1")
    tmp = Path(tempfile.mkdtemp(prefix="ws-hp-"))  # short: socket paths fit sun_path
    try:
        nbytes = sum(a.nbytes for a in model(args.size).values())
        memcpy = Memcpy(nbytes, LANES)
        rows = [run_phase(phase, args, tmp, memcpy) for phase in ("separate", "host")]
        memcpy.pool.shutdown()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps({"size": args.size, "model_bytes": nbytes, "memcpy_threads": LANES, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
