"""`make demo`'s job end to end: the learning run (vLLM samples, the JAX policy learns), the
noise trainer's five transfer steps, JSON summaries, nothing left behind."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from weightsync.provenance import parse_fingerprint

pytestmark = pytest.mark.slow


def _our_processes(workdir: Path) -> list[str]:
    out = subprocess.run(["pgrep", "-af", str(workdir)], capture_output=True, text=True)
    return [line for line in out.stdout.splitlines() if "pgrep" not in line]


def _summary(proc: subprocess.CompletedProcess[str]) -> dict:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_the_learning_demo_samples_with_vllm_and_trains_on_what_it_sampled(
    tmp_path: Path, no_arena_leak: None, mode: str
) -> None:
    """A few steps of the default demo: every sample carries the version its engine served
    and that version's manifest digest, vLLM's log-probs of the sampled tokens equal the
    trainer's JAX policy's to 1e-3 (fp32 both sides), and every version commits.
    Synchronously every sample is of the trainer's version; asynchronously none is more
    than one version behind."""
    workdir = tmp_path / "demo"
    steps = 3
    rollouts = 2 if mode == "sync" else 1  # (one engine fewer to start)
    proc = subprocess.run(
        [sys.executable, "-m", "devtools.demo", "--steps", str(steps), "--rollouts", str(rollouts)]
        + ["--workdir", str(workdir)]
        + (["--async"] if mode == "async" else []),
        capture_output=True,
        text=True,
        timeout=900,
    )
    summary = _summary(proc)
    assert summary["ok"] and summary["mode"] == "learn" and summary["engine"] == "vllm"
    assert summary["async"] is (mode == "async") and summary["model_size"] == "tiny"
    assert summary["steps"] == steps and summary["committed"] == steps + 1  # version 1: the initial weights
    assert summary["logprob_mismatch_max"] <= 1e-3
    assert summary["samples"] == steps * rollouts * summary["group"]
    # every response named its version and that version's manifest digest, the coordinator's
    assert summary["provenance"] == {"responses": summary["samples"], "verified": summary["samples"], "unverified": []}
    for step in summary["per_step"]:
        versions = [v for vs in step["sampled"].values() for v in vs]
        assert set(step["sampled"]) == {f"rollout-{i}" for i in range(rollouts)}
        for rollout, named in step["responses"].items():
            assert sorted(parse_fingerprint(f)[0][0] for f in named) == step["sampled"][rollout]
        assert 0 <= step["reward_mean"] <= step["reward_best"] <= 1
        if mode == "sync":
            assert versions == [step["version"]] * rollouts
        else:
            assert all(step["version"] - 1 <= v <= step["version"] for v in versions)
    if mode == "sync":
        assert summary["stale_samples"] == 0 and summary["dropped_samples"] == 0
    else:
        assert 0 <= summary["dropped_share"] < 1
    assert proc.stdout.count("reward mean") == steps and "|dlogp|" in proc.stdout
    assert not _our_processes(workdir)


def test_demo_runs_five_steps_and_cleans_up(tmp_path: Path, no_arena_leak: None) -> None:
    workdir = tmp_path / "demo"
    # --lr 0.01: noise steps large enough that a tiny random model's greedy completion
    # changes within five versions (at 1e-3 it may stay one token repeated throughout)
    proc = subprocess.run(
        [sys.executable, "-m", "devtools.demo", "--noise", "--model-size", "tiny", "--steps", "5", "--lr", "0.01"]
        + ["--workdir", str(workdir)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    summary = _summary(proc)
    assert summary["ok"] and summary["mode"] == "noise" and summary["steps"] == 5 and summary["committed"] == 5
    assert summary["bytes_per_step"] > 0 and len(summary["per_step"]) == 5
    assert [s["version"] for s in summary["per_step"]] == [1, 2, 3, 4, 5]
    assert all(s["pull_s"] > 0 and s["stage_s"] > 0 for s in summary["per_step"])
    # the sidecar waits for its engine's prefetch before the update: the engine pauses for
    # the apply, not the pull
    assert all(0 < s["apply_s"] <= s["pause_s"] <= s["apply_s"] + 0.25 for s in summary["per_step"]), summary[
        "per_step"
    ]
    assert proc.stdout.count("handshake OK 2/2") == 5
    assert summary["engine"] == "vllm"  # real vLLM rollouts by default
    for step in summary["per_step"]:
        completions = step["completions"]
        assert set(completions) == {"rollout-0", "rollout-1"} and len(set(completions.values())) == 1
    assert len({s["completions"]["rollout-0"] for s in summary["per_step"]}) > 1  # the policy visibly changes
    assert not _our_processes(workdir)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_demo_interrupted_leaves_nothing_behind(tmp_path: Path, no_arena_leak: None, sig: int) -> None:
    workdir = tmp_path / "demo"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "devtools.demo",
            "--model-size",
            "tiny",
            "--steps",
            "500",
            "--engine",
            "numpy",
            "--workdir",
            str(workdir),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (workdir / "trainer.log").exists():
            time.sleep(0.2)
        time.sleep(3)  # mid-run: several steps in
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:  # never leak the demo (and its children) into later tests
            proc.kill()
            proc.communicate(timeout=30)
            subprocess.run(["pkill", "-KILL", "-f", str(workdir)], check=False)
    assert proc.returncode == 130, out[-3000:]
    assert not _our_processes(workdir)


def test_demo_with_delta_pulls_only_the_changed_elements_after_the_first_step(
    tmp_path: Path, no_arena_leak: None
) -> None:
    """`--delta`: real processes; the first version travels whole, every later one as a
    delta (RL-sized steps, bf16), and each commits with both handshakes OK."""
    workdir = tmp_path / "demo"
    proc = subprocess.run(
        [sys.executable, "-m", "devtools.demo", "--model-size", "small", "--steps", "4", "--delta"]
        + ["--workdir", str(workdir)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["ok"] and summary["committed"] == 4 and summary["delta"] and summary["engine"] == "numpy"
    wire = [s["wire_ratio"] for s in summary["per_step"]]
    assert wire[0] >= 1.0 and all(0 < w < 0.1 for w in wire[1:]), wire
    assert not _our_processes(workdir)


def test_demo_with_atomic_flips_shows_each_versions_skew(tmp_path: Path, no_arena_leak: None) -> None:
    """`--flip atomic`: every version commits flipped together, its skew in the summary."""
    workdir = tmp_path / "demo"
    proc = subprocess.run(
        [sys.executable, "-m", "devtools.demo", "--engine", "numpy", "--model-size", "tiny", "--steps", "3"]
        + ["--flip", "atomic", "--workdir", str(workdir)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    summary = _summary(proc)
    assert summary["ok"] and summary["committed"] == 3, summary
    flip = summary["flip"]
    assert flip["policy"] == "ATOMIC" and set(flip["skew_s"]) == {"1", "2", "3"}, flip
    assert 0 <= flip["skew_max_s"] < 1.0 and flip["skew_max_s"] == max(flip["skew_s"].values())
    assert not _our_processes(workdir)


@pytest.mark.parametrize("protocol", ["s3", "gs"])
def test_demo_in_fs_mode_on_an_object_store_emulator(tmp_path: Path, no_arena_leak: None, protocol: str) -> None:
    from devtools.object_stores import missing_packages

    if why := missing_packages(protocol):
        pytest.skip(why)
    workdir = tmp_path / "demo"
    args = ["--model-size", "tiny", "--steps", "3", "--engine", "numpy", "--weight-sync-mode", "fs"]
    proc = subprocess.run(
        [sys.executable, "-m", "devtools.demo", *args, "--fs-emulator", protocol, "--workdir", str(workdir)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["ok"] and summary["committed"] == 3 and summary["weight_sync_mode"] == "fs"
    assert f"fs store     {protocol}://" in proc.stdout and proc.stdout.count("handshake OK 2/2") == 3
    assert (workdir / f"{protocol}-emulator.log").exists() and not (workdir / "store").exists()
    assert not _our_processes(workdir)
