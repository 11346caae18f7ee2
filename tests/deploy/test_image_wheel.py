"""The image's wheel carries the native shim: built from a clean copy of the tracked sources
with deploy/build-wheel.sh, exactly as deploy/Containerfile builds it (no container runtime
here can pull base images), and the check refuses a wheel without it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "deploy"))
from check_wheel import problems  # noqa: E402

from tests.unit.helpers import python_path  # noqa: E402


def _clean_copy(dest: Path) -> None:
    """The files a clean clone has (the build context .dockerignore leaves)."""
    tracked = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for name in filter(None, tracked):
        src = ROOT / name.decode()
        if src.is_file():
            (dest / name.decode()).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name.decode())
    header = ROOT / "build" / "xxhash-include"  # the image installs libxxhash-dev instead
    if header.exists() and not Path("/usr/include/xxhash.h").exists():
        shutil.copytree(header, dest / "build" / "xxhash-include")


@pytest.mark.timeout(600)
def test_the_trainer_image_wheel_holds_the_shim_and_its_ffi_handler(tmp_path: Path) -> None:
    src, out = tmp_path / "src", tmp_path / "wheels"
    src.mkdir()
    _clean_copy(src)
    assert not list((src / "weightsync" / "_native").glob("*.so"))  # nothing prebuilt sneaks in
    env = {**os.environ, "PYTHON": sys.executable}
    proc = subprocess.run(
        ["sh", "deploy/build-wheel.sh", str(out), "trainer"], cwd=src, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "native shim present with the FFI handler" in proc.stdout
    (wheel,) = out.glob("weightsync-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
    assert any(n.startswith("weightsync/_native/libweightsync_native") for n in names)
    assert "rollout_agent/vllm_plugin.py" in names and "devtools/tiny_models.py" in names


def test_the_check_refuses_a_wheel_without_the_shim(tmp_path: Path) -> None:
    bare = tmp_path / "weightsync-0.1.0-py3-none-any.whl"
    with zipfile.ZipFile(bare, "w") as z:
        z.writestr("weightsync/__init__.py", "")
    assert "no weightsync/_native/libweightsync_native" in problems(str(bare), ffi=False)[0]
    no_ffi = tmp_path / "weightsync-0.1.0-cp311-cp311-linux_x86_64.whl"
    with zipfile.ZipFile(no_ffi, "w") as z:
        z.writestr("weightsync/_native/libweightsync_native.cpython-311-x86_64-linux-gnu.so", b"\x7fELF...")
    assert problems(str(no_ffi), ffi=False) == []
    assert "without the JAX FFI handler" in problems(str(no_ffi), ffi=True)[0]


def test_a_trainer_build_without_jax_headers_fails_instead_of_degrading(tmp_path: Path) -> None:
    # setup.py's guard: WEIGHTSYNC_REQUIRE_FFI=1 where jax.ffi is not importable is an error.
    (tmp_path / "shadow" / "jax").mkdir(parents=True)
    (tmp_path / "shadow" / "jax" / "__init__.py").write_text("raise ImportError('no jax in this build')\n")
    proc = subprocess.run(
        [
            sys.executable,
            "setup.py",
            "build_ext",
            "--build-temp",
            str(tmp_path / "t"),
            "--build-lib",
            str(tmp_path / "l"),
        ],
        cwd=ROOT,
        env={**os.environ, "WEIGHTSYNC_REQUIRE_FFI": "1", "PYTHONPATH": python_path(tmp_path / "shadow")},
        capture_output=True,
        text=True,
    )
    assert proc.returncode != 0 and "WEIGHTSYNC_REQUIRE_FFI=1" in proc.stderr, proc.stderr[-2000:]
