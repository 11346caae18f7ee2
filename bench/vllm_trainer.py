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
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import model  # noqa: E402

TARGET_RATIO = 1.3


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
    args = ap.parse_args()
    try:
        import torch
        from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory
    except ImportError as e:
        print(f"torch and vLLM are needed ({e}); install the vllm extra")
        return 3
    from devtools.cluster import Cluster
    from trainer_agent.publisher import WeightPublisher
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


if __name__ == "__main__":
    sys.exit(main())
