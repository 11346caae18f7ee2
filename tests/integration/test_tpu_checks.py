"""devtools/tpu_checks.sh, the TPU host's prepared checks, tried off the host
(TPU_CHECKS_CPU=1: 8 CPU devices): a step's log lands in $OUT with its line in the
summary, a step past its budget is cut short keeping what it printed, the host's facts
are JSON, and an unknown stage is refused."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.unix_only  # the demo step runs over unix sockets, as on the host
ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "devtools" / "tpu_checks.sh"


def _env(**env: str) -> dict[str, str]:
    """This process's environment without the script's own settings (a suite run by the
    script itself has TPU_CHECKS_ONLY and TPU_CHECKS_DEADLINE_S set), plus `env`."""
    return {**{k: v for k, v in os.environ.items() if not k.startswith("TPU_CHECKS_")}, **env}


def test_the_demo_stage_runs_and_reports_into_out(tmp_path: Path) -> None:
    env = _env(TPU_CHECKS_CPU="1", OUT=str(tmp_path), PYTHON=sys.executable)
    proc = subprocess.run([str(SCRIPT), "demo"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "demo" in proc.stdout and "rc=0" in proc.stdout
    summary = json.loads((tmp_path / "demo.log").read_text().strip().splitlines()[-1])
    assert summary["ok"] and summary["committed"] == summary["steps"] == 3
    host = json.loads((tmp_path / "host.json").read_text())
    assert host["platform"] == "cpu" and len(host["devices"]) == 8


def test_an_unknown_stage_is_refused_with_the_stages(tmp_path: Path) -> None:
    proc = subprocess.run([str(SCRIPT), "everything"], cwd=ROOT, env=_env(OUT=str(tmp_path)),
                          capture_output=True, text=True, timeout=30)  # fmt: skip
    assert proc.returncode == 2 and "suite|bench|apply|demo|diagnose" in proc.stderr


def _sourced(tmp_path: Path, commands: str, **env: str) -> subprocess.CompletedProcess[str]:
    """`commands` run by bash after sourcing the script (its functions, no stage), JAX on
    the CPU (on the TPU host this test's process may hold the chip)."""
    env = _env(**{"OUT": str(tmp_path), "PYTHON": sys.executable, "TPU_CHECKS_CPU": "1", **env})
    return subprocess.run(
        ["bash", "-c", f'source "{SCRIPT}" && {commands}'],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_step_past_its_budget_is_cut_short_and_keeps_what_it_printed(tmp_path: Path) -> None:
    """A bench that measured something, then ran past its budget: SIGTERM before the budget
    ends (SIGKILL at its end), its line says so, and its log keeps what it printed."""
    slow = f"{sys.executable} -c \"import time; print('measured 1.5 GB/s'); time.sleep(60)\""
    t0 = time.monotonic()
    done = _sourced(tmp_path, f"step slow 12 {slow} && step quick 30 true")
    assert done.returncode == 0, done.stderr
    assert time.monotonic() - t0 < 12
    lines = (tmp_path / "summary.txt").read_text().splitlines()
    assert re.fullmatch(r"slow +rc=124 +\d+s  cut short at its 12s budget .*", lines[0]), lines
    assert lines[1].strip() == "measured 1.5 GB/s" and re.fullmatch(r"quick +rc=0 +\d+s", lines[2]), lines
    assert (tmp_path / "slow.log").read_text() == "measured 1.5 GB/s\n"


def test_steps_share_the_calls_deadline(tmp_path: Path) -> None:
    done = _sourced(tmp_path, "step late 100 true", TPU_CHECKS_DEADLINE_S="15")
    assert done.returncode == 0, done.stderr
    assert re.fullmatch(r"late +skipped: 1[45]s left of the call\n", (tmp_path / "summary.txt").read_text())
    assert not (tmp_path / "late.log").exists()


def test_only_the_steps_asked_for_run(tmp_path: Path) -> None:
    done = _sourced(tmp_path, "step first 30 true && step second 30 true", TPU_CHECKS_ONLY="second")
    assert done.returncode == 0, done.stderr
    assert re.fullmatch(r"second +rc=0 +\d+s\n", (tmp_path / "summary.txt").read_text())
    assert not (tmp_path / "first.log").exists()


def test_the_host_facts_are_json_whatever_the_interpreter_warns(tmp_path: Path) -> None:
    """JAX on the TPU host warns about transparent hugepages on stderr: host.err, not host.json."""
    warns = tmp_path / "python"
    warns.write_text(
        f'#!/bin/sh\necho "UserWarning: Transparent hugepages are not enabled." >&2\nexec {sys.executable} "$@"\n'
    )
    warns.chmod(0o755)
    done = _sourced(tmp_path, "facts", PYTHON=str(warns))
    assert done.returncode == 0, done.stderr
    assert json.loads((tmp_path / "host.json").read_text())["platform"] == "cpu"
    assert "Transparent hugepages" in (tmp_path / "host.err").read_text()


def test_the_suite_ends_with_one_line_of_its_counts(tmp_path: Path) -> None:
    """`suite`'s verdict over its two pytest steps' logs: errors count as failed, a step
    without pytest's summary is named, a step not asked for is left out."""
    (tmp_path / "unit.log").write_text(
        "..F\nFAILED tests/unit/x.py::t\n7 failed, 655 passed, 34 skipped in 230.87s (0:03:50)\n"
    )
    (tmp_path / "tpu-marked.log").write_text("15 passed, 14 skipped, 1 error, 937 deselected in 141.31s (0:02:21)\n")
    done = _sourced(tmp_path, "suite_verdict unit tpu-marked")
    assert done.stdout == "suite: 8 failed, 670 passed, 48 skipped\n", done.stderr
    (tmp_path / "tpu-marked.log").write_text("..s..\n")  # cut short: no summary
    done = _sourced(tmp_path, "suite_verdict unit tpu-marked")
    assert done.stdout == "suite: 7 failed, 655 passed, 34 skipped; tpu-marked: no summary (cut short or crashed)\n"
    done = _sourced(tmp_path, "suite_verdict unit tpu-marked", TPU_CHECKS_ONLY="unit")
    assert done.stdout == "suite: 7 failed, 655 passed, 34 skipped\n"
    assert (tmp_path / "summary.txt").read_text().count("suite: ") == 3
