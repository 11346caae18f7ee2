"""weightsync inside a real vLLM TPU engine on the chip, end to end, in one run.

    source .tpu-kit/activate-vllm && python devtools/tpu_vllm_check.py          # the TPU host
    python devtools/tpu_vllm_check.py --engine standin                          # anywhere: the stand-in

A coordinator (unix socket), the engine (`devtools/tpu_vllm_engine.py`: `LLM(...)` with
weightsync's worker extension and the `weightsync` weight-transfer backend, tpu-inference's
flax_nnx Qwen3; the only process that opens the chip) and a trainer (this process, JAX on
the CPU). The model is a tiny Qwen3 made here: bf16, head_dim 128 (what tpu-inference 0.25
loads), weights of std 0.02.

The trainer publishes three versions of that checkpoint, each perturbed (every tensor plus
10% of its own spread of seeded noise), then a corrupted fourth (layer 1's q_proj a row
short). After each version the engine applies it through vLLM's `update_weights` and
generates greedily with the top log-probs at every step; a reference forward of the
published weights here (weightsync's JAX Qwen3, float32, highest matmul precision) over
the same tokens gives their log-probs: the largest difference is recorded beside the one
against the version before (what a stale engine would serve). The corrupted version must
be refused, the engine must then serve exactly what it served before (same tokens and
log-probs) and its audit must find the last good version exact.

Every stage logs with a timestamp, unbuffered, so a run cut short shows where it was.
Writes `vllm_check.json` and the processes' logs into `--out` (default $OUT, else
/tmp/tpu-vllm-check) and ends with one line:

    vllm: N of 3 committed, corrupted refused: yes|no, logprob max diff X (stale Y), apply Z s
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # a checkout run as `python devtools/tpu_vllm_check.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ["JAX_PLATFORMS"] = "cpu"  # the trainer and the reference: the chip is the engine's

import numpy as np  # noqa: E402

from weightsync.model_shapes import ModelShape  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# hidden 256, 2 layers, 4 heads, 2 KV heads, head_dim 128, intermediate 512, vocab 1024
SHAPE = ModelShape(256, 2, 4, 2, 128, 512, 1024, tied=False)
CORRUPT = "model.layers.1.self_attn.q_proj.weight"
T0 = time.monotonic()
# the environment of the engine on the host (docs/install-tpu.md#vllms-tpu-engine): no
# metadata server to ask, no inet socket, the flax_nnx model, vLLM in one process
ENGINE_ENV = {
    "MODEL_IMPL_TYPE": "flax_nnx",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "TPU_SKIP_MDS_QUERY": "true",
}
ENGINE_ENV_DEFAULTS = {"TPU_ACCELERATOR_TYPE": "v5litepod-1", "TPU_NAME": "local", "TPU_WORKER_ID": "0"}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')} +{time.monotonic() - T0:6.1f}s] check: {msg}", flush=True)


def make_base(seed: int = 0) -> dict[str, np.ndarray]:
    """HF-named bf16 tensors: weights N(0, 0.02), norms 1 + N(0, 0.1)."""
    import ml_dtypes

    from weightsync.model_shapes import param_shapes

    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in param_shapes(SHAPE).items():
        a = rng.standard_normal(shape, dtype=np.float32)
        a = 1.0 + 0.1 * a if name.endswith("norm.weight") else 0.02 * a
        out[name] = a.astype(ml_dtypes.bfloat16)
    return out


def version_of(base: dict[str, np.ndarray], v: int) -> dict[str, np.ndarray]:
    """Version v: every tensor plus seeded noise of 10% of its own standard deviation (norms:
    of 0.1): the log-probs of one version and the next differ by ~0.5, far beyond bf16's
    rounding."""
    rng = np.random.default_rng(1000 + v)
    out = {}
    for name, a in base.items():
        f = a.astype(np.float32)
        spread = 0.1 if name.endswith("norm.weight") else float(f.std())
        out[name] = (f + 0.1 * spread * rng.standard_normal(f.shape, dtype=np.float32)).astype(a.dtype)
    return out


def write_checkpoint(path: Path, tensors: dict[str, np.ndarray]) -> None:
    """An HF checkpoint directory: config and tokenizer (devtools.tiny_models, bf16), the
    tensors as bf16 safetensors."""
    import torch
    from safetensors.torch import save_file

    from devtools.tiny_models import write_tiny_model

    write_tiny_model(path, "qwen3", shape=SHAPE, weights=False, dtype="bfloat16")
    save_file(
        {n: torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16) for n, a in tensors.items()},
        str(path / "model.safetensors"),
        metadata={"format": "pt"},
    )


def reference_logprobs(tensors: dict[str, np.ndarray], prompt: list[int], generated: list[int]) -> np.ndarray:
    """log_softmax over the vocabulary at each generated step [steps, vocab], float32 on this
    process's CPU at the highest matmul precision, from the HF-named tensors."""
    import jax
    import jax.numpy as jnp

    from weightsync.models.qwen3_jax import Qwen3Config, forward

    cfg = Qwen3Config(**{f: getattr(SHAPE, f) for f in SHAPE.__dataclass_fields__}, rope_theta=10000.0)
    tokens = jnp.asarray([prompt + generated], jnp.int32)
    with jax.default_matmul_precision("highest"):
        params = {n: jnp.asarray(a.astype(np.float32)) for n, a in tensors.items()}
        logits = forward(params, cfg, tokens)[0]
        logp = jax.nn.log_softmax(logits, axis=-1)
    return np.asarray(logp[len(prompt) - 1 : len(prompt) - 1 + len(generated)])


