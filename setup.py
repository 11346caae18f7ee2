"""Builds the native staging shim (native/, CMake) into weightsync/_native/ during pip install.

The JAX FFI handler is compiled when jax's FFI headers are importable at build time
(`make setup` installs with --no-build-isolation into a venv that has jax); otherwise
only the C ABI is built and the FFI path reports itself unavailable, unless
WEIGHTSYNC_REQUIRE_FFI=1 (the trainer image's build), which makes that an error.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
LIB_NAME = "libweightsync_native.so"
CUDA_LIB_NAME = "libweightsync_native_cuda.so"
XXHASH_CANDIDATES = ["/usr/include", "/usr/local/include", str(ROOT / "build" / "xxhash-include")]


def _jax_ffi_include() -> str:
    try:
        out = subprocess.run(
            [sys.executable, "-c", "import jax.ffi; print(jax.ffi.include_dir())"],
            capture_output=True,
            text=True,
            check=True,
            timeout=120,
        )
        return out.stdout.strip()
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError):
        return ""


def _xxhash_include() -> str:
    for d in [os.environ.get("XXHASH_INCLUDE_DIR", ""), *XXHASH_CANDIDATES]:
        if d and (Path(d) / "xxhash.h").exists():
            return d
    raise RuntimeError(
        "xxhash.h not found: install Debian's libxxhash-dev, or run `make setup` (it fetches the header "
        "from the xxhash source distribution), or set XXHASH_INCLUDE_DIR"
    )


class CMakeBuild(build_ext):
    def build_extension(self, ext: Extension) -> None:
        # Named as setuptools expects an extension module; weightsync.native loads it by glob.
        target = Path(self.get_ext_fullpath(ext.name))
        target.parent.mkdir(parents=True, exist_ok=True)
        ffi_include = _jax_ffi_include()
        if not ffi_include and os.environ.get("WEIGHTSYNC_REQUIRE_FFI") == "1":
            raise RuntimeError(
                "WEIGHTSYNC_REQUIRE_FFI=1 but jax's FFI headers are not importable by this build "
                f"({sys.executable} -c 'import jax.ffi'): install jax[cpu] first and build without isolation"
            )
        with tempfile.TemporaryDirectory(prefix="weightsync-native-") as build:
            args = [
                f"-DXXHASH_INCLUDE_DIR={_xxhash_include()}",
                f"-DJAX_FFI_INCLUDE_DIR={ffi_include}",
                "-DCMAKE_BUILD_TYPE=Release",
            ]
            subprocess.run(["cmake", "-S", str(ROOT / "native"), "-B", build, *args], check=True)
            subprocess.run(["cmake", "--build", build, "-j", "2"], check=True)
            shutil.copy2(Path(build) / LIB_NAME, target)
            cuda_lib = Path(build) / CUDA_LIB_NAME
            if cuda_lib.exists():  # built only where a CUDA toolkit is installed
                # Not a declared extension (it may not exist): editable installs need it in
                # the source tree, wheels in build_lib.
                editable = getattr(self, "editable_mode", False) or self.inplace
                dest = ROOT / "weightsync" / "_native" if editable else target.parent
                shutil.copy2(cuda_lib, dest / CUDA_LIB_NAME)


setup(
    ext_modules=[Extension("weightsync._native.libweightsync_native", sources=[])],
    cmdclass={"build_ext": CMakeBuild},
)
