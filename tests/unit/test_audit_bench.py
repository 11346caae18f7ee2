"""bench/audit.py end to end on 8 CPU devices: as a bare TPU host runs it (xxhash, gRPC
and prometheus_client unimportable: the NumPy engine is skipped, saying why), and with
the package's dependencies (both engines). Every audit exact, both faults named, the
fields the docs quote there."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BARE = (
    "import runpy, sys; sys.modules.update(xxhash=None, grpc=None, prometheus_client=None); "
    "sys.argv = ['audit.py', *sys.argv[1:]]; sys.path.insert(0, 'bench'); "
    "runpy.run_path('bench/audit.py', run_name='__main__')"
)
ARGS = ["--devices", "8", "--mesh", "2x4", "--preset", "small", "--repeats", "2", "--audits", "2", "--json"]


@pytest.mark.parametrize("bare", [True, False], ids=["bare-host", "with-deps"])
def test_the_audit_bench_reports_exact_audits_and_caught_faults(bare: bool) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    command = [sys.executable, "-c", BARE, *ARGS] if bare else [sys.executable, "bench/audit.py", *ARGS]
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    jx = out["jax"]
    assert jx["platform"] == "cpu" and jx["devices"] == 8 and jx["fingerprint"] == "view"
    assert jx["audits_exact"] and jx["faults_caught"] and jx["audits"] == 4
    assert jx["audit_seconds"] > 0 and jx["apply_seconds"] > 0
    assert jx["audit_over_apply"] == pytest.approx(jx["audit_seconds"] / jx["apply_seconds"])
    if bare:
        assert "ImportError" in out["numpy"]["skipped"] or "ModuleNotFoundError" in out["numpy"]["skipped"]
    else:
        assert out["numpy"]["audits_exact"] and out["numpy"]["faults_caught"]
