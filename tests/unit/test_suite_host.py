"""The suite on hosts unlike CI's (a TPU VM): JAX's start-up notices are no errors, and the
processes tests start stay off the chip."""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest

HUGEPAGES = (
    "Transparent hugepages are not enabled. TPU runtime startup and shutdown time should be significantly "
    "improved on TPU v5e and newer."
)


def test_jax_start_up_notices_pass_and_nothing_else_from_there_does() -> None:
    """What `import jax` warns on a TPU VM without transparent hugepages is ignored (pyproject's
    filterwarnings); another warning from the same module is still an error."""
    warnings.warn_explicit(HUGEPAGES, UserWarning, "cloud_tpu_init.py", 88, module="jax._src.cloud_tpu_init")
    with pytest.raises(UserWarning, match="TPU_LIBRARY_PATH"):
        warnings.warn_explicit(
            "TPU_LIBRARY_PATH is set to a non-existent path", UserWarning, "cloud_tpu_init.py", 45,
            module="jax._src.cloud_tpu_init",
        )  # fmt: skip
    with pytest.raises(UserWarning, match="Transparent hugepages"):
        warnings.warn_explicit(HUGEPAGES, UserWarning, "elsewhere.py", 1, module="weightsync.native")


def test_processes_the_tests_start_run_jax_on_the_cpu() -> None:
    """One process may hold a TPU chip (the suite's, where JAX_PLATFORMS asks for the default
    platform); a child that opened it too would fail instead of falling back to the CPU."""
    code = "import os; print(os.environ.get('JAX_PLATFORMS'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "cpu"
