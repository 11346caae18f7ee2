"""The device path's batched staging writes the same bytes and specs as one fused pass."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer_agent.staging import HostShard, plan_layout, stage_batched, stage_shards
from weightsync import native
from weightsync.errors import InternalError

ENGINES = ["python", *(["native"] if native.available() else [])]


@settings(max_examples=40, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 40_000), min_size=1, max_size=12),
    chunk_bytes=st.sampled_from([4096, 8192, 65536]),
    batch_bytes=st.integers(1, 100_000),
    engine=st.sampled_from(ENGINES),
)
def test_batched_staging_equals_one_fused_pass(
    sizes: list[int], chunk_bytes: int, batch_bytes: int, engine: str
) -> None:
    rng = np.random.default_rng(len(sizes) * 7919 + chunk_bytes)
    shards = [
        HostShard(f"t{i}", rng.standard_normal(n // 4 or 0).astype(np.float32), (n // 4,), (0,))
        for i, n in enumerate(sizes)
    ]
    layout = plan_layout(shards)
    want = np.full(layout.total_bytes + 64, 0xAB, np.uint8)
    got = np.full(layout.total_bytes + 64, 0xCD, np.uint8)  # other garbage: padding must be zeroed
    ref = stage_shards(want, shards, layout, chunk_bytes, engine=engine)
    out = stage_batched(got, layout, iter(shards), chunk_bytes, batch_bytes=batch_bytes, engine=engine)
    assert out == ref
    assert want[: layout.total_bytes].tobytes() == got[: layout.total_bytes].tobytes()


def test_a_stream_that_differs_from_the_layout_is_refused() -> None:
    shards = [HostShard(f"t{i}", np.ones(1000, np.float32), (1000,), (0,)) for i in range(3)]
    layout = plan_layout(shards)
    slot = np.zeros(layout.total_bytes, np.uint8)
    with pytest.raises(InternalError, match="not the one the layout planned"):
        stage_batched(slot, layout, iter(shards[::-1]), 4096, batch_bytes=1)
    with pytest.raises(InternalError, match="ended after"):
        stage_batched(slot, layout, iter(shards[:2]), 4096, batch_bytes=1 << 30)
