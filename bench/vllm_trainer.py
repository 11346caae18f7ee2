"""vLLM trainer-side benchmark (`make bench-vllm-trainer`): `send_weights` of the
`weightsync` trainer engine against `WeightPublisher.publish`, the same bytes, one run.

The preset's bf16 tensors (`--size`, default 0.6b: 1.19 GB) are held twice over one
buffer: as NumPy arrays, and as the `nn.Parameter`s (requires_grad) of a torch module on
the CPU, named as the checkpoint. Rounds alternate between
- `WeightPublisher.publish` of the NumPy arrays (the bound), and
- `WeightsyncTrainerEngine.send_weights()` over `ModuleSource(module)` (torch views,
  metadata() planning the layout, the stream staged into the arena, start/update/finish),
each with its own publisher and session on one coordinator, arenas warm (a first round of
each is not timed). The client is one whose calls return at once and the engine does not
wait for a commit: a worker's pull and apply cost the same whichever way the trainer
published, so this measures what the trainer side adds. Prints one line per round kind and
the ratio of their medians (target <= 1.3x), and that of their fastest rounds; `--json` one
JSON object instead.

`--end-to-end` measures vLLM's HTTP trainer flow whole instead: it writes a checkpoint of
the preset's shape offline (config and tokenizer; the server loads dummy weights), starts
vLLM's OpenAI server as a user would (`weightsync-vllm serve`, multiprocess, dev mode,
backend `weightsync`, the worker extension, bf16, TP 1) and a coordinator, and
runs three kinds of rounds on the same bytes:
- `make bench`'s tcp N=1 round (`runners.WeightsyncRun`: publish to COMMITTED, one rollout
  sidecar), half of them before the vLLM rounds and half after;
- alternating: vLLM's flow as its examples write it: `/pause`, `send_weights()`, `/resume`;
- the split flow: `publish_weights()` and `wait_prefetched()` while the engine could
  generate, then `/pause`, `apply_weights()`, `/resume`;
- then one round per defect class (`bench/vllm_defects.py`): refused, the served weights
  unchanged (the engine's version, every worker's fresh audit exact), the next good
  version applied.
It prints the medians of send_weights, publish-to-prefetched, the pause (`/pause` to
`/resume`) and the worker's apply (its handshake's apply_seconds), with the ratios the
targets name: send_weights / tcp N=1 (target <= 2x) and pause / apply (target <= 1.5x).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from common import cpu_seconds, emit_json, model  # noqa: E402
from vllm_defects import run_defects  # noqa: E402

TARGET_RATIO = 1.3
TARGET_SEND_TO_TCP = 2.0  # send_weights within 2x of make bench's tcp N=1 in the same run
TARGET_PAUSE_TO_APPLY = 1.5
EXTENSION = "rollout_agent.vllm_worker_extension.WeightsyncWorkerExtension"


class InstantClient:
    """vLLM's four client calls, returning at once (no worker behind them)."""

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None: ...

    def start_weight_update(self) -> None: ...

    def update_weights(self, update_info: Any) -> None: ...

    def finish_weight_update(self, weight_version: str | None = None) -> None: ...


