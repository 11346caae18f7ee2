"""Transfer benchmark (`make bench`): weightsync's modes against the bounds and peer methods.

One run, one table. For a Qwen3-shaped bf16 model (`--size`, default 0.6b, ~1.19 GB):
- bounds (bench/bounds.py): a warm copy of the model's bytes, one xxh3 pass over them, a
  plain loopback TCP socket moving them, each with its CPU seconds;
- weightsync end to end (publish -> N rollout processes pulled, checked, applied,
  handshakes COMMITTED), per mode, N = 1, 2, 4;
- weightsync with delta sync (`tcp+delta`, `relay+delta`, `fs+delta`, N = `--delta-rollouts`): each
  round publishes the next step of an RL update (trainer_agent.update_model: fp32 master
  weights, an Adam-style step at `--delta-lr`, served as bf16) with delta="auto", so the
  rollouts, holding the previous version, pull only its delta; `wire_ratio` (bytes on the
  wire per rollout / model bytes) and the fraction of elements that changed per step;
- peers: safetensors save + load through tmpfs, Orbax (tensorstore) save + restore
  through tmpfs, torch.distributed gloo broadcast, jax.experimental.transfer pulls.

This VM drifts by tens of percent within minutes, so every weightsync row runs its rounds
interleaved with gloo's at the same N (ours, gloo, ours, gloo, ...; gloo's processes stay
up for all of that N's rows): `paired_ratio_to_gloo` is the median of the per-round
ratios, so drift hits both sides. A +delta row at N > 2 cannot run beside gloo (with the
update model's fp32 weights too it passes 24 GB): it alternates `--alternations` blocks of
`--runs` rounds with gloo's instead, each side's processes up only in its own blocks.
Each row: median seconds of `--runs` rounds after one warm-up round, GB/s (model bytes
over seconds: every rollout has the model), ratio to the bound (memcpy for shm, the socket
for the rest), the engine's pause, CPU seconds of every process beside the least CPU the
roles' work takes (`cpu_min_seconds`), trainer egress / model bytes, peak RSS above
baseline. `--vllm PRESET` adds a real vLLM engine generating while versions arrive
(bench/vllm_row.py). Writes bench/results/latest.json, .md, .png
and latest.meta.json with the targets' MET/MISS lines (the table and its verdicts:
bench/transfer_report.py).
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from collections.abc import Iterator  # noqa: E402
from contextlib import contextmanager  # noqa: E402

import bounds as bounds_mod  # noqa: E402
import ml_dtypes  # noqa: E402
from bounds import Bounds  # noqa: E402
from common import model, shapes  # noqa: E402
from runners import Peaks, PeerRun, Round, WeightsyncRun, model_bytes_of  # noqa: E402
from transfer_report import (  # noqa: E402
    CORES,
    PAIRED_PEER,
    Row,
    header,
    plot,
    print_table,
    rejudge,
    verdicts,
    write_results,
)

from devtools.cluster import Cluster  # noqa: E402
from trainer_agent.update_model import AdamSteps, initial_weights  # noqa: E402
from weightsync.config import bounded_number  # noqa: E402
from weightsync.model_shapes import PRESETS  # noqa: E402
from weightsync.validation import DEFAULT_LIMITS  # noqa: E402

HERE = Path(__file__).resolve().parent
MODES = ("grpc", "tcp", "shm", "fs", "relay", "tcp+delta", "relay+delta", "fs+delta")
PEERS = ("safetensors", "orbax", "gloo", "jax_transfer")


def make_row(
    method: str,
    mode: str,
    n: int,
    rounds: list[Round],
    total: int,
    peaks: Peaks,
    bounds: Bounds,
    *,
    paired: list[Round] | None = None,
) -> Row:
    """A table row from a runner's measured rounds (and gloo's rounds interleaved with them)."""
    med = statistics.median
    seconds = med(r.seconds for r in rounds)
    gbps = total / seconds / 1e9
    bound = "memcpy" if mode.startswith("shm") else "socket"
    bound_gbps = bounds.memcpy_gbps if bound == "memcpy" else bounds.socket_gbps
    ours = method == "weightsync"
    row = Row(
        method,
        mode,
        n,
        round(seconds, 4),
        round(gbps, 3),
        round(gbps / bound_gbps, 3),
        bound,
        round(sum(r.egress_bytes for r in rounds) / (total * len(rounds)), 3),
        int(peaks.largest),
        [round(r.seconds, 4) for r in rounds],
        int(peaks.trainer),
        round(med(r.stage for r in rounds), 4) if ours else 0.0,
        round(med(r.pull for r in rounds), 4) if ours else 0.0,
        reuses_memory=method in ("weightsync", "gloo"),
        cpu_seconds=round(med(r.cpu_total for r in rounds), 3),
        cpu_roles={k: round(med(r.cpu[k] for r in rounds), 3) for k in rounds[0].cpu},
        pause_seconds=round(med(r.pause for r in rounds), 4),
        copy_seconds=round(bounds.copy_s, 4),
    )
    if ours:
        row.pull_ratio_to_bound = round(total / row.pull_seconds / 1e9 / bound_gbps, 3) if row.pull_seconds else 0.0
        row.rollout_overhead_bytes = peaks.rollout_overhead
        row.cpu_min_roles = {k: round(v, 6) for k, v in bounds.cpu_min(mode.split("/")[0], n).items()}
        row.cpu_min_seconds = round(sum(row.cpu_min_roles.values()), 6)
        row.wire_ratio = round(med(r.wire_bytes for r in rounds) / total, 4)
        row.delta_bytes = int(med(r.delta_bytes for r in rounds))
        row.egress_bytes = int(med(r.egress_bytes for r in rounds))
        row.changed_fraction = round(med(r.changed for r in rounds), 4)
    if paired:
        row.paired_ratio_to_gloo = round(med(a.seconds / b.seconds for a, b in zip(rounds, paired)), 3)
        row.paired_pause_ratio_to_gloo = round(med(a.pause / b.seconds for a, b in zip(rounds, paired)), 3)
        row.paired_rounds = len(paired)
        row.paired_by = "rounds"
    return row


def run_paired(
    cluster: Cluster,
    coord,  # noqa: ANN001
    modes: list[str],
    n: int,
    params: dict,
    args: argparse.Namespace,
    bounds: Bounds,
    with_gloo: bool,
) -> list[Row]:
    """Every mode's rows at one N, each mode's rounds interleaved with gloo's."""
    total = model_bytes_of(params)
    rows: list[Row] = []
    together = bounds_mod.concurrent_copy_s(total, n) if n > 1 else 0.0
    # A +delta row holds the update model's fp32 master weights beside the arena's two
    # slots; with gloo's N+1 processes and N rollouts up as well, N=4 exceeds this
    # machine's 24 GB (the kernel's OOM killer ended such a run): those rows alternate with
    # gloo instead, each side's processes up only in its own blocks (`_alternated_row`).
    later = [m for m in modes if m.endswith("+delta") and n > 2 and n in args.delta_ns] if with_gloo else []
    now = [m for m in modes if m not in later]
    gloo = PeerRun(PAIRED_PEER, n, args.size, params).start() if with_gloo and now else None
    gloo_rounds: list[Round] = []
    gloo_peaks = Peaks()
    try:
        if gloo is not None:
            gloo.round()  # warm-up
        for mode in now:
            rows += _mode_row(cluster, coord, mode, n, params, args, together, gloo, gloo_rounds)
    finally:
        if gloo is not None:
            gloo_peaks = gloo.close()
    for mode in later:
        got, gloo_peaks = _alternated_row(cluster, coord, mode, n, params, args, together, gloo_rounds, gloo_peaks)
        rows += got
    if gloo_rounds:
        rows.append(make_row(PAIRED_PEER, "tcp", n, gloo_rounds, total, gloo_peaks, bounds))
        print(f"  {PAIRED_PEER} N={n}: {rows[-1].seconds:.3f}s ({len(gloo_rounds)} rounds)", flush=True)
    return rows


