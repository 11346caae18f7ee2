"""The suite on hosts unlike CI's (a TPU VM): JAX's start-up notices are no errors, and the
processes tests start stay off the chip."""

from __future__ import annotations

import re
import subprocess
import sys
import warnings
from pathlib import Path

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


ROOT = Path(__file__).resolve().parents[2]
CODE = ("weightsync", "trainer_agent", "rollout_agent", "coordinator", "devtools", "bench", "examples", "tests")


def test_fault_counts_are_read_only_where_the_host_lane_reaches_them() -> None:
    """gVisor counts no page faults: `weightsync.host_memory.minor_faults` says None there,
    and `make test-host` emulates that through it (WEIGHTSYNC_PROC_LACKS), so a count read
    elsewhere would read 0 on the host and pass in the lane."""
    readers = {
        str(path.relative_to(ROOT))
        for top in CODE
        for path in (ROOT / top).rglob("*.py")
        if re.search(r"\.ru_m(in|aj)flt\b", path.read_text())
    }
    assert readers <= {"weightsync/host_memory.py"}, f"read weightsync.host_memory.minor_faults instead: {readers}"


def test_children_the_tests_start_keep_the_inherited_python_path() -> None:
    """A TPU host's kit puts the dependencies on PYTHONPATH, not in a venv: a child given a
    PYTHONPATH of the project alone imports none of them there. Every
    PYTHONPATH a test or tool sets goes through `tests.unit.helpers.python_path`."""
    setters = {
        f"{path.relative_to(ROOT)}:{n}"
        for top in CODE
        for path in (ROOT / top).rglob("*.py")
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"""["']PYTHONPATH["']\s*:""", line) and "python_path(" not in line
    }
    assert not setters, f"set PYTHONPATH with tests.unit.helpers.python_path(...): {sorted(setters)}"
