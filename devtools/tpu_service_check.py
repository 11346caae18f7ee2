"""The rollout service on the chip, end to end: a coordinator, the TPU rollout service
(`devtools/tpu_rollout.py`, the only process that opens the chip) and a trainer (this
process, JAX on the CPU), every one on a unix socket, the data plane `shm`, prefetch on.

    source .tpu-kit/activate && python devtools/tpu_service_check.py --preset 0.6b     # the TPU host
    python devtools/tpu_service_check.py --preset small --cpu-devices 8                # anywhere
    python devtools/tpu_service_check.py --probe-runtime   # the TPU runtime's own host memory, per setting

The trainer publishes `--versions` versions of a Qwen3 of `--preset` (bf16 with weights of
~0.02 and norms in [1, 2); each version the one before rolled by one row along every
tensor's first axis: every leaf changes). For each version it records publish-to-COMMITTED,
the rollout's pull rate, apply, pause, HBM peak and mode, and compares the logits the
engine computes on the chip from its applied leaves (tpu-inference's layouts, float32,
highest matmul precision) with the same model's logits computed here on the CPU from the
trainer's own tensors (`weightsync.models.qwen3_jax`, HF layouts): their largest
difference over the largest logit must stay within `--rtol`, where the previous version's
logits (what a stale engine serves) differ by orders of magnitude more.

A guard samples every process's resident memory (`/proc/PID/status`) and the host's
MemAvailable every 0.2 s: where MemAvailable falls below `--min-available-gib`, or the
processes' own memory (their RssAnon summed, plus the largest RssShmem: the arena, shared)
passes `--memory-budget-gib`, it kills them all before the host runs out, and says so.
Writes `tpu_service.json` (and the logs) into $OUT (default /tmp/tpu-service-check);
exits 0 when every version committed with the logits, pause and HBM within their bounds.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # a checkout run as `python devtools/tpu_service_check.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from weightsync.host_memory import HostMemory, host_memory, mem_available  # noqa: E402

GIB = 1 << 30
SWAP_PAUSE_S = 0.05  # a swap's pause on the chip stays under this (docs/jax-applier.md)


def build_parser() -> argparse.ArgumentParser:
    from weightsync.model_shapes import PRESETS

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="0.6b", choices=sorted(PRESETS))
    p.add_argument("--versions", type=int, default=3)
    p.add_argument("--mode", default="auto", choices=["auto", "swap", "inplace"], help="the rollout's apply mode")
    p.add_argument("--cpu-devices", type=int, default=0, help="the service on N CPU devices, not the chip")
    p.add_argument("--rtol", type=float, default=1e-4, help="largest logit difference over the largest logit")
    p.add_argument("--memory-budget-gib", type=float, default=30.0)
    p.add_argument("--min-available-gib", type=float, default=4.0)
    p.add_argument("--host-memory-limit-gib", type=float, default=0.0,
                   help="the rollout's host_memory_limit_bytes (0: none)")  # fmt: skip
    p.add_argument("--deadline-s", type=float, default=420.0, help="the whole run, processes' start included")
    p.add_argument("--out", default="", help="where the JSON and logs go (default $OUT, else /tmp/tpu-service-check)")
    p.add_argument(
        "--probe-runtime",
        action="store_true",
        help="instead: the TPU runtime's own host memory, per setting (tpu_runtime_memory.json)",
    )
    p.add_argument("--probe-child", default="", help=argparse.SUPPRESS)
    return p


# TPU runtime settings whose host memory the probe compares (env of a process that opens the chip).
# TPU_PREMAPPED_BUFFER_SIZE: host memory premapped and pinned for DMA (4 GiB by default, Cloud TPU's docs).
RUNTIME_SETTINGS: dict[str, dict[str, str]] = {
    "default": {},
    "premapped_1gib": {"TPU_PREMAPPED_BUFFER_SIZE": str(1 << 30)},
    "premapped_256mib": {"TPU_PREMAPPED_BUFFER_SIZE": str(256 << 20)},
}
PROBE_BYTES = 1 << 30  # what the probe moves to the device: the H2D rate each setting gives


def probe_runtime(args: argparse.Namespace) -> dict[str, Any]:
    """Opens the chip once per setting, each in a fresh process, and records its memory at
    each stage (`_probe`): the runtime's own resident set, what kind it is, and whether
    the host's MemAvailable fell by as much (real memory) or not (mapped, shared, cache)."""
    out: dict[str, Any] = {}
    env = {k: v for k, v in os.environ.items() if k not in ("TPU_PREMAPPED_BUFFER_SIZE",)}
    env["JAX_PLATFORMS"] = "cpu" if args.cpu_devices else ""
    for name, setting in RUNTIME_SETTINGS.items():
        try:
            proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--probe-child", name],
                                  env={**env, **setting}, capture_output=True, text=True, timeout=150)  # fmt: skip
            lines = proc.stdout.strip().splitlines()
            out[name] = json.loads(lines[-1]) if proc.returncode == 0 and lines else {"error": proc.stderr[-2000:]}
        except subprocess.TimeoutExpired:
            out[name] = {"error": "no answer within 150 s"}
        out[name]["env"] = setting
    return out


