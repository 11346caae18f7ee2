"""Delta benchmark (`make bench-delta`): how much of a bf16 model changes per RL step, and
what weightsync's delta codec (native/delta.cc) makes of it.

Update model (`trainer_agent.update_model`): fp32 master weights initialised as a
transformer starts (N(0, 0.02), norms 1 + N(0, 0.02)) and an Adam-style step per
element of lr x N(0, 1), clipped at 3 (Adam's normalized update moves every element by
about lr), served as bf16 (round to nearest even). Per learning rate (default 1e-6 and
1e-5), after a warm-up step, `--steps` steps:
- the fraction of bf16 elements whose bit pattern changed;
- the delta on the wire over the model's bytes (`wire_ratio`): every tensor encoded
  against the previous version, a tensor whose encoding is not smaller than its raw bytes
  sent raw; beside the simplest alternative (LEB128 gap + the 2-byte new value, the
  calibration in the issue) and XOR + zlib level 1;
- encode and rebuild (decode) seconds on one thread, beside staging the same bytes
  (`staging.stage_shards`: copy + chunk digests + sums, every core) measured in the same
  run, rounds interleaved, and the ratio (staging + encode) / staging;
- every rebuilt tensor compared with the new version bit for bit.
Prints one JSON line per learning rate.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import zlib
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ml_dtypes  # noqa: E402
from common import shapes  # noqa: E402

from trainer_agent.params import host_shards  # noqa: E402
from trainer_agent.staging import plan_layout, stage_shards  # noqa: E402
from trainer_agent.update_model import AdamSteps, initial_weights  # noqa: E402
from weightsync import native  # noqa: E402
from weightsync.layout import DEFAULT_CHUNK_BYTES  # noqa: E402


def gap_value_bytes(base: np.ndarray, now: np.ndarray) -> int:
    """LEB128 gap + the 2-byte new value per changed element."""
    idx = np.flatnonzero(base != now)
    gaps = np.diff(idx, prepend=-1) - 1
    return int((1 + (gaps >= 1 << 7) + (gaps >= 1 << 14) + (gaps >= 1 << 21) + (gaps >= 1 << 28)).sum() + 2 * idx.size)


def encode_all(old: dict[str, np.ndarray], new: dict[str, np.ndarray]) -> tuple[dict[str, bytes | None], float]:
    """Each tensor's encoding (None: sent raw) and the seconds it took, one thread."""
    t = time.perf_counter()
    out = {k: native.delta16_encode(old[k], new[k])[0] for k in new}
    return out, time.perf_counter() - t


def rebuild_all(old: dict[str, np.ndarray], encodings: dict[str, bytes | None], new: dict[str, np.ndarray]) -> float:
    """Rebuilds every tensor from the old version and its encoding (raw ones copied), checks
    each against the new version bit for bit; returns the rebuild's seconds."""
    bufs = {k: v.copy() for k, v in old.items()}
    t = time.perf_counter()
    for k, enc in encodings.items():
        if enc is None:
            np.copyto(bufs[k], new[k])
        else:
            native.delta16_decode(bufs[k], enc)
    seconds = time.perf_counter() - t
    bad = [k for k in new if bufs[k].view(np.uint16).tobytes() != new[k].view(np.uint16).tobytes()]
    if bad:
        raise SystemExit(f"rebuilt tensors differ from the new version: {bad[:3]}")
    return seconds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="0.6b")
    ap.add_argument("--lrs", default="1e-6,1e-5")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--zlib", action=argparse.BooleanOptionalAction, default=True, help="also XOR + zlib level 1")
    args = ap.parse_args()
    if not native.available():
        raise SystemExit(native.missing_reason())
    served = initial_weights(shapes(args.size), ml_dtypes.bfloat16, seed=0)
    total = sum(v.nbytes for v in served.values())
    shards = [s for n, v in served.items() for s in host_shards(n, v)]
    layout = plan_layout(shards)
    slot = np.zeros(layout.total_bytes, np.uint8)
    stage_shards(slot, shards, layout, DEFAULT_CHUNK_BYTES)  # warm the destination
    for lr in (float(x) for x in args.lrs.split(",")):
        steps = AdamSteps(served, lr, seed=1)
        old = steps.step()  # warm-up: the first bf16 version of the master weights
        rows = []
        for _ in range(args.steps):
            new = steps.step()
            shards = [s for n, v in new.items() for s in host_shards(n, v)]
            t = time.perf_counter()
            stage_shards(slot, shards, layout, DEFAULT_CHUNK_BYTES)
            stage_s = time.perf_counter() - t
            encodings, encode_s = encode_all(old, new)
            rebuild_s = rebuild_all(old, encodings, new)
            changed = sum(int((old[k].view(np.uint16) != new[k].view(np.uint16)).sum()) for k in new)
            elements = sum(v.size for v in new.values())
            wire = sum(len(e) if e is not None else new[k].nbytes for k, e in encodings.items())
            row = {
                "changed_fraction": changed / elements,
                "wire_ratio": wire / total,
                "raw_tensors": sum(e is None for e in encodings.values()),
                "gap_value_ratio": sum(gap_value_bytes(old[k].view(np.uint16), new[k].view(np.uint16)) for k in new)
                / total,
                "stage_s": stage_s,
                "encode_s": encode_s,
                "rebuild_s": rebuild_s,
                "stage_plus_encode_ratio": (stage_s + encode_s) / stage_s,
            }
            if args.zlib:
                t = time.perf_counter()
                z = sum(len(zlib.compress((old[k].view(np.uint16) ^ new[k].view(np.uint16)).tobytes(), 1)) for k in new)
                row["xor_zlib1_ratio"], row["xor_zlib1_s"] = z / total, time.perf_counter() - t
            rows.append(row)
            old = new
        med = {k: round(statistics.median(r[k] for r in rows), 5) for k in rows[0]}
        print(
            json.dumps(
                {
                    "size": args.size,
                    "model_bytes": total,
                    "update": f"fp32 master, Adam-style step lr x N(0,1) clipped at 3, served bf16; lr {lr:g}",
                    "lr": lr,
                    "steps": args.steps,
                    **med,
                }
            ),
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