def _alternated_row(
    cluster: Cluster,
    coord,  # noqa: ANN001
    mode: str,
    n: int,
    params: dict,
    args: argparse.Namespace,
    together: float,
    gloo_rounds: list[Round],
    gloo_peaks: Peaks,
) -> tuple[list[Row], Peaks]:
    """A +delta row whose processes cannot be up beside gloo's: `--alternations` blocks of
    gloo's rounds, then ours, each side started and closed in its block, so every one of
    our rounds is paired with a gloo round minutes apart at most (this machine drifts by
    tens of percent within minutes; one block of each, run in turn, compared the drift)."""
    ours: list[Round] = []
    theirs: list[Round] = []
    peaks = Peaks()
    for _ in range(args.alternations):
        got, p = _peer_rounds(PAIRED_PEER, n, params, args)
        theirs += got
        gloo_peaks = _higher(gloo_peaks, p)
        got, block_peaks, row_bounds = _weightsync_rounds(cluster, coord, mode, n, params, args, None, [])
        ours += got
        peaks = _higher(peaks, block_peaks)
    gloo_rounds += theirs
    row = _report_row(mode, n, ours, params, peaks, row_bounds, theirs, together)
    row.paired_by = f"blocks of {args.runs} rounds, {args.alternations} of each side in turn"
    return [row], gloo_peaks


