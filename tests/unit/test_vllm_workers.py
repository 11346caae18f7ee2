"""The agreement records of a vLLM engine's workers, and the filter that keeps a refused
version's tracebacks out of vLLM's log (the collectives themselves run in the TP 2 tests
of tests/e2e/test_vllm_trainer.py)."""

from __future__ import annotations

import logging

import pytest

pytest.importorskip("torch")

from rollout_agent.vllm_worker.quiet_refusals import MARKER, RefusalTracebacks  # noqa: E402
from rollout_agent.vllm_worker.workers import EngineWorkers, Verdict, _first_refusal, _record  # noqa: E402


def records(*verdicts: Verdict, tensors: int = 3) -> list:
    return [_record(v, tensors).numpy() for v in verdicts]


def test_a_worker_alone_agrees_with_itself() -> None:
    alone = EngineWorkers()
    assert alone.last and alone.size == 1
    agreed = alone.agree(Verdict(4, "", {"a": 6}), ["a"])
    assert agreed.refusal == "" and agreed.taken == {"a": 6} and agreed.workers == 1
    assert alone.agree(Verdict(4, "no room"), ["a"]).refusal == "no room"


def test_every_worker_ready_with_one_version_is_no_refusal() -> None:
    assert _first_refusal(records(Verdict(7), Verdict(7)), 7, 3) == ""


def test_the_first_own_refusal_is_reported_before_echoes_of_it() -> None:
    found = records(Verdict(7, "echo of 1", echo=True), Verdict(7, "'q' [127, 64] does not load"), Verdict(7))
    assert _first_refusal(found, 7, 3) == "worker 1: 'q' [127, 64] does not load"
    only_echoes = records(Verdict(7, "echo", echo=True), Verdict(7))
    assert _first_refusal(only_echoes, 7, 3) == "worker 0: echo"


def test_workers_on_other_versions_or_manifests_refuse() -> None:
    assert "worker 1: has version 8" in _first_refusal(records(Verdict(7), Verdict(8)), 7, 3)
    assert "(2 tensors)" in _first_refusal([_record(Verdict(7), 3).numpy(), _record(Verdict(7), 2).numpy()], 7, 3)


def test_a_long_reason_is_cut_to_the_record_not_past_it() -> None:
    found = _first_refusal(records(Verdict(7, "é" * 5000)), 7, 3)
    assert found.startswith("worker 0: é") and len(found.encode()) <= 1024 + len("worker 0: ")


def _record_with(error: BaseException | None, msg: str = "WorkerProc hit an exception.") -> logging.LogRecord:
    exc_info = (type(error), error, None) if error is not None else None
    return logging.LogRecord("vllm.v1.executor.multiproc_executor", logging.ERROR, __file__, 1, msg, (), exc_info)


def test_a_refusals_traceback_becomes_one_info_line() -> None:
    try:
        raise RuntimeError(f"Worker failed with error '{MARKER} version 3, not applied: worker 1: bad'")
    except RuntimeError as e:
        record = _record_with(e)
    assert RefusalTracebacks().filter(record)
    assert record.levelno == logging.INFO and record.exc_info is None
    assert "not applied: worker 1: bad" in record.getMessage()


def test_other_errors_keep_their_traceback() -> None:
    record = _record_with(ValueError("a real bug"))
    assert RefusalTracebacks().filter(record)
    assert record.levelno == logging.ERROR and record.exc_info is not None
    plain = _record_with(None, "Exception caught")
    assert RefusalTracebacks().filter(plain) and plain.levelno == logging.ERROR
