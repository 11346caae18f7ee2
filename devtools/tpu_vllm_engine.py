"""The engine process of `devtools/tpu_vllm_check.py`: a vLLM TPU engine (tpu-inference,
flax_nnx) with weightsync's worker extension, or, off the host, the extension inside
tpu-inference 0.25's stand-in worker (`--engine standin`, JAX on the CPU). The only
process that opens the chip.

It reads one JSON command a line on stdin and writes one JSON reply a line to the file
descriptor `--reply-fd`; what it logs (vLLM's log included) goes to stdout/stderr, each of
its own lines stamped with the time. Commands (`cmd`):

- `start`: the engine on `model` (a checkpoint directory), with weightsync's worker
  extension and `weight_transfer_config={"backend": "weightsync"}`; `init_info` attaches
  it to the session through vLLM's `init_weight_transfer_engine`;
- `update`: `version` through vLLM's `start_weight_update`, `update_weights`,
  `finish_weight_update` (then `reset_prefix_cache`); the refusal, if any, and the apply
  report;
- `generate`: greedy completions of `prompts` (token ids), `max_tokens` each, with the
  log-probs of the `logprobs` most likely tokens at every step;
- `audit`: the worker's `weightsync_audit` (the served weights against the version last
  applied whole);
- `quit`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # a checkout run as `python devtools/tpu_vllm_engine.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

EXTENSION = "rollout_agent.tpu_worker_extension.WeightsyncTPUWorkerExtension"
T0 = time.monotonic()


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')} +{time.monotonic() - T0:6.1f}s] engine: {msg}", flush=True)


class VllmEngine:
    """`vllm.LLM` on the chip, driven through vLLM's own weight-transfer API."""

    def __init__(self, model: str, init_info: dict[str, Any], options: dict[str, Any]) -> None:
        from vllm import LLM

        t0 = time.perf_counter()
        self.llm = LLM(
            model=model,
            dtype=options.get("dtype", "bfloat16"),
            max_model_len=int(options.get("max_model_len", 256)),
            max_num_seqs=int(options.get("max_num_seqs", 4)),
            max_num_batched_tokens=int(options.get("max_num_batched_tokens", 256)),
            gpu_memory_utilization=float(options.get("gpu_memory_utilization", 0.3)),
            enforce_eager=bool(options.get("enforce_eager", True)),  # no precompile of every shape
            seed=0,
            worker_extension_cls=EXTENSION,
            weight_transfer_config={"backend": "weightsync"},
        )
        self.start_seconds = time.perf_counter() - t0
        log(f"LLM up in {self.start_seconds:.1f} s")
        self.llm.init_weight_transfer_engine({"init_info": init_info})
        log("attached to the session (init_weight_transfer_engine)")

    def update(self, version: int) -> None:
        try:
            self.llm.start_weight_update()
            self.llm.update_weights({"update_info": {"version": version}})
            self.llm.finish_weight_update()
        finally:
            self.llm.reset_prefix_cache()

    def generate(self, prompts: list[list[int]], max_tokens: int, logprobs: int) -> list[dict[str, Any]]:
        from vllm import SamplingParams

        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=logprobs, ignore_eos=True)
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        rows = []
        for out in outs:
            c = out.outputs[0]
            steps = [{str(t): float(lp.logprob) for t, lp in step.items()} for step in (c.logprobs or [])]
            rows.append({"tokens": list(c.token_ids), "logprobs": steps})
        return rows

    def rpc(self, method: str) -> Any:
        return self.llm.collective_rpc(method)[0]


