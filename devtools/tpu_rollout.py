"""A rollout service holding the chip: tpu-inference's worker (the stand-in,
`devtools/tpu_worker_standin.py`: a real JAX Qwen3 in tpu-inference's layouts, on JAX's
default devices) with weightsync's worker extension, following a session.

    python -m devtools.tpu_rollout --coordinator unix:/run/ws/c.sock --session job \\
        --preset 0.6b --host unix:/run/ws/tpu.sock --report-dir /tmp/tpu-rollout

It attaches as `weightsync_attach` does inside vLLM (prefetch on: each new servable
version is pulled, verified and, where the applier swaps, built aside on the devices in
the background while the engine serves), then for every new servable version the
coordinator announces waits for that (`weightsync_wait_ready`) and calls
`weightsync_sync(v)`, as a vLLM-TPU driver would between steps: the engine pauses for the
swap and the refresh. After each one it computes the engine's logits of a
fixed batch of tokens on the chip (float32, highest matmul precision) and writes, into
`--report-dir`: `tokens.npy` (once), `logits-v<N>.npy`, one JSON line per version in
`versions.jsonl` (the sync's result: timings, the apply's report, the host memory of this
process before and after) and `status.json` (the extension's status). Its gRPC server
answers health only (`--host`, a unix socket on a host without inet sockets). SIGTERM
detaches and exits. `devtools/tpu_service_check.py` runs it beside a trainer.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger("tpu_rollout")
READY_WAIT_S = 300.0  # for a version to be pulled, verified and built aside before its sync


def build_parser() -> argparse.ArgumentParser:
    from weightsync.model_shapes import PRESETS

    p = argparse.ArgumentParser(prog="python -m devtools.tpu_rollout", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--coordinator", required=True, help="the coordinator's address (unix:/path on a TPU host)")
    p.add_argument("--session", required=True)
    p.add_argument("--agent-id", default="tpu-r0")
    p.add_argument("--preset", default="0.6b", choices=sorted(PRESETS), help="the Qwen3 shape the engine holds")
    p.add_argument("--mode", default="auto", choices=["auto", "swap", "inplace"], help="the JAX applier's mode")
    p.add_argument("--mesh", default="", help="data x model over the local devices (default 1 x all)")
    p.add_argument("--weight-sync-mode", default="shm", help="the data plane (shm: the trainer is on this host)")
    p.add_argument("--host-memory-limit-bytes", type=int, default=0,
                   help="the rollout's bound on its own host memory (0: none; see docs/jax-applier.md)")  # fmt: skip
    p.add_argument("--tokens", default="2x16", help="the logits batch: rows x tokens")
    p.add_argument("--host", default="", help="the health server's address (unix:/path); default 127.0.0.1")
    p.add_argument("--report-dir", required=True)
    p.add_argument("--ready-file", default="")
    p.add_argument("--log-level", default="INFO")
    return p


class _Wanted:
    """The newest servable version announced, for the loop that syncs it."""

    def __init__(self) -> None:
        self.version = 0
        self.cond = threading.Condition()

    def note(self, version: int, generation: int = 0) -> None:
        with self.cond:
            if version > self.version:
                self.version = version
                self.cond.notify_all()


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from weightsync.logs import setup_logging

    setup_logging(args.log_level, "text")
    import jax
    import ml_dtypes

    from devtools.tpu_worker_standin import TPUWorker, hf_config_of, vllm_extended
    from rollout_agent.engines.jax.model import mesh_of
    from rollout_agent.sync.follow import FollowStop, follow_servable
    from rollout_agent.vllm_worker.tpu_extension import WeightsyncTPUWorkerExtension
    from weightsync.client import CoordinatorClient
    from weightsync.host_memory import host_memory
    from weightsync.metrics import build_metrics
    from weightsync.model_shapes import PRESETS
    from weightsync.server import start_server, wait_for_signal, write_ready_file

    Worker = vllm_extended(TPUWorker, WeightsyncTPUWorkerExtension)  # as vLLM mixes worker_extension_cls in

    stop = wait_for_signal()
    report = Path(args.report_dir)
    report.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    memory = {"start": host_memory().as_dict()}
    devices = jax.local_devices()
    memory["devices_open"] = host_memory().as_dict()  # the runtime's own, before any weights
    rows, cols = (int(x) for x in args.mesh.split("x")) if args.mesh else (1, len(devices))
    shape = PRESETS[args.preset]
    worker = Worker(hf_config_of(shape), mesh_of((rows, cols), devices), dtype=ml_dtypes.bfloat16)
    memory["weights_held"] = host_memory().as_dict()
    batch, length = (int(x) for x in args.tokens.split("x"))
    tokens = np.random.default_rng(0).integers(0, shape.vocab, (batch, length), dtype=np.int64)
    np.save(report / "tokens.npy", tokens)
    t0 = time.perf_counter()
    with jax.default_matmul_precision("highest"):
        worker.compute_logits(tokens)  # compiles the forward before any version (zero weights)
    compile_s = time.perf_counter() - t0
    try:  # the forward's own HBM high-water mark, before any apply (memory_stats keeps the lifetime's)
        stats = devices[0].memory_stats() or {}
    except Exception:  # noqa: BLE001 - a backend without memory stats (CPU)
        stats = {}
    hbm = {k: stats[k] for k in ("bytes_in_use", "peak_bytes_in_use", "bytes_limit") if k in stats} or None
    worker.weightsync_attach({
        "coordinator": args.coordinator, "session": args.session, "agent_id": args.agent_id,
        "weight_sync_mode": args.weight_sync_mode, "prefetch": True,
        "host_memory_limit_bytes": args.host_memory_limit_bytes, "jax": {"mode": args.mode},
    })  # fmt: skip
    server = start_server([], host=args.host or "127.0.0.1", port=0, metrics=build_metrics("rollout"),
                          metrics_port=-1)  # fmt: skip
    wanted = _Wanted()
    follow_stop = FollowStop()
    client = CoordinatorClient(args.coordinator)
    watcher = threading.Thread(target=follow_servable, args=(client, args.session, wanted.note, follow_stop),
                               name="watch", daemon=True)  # fmt: skip
    watcher.start()
    write_ready_file(
        args.ready_file, address=server.address, agent_id=args.agent_id, platform=devices[0].platform,
        devices=len(devices), mesh=f"{rows}x{cols}", start_seconds=time.perf_counter() - started,
        forward_compile_seconds=compile_s, memory=memory,
        hbm_after_forward=hbm,
    )  # fmt: skip
    log.info("tpu rollout %s ready on %s: %s on %d %s device(s)", args.agent_id, server.address, args.preset,
             len(devices), devices[0].platform)  # fmt: skip
    tried = 0  # the newest version synced, whether it applied or not (its line says)
    try:
        while not stop.is_set():
            with wanted.cond:
                if wanted.version <= tried:
                    wanted.cond.wait(timeout=0.5)
                target = wanted.version
            if target > tried:
                _sync_one(worker, target, tokens, report)
                tried = target
    finally:
        follow_stop.set()
        worker.weightsync_detach()
        client.close()
        server.stop(grace_s=1.0)
    return 0


def _sync_one(worker: Any, version: int, tokens: np.ndarray, report: Path) -> None:
    """Syncs `version`, then writes its logits (where it applied) and its report line."""
    import jax

    from weightsync.host_memory import host_memory

    before = host_memory().as_dict()
    t0 = time.perf_counter()
    ready = worker.weightsync_wait_ready(version, READY_WAIT_S)  # pulled, verified, built aside: the engine serves
    status = worker.weightsync_status().get("prefetch") or {}
    t1 = time.perf_counter()
    result = worker.weightsync_sync(version)
    sync_s = time.perf_counter() - t1
    after = host_memory().as_dict()
    line: dict[str, Any] = {
        "version": result["version"], "ok": result["ok"], "mismatch": result["mismatch"],
        "failure": result["failure"], "bytes_pulled": result["bytes_pulled"], "timings": result["timings"],
        "apply": result["apply"], "sync_seconds": sync_s, "memory_before": before, "memory_after": after,
        "ready": ready, "ready_wait_seconds": t1 - t0, "staged": status.get("staged") == version,
    }  # fmt: skip
    if result["ok"]:
        t1 = time.perf_counter()
        with jax.default_matmul_precision("highest"):
            logits = worker.compute_logits(tokens)
        line["logits_seconds"] = time.perf_counter() - t1
        np.save(report / f"logits-v{result['version']}.npy", logits)
    status = {**worker.weightsync_status(), "memory": host_memory().as_dict()}
    _write_json(report / "status.json", status)
    with open(report / "versions.jsonl", "a") as f:
        f.write(json.dumps(line) + "\n")
    log.info("version %d: ok=%s sync %.3fs", result["version"], result["ok"], sync_s)


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_suffix(f".tmp.{os.getpid()}")
    tmp.write_text(json.dumps(data, default=str))
    os.replace(tmp, path)


if __name__ == "__main__":
    sys.exit(main())