def compare(rows: list[dict[str, Any]], prompts: list[list[int]], tensors: dict[str, np.ndarray]) -> float:
    """The largest |engine - reference| over every log-prob the engine reported."""
    worst = 0.0
    for prompt, row in zip(prompts, rows):
        ref = reference_logprobs(tensors, prompt, row["tokens"])
        for step, entries in enumerate(row["logprobs"]):
            for token, lp in entries.items():
                worst = max(worst, abs(float(lp) - float(ref[step, int(token)])))
    return worst


class Engine:
    """The engine process and its command pipe."""

    def __init__(self, kind: str, out: Path, env: dict[str, str]) -> None:
        read_fd, write_fd = os.pipe()
        self.log_path = out / "vllm-engine.log"
        self.log_file = open(self.log_path, "ab")  # noqa: SIM115 - closed in close()
        cmd = [sys.executable, str(ROOT / "devtools" / "tpu_vllm_engine.py"), "--engine", kind,
               "--reply-fd", str(write_fd)]  # fmt: skip
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=self.log_file, stderr=subprocess.STDOUT,
                                     env=env, pass_fds=(write_fd,), text=True, start_new_session=True)  # fmt: skip
        os.close(write_fd)
        self.replies = os.fdopen(read_fd, "r")

    def ask(self, timeout_s: float, **req: Any) -> dict[str, Any]:
        import select

        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.replies], [], [], timeout_s)
        if not ready:
            raise TimeoutError(f"the engine did not answer {req['cmd']!r} within {timeout_s:.0f} s")
        line = self.replies.readline()
        if not line:
            raise RuntimeError(f"the engine exited (rc {self.proc.poll()}) during {req['cmd']!r}: see {self.log_path}")
        return json.loads(line)  # type: ignore[no-any-return]

    def close(self) -> None:
        if self.log_file.closed:
            return
        try:
            if self.proc.poll() is None:
                self.ask(30, cmd="quit")
                self.proc.wait(30)
        except (OSError, TimeoutError, RuntimeError, subprocess.TimeoutExpired, ValueError):
            pass
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.log_file.close()


def save(out: Path, result: dict[str, Any]) -> None:
    """The results so far (a run cut short keeps them)."""
    (out / "vllm_check.json").write_text(json.dumps(result, indent=1, default=str))


