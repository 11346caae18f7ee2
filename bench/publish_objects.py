"""What a publish costs Python's garbage collector: the objects it tracks that an async
publish keeps alive while it runs.

Python collects its oldest generation (a pause over every object the process tracks: tens
of ms in a JAX trainer) once the objects that survived a middle-generation collection since
the last full one pass a quarter of those in it. An async publish runs for a few training
steps; what it keeps alive that long survives such collections, so each publish brings the
next full collection closer. On a v5e host (docs/performance.md) the overlap bench's async
phases had one or two full collections in 40 steps, its phases without publishing none or
one in 80.

This publishes a preset's parameters (`weightsync.model_shapes`, JAX on this host's
devices) through a coordinator in a process of its own, `publish_async(snapshot=True)`
version after version with the collector off, and samples the collector's count of tracked
objects (allocations less deallocations, `gc.get_count()[0]`) while each runs. Prints, per
version, its peak over the count before it and what it left after, and their medians per
tensor, as one JSON object (also to `--out`). `--force-blocks` takes the accelerator's
branch on CPU devices (blocks cut, as on a TPU).

    python bench/publish_objects.py                          # small preset
    python bench/publish_objects.py --preset 0.6b --force-blocks
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
from common import emit_json  # noqa: E402
from overlap_publishers import coordinator_process, loopback_addresses  # noqa: E402
from overlap_step import init_params  # noqa: E402

from trainer_agent.publish.publisher import WeightPublisher  # noqa: E402
from trainer_agent.settings import PublisherSettings  # noqa: E402
from trainer_agent.stage import params as params_module  # noqa: E402
from weightsync.model_shapes import PRESETS  # noqa: E402


def tracked_during(pub: WeightPublisher, params: dict[str, Any], version: int) -> tuple[int, int]:
    """(the peak of tracked objects over the count before, what is left after) of one
    `publish_async`, the collector off: its count then only rises and falls with them."""
    start = gc.get_count()[0]
    peak = 0
    future = pub.publish_async(params, version, snapshot=True)
    while not future.done():
        peak = max(peak, gc.get_count()[0] - start)
        time.sleep(0.0002)
    future.result()
    return max(peak, gc.get_count()[0] - start), gc.get_count()[0] - start


def run(args: argparse.Namespace) -> dict[str, Any]:
    params = init_params(PRESETS[args.preset], 0)
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="publish-objects-")))
        host, listen = loopback_addresses(tmp)
        coordinator = stack.enter_context(coordinator_process(tmp / "coordinator", listen))
        settings = PublisherSettings(coordinator=coordinator, session="objects", weight_sync_mode="shm", host=host)
        pub = stack.enter_context(WeightPublisher(settings))
        for version in (1, 2):  # programs compiled, slots made, layout cached
            pub.publish_async(params, version, snapshot=True).result()
        gc.collect()
        gc.disable()
        try:
            counts = [tracked_during(pub, params, v) for v in range(3, 3 + args.versions)]
        finally:
            gc.enable()
    peaks, left = [p for p, _ in counts], [a for _, a in counts]
    n = len(params)
    out = {
        "preset": args.preset,
        "platform": jax.default_backend(),
        "blocks_cut": not params_module.HOST_MEMORY_PLATFORMS,
        "tensors": n,
        "versions": args.versions,
        "peak_tracked": peaks,
        "left_tracked": left,
        "peak_per_tensor": round(statistics.median(peaks) / n, 2),
        "left_per_tensor": round(statistics.median(left) / n, 2),
    }
    print(
        f"{args.preset}, {n} tensors: a publish kept up to {statistics.median(peaks):,.0f} tracked objects alive "
        f"(median of {args.versions}; {out['peak_per_tensor']} a tensor), left {statistics.median(left):,.0f} "
        f"after it ({out['left_per_tensor']} a tensor)",
        file=sys.stderr,
    )
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default="small")
    p.add_argument("--versions", type=int, default=5)
    p.add_argument("--force-blocks", action="store_true", help="cut blocks on CPU devices (the accelerator's branch)")
    p.add_argument("--out", default="")
    args = p.parse_args()
    if args.versions < 1:
        p.error("--versions >= 1")
    if args.force_blocks:
        params_module.HOST_MEMORY_PLATFORMS = frozenset()
    emit_json(run(args), args.out)


if __name__ == "__main__":
    main()
