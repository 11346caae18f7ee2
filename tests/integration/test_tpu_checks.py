"""devtools/tpu_checks.sh, the TPU host's prepared checks, tried off the host
(TPU_CHECKS_CPU=1: 8 CPU devices): a step's log lands in $OUT with its line in the
summary, and an unknown stage is refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unix_only  # the demo step runs over unix sockets, as on the host
ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "devtools" / "tpu_checks.sh"


def test_the_demo_stage_runs_and_reports_into_out(tmp_path: Path) -> None:
    env = {**os.environ, "TPU_CHECKS_CPU": "1", "OUT": str(tmp_path), "PYTHON": sys.executable}
    proc = subprocess.run([str(SCRIPT), "demo"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "demo" in proc.stdout and "rc=0" in proc.stdout
    summary = json.loads((tmp_path / "demo.log").read_text().strip().splitlines()[-1])
    assert summary["ok"] and summary["committed"] == summary["steps"] == 3
    host = json.loads((tmp_path / "host.json").read_text())
    assert host["platform"] == "cpu" and len(host["devices"]) == 8


def test_an_unknown_stage_is_refused_with_the_stages(tmp_path: Path) -> None:
    proc = subprocess.run([str(SCRIPT), "everything"], cwd=ROOT, env={**os.environ, "OUT": str(tmp_path)},
                          capture_output=True, text=True, timeout=30)  # fmt: skip
    assert proc.returncode == 2 and "suite|bench|demo" in proc.stderr
