"""bench/stage.py's device-path mode end to end on 8 CPU devices, shards cut into blocks as
on an accelerator: every row's bytes are checked, the verdict (the default configuration
against the best exact copy-only method) is there, the peak RSS comes from a child of its
own, and with --deadline-s the rows that would end past it are skipped and named."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


@functools.cache  # (two tests read the same run)
def stage_bench(*extra: str) -> dict[str, Any]:
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8")
    args = ["--devices", "8", "--model-size", "small", "--repeats", "1", "--force-blocks", "--json", *extra]
    proc = subprocess.run(
        [sys.executable, "bench/stage.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=240, env=env
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "persistent compilation cache" not in proc.stderr  # the cache shared with the RSS child works
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def test_every_row_is_exact_and_the_verdict_compares_the_default_with_the_best_copy() -> None:
    out = stage_bench()
    assert out["platform"] == "cpu" and out["devices"] == 8 and out["blocks_cut"]
    assert out["skipped"] == []
    assert all(row["exact"] for row in out["device_path"].values())
    assert all(row["exact"] for row in out["copy_only"].values() if "gbps" in row)
    default = next(iter(out["device_path"]))
    assert out["gbps"] == out["device_path"][default]["gbps"]
    assert out["best_copy_only"] in out["copy_only"]
    assert out["ratio_to_best_copy_only"] == round(out["gbps"] / out["best_copy_only_gbps"], 3)
    # the default configuration once more, after the copy-only rows: a later publish of the process
    assert out["gbps_again"] == out["device_path"][default + "_again"]["gbps"]
    assert out["ratio_again_to_best_copy_only"] == round(out["gbps_again"] / out["best_copy_only_gbps"], 3)
    assert out["rss_exact"] and 0 < out["peak_rss_over_baseline_bytes"] <= out["rss_bound_bytes"]


def test_rows_past_the_deadline_are_skipped_and_the_default_is_still_measured() -> None:
    out = stage_bench("--deadline-s", "1")
    assert list(out["device_path"]) == ["window_1024MiB_block_18MiB"] and out["exact"]
    assert "window_1024MiB_block_18MiB_again" in out["skipped"] and out["gbps_again"] is None
    assert "whole_pinned_host" in out["skipped"] and "window_1024MiB_block_0MiB" in out["skipped"]
    assert not set(out["skipped"]) & (set(out["device_path"]) | set(out["copy_only"]))


def test_on_a_publish_worker_thread_with_glibcs_own_top_pad_the_rows_are_still_exact() -> None:
    out = stage_bench("--deadline-s", "1", "--publish-thread", "--heaps", "unmapped")
    assert out["staging_thread"].startswith("publish-worker") and out["heaps"] == "unmapped"
    assert out["exact"] and out["rss_exact"] and 0 < out["peak_rss_over_baseline_bytes"] <= out["rss_bound_bytes"]
    assert stage_bench("--deadline-s", "1")["staging_thread"] == "MainThread"