def _probe(name: str) -> dict[str, Any]:
    """In a fresh process: memory before JAX, with the devices open, with a 1 GiB host
    array, with it on the device, and with the host array freed."""
    import gc

    stages = {"start": _snapshot()}
    t0 = time.perf_counter()
    import jax

    device = jax.devices()[0]
    open_s = time.perf_counter() - t0
    stages["devices_open"] = _snapshot()
    host = np.ones(PROBE_BYTES // 4, np.float32)
    stages["host_array"] = _snapshot()
    t1 = time.perf_counter()
    on_device = jax.device_put(host, device)
    on_device.block_until_ready()
    h2d_s = time.perf_counter() - t1
    stages["on_device"] = _snapshot()
    del host
    gc.collect()
    stages["host_array_freed"] = _snapshot()
    return {"setting": name, "platform": device.platform, "open_seconds": open_s,
            "h2d_gbps": PROBE_BYTES / h2d_s / 1e9, "stages": stages}  # fmt: skip


def _snapshot() -> dict[str, Any]:
    """This process's memory by kind, its virtual size, the host's MemAvailable and, where
    the kernel has it, /proc/self/smaps_rollup (Private_Dirty: pages only this process
    wrote; Pss: its proportional share)."""
    snap: dict[str, Any] = {**host_memory().as_dict(), "mem_available": mem_available()}
    for path, keys in (("/proc/self/status", ("VmSize", "VmLck", "VmPin")),
                       ("/proc/self/smaps_rollup", ("Pss", "Private_Dirty", "Private_Clean", "Shared_Dirty",
                                                    "Shared_Clean", "Anonymous", "AnonHugePages"))):  # fmt: skip
        try:
            for line in Path(path).read_text().splitlines():
                key, _, rest = line.partition(":")
                if key in keys:
                    snap[key] = int(rest.split()[0]) * 1024
        except (OSError, ValueError, IndexError):
            snap[path] = "unreadable"
    return snap


class MemoryGuard:
    """Samples the watched processes' memory and the host's MemAvailable; past either
    bound it calls `on_trip` (which kills them) once and records why."""

    def __init__(self, budget: int, floor: int, on_trip: Callable[[], None], period_s: float = 0.2) -> None:
        self.budget, self.floor, self.on_trip, self.period_s = budget, floor, on_trip, period_s
        self.pids: dict[str, int | str] = {"trainer": "self"}
        self.peaks: dict[str, dict[str, int]] = {}
        self.min_available = mem_available()
        self.tripped = ""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="memory-guard", daemon=True)

    def __enter__(self) -> MemoryGuard:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def watch(self, name: str, pid: int) -> None:
        self.pids[name] = pid
        if self.tripped:  # started after the guard tripped: stopped at once too
            self.on_trip()

    def check(self) -> None:
        """RuntimeError once the guard tripped (every process it watches was killed)."""
        if self.tripped:
            raise RuntimeError(f"memory guard: {self.tripped}")

    def sample(self) -> dict[str, HostMemory]:
        now = {name: host_memory(pid) for name, pid in list(self.pids.items())}
        for name, m in now.items():
            peak = self.peaks.setdefault(name, {})
            for kind, n in m.as_dict().items():
                peak[kind] = max(peak.get(kind, 0), n)
            peak["by_kind"] = m.by_kind
        return now

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            now = self.sample()
            available = mem_available()
            if available:
                self.min_available = min(self.min_available or available, available)
            own = sum(m.own for m in now.values()) + max((m.shmem for m in now.values()), default=0)
            why = ""
            if available and available < self.floor:
                why = f"MemAvailable {available / GIB:.1f} GiB fell below {self.floor / GIB:.1f} GiB"
            elif own > self.budget:
                why = f"the processes hold {own / GIB:.1f} GiB, past the budget of {self.budget / GIB:.1f} GiB"
            if why:
                self.tripped = why + ": " + ", ".join(f"{n} own {m.own / GIB:.1f} GiB" for n, m in now.items())
                self.on_trip()
                return


