"""Transfer benchmark (`make bench`): weightsync's modes against the bounds and peer methods.

One run, one table. For a Qwen3-shaped bf16 model (`--size`, default 0.6b, ~1.19 GB):
- bounds: memcpy of the model's bytes, and a plain loopback TCP socket moving them;
- weightsync end to end (publish -> N rollout processes pulled, verified, applied,
  handshakes COMMITTED), per mode, N = 1, 2, 4;
- peers: safetensors save + load through tmpfs, Orbax (tensorstore) save + restore
  through tmpfs, torch.distributed gloo broadcast, jax.experimental.transfer pulls.
Each row: median seconds of `--runs` rounds after one warm-up round, GB/s (model bytes
over seconds: every rollout has the model), ratio to the bound (memcpy for shm, the
socket for the rest), trainer egress / model bytes, peak RSS above baseline (largest
over the method's processes). Writes bench/results/latest.json and latest.png.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import cpu_seconds, model, peak_rss_bytes, reset_peak_rss, rss_bytes  # noqa: E402

from devtools.cluster import Cluster, Proc  # noqa: E402
from trainer_agent.publisher import WeightPublisher  # noqa: E402
from trainer_agent.settings import PublisherSettings  # noqa: E402

HERE = Path(__file__).resolve().parent
MODES = ("grpc", "tcp", "shm", "fs", "relay")
PEERS = ("safetensors", "orbax", "gloo", "jax_transfer")
CROSS_HOST = ("grpc", "tcp", "fs", "relay")
# Between rows: this VM hands freed memory back to its host within 1-2 s, and pages touched
# while that runs cost several times more (docs/machine.md); let it finish.
SETTLE_S = 3.0


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
    pull_seconds: float = 0.0  # weightsync: the slowest rollout's pull + chunk verification
    pull_ratio_to_bound: float = 0.0
    rollout_overhead_bytes: int = 0  # weightsync: a rollout's peak RSS beyond its applied weights
    apply_mode: str = ""
    reuses_memory: bool = True
    # CPU seconds per round over every process of the method (trainer or sender, coordinator,
    # rollouts or readers): on CORES cores no schedule of that work ends before cpu / CORES.
    cpu_seconds: float = 0.0
    # How long the engine could not serve per round: weightsync from its handshakes (a NumPy
    # engine waits for the apply alone); peers, the whole round (the engine waits for the
    # broadcast or the load).
    pause_seconds: float = 0.0


# -- bounds ------------------------------------------------------------------------
def memcpy_gbps(nbytes: int, reps: int = 5) -> float:
    src = np.ones(nbytes, np.uint8)
    dst = np.zeros(nbytes, np.uint8)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t)
    return nbytes / statistics.median(times) / 1e9


def socket_gbps(nbytes: int, reps: int = 5) -> float:
    """A plain loopback TCP socket: sendall from one buffer, recv_into another (both warm).
    Also records the CPU seconds one transfer takes (BOUND_CPU["socket"])."""
    src = np.ones(nbytes, np.uint8)
    dst = np.zeros(nbytes, np.uint8)
    listener = socket.create_server(("127.0.0.1", 0))
    out = socket.create_connection(listener.getsockname())
    inc, _ = listener.accept()
    for s in (out, inc):
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    view = memoryview(dst)
    times = []
    cpu0 = cpu_seconds()
    for _ in range(reps):
        sender = threading.Thread(target=out.sendall, args=(memoryview(src),))
        t = time.perf_counter()
        sender.start()
        got = 0
        while got < nbytes:
            got += inc.recv_into(view[got:], min(nbytes - got, 4 << 20))
        sender.join()
        times.append(time.perf_counter() - t)
    BOUND_CPU["socket"] = (cpu_seconds() - cpu0) / reps
    for s in (out, inc, listener):
        s.close()
    return nbytes / statistics.median(times) / 1e9


# -- weightsync ---------------------------------------------------------------------
def run_weightsync(
    cluster: Cluster,
    coord: Proc,
    mode: str,
    n: int,
    params: dict,
    runs: int,
    chunk_bytes: int,
    apply_mode: str = "atomic",
    rollout_args: tuple[str, ...] = (),
) -> Row:
    session = f"{mode}-n{n}-{uuid.uuid4().hex[:6]}"
    fs_root = tempfile.mkdtemp(prefix="wsbench-fs-", dir="/dev/shm") if mode == "fs" else ""
    args = [
        "--weight-sync-mode",
        mode,
        "--apply-mode",
        apply_mode,
        *(["--fs-root", fs_root] if fs_root else []),
        *rollout_args,
    ]
    names = [f"{session}-r{i}" for i in range(n)]
    procs = [cluster.start_rollout(name, coord.address, session, args) for name in names]
    pids = ["self", coord.pid, *(p.pid for p in procs)]
    baselines = {p.pid: rss_bytes(p.pid) for p in procs}
    reset_peak_rss()
    trainer_base = rss_bytes()
    total = model_bytes_of(params)
    rounds, stages, cpus, served = [], [], [], 0
    try:
        with WeightPublisher(
            PublisherSettings(
                coordinator=coord.address,
                session=session,
                weight_sync_mode=mode,
                fs_root=fs_root,
                min_rollouts=n,
                chunk_bytes=chunk_bytes,
                slot_wait_s=300,
            )
        ) as pub:
            for version in range(1, runs + 2):
                before = pub._servicer.bytes_served
                cpu0 = cpu_seconds(pids)
                t = time.perf_counter()
                result = pub.publish(params, version)
                state = pub.wait_committed(version, 600)
                seconds = time.perf_counter() - t
                cpu = cpu_seconds(pids) - cpu0
                if state != "COMMITTED":
                    why = [
                        f"{h.agent_id}: {h.mismatch}"
                        for h in pub.client.status(session).handshakes
                        if h.version == version
                    ]
                    logs = "\n".join(p.log()[-1500:] for p in procs)
                    raise RuntimeError(f"{mode} n={n}: version {version} ended {state} {why}\n{logs}")
                if version > 1:  # the first round is the warm-up (receive buffers, mappings)
                    rounds.append(seconds)
                    stages.append(result.stage_seconds)
                    cpus.append(cpu)
                    served += pub._servicer.bytes_served - before
            handshakes = pub.client.status(session, runs + 2).handshakes
            pulls = [max(h.timings.pull_seconds for h in handshakes if h.version == v) for v in range(2, runs + 2)]
            pauses = [max(h.timings.pause_seconds for h in handshakes if h.version == v) for v in range(2, runs + 2)]
        trainer_peak = peak_rss_bytes() - trainer_base
        peak = max(peak_rss_bytes(p.pid) - baselines[p.pid] for p in procs)
        # beyond the applier's own copy of the weights (an engine holds those anyway)
        overhead = max(0, peak - total)
    finally:
        for name in names:
            cluster.stop(name)
        if fs_root:
            shutil.rmtree(fs_root, ignore_errors=True)
        time.sleep(SETTLE_S)
    egress = {"shm": 0.0, "fs": 1.0}.get(mode, served / (total * runs))  # fs: written once to the store
    row = _row(
        "weightsync",
        mode,
        n,
        rounds,
        total,
        egress,
        peak,
        trainer_peak=trainer_peak,
        stage=statistics.median(stages),
        cpus=cpus,
    )
    row.rollout_overhead_bytes = overhead
    row.apply_mode = apply_mode
    if apply_mode != "atomic":
        row.mode = f"{mode}/{apply_mode}"
    row.pull_seconds = round(statistics.median(pulls), 4)
    row.pause_seconds = round(statistics.median(pauses), 4)
    row.pull_ratio_to_bound = round(total / row.pull_seconds / 1e9 / BOUNDS[row.bound], 3)
    return row


def model_bytes_of(params: dict) -> int:
    return sum(v.nbytes for v in params.values())


# -- peers ----------------------------------------------------------------------------
class Worker:
    """A peer_worker.py process: JSON lines on stdout, commands on stdin."""

    def __init__(self, *argv: object) -> None:
        self.popen = subprocess.Popen(
            [sys.executable, str(HERE / "peer_worker.py"), *map(str, argv)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
        )
        self.ready = self.read()

    def read(self) -> dict:
        line = self.popen.stdout.readline()  # type: ignore[union-attr]
        if not line:
            raise RuntimeError(f"peer worker {self.popen.args} exited with {self.popen.wait()}")
        return json.loads(line)

    def send(self, text: str) -> None:
        self.popen.stdin.write(text + "\n")  # type: ignore[union-attr]
        self.popen.stdin.flush()  # type: ignore[union-attr]

    def wchar(self) -> int:
        with open(f"/proc/{self.popen.pid}/io") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("wchar"))

    def quit(self) -> dict:
        self.send("quit")
        out = self.read()
        self.popen.wait(60)
        return out


def _sent_bytes(method: str, sender: Worker | None) -> int:
    """Bytes the sender has written: its write/send syscalls (/proc/PID/io wchar); for
    jax_transfer, whose sends bypass that counter, the loopback interface's tx bytes
    (only its transfers run meanwhile)."""
    if sender is None:
        return 0
    if method == "jax_transfer":
        with open("/proc/net/dev") as f:
            return next(int(line.split(":")[1].split()[8]) for line in f if line.strip().startswith("lo:"))
    return sender.wchar()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_peer(method: str, n: int, size: str, params: dict, runs: int) -> Row:
    workdir = Path(tempfile.mkdtemp(prefix=f"wsbench-{method}-", dir="/dev/shm"))
    port = _free_port()
    sender: Worker | None = None
    readers: list[Worker] = []
    rounds: list[float] = []
    cpus: list[float] = []
    total = model_bytes_of(params)
    egress_bytes = 0
    reset_peak_rss()
    trainer_base = rss_bytes()
    try:
        if method == "gloo":  # every rank must join the group before any of them is ready
            workers = _start_all(
                lambda r: Worker(method, "send" if r == 0 else "recv", r, n, size, port, workdir), n + 1
            )
            sender, readers = workers[0], workers[1:]
        elif method == "jax_transfer":
            sender = Worker(method, "send", 0, n, size, port, workdir)
            readers = [Worker(method, "recv", r, n, size, port, sender.ready["address"]) for r in range(1, n + 1)]
        else:
            readers = _start_all(lambda r: Worker(method, "recv", r + 1, n, size, port, workdir), n)
        writer = _checkpoint_writer(method, params) if method in ("safetensors", "orbax") else None
        pids = ["self", *(w.popen.pid for w in ([sender] if sender else []) + readers)]
        for it in range(runs + 1):
            w0 = _sent_bytes(method, sender)
            cpu0 = cpu_seconds(pids)
            t0 = time.time()
            if writer is not None:
                writer(workdir, it)
            if sender is not None and method == "jax_transfer":
                sender.send(f"go {it}")
                sender.read()
            everyone = readers + ([sender] if method == "gloo" and sender else [])
            for w in everyone:
                w.send(f"go {it}")
            t_end = max(w.read()["t_end"] for w in everyone)
            if it > 0:
                rounds.append(t_end - t0)
                cpus.append(cpu_seconds(pids) - cpu0)
                egress_bytes += (_sent_bytes(method, sender) - w0) if sender else total  # checkpoints: written once
            for old in workdir.glob(f"v{it}*"):
                shutil.rmtree(old, ignore_errors=True) if old.is_dir() else old.unlink()
        stats = [w.quit() for w in ([sender] if sender else []) + readers]
        peak = max(s["peak_rss"] - s["baseline_rss"] for s in stats)
        if writer is not None:
            peak = max(peak, peak_rss_bytes() - trainer_base)
    finally:
        for w in ([sender] if sender else []) + readers:
            if w.popen.poll() is None:
                w.popen.kill()
        shutil.rmtree(workdir, ignore_errors=True)
        time.sleep(SETTLE_S)
    bound_mode = "tmpfs" if method in ("safetensors", "orbax") else "tcp"
    return _row(
        method, bound_mode, n, rounds, total, egress_bytes / (total * runs), peak, reuses=method == "gloo", cpus=cpus
    )


def _start_all(make, n: int) -> list[Worker]:  # noqa: ANN001
    """Starts workers 0..n-1 concurrently (gloo ranks are ready only once all joined)."""
    out: list[Worker | None] = [None] * n

    def start(r: int) -> None:
        out[r] = make(r)

    threads = [threading.Thread(target=start, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    if any(w is None for w in out):
        raise RuntimeError("a peer worker did not start")
    return out  # type: ignore[return-value]


def _checkpoint_writer(method: str, params: dict):  # noqa: ANN202
    if method == "safetensors":
        from safetensors.numpy import save_file

        as_u16 = {k: v.view(np.uint16) for k, v in params.items()}  # same bytes; numpy has no bf16
        return lambda workdir, it: save_file(as_u16, str(workdir / f"v{it}.safetensors"))
    import jax
    import orbax.checkpoint as ocp

    tree = {k: jax.device_put(v) for k, v in params.items()}
    ckpt = ocp.StandardCheckpointer()

    def write(workdir: Path, it: int) -> None:
        ckpt.save(workdir / f"v{it}", tree)
        ckpt.wait_until_finished()

    return write


# -- report ---------------------------------------------------------------------------
BOUNDS: dict[str, float] = {}
BOUND_CPU: dict[str, float] = {}  # CPU seconds of one bound transfer
CORES = os.cpu_count() or 1
LARGEST = [0]  # the model's largest tensor, bytes
WINDOW = [0]  # a streaming rollout's in-flight bytes: streams x window_chunks x chunk_bytes (its defaults)


def _row(
    method: str,
    mode: str,
    n: int,
    rounds: list[float],
    total: int,
    egress: float,
    peak: int,
    *,
    trainer_peak: int = 0,
    stage: float = 0.0,
    reuses: bool = True,
    cpus: list[float] | None = None,
) -> Row:
    seconds = statistics.median(rounds)
    gbps = total / seconds / 1e9
    bound = "memcpy" if mode.startswith("shm") else "socket"
    return Row(
        method,
        mode,
        n,
        round(seconds, 4),
        round(gbps, 3),
        round(gbps / BOUNDS[bound], 3),
        bound,
        round(egress, 3),
        int(peak),
        [round(r, 4) for r in rounds],
        int(trainer_peak),
        round(stage, 4),
        reuses,
        cpu_seconds=round(statistics.median(cpus), 3) if cpus else 0.0,
        pause_seconds=0.0 if method == "weightsync" else round(seconds, 4),
    )


COLUMNS = (
    "method",
    "mode",
    "N",
    "seconds",
    "GB/s",
    "x bound",
    "stage s",
    "pull s",
    "pull x bound",
    "pause s",
    "CPU s",
    "egress/model",
    "peak RSS GB",
    "trainer RSS GB",
)


def _cells(r: Row) -> list[str]:
    """One row's cells, in COLUMNS order (staging and pull only weightsync measures)."""
    ours = r.method == "weightsync"
    return [
        r.method,
        r.mode,
        str(r.rollouts),
        f"{r.seconds:.3f}",
        f"{r.gbps:.2f}",
        f"{r.ratio_to_bound:.2f} {r.bound}",
        f"{r.stage_seconds:.3f}" if ours else "",
        f"{r.pull_seconds:.3f}" if ours else "",
        f"{r.pull_ratio_to_bound:.2f}" if ours else "",
        f"{r.pause_seconds:.3f}",
        f"{r.cpu_seconds:.2f}",
        f"{r.egress_ratio:.2f}",
        f"{r.peak_rss_bytes / 1e9:.2f}",
        f"{r.trainer_peak_rss_bytes / 1e9:.2f}",
    ]


