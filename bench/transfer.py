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
and latest.meta.json with the targets' MET/MISS lines.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from collections.abc import Iterator  # noqa: E402
from contextlib import contextmanager  # noqa: E402

import bounds as bounds_mod  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
from bounds import Bounds  # noqa: E402
from common import model, shapes  # noqa: E402
from runners import Peaks, PeerRun, Round, WeightsyncRun, model_bytes_of  # noqa: E402

from devtools.cluster import Cluster  # noqa: E402
from trainer_agent.update_model import AdamSteps, initial_weights  # noqa: E402
from weightsync.config import bounded_number  # noqa: E402
from weightsync.model_shapes import PRESETS  # noqa: E402
from weightsync.validation import DEFAULT_LIMITS  # noqa: E402

HERE = Path(__file__).resolve().parent
MODES = ("grpc", "tcp", "shm", "fs", "relay", "tcp+delta", "relay+delta", "fs+delta")
PEERS = ("safetensors", "orbax", "gloo", "jax_transfer")
PAIRED_PEER = "gloo"
CORES = os.cpu_count() or 1


@dataclass
class Row:
    method: str
    mode: str
    rollouts: int
    seconds: float
    gbps: float
    ratio_to_bound: float
    bound: str
    egress_ratio: float
    peak_rss_bytes: int
    rounds: list[float] = field(default_factory=list)
    trainer_peak_rss_bytes: int = 0
    stage_seconds: float = 0.0  # weightsync: the trainer's staging (copy + digests) inside `seconds`
    pull_seconds: float = 0.0  # weightsync: the slowest rollout's pull
    pull_ratio_to_bound: float = 0.0
    rollout_overhead_bytes: int = 0  # weightsync: a rollout's peak RSS beyond its applied weights
    apply_mode: str = ""
    reuses_memory: bool = True
    # CPU seconds per round over every process of the method (trainer or sender, coordinator,
    # rollouts or readers), and by role: on CORES cores no schedule of that work ends before
    # cpu / CORES.
    cpu_seconds: float = 0.0
    cpu_roles: dict[str, float] = field(default_factory=dict)
    # the least CPU the roles' work takes (bounds.Bounds.cpu_min), and by role
    cpu_min_seconds: float = 0.0
    cpu_min_roles: dict[str, float] = field(default_factory=dict)
    # How long the engine could not serve per round: weightsync from its handshakes (a NumPy
    # engine waits for the apply alone); peers, the whole round (the engine waits for the
    # broadcast or the load).
    pause_seconds: float = 0.0
    # medians of per-round ratios to gloo's round at the same N, rounds interleaved, or for
    # rows that cannot run beside gloo (memory) blocks of rounds alternated (`paired_by`)
    paired_ratio_to_gloo: float = 0.0
    paired_pause_ratio_to_gloo: float = 0.0
    paired_rounds: int = 0
    paired_by: str = ""
    # results from before the alternation (--rejudge): median seconds over gloo's median
    ratio_to_gloo: float = 0.0
    # one warm copy of the model's bytes (an apply), measured just before the row's rounds,
    # and N such copies at once (N rollouts applying together on this one machine)
    copy_seconds: float = 0.0
    copies_at_once_seconds: float = 0.0
    # bytes on the wire per rollout / model bytes (medians); with a delta, also the delta's
    # bytes and the fraction of 16-bit elements that changed per step
    wire_ratio: float = 0.0
    delta_bytes: int = 0
    changed_fraction: float = 0.0
    egress_bytes: int = 0  # median per round


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


# -- report ---------------------------------------------------------------------------
COLUMNS = (
    "method",
    "mode",
    "N",
    "seconds",
    "GB/s",
    "x bound",
    "x gloo (paired)",
    "stage s",
    "pull s",
    "pause s",
    "CPU s",
    "CPU min s",
    "wire/model",
    "egress/model",
    "peak RSS GB",
    "trainer RSS GB",
)


def _cells(r: Row) -> list[str]:
    """One row's cells, in COLUMNS order (staging, pull and CPU min only weightsync measures)."""
    ours = r.method == "weightsync"
    return [
        r.method,
        r.mode,
        str(r.rollouts),
        f"{r.seconds:.3f}",
        f"{r.gbps:.2f}",
        f"{r.ratio_to_bound:.2f} {r.bound}",
        f"{r.paired_ratio_to_gloo:.2f}" if r.paired_rounds else (f"{r.ratio_to_gloo:.2f}*" if r.ratio_to_gloo else ""),
        f"{r.stage_seconds:.3f}" if ours else "",
        f"{r.pull_seconds:.3f}" if ours else "",
        f"{r.pause_seconds:.3f}",
        f"{r.cpu_seconds:.2f}",
        f"{r.cpu_min_seconds:.2f}" if ours else "",
        f"{r.wire_ratio:.4f}" if ours else "",
        f"{r.egress_ratio:.4f}" if r.delta_bytes else f"{r.egress_ratio:.2f}",
        f"{r.peak_rss_bytes / 1e9:.2f}",
        f"{r.trainer_peak_rss_bytes / 1e9:.2f}",
    ]