def make_base(preset: str, seed: int = 0) -> dict[str, np.ndarray]:
    """HF-named bf16 tensors: weights of magnitude in [2^-7, 2^-5) with random signs,
    norms in [1, 2) (a deep random model whose logits stay finite and of order one)."""
    import ml_dtypes

    from weightsync.model_shapes import PRESETS, param_shapes

    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in param_shapes(PRESETS[preset]).items():
        bits = rng.integers(0, 1 << 16, int(np.prod(shape)), dtype=np.uint16)
        bits = 0x3F80 | (bits & 0x7F) if name.endswith("norm.weight") else 0x3C00 | (bits & 0x80FF)
        out[name] = bits.view(ml_dtypes.bfloat16).reshape(shape)
    return out


def version_of(base: dict[str, np.ndarray], v: int) -> dict[str, np.ndarray]:
    """Version v: every tensor of the base rolled by v rows along its first axis."""
    return {name: np.roll(a, v, axis=0) for name, a in base.items()}


def reference_logits(tensors: dict[str, np.ndarray], preset: str, tokens: np.ndarray) -> np.ndarray:
    """The model's float32 logits on this process's CPU, from the trainer's tensors in HF
    layouts, op by op (no compile of the whole model), at the highest matmul precision."""
    import jax
    import jax.numpy as jnp

    from weightsync.model_shapes import PRESETS
    from weightsync.models.qwen3_jax import Qwen3Config, forward

    shape = PRESETS[preset]
    cfg = Qwen3Config(**{f: getattr(shape, f) for f in shape.__dataclass_fields__})
    with jax.default_matmul_precision("highest"):
        params = {n: jnp.asarray(a) for n, a in tensors.items()}
        return np.asarray(forward(params, cfg, jnp.asarray(tokens)))


def _read_lines(path: Path) -> dict[int, dict[str, Any]]:
    if not path.exists():
        return {}
    out = {}
    for line in path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            out[row["version"]] = row
    return out


def run(args: argparse.Namespace, out: dict[str, Any], workdir: Path, report: Path) -> None:
    from devtools.cluster import Cluster
    from trainer_agent.publish.publisher import WeightPublisher
    from trainer_agent.settings import PublisherSettings
    from weightsync.model_shapes import PRESETS, param_shapes

    deadline = time.monotonic() + args.deadline_s

    def left() -> float:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"past the deadline of {args.deadline_s:.0f} s")
        return remaining

    sock = lambda name: f"unix:{workdir}/{name}.sock"  # noqa: E731
    if args.cpu_devices:
        flags = f"--xla_force_host_platform_device_count={args.cpu_devices}"
        service_env = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": flags}
    else:
        service_env = {"JAX_PLATFORMS": ""}  # JAX's own choice: the chip
    session = "tpu-check"
    shape = PRESETS[args.preset]
    model_bytes = sum(int(np.prod(s)) * 2 for s in param_shapes(shape).values())
    out["model_bytes"] = model_bytes
    with Cluster(workdir / "procs") as cluster:
        guard = MemoryGuard(int(args.memory_budget_gib * GIB), int(args.min_available_gib * GIB),
                            lambda: _kill_all(cluster))  # fmt: skip
        out["memory"] = {"guard": guard}
        with guard:
            coord = cluster.start_coordinator(host=sock("coordinator"), args=["--metrics-port", "-1"])
            guard.watch("coordinator", coord.pid)
            service_args = [
                "--coordinator", coord.address, "--session", session, "--preset", args.preset, "--mode", args.mode,
                "--host", sock("tpu-rollout"), "--report-dir", str(report),
                "--host-memory-limit-bytes", str(int(args.host_memory_limit_gib * GIB)),
            ]  # fmt: skip
            t0 = time.perf_counter()
            service = cluster.start("tpu-rollout", "devtools.tpu_rollout", service_args, wait=False, env=service_env)
            guard.watch("tpu-rollout", service.pid)
            base = make_base(args.preset)  # while the service opens the chip
            cluster.wait_ready(service, timeout_s=min(300.0, left()))
            guard.check()
            out["service"] = {k: v for k, v in service.ready.items() if k not in ("address", "pid")}
            out["service"]["ready_seconds"] = time.perf_counter() - t0
            tokens = np.load(report / "tokens.npy")
            settings = PublisherSettings(
                coordinator=coord.address, session=session, host=sock("trainer"), weight_sync_mode="shm",
                min_rollouts=1, metrics_port=-1,
            )  # fmt: skip
            rows: list[dict[str, Any]] = []
            out["per_version"] = rows
            previous: np.ndarray | None = None
            with WeightPublisher(settings) as pub:
                for v in range(1, args.versions + 1):
                    tensors = version_of(base, v)
                    t1 = time.perf_counter()
                    published = pub.publish(tensors, v)
                    state = _wait_committed(pub, v, guard, left)
                    row: dict[str, Any] = {
                        "version": v, "state": state, "stage_seconds": published.stage_seconds,
                        "publish_seconds": published.publish_seconds,
                        "publish_to_committed_seconds": time.perf_counter() - t1,
                    }  # fmt: skip
                    rows.append(row)
                    line = _wait_line(report / "versions.jsonl", v, guard, left)
                    row.update(_service_row(line))
                    ref = reference_logits(tensors, args.preset, tokens)
                    del tensors
                    served_path = report / f"logits-v{v}.npy"
                    if served_path.exists():
                        row.update(_compare(np.load(served_path), ref, previous, args.rtol))
                    previous = ref
                    if state != "COMMITTED" or not row.get("logits_ok"):
                        break
            out["service_status"] = json.loads((report / "status.json").read_text())
            guard.sample()
            for name, proc in cluster.procs.items():  # VmHWM: each process's own high-water mark
                # None: unknown (gVisor has no VmHWM, and another process's getrusage is not ours)
                out["memory"].setdefault("vmhwm", {})[name] = host_memory(proc.pid).peak or None
            out["memory"]["vmhwm"]["trainer"] = host_memory().peak