def print_table(rows: list[Row], total: int) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"model {total / 1e9:.2f} GB bf16 · memcpy {BOUNDS['memcpy']:.1f} GB/s · "
        f"socket {BOUNDS['socket']:.2f} GB/s"
    )
    for col in COLUMNS:
        table.add_column(col, justify="right" if col not in ("method", "mode") else "left")
    for r in rows:
        table.add_row(*_cells(r))
    Console(width=170).print(table)


def markdown_table(rows: list[Row]) -> str:
    """The table as Markdown (written beside the JSON, for the README; without trainer RSS)."""
    cols = COLUMNS[:-1]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(_cells(r)[: len(cols)]) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def verdicts(rows: list[Row]) -> list[str]:
    """The issue's targets, each with the numbers it was judged on."""
    by = {(r.method, r.mode, r.rollouts): r for r in rows}
    out = []

    def check(name: str, ok: bool, detail: str) -> None:
        out.append(f"{'MET ' if ok else 'MISS'} {name}: {detail}")

    def floor(r: Row, ratio: bool = True) -> str:
        """What the row's CPU work allows on this machine's cores, whatever the overlap."""
        least = r.cpu_seconds / CORES
        best = f" (<= {r.ratio_to_bound * r.seconds / least:.2f}x {r.bound})" if least and ratio else ""
        return f"; {r.mode} CPU {r.cpu_seconds:.2f} s on {CORES} cores: no schedule under {least:.3f} s{best}"

    for mode, target in (("shm", 0.4), ("tcp", 0.8), ("grpc", 0.4)):
        r = by.get(("weightsync", mode, 1))
        if r:
            rest = r.seconds - r.stage_seconds - r.pull_seconds
            alone = f"{r.pull_ratio_to_bound:.2f}x alone"
            check(
                f"{mode} N=1 end to end >= {target}x {r.bound}",
                r.ratio_to_bound >= target,
                f"{r.ratio_to_bound:.2f}x = stage {r.stage_seconds:.3f}s + pull {r.pull_seconds:.3f}s "
                f"({alone}) + tensor verify, apply, control {rest:.3f}s{floor(r)}",
            )
    for n in (1, 4):
        ours = [r for r in rows if r.method == "weightsync" and r.rollouts == n]
        peers = [r for r in rows if r.method != "weightsync" and r.rollouts == n]
        cross = [r for r in ours if r.mode in CROSS_HOST]
        gloo = by.get(("gloo", "tcp", n))
        if cross and gloo:
            best = min(cross, key=lambda r: r.seconds)
            check(
                f"best cross-host mode faster than gloo, N={n}",
                best.seconds < gloo.seconds,
                f"{best.mode} {best.seconds:.3f}s vs gloo {gloo.seconds:.3f}s "
                f"(gloo CPU {gloo.cpu_seconds:.2f} s){floor(best, ratio=False)}",
            )
        if ours and peers:
            best, peer = min(ours, key=lambda r: r.seconds), min(peers, key=lambda r: r.seconds)
            check(
                f"faster than every peer, N={n}",
                best.seconds < peer.seconds,
                f"{best.mode} {best.seconds:.3f}s vs {peer.method} {peer.seconds:.3f}s",
            )
    relay = by.get(("weightsync", "relay", 4))
    if relay:
        check("relay N=4 egress <= 1.25x model", relay.egress_ratio <= 1.25, f"{relay.egress_ratio:.2f}x")
    for r in rows:
        if r.apply_mode == "streaming":
            bound = WINDOW[0] + LARGEST[0] + (256 << 20)
            check(
                f"streaming rollout RSS <= window + largest tensor + 256 MiB ({r.mode}, N={r.rollouts})",
                r.rollout_overhead_bytes <= bound,
                f"{r.rollout_overhead_bytes / 2**20:.0f} MiB vs {bound / 2**20:.0f} MiB",
            )
    return out