def _higher(a: Peaks, b: Peaks) -> Peaks:
    """The high-water marks of two runs (blocks of one row)."""
    return Peaks(max(a.largest, b.largest), max(a.trainer, b.trainer), max(a.rollout_overhead, b.rollout_overhead))


def _mode_row(
    cluster: Cluster,
    coord,  # noqa: ANN001
    mode: str,
    n: int,
    params: dict,
    args: argparse.Namespace,
    together: float,
    gloo: PeerRun | None,
    gloo_rounds: list[Round],
) -> list[Row]:
    """One mode's row at N, its rounds interleaved with gloo's when it runs (appended to
    `gloo_rounds`); none for a +delta mode at an N not asked for."""
    if mode.endswith("+delta") and n not in args.delta_ns:
        return []
    theirs: list[Round] = []
    ours, peaks, row_bounds = _weightsync_rounds(cluster, coord, mode, n, params, args, gloo, theirs)
    gloo_rounds += theirs
    return [_report_row(mode, n, ours, params, peaks, row_bounds, theirs, together)]


def _weightsync_rounds(
    cluster: Cluster,
    coord,  # noqa: ANN001
    mode: str,
    n: int,
    params: dict,
    args: argparse.Namespace,
    gloo: PeerRun | None,
    theirs: list[Round],
) -> tuple[list[Round], Peaks, Bounds]:
    """One warm-up and --runs rounds of weightsync in `mode` at N (each followed by a round
    of gloo's when it runs, appended to `theirs`), the runner's peaks and the bounds
    measured just before."""
    steps = None
    if mode.endswith("+delta"):
        steps = AdamSteps(initial_weights(shapes(args.size), ml_dtypes.bfloat16), args.delta_lr, seed=1)
    # the bounds again beside each row: this VM drifts within minutes
    row_bounds = bounds_mod.measure(model_bytes_of(params), reps=3)
    # (with steps, every round publishes the next step: the warm-up round the first)
    ws = WeightsyncRun(cluster, coord, mode, n, params, args.chunk_bytes, steps=steps).start()
    steps = None  # the runner's now: released when it closes
    ours: list[Round] = []
    try:
        ws.round()  # warm-up: receive buffers, mappings, connections
        for _ in range(args.runs):
            ours.append(ws.round())
            if gloo is not None:
                theirs.append(gloo.round())
    finally:
        peaks = ws.close()
    return ours, peaks, row_bounds


