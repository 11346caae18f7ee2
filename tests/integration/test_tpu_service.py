"""devtools/tpu_service_check.py off the chip (the service on 8 CPU devices): a
coordinator, the TPU rollout service (the stand-in worker with the extension) and a
trainer in three processes on unix sockets and shm. Every version commits, the engine's
logits equal the trainer's model's to float32 rounding while the previous version's
differ by far more, a swap is built aside before its sync (an in-place apply cannot be),
and the memory guard stops every process when the budget is passed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.unix_only, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "devtools" / "tpu_service_check.py"


def _check(out: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], dict]:  # type: ignore[type-arg]
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "OUT")}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--preset", "small", "--cpu-devices", "8", "--out", str(out), *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    return proc, json.loads((out / "tpu_service.json").read_text())


@pytest.mark.parametrize("mode", ["swap", "inplace"])
def test_every_version_commits_and_serves_the_trainers_logits(tmp_path: Path, no_arena_leak: None, mode: str) -> None:
    proc, out = _check(tmp_path, "--mode", mode, "--versions", "3")
    assert proc.returncode == 0, (proc.stdout[-2000:], out.get("error"))
    assert out["ok"] and out["committed"] == 3 and out["platform"] == "cpu"
    assert out["service"]["devices"] == 8 and out["service"]["mesh"] == "1x8"
    for row in out["per_version"]:
        assert row["state"] == "COMMITTED" and row["rollout_ok"] and row["apply_mode"] == mode
        assert row["logits_rel_err"] <= 1e-4, row
        if row["version"] > 1:  # what a stale engine would serve: far outside the bound
            assert row["stale_rel_diff"] > 100 * out["rtol"], row
        assert row["staged"] == (mode == "swap")  # built aside while the engine served
        assert row["bytes_pulled"] >= out["model_bytes"] and row["pull_gbps"] > 0  # (shards 256-byte aligned)
        assert row["publish_to_committed_seconds"] > 0 and row["pause_seconds"] is not None
    peaks = out["memory"]["peaks"]
    assert set(peaks) == {"trainer", "coordinator", "tpu-rollout"} and all(p["rss"] > 0 for p in peaks.values())
    if peaks["tpu-rollout"]["by_kind"]:  # Linux; gVisor (the TPU host) reports VmRSS alone
        assert all(p["anon"] > 0 for p in peaks.values())
        assert peaks["tpu-rollout"]["shmem"] > 0  # the trainer's arena, mapped by shm
    assert out["memory"]["guard_tripped"] == "" and out["memory"]["min_mem_available"] > 0
    status = out["service_status"]
    assert status["current_version"] == 3 and not status["torn"]
    assert status["host_memory"]["held"]["receive"] >= out["model_bytes"] and status["host_memory"]["rss"] > 0
    assert (tmp_path / "tpu-rollout.log").exists()


def test_the_memory_guard_stops_every_process_past_its_budget(tmp_path: Path, no_arena_leak: None) -> None:
    proc, out = _check(tmp_path, "--memory-budget-gib", "0.05", "--versions", "2")
    assert proc.returncode == 1 and not out["ok"]
    assert "past the budget" in out["memory"]["guard_tripped"], out["memory"]
    assert out["error"]  # the run stopped where the guard tripped, and says so
