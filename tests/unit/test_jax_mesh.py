"""Applies over meshes of 8 CPU devices, (1, 8), (2, 4) and (8, 1), with heads, hidden,
vocabulary, all of them or nothing sharded: every device's shard of every leaf equals
the NumPy reference of its slice, the fingerprints agree, and a flipped bit is refused.
Each mesh runs in a process of its own (tests/unit/jax_mesh_worker.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("jax_mesh_worker.py")
PROFILES = ["none", "heads", "hidden", "vocab", "tpu_inference", "2d"]


def _cases() -> list[dict[str, object]]:
    cases: list[dict[str, object]] = [
        {"layout": "tpu_inference", "profile": p, "transfer": "host", "mode": "swap"} for p in PROFILES
    ]
    cases += [
        {"layout": "tpu_inference", "profile": "2d", "transfer": "device", "mode": "swap", "fingerprint": "jit",
         "corrupt": True},
        {"layout": "tpu_inference", "profile": "tpu_inference", "transfer": "device", "mode": "inplace"},
        {"layout": "tpu_inference", "profile": "heads", "transfer": "host", "mode": "inplace", "corrupt": True},
        {"layout": "hf", "profile": "2d", "transfer": "auto", "mode": "swap"},
        # a layer at a time, each group's leaves transformed and fingerprinted by one program
        {"layout": "tpu_inference", "profile": "heads", "transfer": "device", "mode": "inplace", "fingerprint": "jit",
         "corrupt": True},
        {"layout": "tpu_inference", "profile": "vocab", "transfer": "auto", "mode": "swap", "fingerprint": "jit"},
    ]  # fmt: skip
    return cases


@pytest.mark.parametrize("mesh", [(1, 8), (2, 4), (8, 1)], ids=lambda m: f"{m[0]}x{m[1]}")
def test_every_shard_on_every_device_is_bit_exact(mesh: tuple[int, int]) -> None:
    spec = {"devices": 8, "mesh": list(mesh), "cases": _cases()}
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.run(
        [sys.executable, str(WORKER), json.dumps(spec)], capture_output=True, text=True, timeout=240, env=env
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(results) == len(spec["cases"])
    for case, found in results.items():
        assert found["wrong"] == [], (case, found["wrong"][:5])
        assert found["leaves"] == 25, case
        if "corrupt_caught" in found:
            assert found["corrupt_caught"], case
        profile = case.split("/")[1]
        ways = {"none": 1, "hidden": mesh[0], "2d": mesh[0] * mesh[1]}.get(profile, mesh[1])
        if ways > 1:
            assert found["sharded_leaves"] > 0, case  # the profile really sharded something here
        if case.startswith("tpu_inference/2d/device"):
            assert found["fingerprint"] == "jit" and "device" in found["transfer"], found
        # jit-checked leaves on a mesh go over a layer at a time: the head, two layers, the tail
        assert found["groups"] == (4 if found["fingerprint"] == "jit" else 0), (case, found["groups"])