def _report_row(
    mode: str,
    n: int,
    ours: list[Round],
    params: dict,
    peaks: Peaks,
    row_bounds: Bounds,
    theirs: list[Round],
    together: float,
) -> Row:
    """Our row from its rounds (paired with gloo's `theirs` when there are any), printed."""
    r = make_row("weightsync", mode, n, ours, model_bytes_of(params), peaks, row_bounds, paired=theirs or None)
    r.copies_at_once_seconds = round(together, 4)
    paired = f", {r.paired_ratio_to_gloo:.2f}x gloo paired" if theirs else ""
    wire = f", wire {r.wire_ratio:.4f}x model ({r.changed_fraction:.2%} changed)" if mode.endswith("+delta") else ""
    print(
        f"  weightsync {mode} N={n}: {r.seconds:.3f}s pause {r.pause_seconds:.3f}s "
        f"CPU {r.cpu_seconds:.2f} (min {r.cpu_min_seconds:.2f}){paired}{wire}",
        flush=True,
    )
    return r


def _peer_rounds(method: str, n: int, params: dict, args: argparse.Namespace) -> tuple[list[Round], Peaks]:
    """A peer's processes up for one warm-up and --runs rounds, then closed: the rounds and
    the peaks."""
    runner = PeerRun(method, n, args.size, params).start()
    try:
        runner.round()
        rounds = [runner.round() for _ in range(args.runs)]
    finally:
        peaks = runner.close()
    return rounds, peaks


def run_alone(method: str, n: int, params: dict, args: argparse.Namespace, bounds: Bounds) -> Row:
    """A peer's row on its own: one warm-up round, then --runs rounds."""
    rounds, peaks = _peer_rounds(method, n, params, args)
    mode = "tmpfs" if method in ("safetensors", "orbax") else "tcp"
    return make_row(method, mode, n, rounds, model_bytes_of(params), peaks, bounds)


def run_streaming(cluster: Cluster, coord, mode: str, params: dict, args: argparse.Namespace, bounds: Bounds) -> Row:  # noqa: ANN001
    ws = WeightsyncRun(cluster, coord, mode, 1, params, args.chunk_bytes, apply_mode="streaming").start()
    try:
        ws.round()
        rounds = [ws.round() for _ in range(args.runs)]
    finally:
        peaks = ws.close()
    row = make_row("weightsync", f"{mode}/streaming", 1, rounds, model_bytes_of(params), peaks, bounds)
    row.apply_mode = "streaming"
    return row


