"""bench/rss_sampler.py: a process's RSS sampled from outside it, its peak per phase."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from rss_sampler import RssSampler  # noqa: E402

from weightsync.host_memory import LACKS_VARIABLE  # noqa: E402

MB = 1 << 20


def test_each_phase_keeps_its_own_peak_from_outside_the_process() -> None:
    with RssSampler(interval_ms=1.0) as rss:
        rss.phase("idle")
        time.sleep(0.05)
        rss.phase("big")
        block = np.ones(256 * MB, np.uint8)  # every page touched
        time.sleep(0.05)
        del block
        rss.phase("after")
        time.sleep(0.05)
    assert set(rss.peaks) >= {"idle", "big", "after"}
    assert rss.peaks["big"] >= rss.peaks["idle"] + 200 * MB
    assert rss.peaks["after"] < rss.peaks["big"] - 200 * MB  # freed: glibc unmaps a block that large


def test_the_sampler_has_read_the_rss_once_before_the_block_starts() -> None:
    """Its child takes ~1 s to start on a TPU host (~0.3 s here): phases that passed before
    its first sample would read nothing. It has sampled once when the block starts."""
    with RssSampler(interval_ms=1.0) as rss:
        rss.phase("at-once")
    assert (rss.peaks.get("start") or 0) > 0, rss.peaks


def test_a_phase_whose_rss_cannot_be_read_is_unknown_not_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sampler reads before the block starts (its child's start is slow on a TPU host),
    and a phase without a reading is None."""
    monkeypatch.setenv(LACKS_VARIABLE, "VmRSS")  # the child's reader: no VmRSS in any status
    with RssSampler(interval_ms=1.0) as rss:
        rss.phase("idle")
        time.sleep(0.02)
    assert rss.peaks == {"start": None, "idle": None}


def test_an_interval_of_zero_samples_nothing_and_starts_no_process() -> None:
    with RssSampler(interval_ms=0) as rss:
        rss.phase("idle")
        assert rss._child is None
    assert not rss.sampling and rss.peaks == {}
