"""bench/apply.py end to end on 8 CPU devices, as a bare TPU host runs it: a process where
xxhash, gRPC and prometheus_client cannot be imported. Every field the docs quote is
there, the read back is exact and the corrupted version is caught, in both modes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# the bench as `python bench/apply.py ...`, with the packages a bare JAX host lacks made unimportable
BARE = (
    "import runpy, sys; sys.modules.update(xxhash=None, grpc=None, prometheus_client=None); "
    "sys.argv = ['apply.py', *sys.argv[1:]]; sys.path.insert(0, 'bench'); "
    "runpy.run_path('bench/apply.py', run_name='__main__')"
)


@pytest.mark.parametrize("mode", ["swap", "inplace"])
def test_the_apply_bench_reports_an_exact_checked_apply_on_a_bare_host(mode: str) -> None:
    args = ["--devices", "8", "--mesh", "2x4", "--preset", "small", "--mode", mode, "--repeats", "2", "--json"]
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    proc = subprocess.run(
        [sys.executable, "-c", BARE, *args], cwd=ROOT, capture_output=True, text=True, timeout=240, env=env
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["platform"] == "cpu" and out["devices"] == 8 and out["mode"] == mode
    assert out["bit_exact"] and out["fingerprint_ok"] and out["corrupt_caught"]
    assert len(out["repaired_leaves"]) == (0 if mode == "swap" else 1)  # in place: the damaged leaf rebuilt
    assert out["bytes"] > 0 and out["apply_seconds"] > 0 and out["device_put_bound_seconds"] > 0
    assert out["ratio"] == pytest.approx(out["device_put_bound_seconds"] / out["apply_seconds"])
    assert len(out["rounds"]) == 2
