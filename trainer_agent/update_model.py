"""A realistic RL update for demos and benchmarks: fp32 master weights, an Adam-style step,
weights served in a 16-bit dtype.

In RL on bf16 weights most served values do not change from one step to the next: the
optimizer moves the fp32 master weights by about the learning rate per element (Adam
normalizes its update), and a bf16 value changes only when its master value crosses a
rounding boundary (`make bench-delta`, docs/performance.md "Delta sync": 1.6% of elements
per step at lr 1e-6, 15.6% at 1e-5). That is what delta sync exploits.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np


def initial_weights(shapes: Mapping[str, tuple[int, ...]], dtype: object, *, seed: int = 0) -> dict[str, np.ndarray]:
    """Weights as a transformer starts training: N(0, 0.02) for matrices and embeddings,
    1 + N(0, 0.02) for norm scales (the magnitudes decide how often a bf16 value moves)."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in shapes.items():
        w = rng.standard_normal(shape, dtype=np.float32)
        w *= 0.02
        if name.endswith("norm.weight"):
            w += 1.0
        out[name] = w.astype(dtype)
    return out


class AdamSteps:
    """fp32 master weights (starting from `initial`'s values) and, per `step()`, an update
    of lr x N(0, 1) clipped at 3 per element; each step returns the master weights cast to
    the served dtype (each tensor's own dtype in `initial`, round to nearest even), and
    `changed` says which fraction of the served elements' bit patterns it changed."""

    def __init__(self, initial: Mapping[str, np.ndarray], lr: float, *, seed: int = 0) -> None:
        if not lr > 0:
            raise ValueError(f"lr must be > 0, got {lr}")
        self.lr = lr
        self._rng = np.random.default_rng(seed)
        self._dtypes = {k: v.dtype for k, v in initial.items()}
        self.master = {k: np.asarray(v, np.float32).copy() for k, v in initial.items()}
        self.steps = 0
        self.changed = 0.0
        self._served: dict[str, np.ndarray] | None = None

    def step(self) -> dict[str, np.ndarray]:
        """Applies one update to the master weights; returns the weights as served (the
        previous step's served arrays are released tensor by tensor, so only one extra
        tensor is held at a time: drop your reference to the previous dict first)."""
        served, self._served = self._served or self.served(), None
        changed = total = 0
        for k, w in self.master.items():
            update = self._rng.standard_normal(w.shape, dtype=np.float32)
            np.clip(update, -3.0, 3.0, out=update)
            update *= self.lr
            w -= update
            new = w.astype(self._dtypes[k])
            old = served[k]
            if old.dtype.itemsize == 2:
                changed += int(np.count_nonzero(new.view(np.uint16) != old.view(np.uint16)))
            else:
                changed += int(np.count_nonzero(new != old))
            total += new.size
            served[k] = new
        self.steps += 1
        self.changed = changed / max(1, total)
        self._served = served
        return dict(served)

    def served(self) -> dict[str, np.ndarray]:
        """The master weights cast to the served dtypes."""
        return {k: w.astype(self._dtypes[k]) for k, w in self.master.items()}
