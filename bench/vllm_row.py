"""The transfer benchmark's vLLM row: a real vLLM engine (CPU, in process) generating without
a break while versions arrive, prefetched in the background, each applied in one pause.

    python bench/vllm_row.py --preset small --versions 6

One thread generates continuously (short `generate` calls, greedy, fixed lengths) and,
between two calls, applies a version once the weightsync backend's prefetcher holds it
verified; the trainer (a WeightPublisher in this process, tcp) publishes in another thread.
Tokens/s is measured over three kinds of time: idle (nothing else running), staging (the
trainer copying and hashing; on a real deployment on another host) and prefetch (READY ->
verified in the receive buffer, i.e. the rollout's pull and checks plus the trainer's
sends). A `generate` call that straddles two kinds counts in each by its overlap. Prints
one JSON line. Exit code 3: vLLM is not installed (the row is skipped).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PROMPTS = 4  # sequences per generate call
NEW_TOKENS = 4  # short calls: a prefetch window spans several of them
ENGINE_ARGS = dict(
    dtype="float32", enforce_eager=True, max_model_len=128, kv_cache_memory_bytes=64 << 20, block_size=32, seed=0
)


class Windows:
    """Closed [start, end) intervals of one kind, on the perf_counter clock."""

    def __init__(self) -> None:
        self.spans: list[tuple[float, float]] = []

    def add(self, start: float, end: float) -> None:
        self.spans.append((start, end))

    def overlap(self, a: float, b: float) -> float:
        return sum(max(0.0, min(b, e) - max(a, s)) for s, e in self.spans)

    @property
    def seconds(self) -> float:
        return sum(e - s for s, e in self.spans)


def _publish(pub, weights: dict, version: int, ready: list[float]) -> None:  # noqa: ANN001
    pub.publish(weights, version)
    ready.append(time.perf_counter())  # READY: the rollout's prefetch starts now


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small", help="model shape (weightsync.model_shapes.PRESETS)")
    ap.add_argument("--versions", type=int, default=6)
    ap.add_argument("--idle-s", type=float, default=3.0, help="generating with nothing else running, first")
    args = ap.parse_args()
    try:
        import vllm
    except ImportError as e:
        print(f"vLLM is not installed here ({e}); install the vllm extra")
        return 3
    import numpy as np
    from safetensors.numpy import load_file

    from devtools.cluster import Cluster
    from devtools.tiny_models import write_tiny_model
    from rollout_agent.vllm_worker.rollout import in_process
    from trainer_agent.publish.publisher import WeightPublisher
    from trainer_agent.settings import PublisherSettings
    from weightsync.client import CoordinatorClient

    with tempfile.TemporaryDirectory(prefix="wsbench-vllm-") as tmp, Cluster(Path(tmp) / "cluster") as cluster:
        model_dir = write_tiny_model(Path(tmp) / "model", "qwen3", shape=args.preset)
        base = load_file(str(model_dir / "model.safetensors"))
        model_bytes = sum(v.nbytes for v in base.values())
        coord = cluster.start_coordinator().address
        settings = PublisherSettings(coordinator=coord, session="vllm", weight_sync_mode="tcp", min_rollouts=1)
        with WeightPublisher(settings) as pub:
            llm = vllm.LLM(model=str(model_dir), weight_transfer_config={"backend": "weightsync"}, **ENGINE_ARGS)
            info = {"coordinator": coord, "session": "vllm", "agent_id": "vllm-0", "weight_sync_mode": "tcp"}
            llm.init_weight_transfer_engine({"init_info": info})  # prefetch on: the default
            rollout = in_process("vllm-0")
            assert rollout is not None and rollout.prefetcher is not None
            sp = vllm.SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
            prompts = [{"prompt_token_ids": [1, 5 + i, 6, 7, 8, 9]} for i in range(PROMPTS)]
            calls: list[tuple[float, float, int]] = []

            def generate() -> None:
                t0 = time.perf_counter()
                outs = llm.generate(prompts, sp, use_tqdm=False)
                calls.append((t0, time.perf_counter(), sum(len(o.outputs[0].token_ids) for o in outs)))

            for _ in range(3):  # warm-up, not measured
                generate()
            calls.clear()
            t_end = time.perf_counter() + args.idle_s
            while time.perf_counter() < t_end:
                generate()
            staging, prefetch, updates = Windows(), Windows(), Windows()
            rng = np.random.default_rng(0)
            for v in range(1, args.versions + 1):
                weights = {k: (a + 0.01 * rng.standard_normal(a.shape)).astype(a.dtype) for k, a in base.items()}
                ready: list[float] = []
                t_pub = time.perf_counter()
                publisher = threading.Thread(target=_publish, args=(pub, weights, v, ready))
                publisher.start()
                deadline = time.monotonic() + 120
                while rollout.prefetcher.status()["ready"] != v:  # generate while it stages and prefetches
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"version {v} was not prefetched within 120 s")
                    generate()
                t_prefetched = time.perf_counter()
                publisher.join()
                staging.add(t_pub, ready[0])
                prefetch.add(ready[0], t_prefetched)
                t0 = time.perf_counter()
                llm.start_weight_update()
                llm.update_weights({"update_info": {"version": v}})
                llm.finish_weight_update(weight_version=str(v))
                llm.reset_prefix_cache()
                updates.add(t0, time.perf_counter())
                if pub.wait_committed(v, 60) != "COMMITTED":
                    raise RuntimeError(f"version {v} did not commit")
                t_end = time.perf_counter() + 0.5
                while time.perf_counter() < t_end:
                    generate()
            with CoordinatorClient(coord) as c:
                hs = [h for h in c.status("vllm", args.versions + 1).handshakes if h.agent_id == "vllm-0"]
            llm.shutdown_weight_transfer_engine()

    def rate(windows: Windows | None) -> tuple[float, float]:
        """(tokens/s, seconds) of the generate calls inside `windows` (None: outside every window)."""
        tokens = seconds = 0.0
        for a, b, n in calls:
            busy = staging.overlap(a, b) + prefetch.overlap(a, b) + updates.overlap(a, b)
            inside = (b - a) - busy if windows is None else windows.overlap(a, b)
            tokens += n * inside / (b - a)
            seconds += inside
        return (tokens / seconds if seconds else 0.0), seconds

    idle, idle_s = rate(None)
    during, during_s = rate(prefetch)
    staged, staged_s = rate(staging)
    pauses = [h.timings.pause_seconds for h in hs]
    applies = [h.timings.apply_seconds for h in hs]
    print(
        json.dumps(
            {
                "preset": args.preset,
                "model_bytes": model_bytes,
                "versions": len(hs),
                "all_ok": all(h.ok for h in hs),
                "tokens_per_s_idle": round(idle, 2),
                "idle_seconds": round(idle_s, 3),
                "tokens_per_s_prefetch": round(during, 2),
                "prefetch_seconds": round(during_s, 3),
                "tokens_per_s_ratio": round(during / idle, 3) if idle else 0.0,
                "tokens_per_s_staging": round(staged, 2),
                "staging_seconds": round(staged_s, 3),
                "pause_s": [round(p, 4) for p in pauses],
                "apply_s": [round(a, 4) for a in applies],
                "pause_s_median": round(statistics.median(pauses), 4),
                "apply_s_median": round(statistics.median(applies), 4),
                "max_pause_over_apply_s": round(max(p - a for p, a in zip(pauses, applies)), 4),
                "update_call_s_median": round(statistics.median(e - s for s, e in updates.spans), 4),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