def header(total: int, b: Bounds, delta_lr: float = 0.0, link: str = "") -> str:
    update = (
        f" · +delta rows: fp32 master weights, Adam-style step lr {delta_lr:g} x N(0,1) per element, served bf16"
        if delta_lr
        else ""
    )
    return (
        f"model {total / 1e9:.2f} GB bf16 · copy {b.copy_s:.3f} s ({b.memcpy_gbps:.1f} GB/s) · "
        f"xxh3 {b.hash_s:.3f} s · socket {b.socket_gbps:.2f} GB/s "
        f"(send {b.send_cpu_s:.2f} + recv {b.recv_cpu_s:.2f} CPU s) · {CORES} cores{update}"
        + (f" · every loopback byte through one {link} link (tc tbf on lo)" if link else "")
    )


def print_table(rows: list[Row], total: int, b: Bounds, delta_lr: float, link: str = "") -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=header(total, b, delta_lr, link))
    for col in COLUMNS:
        table.add_column(col, justify="right" if col not in ("method", "mode") else "left")
    for r in rows:
        table.add_row(*_cells(r))
    Console(width=190).print(table)


def markdown_table(rows: list[Row]) -> str:
    """The table as Markdown (written beside the JSON, for the README; without trainer RSS)."""
    cols = COLUMNS[:-1]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(_cells(r)[: len(cols)]) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def delta_verdicts(by: dict[tuple[str, str, int], Row], lr: float) -> list[str]:
    """The delta-sync targets, from the +delta rows beside the full rows and gloo's."""
    out: list[str] = []

    def check(name: str, ok: bool, detail: str) -> None:
        out.append(f"{'MET ' if ok else 'MISS'} {name}: {detail}")

    d1, full1 = by.get(("weightsync", "tcp+delta", 1)), by.get(("weightsync", "tcp", 1))
    if d1 is not None:
        check(
            f"lr {lr:g}: delta bytes on the wire <= 5% of model bytes",
            d1.wire_ratio <= 0.05,
            f"{d1.wire_ratio:.2%} ({d1.delta_bytes / 1e6:.1f} MB per step; "
            f"{d1.changed_fraction:.2%} of elements changed)",
        )
        if full1 is not None:
            ratio = d1.stage_seconds / max(full1.stage_seconds, 1e-9)
            check(
                "staging with delta <= 1.3x staging without",
                ratio <= 1.3,
                f"{d1.stage_seconds:.3f} s vs {full1.stage_seconds:.3f} s = {ratio:.2f}x (bench-delta splits it up)",
            )
    for n in (1, 4):
        d, full, gloo = (
            by.get(("weightsync", "tcp+delta", n)),
            by.get(("weightsync", "tcp", n)),
            by.get(("gloo", "tcp", n)),
        )
        if d is None or gloo is None or not (d.paired_rounds or d.ratio_to_gloo):
            continue
        how = (
            ("paired" if d.paired_by == "rounds" else f"paired by {d.paired_by}")
            if d.paired_rounds
            else "unpaired: it ran after gloo's processes closed (memory)"
        )
        vs_gloo = d.paired_ratio_to_gloo or d.ratio_to_gloo
        floor = (
            f"; the least work {d.cpu_min_seconds:.2f} CPU s needs {d.cpu_min_seconds / CORES:.3f} s on {CORES} "
            f"cores, our CPU {d.cpu_seconds:.2f} s ({d.cpu_roles}), gloo's {gloo.cpu_seconds:.2f} s"
        )
        check(
            f"tcp+delta N={n} publish -> COMMITTED faster than gloo's full broadcast ({how})",
            vs_gloo < 1.0,
            f"{vs_gloo:.3f}x (ours {d.seconds:.3f} s, gloo {gloo.seconds:.3f} s{floor})",
        )
        if full is not None:
            both_paired = bool(full.paired_rounds and d.paired_rounds)
            speedup = (
                full.paired_ratio_to_gloo / max(d.paired_ratio_to_gloo, 1e-9)
                if both_paired
                else full.seconds / d.seconds
            )
            check(
                f"tcp+delta N={n} >= 3x faster than full tcp",
                speedup >= 3.0,
                f"{speedup:.2f}x ({'ratio of their paired ratios to gloo, ' if both_paired else ''}"
                f"{full.seconds:.3f} s vs {d.seconds:.3f} s; full CPU {full.cpu_seconds:.2f} s, "
                f"delta CPU {d.cpu_seconds:.2f} s)",
            )
    relay = by.get(("weightsync", "relay+delta", 4))
    if relay is not None and relay.delta_bytes:
        ratio = relay.egress_bytes / relay.delta_bytes
        check(
            "relay+delta N=4 trainer egress <= 1.25x the delta bytes",
            ratio <= 1.25,
            f"{ratio:.2f}x ({relay.egress_bytes / 1e6:.1f} MB sent per step, delta {relay.delta_bytes / 1e6:.1f} MB)",
        )
    return out