def run(args: argparse.Namespace, out: Path, result: dict[str, Any]) -> None:
    from devtools.cluster import Cluster
    from trainer_agent.publish.publisher import WeightPublisher
    from trainer_agent.settings import PublisherSettings

    deadline = time.monotonic() + args.deadline_s

    def left(need: float = 1.0) -> float:
        remaining = deadline - time.monotonic()
        if remaining < need:
            raise TimeoutError(f"past the deadline of {args.deadline_s:.0f} s")
        return remaining

    work = Path(tempfile.mkdtemp(prefix="ws-v-"))  # short: unix socket paths are at most 107 bytes
    sock = lambda name: f"unix:{work}/{name}.sock"  # noqa: E731
    session = "tpu-vllm-check"
    rng = np.random.default_rng(7)
    prompts = [[int(t) for t in rng.integers(4, SHAPE.vocab, 12)] for _ in range(2)]
    result.update(shape=SHAPE.__dict__, prompts=prompts, versions=[])
    engine: Engine | None = None
    try:
        base = make_base()
        ckpt = work / "model"
        write_checkpoint(ckpt, base)
        log(f"checkpoint: {ckpt} (bf16, head_dim {SHAPE.head_dim})")
        with Cluster(out / "vllm-procs") as cluster:
            coord = cluster.start_coordinator(host=sock("coordinator"), args=["--metrics-port", "-1"])
            log(f"coordinator on {coord.address}")
            env = {**os.environ, **ENGINE_ENV, "PYTHONUNBUFFERED": "1"}
            for k, v in ENGINE_ENV_DEFAULTS.items():
                env.setdefault(k, v)
            env.pop("JAX_PLATFORMS", None)  # the engine's JAX takes the chip
            if args.engine == "standin":
                env["JAX_PLATFORMS"] = "cpu"
            for cache in ("VLLM_CACHE_ROOT", "XDG_CACHE_HOME", "HF_HOME"):
                env.setdefault(cache, str(work / "cache"))
            engine = Engine(args.engine, out, env)
            init_info = {"coordinator": coord.address, "session": session, "agent_id": "tpu-vllm",
                         "weight_sync_mode": "shm"}  # fmt: skip
            settings = PublisherSettings(coordinator=coord.address, session=session, host=sock("trainer"),
                                         weight_sync_mode="shm", min_rollouts=1, metrics_port=-1)  # fmt: skip
            with WeightPublisher(settings) as pub, _closing(engine):
                log(f"starting the {args.engine} engine (its log: {engine.log_path})")
                started = engine.ask(min(args.start_timeout_s, left()), cmd="start", model=str(ckpt),
                                     init_info=init_info, options={"dtype": args.dtype})  # fmt: skip
                if not started["ok"]:
                    raise RuntimeError(f"the engine did not start: {started.get('error')}")
                result["engine_start_seconds"] = started["start_seconds"]
                log(f"engine up in {started['start_seconds']:.1f} s")
                served, previous = None, base
                for v in range(1, 4):
                    tensors = version_of(base, v)
                    t0 = time.perf_counter()
                    pub.publish(tensors, v)
                    log(f"published version {v} in {time.perf_counter() - t0:.2f} s")
                    row: dict[str, Any] = {"version": v}
                    result["versions"].append(row)
                    upd = engine.ask(left(), cmd="update", version=v)
                    row.update(applied=upd["ok"], refusal=upd.get("refusal", ""), update_seconds=upd.get("seconds"))
                    last = ((upd.get("status") or {}).get("last") or {}) if upd.get("status") else {}
                    row["apply"] = last.get("apply")
                    if not upd["ok"]:
                        log(f"version {v} not applied: {upd.get('refusal') or upd.get('error')}")
                        break
                    row["state"] = str(pub.wait_committed(v, min(60.0, left())))
                    log(f"version {v}: applied in {upd['seconds']:.3f} s, {row['state']}")
                    gen = engine.ask(left(), cmd="generate", prompts=prompts, max_tokens=args.max_tokens,
                                     logprobs=args.logprobs)  # fmt: skip
                    if not gen["ok"]:
                        raise RuntimeError(f"generate failed: {gen.get('error')}")
                    served = gen["rows"]
                    row["tokens"] = [r["tokens"] for r in served]
                    row["logprob_max_diff"] = compare(served, prompts, tensors)
                    row["stale_logprob_max_diff"] = compare(served, prompts, previous)
                    log(f"version {v}: logprob max diff {row['logprob_max_diff']:.3g} "
                        f"(against the version before: {row['stale_logprob_max_diff']:.3g})")  # fmt: skip
                    previous = tensors
                    save(out, result)
                # the corrupted version: a trainer's bug, layer 1's q_proj a row short
                bad = dict(version_of(base, 4))
                bad[CORRUPT] = bad[CORRUPT][:-1]
                pub.publish(bad, 4)
                log("published version 4, corrupted (layer 1's q_proj a row short)")
                upd = engine.ask(left(), cmd="update", version=4)
                corrupt: dict[str, Any] = {"version": 4, "refused": not upd["ok"], "refusal": upd.get("refusal", "")}
                result["corrupted"] = corrupt
                gen = engine.ask(left(), cmd="generate", prompts=prompts, max_tokens=args.max_tokens,
                                 logprobs=args.logprobs)  # fmt: skip
                corrupt["served_unchanged"] = bool(gen["ok"] and served is not None and gen["rows"] == served)
                audit = engine.ask(left(), cmd="audit")
                found = audit.get("audit") or {}
                good = max([r["version"] for r in result["versions"] if r.get("applied")], default=0)
                corrupt["audit"] = found
                corrupt["audit_exact"] = bool(audit["ok"] and found.get("exact") and found.get("version") == str(good))
                log(f"corrupted version: refused={corrupt['refused']} served_unchanged={corrupt['served_unchanged']} "
                    f"audit_exact={corrupt['audit_exact']}")  # fmt: skip
    finally:
        if engine is not None:
            engine.close()  # (once more where the cluster failed first: a no-op after the first)
        shutil.rmtree(work, ignore_errors=True)