def module_of(params: dict[str, Any]) -> Any:
    """A torch module whose named_parameters() are `params`, in order, under their names."""
    import torch

    root = torch.nn.Module()
    for name, tensor in params.items():
        *path, leaf = name.split(".")
        parent = root
        for part in path:
            if not hasattr(parent, part):
                parent.add_module(part, torch.nn.Module())
            parent = getattr(parent, part)
        parent.register_parameter(leaf, torch.nn.Parameter(tensor))
    return root


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="0.6b", help="model preset (weightsync.model_shapes.PRESETS)")
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds of each kind")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--end-to-end", action="store_true", help="against a real vLLM server (see above)")
    ap.add_argument("--out", default="", help="--end-to-end: also write the JSON result here")
    ap.add_argument("--dtype", default="bfloat16", help="--end-to-end: what the server serves (the trainer sends bf16)")
    args = ap.parse_args()
    if args.end_to_end:
        return end_to_end(args)
    try:
        import torch
        from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory
    except ImportError as e:
        print(f"torch and vLLM are needed ({e}); install the vllm extra")
        return 3
    from devtools.cluster import Cluster
    from trainer_agent.publish.publisher import WeightPublisher
    from trainer_agent.settings import PublisherSettings
    from trainer_agent.vllm_trainer import WeightsyncTrainerInitInfo

    arrays = model(args.size)
    nbytes = sum(a.nbytes for a in arrays.values())
    tensors = {k: torch.from_numpy(a.view("uint16")).view(torch.bfloat16) for k, a in arrays.items()}
    module = module_of(tensors)
    assert all(p.requires_grad for p in module.parameters())
    publish_s: list[float] = []
    send_s: list[float] = []
    with Cluster(Path(tempfile.mkdtemp(prefix="bench-vllm-trainer-"))) as cluster:
        address = cluster.start_coordinator().address
        info = WeightsyncTrainerInitInfo(address, "torch", rank=0, commit_timeout_s=0)
        engine = WeightTransferTrainerFactory.trainer_init(
            init_info=info, client=InstantClient(), source=ModuleSource(module)
        )
        try:
            with WeightPublisher(PublisherSettings(coordinator=address, session="numpy")) as pub:
                for version in range(1, args.rounds + 2):  # the first round of each warms its arena
                    t0 = time.perf_counter()
                    pub.publish(arrays, version)
                    t1 = time.perf_counter()
                    engine.send_weights()
                    t2 = time.perf_counter()
                    if version > 1:
                        publish_s.append(t1 - t0)
                        send_s.append(t2 - t1)
                path = pub.last_path
        finally:
            engine.shutdown()
    bound, ours = statistics.median(publish_s), statistics.median(send_s)
    result = {
        "preset": args.size,
        "bytes": nbytes,
        "rounds": args.rounds,
        "publish_numpy_s": bound,
        "publish_path": path,
        "send_weights_torch_s": ours,
        "ratio": ours / bound,
        "best_ratio": min(send_s) / min(publish_s),  # the fastest of each: less of a busy host's noise
        "target_ratio": TARGET_RATIO,
        "publish_numpy_rounds_s": publish_s,
        "send_weights_rounds_s": send_s,
    }
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{args.size}: {nbytes / 1e9:.2f} GB of bf16 tensors, median of {args.rounds} rounds each")
    print(f"  WeightPublisher.publish (NumPy, {path} path): {bound:.3f} s  {nbytes / bound / 1e9:.2f} GB/s")
    print(f"  send_weights (CPU torch, ModuleSource):     {ours:.3f} s  {nbytes / ours / 1e9:.2f} GB/s")
    verdict = "MET " if ours / bound <= TARGET_RATIO else "MISS"
    print(f"{verdict} send_weights / publish = {ours / bound:.2f}x (target <= {TARGET_RATIO}x)")
    print(f"     fastest round of each: {result['best_ratio']:.2f}x")
    return 0


class VllmServer:
    """vLLM's OpenAI server in a process group of its own, as a user starts it. Its log is
    in the error when it does not come up; the group is killed at the end and the
    shared-memory files it left removed."""

    def __init__(self, model_dir: Path, log_path: Path, dtype: str, start_timeout_s: float = 600.0) -> None:
        self.model_dir, self.log_path, self.dtype, self.start_timeout_s = model_dir, log_path, dtype, start_timeout_s
        self.proc: subprocess.Popen[bytes] | None = None
        self.base = ""

    def __enter__(self) -> VllmServer:
        import requests

        self.shm_before = _vllm_shm()
        port = _free_port()
        env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
        env.update(VLLM_SERVER_DEV_MODE="1", HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))
        command = [sys.executable, "-m", "rollout_agent.vllm_cli", "serve", str(self.model_dir)]
        command += ["--host", "127.0.0.1", "--port", str(port), "--load-format", "dummy", "--dtype", self.dtype]
        command += ["--max-model-len", "128", "--kv-cache-memory-bytes", str(256 << 20), "--block-size", "32"]
        command += ["--enforce-eager", "--weight-transfer-config", '{"backend": "weightsync"}']
        command += ["--worker-extension-cls", EXTENSION]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                         start_new_session=True)  # fmt: skip
        self.base = base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.__exit__()
                raise RuntimeError(f"vLLM's server did not come up:\n{self.log_path.read_text()[-4000:]}")
            try:
                if requests.get(f"{base}/health", timeout=2).status_code == 200:
                    return self
            except requests.RequestException:
                pass
            time.sleep(1.0)

    def pids(self) -> list[int]:
        """The server's processes (API server, engine core, workers: its process group)."""
        assert self.proc is not None
        out = []
        for entry in Path("/proc").iterdir():
            with contextlib.suppress(ValueError, OSError):
                if os.getpgid(int(entry.name)) == self.proc.pid:
                    out.append(int(entry.name))
        return out

    def __exit__(self, *exc: object) -> None:
        if self.proc is None:
            return
        for sig, wait_s in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)  # the engine and its workers too
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(wait_s)
                break
        time.sleep(0.5)
        for path in _vllm_shm() - self.shm_before:
            path.unlink(missing_ok=True)
        self.proc = None