def verdicts(
    rows: list[Row], b: Bounds, vllm: dict | None, window: int, largest: int, delta_lr: float = 0.0
) -> list[str]:
    """The transfer targets (the pause, the CPU, the time against gloo), each with the figures it
    was judged on."""
    by = {(r.method, r.mode, r.rollouts): r for r in rows}
    out: list[str] = []

    def check(name: str, ok: bool, detail: str) -> None:
        out.append(f"{'MET ' if ok else 'MISS'} {name}: {detail}")

    for mode in ("tcp", "relay"):
        for n in (1, 4):
            r = by.get(("weightsync", mode, n))
            if r is None:
                continue
            copy = r.copy_seconds
            shared = ""
            if n > 1:
                shared = (
                    f"; the {n} rollouts share {CORES} cores and apply at once: {n} copies at once take "
                    f"{r.copies_at_once_seconds:.3f} s here"
                )
            check(
                f"{mode} N={n} pause <= 1.5x one apply copy",
                r.pause_seconds <= 1.5 * copy,
                f"{r.pause_seconds:.3f} s vs 1.5 x {copy:.3f} s = {1.5 * copy:.3f} s{shared}",
            )
            if r.paired_rounds:
                check(
                    f"{mode} N={n} pause <= 0.5x gloo's round (paired)",
                    r.paired_pause_ratio_to_gloo <= 0.5,
                    f"median of {r.paired_rounds} paired ratios {r.paired_pause_ratio_to_gloo:.3f}",
                )
    for mode in ("tcp", "relay"):
        r = by.get(("weightsync", mode, 1))
        if r is not None:
            roles = ", ".join(f"{k} {v:.2f} (min {r.cpu_min_roles.get(k, 0.0):.2f})" for k, v in r.cpu_roles.items())
            check(
                f"{mode} N=1 CPU <= 1.3x the roles' physical minimum",
                r.cpu_seconds <= 1.3 * r.cpu_min_seconds,
                f"{r.cpu_seconds:.2f} CPU s vs 1.3 x {r.cpu_min_seconds:.2f} = {1.3 * r.cpu_min_seconds:.2f} "
                f"({r.cpu_seconds / max(r.cpu_min_seconds, 1e-9):.2f}x; {roles})",
            )
    for n in (1, 2, 4):
        gloo = by.get((PAIRED_PEER, "tcp", n))
        paired = [r for r in rows if r.method == "weightsync" and r.rollouts == n and r.paired_rounds]
        if not (gloo and paired):
            continue
        if n == 1:
            best = min(
                (r for r in paired if r.mode in ("tcp", "relay")), key=lambda r: r.paired_ratio_to_gloo, default=None
            )
            if best is not None:
                check(
                    "tcp or relay N=1 publish -> COMMITTED <= 1.25x gloo (paired)",
                    best.paired_ratio_to_gloo <= 1.25,
                    f"{best.mode} {best.paired_ratio_to_gloo:.3f}x{_floor(best, gloo)}",
                )
        if n == 4 and (relay := by.get(("weightsync", "relay", 4))) and relay.paired_rounds:
            check(
                "relay N=4 publish -> COMMITTED faster than gloo (paired)",
                relay.paired_ratio_to_gloo < 1.0,
                f"{relay.paired_ratio_to_gloo:.3f}x{_floor(relay, gloo)}",
            )
    relay = by.get(("weightsync", "relay", 4))
    if relay:
        check("relay N=4 egress <= 1.25x model", relay.egress_ratio <= 1.25, f"{relay.egress_ratio:.2f}x")
    out += delta_verdicts(by, delta_lr)
    for r in rows:
        if r.apply_mode == "streaming":
            bound = window + largest + (256 << 20)
            check(
                f"streaming rollout RSS <= window + largest tensor + 256 MiB ({r.mode}, N={r.rollouts})",
                r.rollout_overhead_bytes <= bound,
                f"{r.rollout_overhead_bytes / 2**20:.0f} MiB vs {bound / 2**20:.0f} MiB",
            )
    if vllm is not None:
        check(
            f"vLLM ({vllm['preset']}) tokens/s while prefetching >= 0.5x idle",
            vllm["tokens_per_s_ratio"] >= 0.5,
            f"{vllm['tokens_per_s_prefetch']:.1f} vs {vllm['tokens_per_s_idle']:.1f} tokens/s "
            f"= {vllm['tokens_per_s_ratio']:.2f}x over {vllm['prefetch_seconds']:.2f} s of prefetch",
        )
        check(
            f"vLLM ({vllm['preset']}) pause per version <= apply + 50 ms",
            vllm["max_pause_over_apply_s"] <= 0.05,
            f"largest pause - apply {vllm['max_pause_over_apply_s'] * 1e3:.1f} ms "
            f"(median pause {vllm['pause_s_median'] * 1e3:.1f} ms, apply {vllm['apply_s_median'] * 1e3:.1f} ms)",
        )
    return out


