"""The rollout sidecar with a JAX engine (`--engine jax`): it follows a trainer's session,
applies every version into its sharded arrays and closes the handshake; a bit flipped on
its way to the device fails that version's handshake, and the next one applies."""

from __future__ import annotations

import pytest

from devtools.cluster import Cluster
from devtools.scrape import metric_value, scrape
from tests.integration.support import serving, state_name
from weightsync.client import CoordinatorClient

pytestmark = pytest.mark.slow


def test_a_jax_sidecar_applies_each_version_and_refuses_one_corrupted_on_its_way_to_the_device(
    cluster: Cluster,
) -> None:
    coord = cluster.start_coordinator()
    jx = cluster.start_rollout(
        "jx", coord.address, "job",
        ["--engine", "jax", "--jax-preset", "tiny", "--failpoints", "jax_applier.corrupt_after_check=1"],
    )  # fmt: skip
    cluster.start_trainer("trainer", coord.address, "job", ["--model-size", "tiny", "--steps", "2", "--hold",
                                                            "--wait-commit", "false"])  # fmt: skip
    with CoordinatorClient(coord.address) as client:
        v1 = client.wait_for_version("job", 1, timeout_s=120)
        assert state_name(v1) == "PARTIAL"
        (h1,) = [h for h in client.status("job").handshakes if h.version == 1]
        assert not h1.ok and "on the device does not match the verified bytes" in h1.mismatch
        v2 = client.wait_for_version("job", 2, timeout_s=120)
        assert state_name(v2) == "COMMITTED"
        (h2,) = [h for h in client.status("job").handshakes if h.version == 2]
        assert h2.ok and 0 < h2.timings.pause_seconds < h2.timings.apply_seconds  # swapped in: paused for the swap
    status = serving(jx.address, 2)
    # its own memory, by kind, and the receive buffer it keeps (one copy of the model)
    assert status.host_memory.anon > 0 and status.host_memory.rss >= status.host_memory.anon
    assert status.host_memory.receive_bytes > 0 and status.host_memory.limit == 0
    text = scrape(jx.ready["metrics_port"])
    assert metric_value(text, "weightsync_applies_total", session="job", mode="swap") == 1
    assert metric_value(text, "weightsync_host_memory_bytes", session="job", kind="anon") > 0
