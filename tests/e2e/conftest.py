"""Fixtures of the vLLM end-to-end modules: one per module that asks for it."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from devtools.cluster import Cluster
from devtools.tiny_models import write_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny untied Qwen3 (float32 weights, a word-level tokenizer); engines made in this
    process run in it (VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["HF_HUB_OFFLINE"] = "1"
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "qwen3", "qwen3")


@pytest.fixture(scope="module")
def coordinator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A coordinator subprocess; its address."""
    with Cluster(tmp_path_factory.mktemp("cluster")) as c:
        yield c.start_coordinator().address
