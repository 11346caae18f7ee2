"""Delta benchmark (`make bench-delta`): how much of a bf16 model changes per RL step, and
what weightsync's delta codec (native/delta.cc) makes of it.

Update model (`trainer_agent.update_model`): fp32 master weights initialised as a
transformer starts (N(0, 0.02), norms 1 + N(0, 0.02)) and an Adam-style step per
element of lr x N(0, 1), clipped at 3 (Adam's normalized update moves every element by
about lr), served as bf16 (round to nearest even). Per learning rate (default 1e-6 and
1e-5), after a warm-up step, `--steps` steps:
- the fraction of bf16 elements whose bit pattern changed;
- the delta on the wire over the model's bytes (`wire_ratio`): staging encodes each chunk
  against the previous version in the other slot, in the same pass (a chunk whose
  encoding would pass half its bytes goes raw); beside the simplest alternative (LEB128
  gap + the 2-byte new value, a first estimate's encoding) and XOR + zlib level 1;
- staging with the delta against staging alone, the same bytes into a warm slot, every
  core, the two interleaved (which goes first alternates), and their ratio;
- the same version staged again against identical bytes (nothing to emit) against staging
  alone (`unchanged_stage_delta_ratio`): what reading and comparing the previous version
  costs by itself;
- the rebuild (decode) on one thread;
- the rebuilt slot compared with the staged new version bit for bit.
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

from trainer_agent.stage.params import host_shards  # noqa: E402
from trainer_agent.stage.staging import native_sources, plan_layout  # noqa: E402
from trainer_agent.update_model import AdamSteps, initial_weights  # noqa: E402
from weightsync import native  # noqa: E402
from weightsync.config import bounded_number  # noqa: E402
from weightsync.layout import DEFAULT_CHUNK_BYTES  # noqa: E402
from weightsync.model_shapes import PRESETS  # noqa: E402


def gap_value_bytes(base: np.ndarray, now: np.ndarray) -> int:
    """LEB128 gap + the 2-byte new value per changed element."""
    idx = np.flatnonzero(base != now)
    gaps = np.diff(idx, prepend=-1) - 1
    return int((1 + (gaps >= 1 << 7) + (gaps >= 1 << 14) + (gaps >= 1 << 21) + (gaps >= 1 << 28)).sum() + 2 * idx.size)


class Slots:
    """Two arena-like slots staged alternately (each version against the other, which holds
    the previous one, as the publisher's arena does) and a scratch slot for staging alone."""

    def __init__(self, params: dict[str, np.ndarray], chunk_bytes: int) -> None:
        shards = [s for n, v in params.items() for s in host_shards(n, v)]
        self.layout = plan_layout(shards)
        self.lengths = [n for _, n in self.layout.chunk_plan(chunk_bytes)]
        self.chunk_bytes = chunk_bytes
        self.slots = [np.zeros(self.layout.total_bytes, np.uint8) for _ in range(3)]
        self.deltas = np.zeros(self.layout.total_bytes // 2 + 1, np.uint8)  # kept, as an arena is
        self.k = 0

    def _sources(self, params: dict[str, np.ndarray]) -> list[tuple[np.ndarray, int, int]]:
        return native_sources([s for n, v in params.items() for s in host_shards(n, v)], self.layout)

    def stage_alone(self, params: dict[str, np.ndarray]) -> float:
        sources = self._sources(params)
        t = time.perf_counter()
        native.stage(self.slots[2], self.layout.total_bytes, self.lengths, self.chunk_bytes, sources)
        return time.perf_counter() - t

    def stage_with_delta(
        self, params: dict[str, np.ndarray]
    ) -> tuple[float, list[bytes | None], np.ndarray, np.ndarray]:
        """Stages into the next slot against the other; (seconds, chunk deltas, base, new)."""
        sources = self._sources(params)
        new, base = self.slots[self.k % 2], self.slots[(self.k + 1) % 2]
        self.k += 1
        t = time.perf_counter()
        result = native.stage(
            new, self.layout.total_bytes, self.lengths, self.chunk_bytes, sources, base=base, delta_out=self.deltas
        )
        return time.perf_counter() - t, result.chunk_deltas or [], base, new


def rebuild(lengths: list[int], deltas: list[bytes | None], base: np.ndarray, new: np.ndarray) -> float:
    """Rebuilds the new slot from the base slot and the chunk deltas (raw chunks copied),
    checks it against the new slot bit for bit; returns the rebuild's seconds."""
    out = base.copy()
    t = time.perf_counter()
    start = 0
    for length, enc in zip(lengths, deltas):
        if enc is None:
            out[start : start + length] = new[start : start + length]
        else:
            native.delta16_decode(out[start : start + length].view(np.uint16), enc)
        start += length
    seconds = time.perf_counter() - t
    if out.tobytes() != new.tobytes():
        raise SystemExit("the rebuilt slot differs from the new version")
    return seconds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="0.6b", choices=list(PRESETS))
    ap.add_argument("--lrs", default="1e-6,1e-5")
    ap.add_argument("--steps", type=bounded_number(1), default=3)
    ap.add_argument("--zlib", action=argparse.BooleanOptionalAction, default=True, help="also XOR + zlib level 1")
    args = ap.parse_args()
    if not native.available():
        raise SystemExit(native.missing_reason())
    served = initial_weights(shapes(args.size), ml_dtypes.bfloat16, seed=0)
    total = sum(v.nbytes for v in served.values())
    for lr in (float(x) for x in args.lrs.split(",")):
        steps = AdamSteps(served, lr, seed=1)
        slots = Slots(served, DEFAULT_CHUNK_BYTES)
        old = steps.step()  # warm-up: the first version, staged into both slots
        for _ in range(2):
            slots.stage_with_delta(old)
        slots.stage_alone(old)
        # The compare alone: the same version again against identical bytes (nothing to
        # emit), interleaved with staging alone: what reading the previous version costs.
        same = [(slots.stage_alone(old), slots.stage_with_delta(old)[0]) for _ in range(3)]
        rows = []
        for i in range(args.steps):
            new = steps.step()
            if i % 2 == 0:  # ABAB: which of the two goes first alternates
                stage_s = slots.stage_alone(new)
                fused_s, deltas, base, staged = slots.stage_with_delta(new)
            else:
                fused_s, deltas, base, staged = slots.stage_with_delta(new)
                stage_s = slots.stage_alone(new)
            rebuild_s = rebuild(slots.lengths, deltas, base, staged)
            changed = sum(int((old[k].view(np.uint16) != new[k].view(np.uint16)).sum()) for k in new)
            elements = sum(v.size for v in new.values())
            wire = sum(len(d) if d is not None else n for d, n in zip(deltas, slots.lengths))
            row = {
                "changed_fraction": changed / elements,
                "wire_ratio": wire / total,
                "raw_chunks": sum(d is None for d in deltas),
                "chunks": len(deltas),
                "gap_value_ratio": sum(gap_value_bytes(old[k].view(np.uint16), new[k].view(np.uint16)) for k in new)
                / total,
                "stage_s": stage_s,
                "stage_delta_s": fused_s,
                "stage_delta_ratio": fused_s / stage_s,
                "rebuild_s": rebuild_s,
            }
            if args.zlib:
                t = time.perf_counter()
                z = sum(len(zlib.compress((old[k].view(np.uint16) ^ new[k].view(np.uint16)).tobytes(), 1)) for k in new)
                row["xor_zlib1_ratio"], row["xor_zlib1_s"] = z / total, time.perf_counter() - t
            rows.append(row)
            old = new
        med = {k: round(statistics.median(r[k] for r in rows), 5) for k in rows[0]}
        med["unchanged_stage_delta_ratio"] = round(statistics.median(b / a for a, b in same), 3)
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
