"""bench/publish_objects.py on the small preset: a publish through a real coordinator keeps
tracked objects alive while it runs, at least one per tensor (its shard's spec), and the
JSON says how many a tensor; bad arguments are refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "publish_objects.py"


def test_a_publish_keeps_tracked_objects_alive_per_tensor(tmp_path: Path) -> None:
    out = tmp_path / "objects.json"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    args = ["--preset", "small", "--versions", "2", "--force-blocks", "--out", str(out)]
    run = subprocess.run([sys.executable, str(BENCH), *args], capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["blocks_cut"] and r["tensors"] > 0 and len(r["peak_tracked"]) == len(r["left_tracked"]) == 2
    assert r["peak_per_tensor"] >= 1  # at least each tensor's shard spec, held until the publish ends
    assert "tracked objects alive" in run.stderr


def test_it_refuses_no_versions() -> None:
    run = subprocess.run([sys.executable, str(BENCH), "--versions", "0"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "--versions >= 1" in run.stderr
