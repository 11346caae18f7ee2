"""devtools/suite_verdict.py: one line of counts from pytest logs, the tests' verdict on the
TPU host (`tpu_checks.sh suite`) and in the host lane."""

from __future__ import annotations

from pathlib import Path

from devtools.suite_verdict import counts, verdict


def test_the_last_summary_line_counts_and_errors_are_failures() -> None:
    log = (
        "tests/unit/a.py .. 3 passed in the name\n1 failed, 2 passed in 1.00s\n"
        "2 failed, 3 errors, 4 passed, 5 skipped, 6 deselected in 9.5s (0:00:09)\n"
    )
    assert counts(log) == {"failed": 5, "passed": 4, "skipped": 5}
    assert counts("15 passed, 14 skipped, 937 deselected in 141.31s (0:02:21)") == {
        "failed": 0, "passed": 15, "skipped": 14,
    }  # fmt: skip
    assert counts("no tests ran in 0.01s") == {"failed": 0, "passed": 0, "skipped": 0}
    assert counts("....s...\n") is None  # cut short before pytest summed up


def test_the_verdict_sums_the_runs_and_names_a_log_without_a_summary(tmp_path: Path) -> None:
    (tmp_path / "unit.log").write_text("7 failed, 655 passed, 34 skipped in 230.87s (0:03:50)\n")
    (tmp_path / "marked.log").write_text("15 passed, 14 skipped, 937 deselected in 141.31s\n")
    (tmp_path / "cut.log").write_text("..s\n")
    assert verdict("suite", [tmp_path / "unit.log", tmp_path / "marked.log"]) == (
        "suite: 7 failed, 670 passed, 48 skipped", False,
    )  # fmt: skip
    assert verdict("host lane", [tmp_path / "marked.log", tmp_path / "cut.log", tmp_path / "gone.log"]) == (
        "host lane: 0 failed, 15 passed, 14 skipped; cut: no summary (cut short or crashed); gone: no summary "
        "(cut short or crashed)", False,
    )  # fmt: skip
    assert verdict("suite", [tmp_path / "marked.log"]) == ("suite: 0 failed, 15 passed, 14 skipped", True)