def _wait_committed(pub: Any, v: int, guard: MemoryGuard, left: Callable[[], float]) -> str:
    from weightsync.errors import DeadlineExceeded

    while True:
        guard.check()
        try:
            return str(pub.wait_committed(v, min(2.0, left())))
        except DeadlineExceeded:
            continue


def _wait_line(path: Path, v: int, guard: MemoryGuard, left: Callable[[], float]) -> dict[str, Any]:
    while True:
        guard.check()
        line = _read_lines(path).get(v)
        if line is not None:
            return line
        time.sleep(min(0.1, left()))


def _service_row(line: dict[str, Any]) -> dict[str, Any]:
    """What the rollout said of a version: pull, apply, pause, HBM, its memory after."""
    t, a = line.get("timings", {}), line.get("apply", {})
    pull_s = t.get("pull_seconds", 0.0)
    return {
        "rollout_ok": line["ok"], "mismatch": line["mismatch"], "bytes_pulled": line["bytes_pulled"],
        "pull_seconds": pull_s, "pull_gbps": line["bytes_pulled"] / pull_s / 1e9 if pull_s else None,
        "verify_seconds": t.get("verify_seconds"), "apply_seconds": t.get("apply_seconds"),
        "pause_seconds": t.get("pause_seconds"), "ready_to_serving_seconds": t.get("ready_to_serving_seconds"),
        "sync_seconds": line["sync_seconds"], "logits_seconds": line.get("logits_seconds"),
        "staged": line.get("staged"), "ready_wait_seconds": line.get("ready_wait_seconds"),
        "apply_mode": a.get("mode"), "transfer": a.get("transfer"), "groups": a.get("groups"),
        "build_seconds": a.get("build_seconds"), "wait_seconds": a.get("wait_seconds"),
        "fingerprint_seconds": a.get("fingerprint_seconds"),
        "host_fingerprint_seconds": a.get("host_fingerprint_seconds"),
        "hbm_before_bytes": a.get("hbm_before_bytes"), "hbm_peak_bytes": a.get("hbm_peak_bytes"),
        "hbm_limit_bytes": a.get("hbm_limit_bytes"), "rollout_memory_after": line.get("memory_after"),
    }  # fmt: skip


def _compare(served: np.ndarray, ref: np.ndarray, previous: np.ndarray | None, rtol: float) -> dict[str, Any]:
    scale = float(np.abs(ref).max())
    err = float(np.abs(served.astype(np.float64) - ref).max())
    stale = float(np.abs(served.astype(np.float64) - previous).max()) / scale if previous is not None else None
    finite = bool(np.isfinite(served).all() and np.isfinite(ref).all())
    return {
        "logits_scale": scale, "logits_max_abs_err": err, "logits_rel_err": err / scale if scale else None,
        "stale_rel_diff": stale, "logits_ok": finite and scale > 0 and err <= rtol * scale,
    }  # fmt: skip