class StandinEngine:
    """The extension inside tpu-inference 0.25's stand-in worker (`devtools/tpu_worker_standin`),
    driven as vLLM's API drives it: for trying the check off the host."""

    def __init__(self, model: str, init_info: dict[str, Any], options: dict[str, Any]) -> None:
        import jax
        import ml_dtypes
        import numpy as np

        from devtools.tpu_worker_standin import HfConfig, TPUWorker025, vllm_extended
        from rollout_agent.engines.jax.model import mesh_of
        from rollout_agent.vllm_worker.tpu_extension import WeightsyncTPUWorkerExtension

        Worker = vllm_extended(TPUWorker025, WeightsyncTPUWorkerExtension)  # as vLLM mixes worker_extension_cls in

        config = HfConfig(json.loads((Path(model) / "config.json").read_text()))
        t0 = time.perf_counter()
        self.worker = Worker(config, mesh_of((1, 1), jax.devices()[:1]), dtype=ml_dtypes.bfloat16)
        self.worker.vllm_config.weight_transfer_config = type("W", (), {"backend": "weightsync"})()
        self.np = np
        self.start_seconds = time.perf_counter() - t0
        self.worker.init_weight_transfer_engine(init_info)
        log("stand-in worker attached to the session")

    def update(self, version: int) -> None:
        self.worker.start_weight_update()
        self.worker.update_weights({"version": version})
        self.worker.finish_weight_update()

    def generate(self, prompts: list[list[int]], max_tokens: int, logprobs: int) -> list[dict[str, Any]]:
        np = self.np
        rows = []
        for prompt in prompts:
            seq, steps = list(prompt), []
            for _ in range(max_tokens):
                z = self.worker.compute_logits(np.array([seq], np.int64))[0, -1].astype(np.float64)
                lp = z - z.max() - np.log(np.exp(z - z.max()).sum())
                pick = int(np.argmax(lp))
                top = [int(t) for t in np.argsort(-lp)[:logprobs]]
                steps.append({str(t): float(lp[t]) for t in {pick, *top}})
                seq.append(pick)
            rows.append({"tokens": seq[len(prompt) :], "logprobs": steps})
        return rows

    def rpc(self, method: str) -> Any:
        return getattr(self.worker, method)()


def serve(args: argparse.Namespace) -> int:
    reply = os.fdopen(args.reply_fd, "w", buffering=1)
    engine: Any = None

    def answer(obj: dict[str, Any]) -> None:
        reply.write(json.dumps(obj) + "\n")
        reply.flush()

    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        cmd = req.get("cmd")
        t0 = time.perf_counter()
        try:
            if cmd == "start":
                kind = StandinEngine if args.engine == "standin" else VllmEngine
                log(f"starting the {args.engine} engine on {req['model']}")
                engine = kind(req["model"], req["init_info"], req.get("options", {}))
                answer({"ok": True, "start_seconds": engine.start_seconds})
            elif cmd == "update":
                log(f"update_weights(version={req['version']})")
                try:
                    engine.update(int(req["version"]))
                    refusal = ""
                except Exception as e:  # noqa: BLE001 - a refusal is an answer
                    refusal = f"{type(e).__name__}: {e}"
                seconds = time.perf_counter() - t0
                status = engine.rpc("weightsync_status")
                log(f"version {req['version']}: {'refused: ' + refusal[:300] if refusal else 'applied'} "
                    f"in {seconds:.3f} s")  # fmt: skip
                answer({"ok": not refusal, "refusal": refusal[:2000], "seconds": seconds, "status": status})
            elif cmd == "generate":
                rows = engine.generate(req["prompts"], int(req["max_tokens"]), int(req["logprobs"]))
                log(f"generated {len(rows)} completions in {time.perf_counter() - t0:.2f} s")
                answer({"ok": True, "rows": rows, "seconds": time.perf_counter() - t0})
            elif cmd == "audit":
                found = engine.rpc("weightsync_audit")
                log(f"audit: exact={found.get('exact')} version={found.get('version')}")
                answer({"ok": True, "audit": found})
            elif cmd == "quit":
                answer({"ok": True})
                break
            else:
                answer({"ok": False, "error": f"unknown command {cmd!r}"})
        except Exception as e:  # noqa: BLE001 - every failure is reported to the driver, which decides
            log(f"{cmd} failed: {type(e).__name__}: {e}\n{traceback.format_exc()}")
            answer({"ok": False, "error": f"{type(e).__name__}: {e}"[:4000]})
    if engine is not None and args.engine == "standin":
        engine.worker.weightsync_detach()
    log("done")
    os._exit(0)  # vLLM 0.25's exit-time cleanup raises after the results (docs/install-tpu.md)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", choices=["vllm", "standin"], default="vllm")
    p.add_argument("--reply-fd", type=int, required=True)
    return serve(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
