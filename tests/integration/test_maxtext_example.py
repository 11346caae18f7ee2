"""examples/maxtext_trainer.py run as its docstring says: against a coordinator and a rollout
sidecar on loopback, every step's version commits with the rollout's OK handshake, and each
version the rollout applied is the trainer's scanned tree at that step, read back into
MaxText's layout by the test-side reference (tests/unit/maxtext_reference.py), not by the
converters."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import jax.numpy as jnp
import numpy as np
from safetensors.numpy import load_file

from devtools.cluster import Cluster
from tests.unit.helpers import python_path
from tests.unit.maxtext_reference import to_maxtext

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "maxtext_trainer.py"
SESSION = "maxtext"
STEPS = 3
SEED = 3


def _example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("maxtext_trainer_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _dotted(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        out.update(_dotted(value, name + ".") if isinstance(value, dict) else {name: value})
    return out


def test_the_maxtext_example_commits_every_step_and_the_rollout_applies_the_trainers_tree(
    cluster: Cluster, tmp_path: Path
) -> None:
    coord = cluster.start_coordinator()
    dump = tmp_path / "dump"
    cluster.start_rollout("r0", coord.address, SESSION, ["--dump-dir", str(dump)])
    run = subprocess.run(
        [sys.executable, str(EXAMPLE), "--coordinator", coord.address, "--session", SESSION]
        + ["--steps", str(STEPS), "--seed", str(SEED)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**cluster.env, "PYTHONPATH": python_path(ROOT)},
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    steps = [json.loads(line) for line in run.stdout.splitlines()]
    assert [(s["version"], s["state"], s["handshakes_ok"], s["handshakes"]) for s in steps] == [
        (v, "COMMITTED", 1, 1) for v in range(1, STEPS + 1)
    ]

    example = _example()
    params = example.init_params(SEED)
    previous: dict[str, bytes] = {}
    for step in range(1, STEPS + 1):
        params = example.train_step(params, example.step_key(SEED, step))
        want = {k: np.asarray(v.astype(jnp.bfloat16)) for k, v in _dotted(params["params"]).items()}
        applied = load_file(str(dump / f"v{step}.safetensors"))
        dims = example.DIMS
        back = to_maxtext(
            applied, "qwen3", layers=dims.layers, heads=dims.heads, kv_heads=dims.kv_heads, head_dim=dims.head_dim
        )
        assert back.keys() == want.keys()
        for name, array in want.items():
            got = np.ascontiguousarray(back[name])
            assert got.dtype == array.dtype and got.shape == array.shape, name
            assert got.tobytes() == array.tobytes(), f"version {step}: {name} is not the trainer's"
            assert previous.get(name, b"") != array.tobytes(), f"step {step} left {name} as it was"
            previous[name] = array.tobytes()