@contextlib.contextmanager
def _closing(engine: Engine) -> Iterator[None]:
    """The engine stopped before the coordinator it follows."""
    try:
        yield
    finally:
        engine.close()


def verdict(result: dict[str, Any], tolerance: float) -> tuple[str, bool]:
    """The one-line verdict, and whether the run passed."""
    rows = result.get("versions", [])
    committed = sum(1 for r in rows if r.get("state") == "COMMITTED")
    diffs = [r["logprob_max_diff"] for r in rows if "logprob_max_diff" in r]
    stale = [r["stale_logprob_max_diff"] for r in rows if "stale_logprob_max_diff" in r]
    applies = [r["update_seconds"] for r in rows if r.get("applied")]
    c = result.get("corrupted") or {}
    refused = bool(c.get("refused") and c.get("served_unchanged") and c.get("audit_exact"))
    line = f"vllm: {committed} of 3 committed, corrupted refused: {'yes' if refused else 'no'}, logprob max diff "
    line += f"{max(diffs):.3g}" if diffs else "n/a"
    if stale:
        line += f" (stale {min(stale):.3g})"
    if applies:
        line += f", apply {statistics.median(applies):.3f} s"
    if result.get("error"):
        line += f"; stopped: {result['error'][:200]}"
    ok = committed == 3 and refused and bool(diffs) and max(diffs) <= tolerance and not result.get("error")
    return line, ok


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", choices=["vllm", "standin"], default="vllm")
    p.add_argument("--dtype", default="bfloat16", help="the engine's dtype (the checkpoint is bf16)")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--logprobs", type=int, default=5, help="top log-probs the engine reports at each step")
    p.add_argument("--tolerance", type=float, default=0.05, help="largest log-prob difference that passes")
    p.add_argument("--start-timeout-s", type=float, default=300.0)
    p.add_argument("--deadline-s", type=float, default=480.0, help="the whole run")
    p.add_argument("--out", default="", help="default $OUT, else /tmp/tpu-vllm-check")
    args = p.parse_args(argv)
    out = Path(args.out or os.environ.get("OUT") or "/tmp/tpu-vllm-check")
    out.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"engine": args.engine, "dtype": args.dtype}
    log(f"engine {args.engine}, results in {out}")

    def stop(signum: int, frame: Any) -> None:  # the step's budget ran out: stop the engine, keep the results
        raise TimeoutError(f"signal {signum}: the step's budget ran out")

    signal.signal(signal.SIGTERM, stop)
    try:
        run(args, out, result)
    except Exception as e:  # noqa: BLE001 - the verdict says where it stopped
        result["error"] = f"{type(e).__name__}: {e}"
        log(f"stopped: {result['error']}")
    line, ok = verdict(result, args.tolerance)
    result["verdict"], result["ok"] = line, ok
    save(out, result)
    print(line, flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
