"""bench/heap_reuse.py with the real C library: its worker's blocks fault in no page once
the heaps are kept, and fault some in every version with glibc's own top pad."""

from __future__ import annotations

import json
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from weightsync.host_memory import faults_counted

BENCH = Path(__file__).resolve().parents[2] / "bench" / "heap_reuse.py"


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_kept_heaps_fault_in_nothing_and_unmapped_ones_fault_in_every_version(tmp_path: Path) -> None:
    out = tmp_path / "heap.json"
    sizes = ["--version-mib", "256", "--window-mib", "128", "--versions", "3", "--rounds", "1"]
    run = subprocess.run(
        [sys.executable, str(BENCH), *sizes, "--out", str(out)], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    r = json.loads(out.read_text())
    assert r["version_bytes"] == 14 * (18 << 20) and r["in_flight_blocks"] == 7 and r["versions_counted"] == 2
    assert {"gbps", "ratio_to_bound", "sys_s_per_version"} <= set(r["kept"]) and r["bound"]["gbps"] > 0
    assert "unmapped:" in run.stderr and "x the bound" in run.stderr
    if not faults_counted():  # gVisor (a TPU host): unknown, not 0
        assert [r[m]["faults_per_version"] for m in ("kept", "unmapped", "bound")] == [None] * 3
        assert run.stderr.count("unknown page faults") == 3
        return
    assert r["kept"]["faults_per_version"] == 0 and r["bound"]["faults_per_version"] == 0
    assert r["unmapped"]["faults_per_version"] > 0  # the emptied heaps mapped and faulted in again, each version


def test_it_refuses_a_single_version_per_mode() -> None:
    run = subprocess.run([sys.executable, str(BENCH), "--versions", "1"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "--versions >= 2" in run.stderr