def _floor(r: Row, gloo: Row) -> str:
    """What CPU allows on this machine's cores: our round cannot end before cpu / CORES,
    nor before the roles' minimum work / CORES."""
    return (
        f" (ours {r.seconds:.3f} s, gloo {gloo.seconds:.3f} s; our CPU {r.cpu_seconds:.2f} s on {CORES} cores: "
        f"no schedule under {r.cpu_seconds / CORES:.3f} s; the least work {r.cpu_min_seconds:.2f} CPU s: "
        f"{r.cpu_min_seconds / CORES:.3f} s; gloo CPU {gloo.cpu_seconds:.2f} s)"
    )


def plot(rows: list[Row], path: Path, b: Bounds) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    labels = sorted({f"{r.method}:{r.mode}" for r in rows}, key=lambda s: (not s.startswith("weightsync"), s))
    ns = sorted({r.rollouts for r in rows})
    by = {(f"{r.method}:{r.mode}", r.rollouts): r.gbps for r in rows}
    fig, ax = plt.subplots(figsize=(max(8, len(labels) * 1.1), 4.5))
    width = 0.8 / len(ns)
    for k, n in enumerate(ns):
        ax.bar(
            [i + k * width for i in range(len(labels))], [by.get((lab, n), 0) for lab in labels], width, label=f"N={n}"
        )
    ax.axhline(b.socket_gbps, color="gray", linestyle="--", label="loopback socket")
    ax.set_xticks([i + width * (len(ns) - 1) / 2 for i in range(len(labels))], labels, rotation=30, ha="right")
    ax.set_ylabel("GB/s (model bytes / seconds to every rollout)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


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


def write_results(out: Path, rows: list[Row], meta: dict, b: Bounds, delta_lr: float) -> None:
    """latest.json (rows), .meta.json (bounds, verdicts), .md (the table and verdicts)."""
    total, vllm, lines = meta["model_bytes"], meta["vllm"], meta["verdicts"]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps([asdict(r) for r in rows], indent=1))
    out.with_suffix(".meta.json").write_text(json.dumps(meta, indent=1))
    vllm_md = f"\nvLLM row: `{json.dumps(vllm)}`\n" if vllm else ""
    out.with_suffix(".md").write_text(
        f"{header(total, b, delta_lr, meta.get('link', ''))}\n\n"
        + markdown_table(rows)
        + vllm_md
        + "\n"
        + "\n".join(f"- {v}" for v in lines)
        + "\n"
    )


def rejudge(out: Path, window: int) -> int:
    """The verdicts of a finished run again, from its JSON (after a change to `verdicts`)."""
    rows = [Row(**r) for r in json.loads(out.read_text())]
    meta = json.loads(out.with_suffix(".meta.json").read_text())
    fields = {f for f in Bounds.__dataclass_fields__}
    b = Bounds(**{k: v for k, v in meta["bounds"].items() if k in fields})
    delta_lr = (meta.get("delta_update_model") or {}).get("lr", 0.0)
    largest = meta.get("largest_tensor_bytes") or 2 * max(
        int(np.prod(shape)) for shape in shapes(meta["size"]).values()
    )  # (bf16)
    meta["verdicts"] = verdicts(rows, b, meta["vllm"], window, largest, delta_lr)
    write_results(out, rows, meta, b, delta_lr)
    print("\n".join(meta["verdicts"]))
    return 0


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
