"""`bench/transfer.py` runs end to end on a tiny model and writes the table's JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
FIELDS = {"method", "mode", "rollouts", "seconds", "gbps", "ratio_to_bound", "egress_ratio", "peak_rss_bytes"}


def _bench(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Runs bench/<script> with `args` and asserts it exited 0 (its output tails if not)."""
    run = subprocess.run(
        [sys.executable, str(ROOT / "bench" / script), *args], capture_output=True, text=True, timeout=600, cwd=ROOT
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return run


def test_transfer_bench_writes_rows_for_modes_and_peers(tmp_path: Path, no_arena_leak: None) -> None:
    out = tmp_path / "latest.json"
    run = _bench(
        "transfer.py",
        "--size",
        "tiny",
        "--runs",
        "1",
        "--rollouts",
        "1,2",
        "--modes",
        "tcp,relay",
        "--peers",
        "safetensors,gloo",
        "--vllm",
        "",
        "--out",
        str(out),
    )
    rows = json.loads(out.read_text())
    assert {(r["method"], r["mode"], r["rollouts"]) for r in rows} == {
        ("weightsync", "tcp", 1),
        ("weightsync", "tcp", 2),
        ("weightsync", "relay", 1),
        ("weightsync", "relay", 2),
        ("weightsync", "tcp/streaming", 1),
        ("safetensors", "tmpfs", 1),
        ("safetensors", "tmpfs", 2),
        ("gloo", "tcp", 1),
        ("gloo", "tcp", 2),
    }
    for r in rows:
        assert FIELDS <= set(r) and r["seconds"] > 0 and r["gbps"] > 0 and r["peak_rss_bytes"] >= 0
    by = {(r["method"], r["mode"], r["rollouts"]): r for r in rows}
    # (ratios to the tensors' bytes: the arena's alignment padding travels too)
    assert 2.0 <= by[("weightsync", "tcp", 2)]["egress_ratio"] < 2.05  # direct pulls: one copy per rollout
    assert 1.0 <= by[("weightsync", "relay", 2)]["egress_ratio"] < 1.03  # the chain: the trainer sends once
    # CPU seconds per round (clock ticks: a tiny round may read 0); every weightsync round
    # runs a coordinator, a trainer and rollouts, so their CPU shows
    assert all(r["cpu_seconds"] >= 0 for r in rows) and by[("weightsync", "tcp", 2)]["cpu_seconds"] > 0
    # the engine's pause: weightsync's NumPy engine waits for the apply, a peer's for its round
    assert 0 < by[("weightsync", "tcp", 1)]["pause_seconds"] < by[("weightsync", "tcp", 1)]["seconds"]
    assert by[("gloo", "tcp", 1)]["pause_seconds"] == by[("gloo", "tcp", 1)]["seconds"]
    # every weightsync row ran its rounds interleaved with gloo's at the same N
    for r in rows:
        if r["method"] == "weightsync" and r["apply_mode"] != "streaming":
            assert r["paired_rounds"] == 1 and r["paired_ratio_to_gloo"] > 0 and r["paired_pause_ratio_to_gloo"] > 0
            assert set(r["cpu_roles"]) == {"trainer", "coordinator", "rollouts"}
            assert set(r["cpu_min_roles"]) == {"trainer", "rollouts"} and r["cpu_min_seconds"] > 0
    assert len(by[("gloo", "tcp", 1)]["rounds"]) == 2  # one paired round per weightsync mode at N=1
    meta = json.loads(out.with_suffix(".meta.json").read_text())
    b = meta["bounds"]
    assert b["socket_gbps"] > 0 and b["send_cpu_s"] > 0 and b["recv_cpu_s"] > 0 and meta["cores"] >= 1
    assert any(v.startswith("MET  streaming rollout RSS") for v in meta["verdicts"]), meta["verdicts"]
    assert any("CPU <= 1.3x the roles' physical minimum" in v for v in meta["verdicts"]), meta["verdicts"]
    assert any("<= 1.25x gloo (paired)" in v for v in meta["verdicts"]), meta["verdicts"]
    assert "x bound" in run.stdout


def test_vllm_row_generates_while_versions_prefetch_and_reports_the_pause(no_arena_leak: None) -> None:
    pytest.importorskip("vllm")
    run = _bench("vllm_row.py", "--preset", "tiny", "--versions", "2", "--idle-s", "1")
    row = json.loads(run.stdout.strip().splitlines()[-1])
    assert row["versions"] == 2 and row["all_ok"]
    assert row["tokens_per_s_idle"] > 0 and row["idle_seconds"] > 0.5
    assert row["prefetch_seconds"] > 0 and row["tokens_per_s_prefetch"] >= 0
    assert len(row["pause_s"]) == 2 and all(p >= a > 0 for p, a in zip(row["pause_s"], row["apply_s"]))


def test_vllm_trainer_bench_times_send_weights_against_publish_of_the_same_bytes(no_arena_leak: None) -> None:
    pytest.importorskip("vllm")
    run = _bench("vllm_trainer.py", "--size", "tiny", "--rounds", "2", "--json")
    row = json.loads(run.stdout.strip().splitlines()[-1])
    assert row["preset"] == "tiny" and row["bytes"] > 0 and row["target_ratio"] == 1.3
    assert len(row["publish_numpy_rounds_s"]) == len(row["send_weights_rounds_s"]) == 2
    assert row["ratio"] == row["send_weights_torch_s"] / row["publish_numpy_s"] > 0 and row["best_ratio"] > 0


def test_vllm_trainer_bench_end_to_end_runs_vllms_flow_against_a_real_server(
    tmp_path: Path, no_arena_leak: None
) -> None:
    """--end-to-end: vLLM's server, vLLM's HTTP flow back to back and split, make bench's
    tcp N=1 rounds, in one run; every kind measured and the ratios the targets name; each
    defect refused with the served weights unchanged and the next version applied."""
    pytest.importorskip("vllm")
    out = tmp_path / "e2e.json"
    args = ["--end-to-end", "--size", "tiny", "--rounds", "1", "--dtype", "float32", "--out", str(out)]
    _bench("vllm_trainer.py", *args)
    row = json.loads(out.read_text())
    assert row["preset"] == "tiny" and row["rounds"] == 1 and row["bytes"] > 0
    kinds = ("tcp", "send", "send_pause", "send_apply", "publish", "prefetched", "pause", "apply", "pull", "verify")
    assert all(row["medians_s"][k] > 0 for k in kinds)
    assert len(row["rounds_s"]["tcp"]) == 2 and len(row["rounds_s"]["pause"]) == 1
    assert row["pause_to_apply"] == row["medians_s"]["pause"] / row["medians_s"]["apply"]
    assert row["send_weights_to_tcp"] == row["medians_s"]["send"] / row["medians_s"]["tcp"]
    defects = row["defects"]
    assert defects["held"] == defects["of"] == 5, defects["rounds"]


def test_a_delta_row_that_cannot_run_beside_gloo_alternates_with_it(tmp_path: Path, no_arena_leak: None) -> None:
    """At N > 2 a +delta row's processes and gloo's take turns, block by block, and every
    one of our rounds is paired with one of gloo's."""
    out = tmp_path / "latest.json"
    args = ["--size", "tiny", "--runs", "1", "--rollouts", "3", "--delta-rollouts", "3", "--modes", "tcp+delta"]
    args += ["--peers", "gloo", "--streaming", "", "--vllm", "", "--alternations", "2", "--out", str(out)]
    _bench("transfer.py", *args)
    by = {(r["method"], r["mode"], r["rollouts"]): r for r in json.loads(out.read_text())}
    assert set(by) == {("weightsync", "tcp+delta", 3), ("gloo", "tcp", 3)}
    delta, gloo = by[("weightsync", "tcp+delta", 3)], by[("gloo", "tcp", 3)]
    assert len(delta["rounds"]) == len(gloo["rounds"]) == delta["paired_rounds"] == 2
    assert delta["paired_by"].startswith("blocks of 1 rounds") and delta["paired_ratio_to_gloo"] > 0


def test_object_store_bench_reads_each_protocol_back_and_overlaps_its_gets() -> None:
    from devtools.object_stores import missing_packages

    run = _bench("object_store.py", "--part-mib", "2", "--chunk-mib", "1", "--window", "2", "--repeat", "1")
    out = json.loads(run.stdout)
    installed = {"fs-s3": "s3", "fs-gcs": "gs"}
    assert {r["row"] for r in out["rows"]} == {row for row, p in installed.items() if not missing_packages(p)}
    assert set(out["skipped"]) == {row for row, p in installed.items() if missing_packages(p)}
    for row in out["rows"]:  # every chunk was compared with what was written (the bench asserts it)
        assert row["max_gets_in_flight"] == 2 and row["speedup"] > 0, row
