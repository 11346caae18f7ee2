"""The in-engine backend's readiness (`VllmRollout.readiness`, behind vLLM's server's
`GET /weightsync/ready`): ready only while it serves the session's newest committed
version verified. Backends over a NumPy dict (no vLLM); the route's own wiring runs
against vLLM's server in tests/e2e/test_vllm_trainer.py."""

from __future__ import annotations

import numpy as np

from rollout_agent.engines.dict_applier import DictApplier
from rollout_agent.settings import InitInfo
from rollout_agent.vllm_worker.extension import WeightsyncWorkerExtension
from rollout_agent.vllm_worker.ready_route import verdict
from rollout_agent.vllm_worker.rollout import VllmRollout
from tests.integration.support import state_name
from trainer_agent.publish.publisher import WeightPublisher
from trainer_agent.settings import PublisherSettings
from weightsync.client import CoordinatorClient
from weightsync.server import RunningServer

WEIGHTS = {f"layer.{i}.weight": np.full((16, 16), float(i), dtype=np.float32) for i in range(2)}


def backend(address: str, name: str) -> VllmRollout:
    info = InitInfo(coordinator=address, session="job", agent_id=name, prefetch=False)
    info.check()
    return VllmRollout(info, None, None, applier=DictApplier())


def test_a_backend_is_ready_only_while_it_serves_the_newest_committed_version(
    inprocess_coordinator: RunningServer,
) -> None:
    address = inprocess_coordinator.address
    first = backend(address, "w0")
    late = None
    try:
        got = first.readiness()
        assert [got[k] for k in ("ready", "serving", "committed")] == [True, 0, 0]  # nothing committed yet
        settings = PublisherSettings(coordinator=address, session="job", slots=2, min_rollouts=1)
        with WeightPublisher(settings) as pub, CoordinatorClient(address) as client:
            pub.publish(WEIGHTS, 1)
            assert first.sync(1).ok
            assert state_name(client.wait_for_version("job", 1, timeout_s=30)) == "COMMITTED"
            assert first.readiness()["ready"] is True
            late = backend(address, "w1")  # a server that (re)started: its load-time weights
            got = late.readiness()
            assert (got["ready"], got["serving"], got["committed"]) == (False, 0, 1)
            assert got["reason"] == "serves version 0; the session's newest committed version is 1"
            status, body = verdict([first.readiness(), got])
            assert status == 503 and body["ready"] is False and body["workers"][1]["agent_id"] == "w1"
            assert late.sync(1).ok
            assert late.readiness()["ready"] is True
            assert verdict([first.readiness(), late.readiness()])[0] == 200
    finally:
        first.close()
        if late is not None:
            late.close()


def test_a_coordinator_that_does_not_answer_makes_it_not_ready_saying_so(inprocess_coordinator: RunningServer) -> None:
    b = backend(inprocess_coordinator.address, "w0")
    try:
        inprocess_coordinator.stop(grace_s=0)
        got = b.readiness(timeout_s=1.0)
        assert got["ready"] is False and got["committed"] is None
        assert got["reason"].startswith("the coordinator did not answer: ")
    finally:
        b.close()


def test_the_worker_extension_answers_for_the_backends_rollout_and_says_why_without_one(
    inprocess_coordinator: RunningServer,
) -> None:
    worker = WeightsyncWorkerExtension()
    assert worker.weightsync_readiness() == {
        "ready": False,
        "reason": "no weightsync rollout yet: init_weight_transfer_engine was not called",
    }
    b = backend(inprocess_coordinator.address, "w0")
    try:
        worker.weight_transfer_engine = type("Backend", (), {"rollout": b})()  # type: ignore[attr-defined]
        assert worker.weightsync_readiness()["agent_id"] == "w0"
    finally:
        b.close()


def test_the_verdict_wants_every_worker_ready_and_an_answer_from_one() -> None:
    assert verdict([]) == (503, {"ready": False, "workers": []})
    assert verdict([{"ready": True}, {"ready": True}])[0] == 200
    assert verdict([{"ready": True}, {"ready": "yes"}])[0] == 503
    status, body = verdict([{"ready": True}, None])
    assert status == 503 and body["workers"][1]["reason"].startswith("an answer not understood")