def _kill_all(cluster: Any) -> None:
    for proc in cluster.procs.values():
        if proc.alive():
            proc.popen.send_signal(signal.SIGKILL)


def summarize(out: dict[str, Any], args: argparse.Namespace) -> None:
    """The run's verdict from its rows: every version committed, logits within rtol, the
    pause and the HBM peak within their bounds."""
    rows = out.get("per_version", [])
    model = out.get("model_bytes", 0)
    largest = 0
    if model:
        from weightsync.model_shapes import PRESETS, param_shapes

        largest = max(int(np.prod(s)) * 2 for s in param_shapes(PRESETS[args.preset]).values())
    # memory_stats' peak is the process's: where the engine's forward (run before any apply)
    # already passed an apply's budget, the peak says nothing of the apply
    forward_peak = (out.get("service", {}).get("hbm_after_forward") or {}).get("peak_bytes_in_use")
    for row in rows:
        mode = row.get("apply_mode")
        budget = 2 * model + (256 << 20) if mode == "swap" else model + largest + (256 << 20)
        row["hbm_budget_bytes"] = budget
        peak = row.get("hbm_peak_bytes")
        judged = peak is not None and (forward_peak is None or forward_peak <= budget)
        row["hbm_ok"] = peak <= budget if judged else None
        pause = row.get("pause_seconds")
        row["pause_ok"] = None if mode != "swap" or pause is None else pause < SWAP_PAUSE_S
    committed = [r for r in rows if r["state"] == "COMMITTED" and r.get("rollout_ok")]
    out["committed"] = len(committed)
    out["platform"] = out.get("service", {}).get("platform")
    # the pause bound is the chip's: CPU devices share this host's cores with every other process
    timed = out["platform"] not in (None, "cpu")
    out["ok"] = (
        len(committed) == args.versions
        and all(r.get("logits_ok") for r in rows)
        and all(r["hbm_ok"] is not False and (r["pause_ok"] is not False or not timed) for r in rows)
        and not out.get("error")
    )
    guard = out.get("memory", {}).get("guard")
    if isinstance(guard, MemoryGuard):
        out["memory"]["peaks"] = guard.peaks
        out["memory"]["min_mem_available"] = guard.min_available
        out["memory"]["guard_tripped"] = guard.tripped
        out["memory"]["budget_bytes"], out["memory"]["floor_bytes"] = guard.budget, guard.floor
        del out["memory"]["guard"]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.probe_child:  # (JAX's platform comes from the parent's env)
        print(json.dumps(_probe(args.probe_child)))
        return 0
    os.environ["JAX_PLATFORMS"] = "cpu"  # before JAX is imported: one process holds the chip, not this one
    out_dir = Path(args.out or os.environ.get("OUT") or "/tmp/tpu-service-check")
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.probe_runtime:
        probe = probe_runtime(args)
        (out_dir / "tpu_runtime_memory.json").write_text(json.dumps(probe, indent=1))
        keys = ("open_seconds", "h2d_gbps", "error")
        print(json.dumps({name: {k: r.get(k) for k in keys} for name, r in probe.items()}))
        return 0 if all("error" not in r for r in probe.values()) else 1
    workdir = Path(tempfile.mkdtemp(prefix="ws-tpu-"))  # short: unix socket paths are at most 107 bytes
    report = workdir / "report"
    out: dict[str, Any] = {"preset": args.preset, "versions": args.versions, "mode": args.mode, "rtol": args.rtol,
                           "cpu_devices": args.cpu_devices, "ok": False}  # fmt: skip
    t0 = time.perf_counter()
    try:
        run(args, out, workdir, report)
    except Exception as e:  # noqa: BLE001 - recorded in the JSON, which is what the run is for
        out["error"] = f"{type(e).__name__}: {e}"
    finally:
        out["seconds"] = time.perf_counter() - t0
        summarize(out, args)
        for log in (workdir / "procs").glob("*.log"):
            shutil.copy(log, out_dir / log.name)
        shutil.rmtree(workdir, ignore_errors=True)
        (out_dir / "tpu_service.json").write_text(json.dumps(out, indent=1, default=str))
    print(json.dumps({k: out.get(k) for k in ("ok", "committed", "versions", "seconds", "error")}, default=str))
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