def _vllm_shm() -> set[Path]:
    shm = Path("/dev/shm")
    return set(shm.glob("vllm_dist_*")) | set(shm.glob("psm_*"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def end_to_end(args: argparse.Namespace) -> int:
    """vLLM's HTTP trainer flow against a real server beside make bench's tcp N=1 (see the
    module docstring)."""
    try:
        import requests
        import torch
        from vllm.distributed.weight_transfer import (
            HTTPVLLMWeightSyncClient,
            ModuleSource,
            WeightTransferTrainerFactory,
        )
    except ImportError as e:
        print(f"torch and vLLM are needed ({e}); install the vllm extra")
        return 3
    from runners import WeightsyncRun

    from devtools.cluster import Cluster
    from devtools.tiny_models import write_tiny_model
    from trainer_agent.vllm_trainer import WeightsyncTrainerInitInfo
    from weightsync.layout import DEFAULT_CHUNK_BYTES

    arrays = model(args.size)
    nbytes = sum(a.nbytes for a in arrays.values())
    module = module_of({k: torch.from_numpy(a.view("uint16")).view(torch.bfloat16) for k, a in arrays.items()})
    root = Path(tempfile.mkdtemp(prefix="bench-vllm-e2e-"))
    model_dir = write_tiny_model(root / "model", shape=args.size, weights=False, dtype=args.dtype)
    kinds = ("tcp", "send", "send_pause", "send_apply", "publish", "prefetched", "pause", "apply", "pull", "verify")
    rows: dict[str, list[float]] = {k: [] for k in (*kinds, "worker_cpu")}
    with Cluster(root / "cluster") as cluster, VllmServer(model_dir, root / "server.log", args.dtype) as server:
        base = server.base
        coord = cluster.start_coordinator()

        def tcp_rounds(n: int) -> None:
            """make bench's tcp N=1 rows: a rollout sidecar, a warm-up round, `n` rounds. Run
            before and after the vLLM rounds, not beside them: three arenas and a sidecar's
            buffers beside the server are more than a shared 24 GB host keeps free."""
            tcp = WeightsyncRun(cluster, coord, "tcp", 1, arrays, DEFAULT_CHUNK_BYTES).start()
            try:
                tcp.round()
                rows["tcp"].extend(tcp.round().seconds for _ in range(n))
            finally:
                tcp.close()

        tcp_rounds((args.rounds + 1) // 2)
        info = WeightsyncTrainerInitInfo(coord.address, "vllm-e2e", rank=0)
        engine = WeightTransferTrainerFactory.trainer_init(
            init_info=info, client=HTTPVLLMWeightSyncClient(base), source=ModuleSource(module)
        )
        assert engine.publisher is not None
        client, session = engine.publisher.client, engine.publisher.session

        def post(route: str) -> None:
            requests.post(f"{base}/{route}", timeout=600).raise_for_status()

        def worker_timings(version: int) -> Any:
            (h,) = [h for h in client.status(session, 8).handshakes if h.version == version and h.ok]
            return h.timings

        workers = server.pids()
        try:
            for r in range(args.rounds + 1):  # the first round of each kind warms up
                t0 = time.perf_counter()
                post("pause")
                t1 = time.perf_counter()
                engine.send_weights()  # vLLM's flow: publish, then start/update/finish back to back
                t2 = time.perf_counter()
                post("resume")
                t3 = time.perf_counter()
                send_apply = worker_timings(engine.version).apply_seconds
                cpu0 = cpu_seconds(workers)
                t4 = time.perf_counter()
                engine.publish_weights()  # the split flow: the engine could generate through these two
                t5 = time.perf_counter()
                if not engine.wait_prefetched(timeout_s=600):
                    raise RuntimeError(f"version {engine.version} was not prefetched within 600 s")
                t6 = time.perf_counter()
                post("pause")
                engine.apply_weights()
                post("resume")
                t7 = time.perf_counter()
                if r:
                    split = worker_timings(engine.version)
                    got = dict(send=t2 - t1, send_pause=t3 - t0, send_apply=send_apply, publish=t5 - t4)
                    got.update(prefetched=t6 - t4, pause=t7 - t6, apply=split.apply_seconds)
                    got.update(pull=split.pull_seconds, verify=split.verify_seconds)
                    got.update(worker_cpu=cpu_seconds(workers) - cpu0)
                    for key, value in got.items():
                        rows[key].append(value)
            refused = run_defects(engine, engine.source, base, post, client, session)
        finally:
            engine.shutdown()
        tcp_rounds(args.rounds // 2 or 1)
    med = {k: statistics.median(v) for k, v in rows.items()}
    result = {
        "preset": args.size,
        "bytes": nbytes,
        "rounds": args.rounds,
        "dtype": args.dtype,
        "medians_s": med,
        "send_weights_to_tcp": med["send"] / med["tcp"],
        "prefetched_to_tcp": med["prefetched"] / med["tcp"],
        "send_pause_to_apply": med["send_pause"] / med["send_apply"],
        "pause_to_apply": med["pause"] / med["apply"],
        "targets": {"send_weights_to_tcp": TARGET_SEND_TO_TCP, "pause_to_apply": TARGET_PAUSE_TO_APPLY},
        "rounds_s": rows,
        "defects": refused,
    }
    if args.json:
        emit_json(result, args.out)
        return 0
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    shown = {k: f"{v:.3f}" for k, v in med.items()}
    print(f"{args.size}: {nbytes / 1e9:.2f} GB of bf16 tensors into vLLM's server (TP 1), median of {args.rounds}")
    print(f"  make bench tcp N=1 (publish to COMMITTED):            {shown['tcp']} s")
    print(
        f"  vLLM's flow: send_weights {shown['send']} s, pause {shown['send_pause']} s, apply {shown['send_apply']} s"
    )
    print(f"  split flow: publish {shown['publish']} s, publish to prefetched {shown['prefetched']} s, "
          f"pause {shown['pause']} s, apply {shown['apply']} s")  # fmt: skip
    print(f"  the worker's prefetch: pull {shown['pull']} s, verify {shown['verify']} s "
          f"({nbytes / med['verify'] / 1e9:.2f} GB/s on its one core)")  # fmt: skip
    for r in refused["rounds"]:
        shown_r = ", ".join(k for k in ("refused", "served_unchanged", "audit_exact", "next_applied") if r[k])
        print(f"  defect {r['defect']}: {shown_r or 'nothing held'} ({r['refused_s']:.3f} s to the refusal)")
    held = "MET " if refused["held"] == refused["of"] else "MISS"
    print(f"{held} refused versions leave the served weights as they were: {refused['held']} of {refused['of']}")
    for label, ratio, target in (
        ("send_weights / tcp N=1", result["send_weights_to_tcp"], TARGET_SEND_TO_TCP),
        ("publish to prefetched / tcp N=1", result["prefetched_to_tcp"], TARGET_SEND_TO_TCP),
        ("vLLM's flow: pause / apply", result["send_pause_to_apply"], TARGET_PAUSE_TO_APPLY),
        ("split flow: pause / apply", result["pause_to_apply"], TARGET_PAUSE_TO_APPLY),
    ):
        print(f"{'MET ' if ratio <= target else 'MISS'} {label} = {ratio:.2f}x (target <= {target}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