def run_vllm(preset: str, versions: int) -> dict | None:
    """The vLLM row (bench/vllm_row.py) in its own process; None when vLLM is not installed."""
    out = subprocess.run(
        [sys.executable, str(HERE / "vllm_row.py"), "--preset", preset, "--versions", str(versions)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    if out.returncode == 3:
        print(f"  vllm: skipped ({out.stdout.strip() or out.stderr.strip()[-300:]})", flush=True)
        return None
    if out.returncode != 0:
        raise RuntimeError(f"bench/vllm_row.py failed ({out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


@contextmanager
def shaped_loopback(rate: str) -> Iterator[None]:
    """Every loopback byte of the run through one link of `rate` (e.g. 10gbit): a token
    bucket on `lo` (tc tbf; needs root), removed at the end. It stands in for the trainer's
    network link: the methods' bytes, control messages included, all share it."""
    add = ["tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate", rate, "burst", "4mb", "latency", "100ms"]
    out = subprocess.run(add, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"--link {rate}: cannot shape loopback ({out.stderr.strip()}); needs root and tc")
    try:
        yield
    finally:
        subprocess.run(["tc", "qdisc", "del", "dev", "lo", "root"], capture_output=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="0.6b", choices=list(PRESETS), help="model preset: tiny | small | medium | 0.6b")
    ap.add_argument("--runs", type=bounded_number(1), default=3, help="measured rounds per row (after one warm-up)")
    ap.add_argument("--rollouts", default="1,2,4")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--peers", default=",".join(PEERS))
    ap.add_argument(
        "--chunk-bytes",
        type=bounded_number(DEFAULT_LIMITS.min_chunk_bytes, high=DEFAULT_LIMITS.max_chunk_bytes),
        default=3 << 20,
    )
    ap.add_argument("--streaming", default="tcp", help="modes also run with --apply-mode streaming at N=1 (RSS target)")
    ap.add_argument("--delta-rollouts", default="1,4", help="N of the +delta rows")
    ap.add_argument(
        "--alternations",
        type=int,
        default=2,
        help="blocks of gloo's rounds and ours in turn, for +delta rows that cannot run beside gloo (N > 2)",
    )
    ap.add_argument(
        "--delta-lr", type=bounded_number(0, float), default=1e-6, help="learning rate of the +delta rows' update model"
    )
    ap.add_argument("--vllm", default="small", help="the vLLM row's model preset ('' skips the row)")
    ap.add_argument("--vllm-versions", type=bounded_number(1), default=6)
    ap.add_argument("--out", default=str(HERE / "results" / "latest.json"))
    ap.add_argument(
        "--rejudge", action="store_true", help="recompute the MET/MISS lines of the run in --out (no measuring)"
    )
    ap.add_argument(
        "--link",
        default="",
        help="run every row through one link of this rate (tc tbf on lo, e.g. 10gbit; needs root): "
        "where the bytes on the wire, not this machine's 2 cores, bound a sync",
    )
    args = ap.parse_args()
    if args.rejudge:
        return rejudge(Path(args.out), window=2 * 32 * args.chunk_bytes)
    if args.link:
        with shaped_loopback(args.link):
            return measure_all(args)
    return measure_all(args)


def measure_all(args: argparse.Namespace) -> int:
    """Every row, the table, the verdicts and the result files."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: stop rollouts, free the arena, unshape lo
    ns = [int(x) for x in args.rollouts.split(",") if x]
    args.delta_ns = [int(x) for x in args.delta_rollouts.split(",") if x]
    modes = [m for m in args.modes.split(",") if m]
    peers = [p for p in args.peers.split(",") if p]
    params = model(args.size)
    total = model_bytes_of(params)
    largest = max(v.nbytes for v in params.values())
    window = 2 * 32 * args.chunk_bytes  # a streaming rollout's in-flight bytes at its defaults
    b = bounds_mod.measure(total)
    print(f"bounds: {header(total, b, link=args.link)}", flush=True)
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="wsbench-") as tmp, Cluster(tmp) as cluster:
        coord = cluster.start_coordinator()
        for n in ns:
            rows += run_paired(cluster, coord, modes, n, params, args, b, with_gloo=PAIRED_PEER in peers)
        for mode in filter(None, args.streaming.split(",")):
            rows.append(run_streaming(cluster, coord, mode, params, args, b))
            print(f"  weightsync {mode} streaming N=1: overhead RSS {rows[-1].rollout_overhead_bytes / 2**20:.0f} MiB")
    for method in (p for p in peers if p != PAIRED_PEER):
        for n in ns:
            try:
                rows.append(run_alone(method, n, params, args, b))
                print(f"  {method} N={n}: {rows[-1].seconds:.3f}s {rows[-1].gbps:.2f} GB/s", flush=True)
            except (ImportError, RuntimeError) as e:
                print(f"  {method} N={n}: skipped ({e})", flush=True)
                break
    vllm = run_vllm(args.vllm, args.vllm_versions) if args.vllm else None
    delta_lr = args.delta_lr if any(m.endswith("+delta") for m in modes) else 0.0
    print_table(rows, total, b, delta_lr, args.link)
    lines = verdicts(rows, b, vllm, window, largest, delta_lr)
    for line in lines:
        print(line)
    out = Path(args.out)
    meta = {
        "size": args.size,
        "model_bytes": total,
        "largest_tensor_bytes": largest,
        "runs": args.runs,
        "bounds": {**asdict(b), "memcpy_gbps": b.memcpy_gbps, "socket_gbps": b.socket_gbps},
        "chunk_bytes": args.chunk_bytes,
        "cores": CORES,
        "delta_update_model": {"lr": args.delta_lr, "rollouts": args.delta_ns} if delta_lr else None,
        "link": args.link,
        "vllm": vllm,
        "verdicts": lines,
    }
    write_results(out, rows, meta, b, delta_lr)
    png = out.with_suffix(".png")
    print(f"wrote {out}" + (f" and {png}" if plot(rows, png, b) else " (no matplotlib: no PNG)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
