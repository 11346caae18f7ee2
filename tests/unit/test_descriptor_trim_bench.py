"""bench/descriptor_trim.py on a small fragmented heap: both ways build the same requests'
worth of versions, the JSON names each way's figures, and bad arguments are refused."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "descriptor_trim.py"


def test_both_ways_are_timed_on_a_fragmented_heap(tmp_path: Path) -> None:
    out = tmp_path / "trim.json"
    args = ["--preset", "small", "--free-chunks", "2000", "--versions", "3", "--rounds", "2", "--out", str(out)]
    run = subprocess.run([sys.executable, str(BENCH), *args], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    r = json.loads(out.read_text())
    assert r["free_chunks"] == 2000 and r["versions_per_way"] == 6 and r["tensors"] > 0 and r["chunks"] > 0
    for way in ("per-descriptor", "in-place"):
        assert {"median_ms", "max_ms", "mean_ms", "over_10x", "mean_to_in_place"} <= set(r[way])
        assert f"{way}: median" in run.stderr
    assert r["in-place"]["mean_to_in_place"] == 1.0


def test_it_refuses_no_versions() -> None:
    run = subprocess.run([sys.executable, str(BENCH), "--versions", "0"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "--versions >= 1" in run.stderr