def plot(rows: list[Row], path: Path) -> bool:
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
    ax.axhline(BOUNDS["socket"], color="gray", linestyle="--", label="loopback socket")
    ax.set_xticks([i + width * (len(ns) - 1) / 2 for i in range(len(labels))], labels, rotation=30, ha="right")
    ax.set_ylabel("GB/s (model bytes / seconds to every rollout)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="0.6b", help="model preset: tiny | small | medium | 0.6b")
    ap.add_argument("--runs", type=int, default=3, help="measured rounds per row (after one warm-up)")
    ap.add_argument("--rollouts", default="1,2,4")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--peers", default=",".join(PEERS))
    ap.add_argument("--chunk-bytes", type=int, default=3 << 20)
    ap.add_argument("--streaming", default="tcp", help="modes also run with --apply-mode streaming at N=1 (RSS target)")
    ap.add_argument("--out", default=str(HERE / "results" / "latest.json"))
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: stop rollouts, free the arena
    ns = [int(x) for x in args.rollouts.split(",") if x]
    modes = [m for m in args.modes.split(",") if m]
    peers = [p for p in args.peers.split(",") if p]
    params = model(args.size)
    total = model_bytes_of(params)
    LARGEST[0] = max(v.nbytes for v in params.values())
    WINDOW[0] = 2 * 32 * args.chunk_bytes
    BOUNDS["memcpy"] = memcpy_gbps(total)
    BOUNDS["socket"] = socket_gbps(total)
    print(
        f"bounds: memcpy {BOUNDS['memcpy']:.2f} GB/s, loopback socket {BOUNDS['socket']:.2f} GB/s "
        f"({BOUND_CPU['socket']:.2f} CPU s per transfer; {total / 1e9:.2f} GB, {CORES} cores)",
        flush=True,
    )
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="wsbench-") as tmp, Cluster(tmp) as cluster:
        coord = cluster.start_coordinator()
        for mode in modes:
            for n in ns:
                rows.append(run_weightsync(cluster, coord, mode, n, params, args.runs, args.chunk_bytes))
                print(f"  weightsync {mode} N={n}: {rows[-1].seconds:.3f}s {rows[-1].gbps:.2f} GB/s", flush=True)
        for mode in filter(None, args.streaming.split(",")):
            rows.append(run_weightsync(cluster, coord, mode, 1, params, args.runs, args.chunk_bytes, "streaming"))
            print(
                f"  weightsync {mode} streaming N=1: overhead RSS {rows[-1].rollout_overhead_bytes / 2**20:.0f} MiB",
                flush=True,
            )
    for method in peers:
        for n in ns:
            try:
                rows.append(run_peer(method, n, args.size, params, args.runs))
                print(f"  {method} N={n}: {rows[-1].seconds:.3f}s {rows[-1].gbps:.2f} GB/s", flush=True)
            except (ImportError, RuntimeError) as e:
                print(f"  {method} N={n}: skipped ({e})", flush=True)
                break
    print_table(rows, total)
    for line in verdicts(rows):
        print(line)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "size": args.size,
        "model_bytes": total,
        "runs": args.runs,
        "bounds_gbps": BOUNDS,
        "chunk_bytes": args.chunk_bytes,
        "bounds_cpu_seconds": BOUND_CPU,
        "cores": CORES,
    }
    out.write_text(json.dumps([asdict(r) for r in rows], indent=1))
    out.with_suffix(".meta.json").write_text(json.dumps({**meta, "verdicts": verdicts(rows)}, indent=1))
    out.with_suffix(".md").write_text(markdown_table(rows) + "\n" + "\n".join(f"- {v}" for v in verdicts(rows)) + "\n")
    png = out.with_suffix(".png")
    print(f"wrote {out}" + (f" and {png}" if plot(rows, png) else " (no matplotlib: no PNG)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
