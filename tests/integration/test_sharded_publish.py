"""Sharded JAX arrays published from CPU devices (FSDP x TP meshes), in one process of 8
devices and as two processes of 4 (two hosts of one jax.distributed run, one rank each):
the staged bytes are the global arrays' (replica 0 only), every rollout assembles them bit
for bit, the device path keeps host memory within arena + window, and a sharded MaxText
tree converts while it streams."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from rollout_agent.engines.dict_applier import DictApplier
from rollout_agent.pull.puller import WeightPuller
from rollout_agent.sync.round import sync_version
from tests.integration.sharded_publisher import MESH_TREE, global_value
from tests.integration.support import free_port
from tests.unit.helpers import python_path
from weightsync.client import CoordinatorClient
from weightsync.heartbeat import Heartbeat
from weightsync.manifest import Endpoint
from weightsync.server import RunningServer

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).with_name("sharded_publisher.py")


def _start(spec: dict) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(SCRIPT), json.dumps(spec)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={"PYTHONPATH": python_path(ROOT), "PATH": "/usr/bin:/bin"},
    )


def _sync_and_finish(address: str, specs: list[dict], timeout_s: float = 180) -> tuple[dict, list]:
    """Registers rollout r0 (heartbeating, so the version waits for its handshake), starts
    the publishers, syncs version 1 into a DictApplier, then collects each publisher's
    JSON line (they exit once the version committed)."""
    with CoordinatorClient(address) as client:
        client.open_session("job", trainer=False)

        def register() -> float:
            return client.register_agent("job", "r0", trainer=False, endpoint=Endpoint()).lease_ttl_seconds

        heartbeat = Heartbeat(client, "job", "r0", current_version=lambda: 0, register=register).start()
        procs = [_start(spec) for spec in specs]
        try:
            client.wait_for_version("job", 1, timeout_s=timeout_s, states=("READY", "COMMITTED"))
            applier = DictApplier()
            puller = WeightPuller(client, "job", "r0", mode="grpc")
            outcome = sync_version(puller, applier, 1)
            puller.close()
            lines = []
            for p in procs:
                out, err = p.communicate(timeout=timeout_s)
                assert p.returncode == 0, err[-4000:]
                lines.append(json.loads(out.strip().splitlines()[-1]))
        finally:
            heartbeat.stop()
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
    assert outcome.ok, outcome.mismatch
    return applier.weights, lines


@pytest.mark.parametrize(("use_ffi", "weight_dtype", "path"), [(None, "", "native"), (False, "bfloat16", "device")])
def test_one_host_of_eight_devices_stages_the_global_arrays(
    inprocess_coordinator: RunningServer, no_arena_leak: None, use_ffi: bool | None, weight_dtype: str, path: str
) -> None:
    spec = dict(
        coordinator=inprocess_coordinator.address, session="job", process_id=0, processes=1, devices=8,
        use_ffi=use_ffi, weight_dtype=weight_dtype, window_bytes=16 << 10, model="mesh",
    )  # fmt: skip
    weights, (line,) = _sync_and_finish(inprocess_coordinator.address, [spec])
    assert line["path"] == path
    for name, (shape, _) in MESH_TREE.items():
        expected = global_value(name, shape)
        if weight_dtype:
            expected = expected.astype(ml_dtypes.bfloat16)
        assert weights[name].dtype == expected.dtype and weights[name].tobytes() == expected.tobytes(), name


def test_two_hosts_publish_their_own_shards_and_rollouts_assemble_every_tensor(
    inprocess_coordinator: RunningServer, no_arena_leak: None
) -> None:
    base = dict(
        coordinator=inprocess_coordinator.address, session="job", processes=2, devices=4, jax_port=free_port(),
        use_ffi=None, weight_dtype="bfloat16", window_bytes=16 << 10, model="mesh",
    )  # fmt: skip
    weights, lines = _sync_and_finish(inprocess_coordinator.address, [{**base, "process_id": i} for i in range(2)])
    assert [x["path"] for x in lines] == ["device", "device"]
    # each host staged only the replica-0 shards it holds: together, every byte once
    total = sum(int(np.prod(shape)) * 2 for shape, _ in MESH_TREE.values())
    assert sum(x["bytes"] for x in lines) >= total and all(x["bytes"] < total for x in lines)
    for name, (shape, _) in MESH_TREE.items():
        expected = global_value(name, shape).astype(ml_dtypes.bfloat16)
        assert weights[name].tobytes() == expected.tobytes(), name
    with CoordinatorClient(inprocess_coordinator.address) as client:
        parts = client.get_manifest("job", 1)[1].parts
    assert sorted(p.rank for p in parts) == [0, 1]


@pytest.mark.parametrize("weight_dtype", ["", "bfloat16"])
def test_shards_cut_into_blocks_publish_the_manifest_of_whole_shards(
    inprocess_coordinator: RunningServer, no_arena_leak: None, weight_dtype: str
) -> None:
    """The same sharded arrays over eight CPU devices published twice: by the CPU devices'
    own path (whole shards read in place), then cut into blocks and staged on a pool as an
    accelerator's arrays are. Every digest, sum, chunk and the bytes served agree."""
    spec = dict(
        coordinator=inprocess_coordinator.address, session="job", process_id=0, processes=1, devices=8,
        use_ffi=False, weight_dtype=weight_dtype, window_bytes=64 << 10, block_bytes=8 << 10, chunk_bytes=4096,
        model="mesh", both_ways=True,
    )  # fmt: skip
    with CoordinatorClient(inprocess_coordinator.address) as client:
        client.open_session("job", trainer=False)
        proc = _start(spec)
        out, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err[-4000:]
        paths = json.loads(out.strip().splitlines()[-1])["paths"]
        (whole,) = client.get_manifest("job", 1)[1].parts
        (blocks,) = client.get_manifest("job", 2)[1].parts
    assert paths == ["native" if not weight_dtype else "device", "device"]
    assert any(s.nbytes > 8 << 10 for s in blocks.shards)  # some shards really were cut
    assert blocks.content_dict() == whole.content_dict()


@pytest.mark.timeout(600)
def test_the_device_path_keeps_host_memory_within_arena_plus_window(
    inprocess_coordinator: RunningServer, no_arena_leak: None
) -> None:
    window = 32 << 20
    spec = dict(
        coordinator=inprocess_coordinator.address, session="job", process_id=0, processes=1, devices=8,
        use_ffi=False, weight_dtype="bfloat16", window_bytes=window, model="big", chunk_bytes=3 << 20,
    )  # fmt: skip
    weights, (line,) = _sync_and_finish(inprocess_coordinator.address, [spec], timeout_s=400)
    assert line["path"] == "device" and line["bytes"] == 24 * 4096 * 4096 * 2  # 768 MiB: 24 windows
    bound = line["arena_bytes"] + window + (256 << 20)
    # a whole cast copy of the model (768 MiB) or of the host arrays would break the bound
    assert line["peak_rss_over_baseline_bytes"] <= bound, (line, bound)
    assert float(weights["model.layers.7.mlp.up_proj.weight"][123, 456]) == 7.5


def test_a_sharded_maxtext_tree_converts_while_it_streams(
    inprocess_coordinator: RunningServer, no_arena_leak: None
) -> None:
    from tests.unit.maxtext_reference import to_maxtext, with_style
    from tests.unit.test_convert import H, K, L, N, hf_weights
    from trainer_agent.convert import ConvertOptions, ModelDims, convert_maxtext

    dims = ModelDims(layers=L, heads=N, kv_heads=K, head_dim=H, vocab=128)
    tree = with_style(
        to_maxtext(hf_weights("llama3"), "llama3", layers=L, heads=N, kv_heads=K, head_dim=H, vocab_pad=8), "linen"
    )
    expected = dict(convert_maxtext(tree, "llama3", dims, ConvertOptions(weight_dtype="bfloat16")))
    spec = dict(
        coordinator=inprocess_coordinator.address, session="job", process_id=0, processes=1, devices=8,
        use_ffi=None, weight_dtype="", window_bytes=16 << 10, model="maxtext", repo=str(ROOT),
        capacity_bytes=sum(a.nbytes + 256 for a in expected.values()), chunk_bytes=16384,
    )  # fmt: skip
    weights, (line,) = _sync_and_finish(inprocess_coordinator.address, [spec])
    assert line["path"].startswith("stream")
    assert set(weights) == set(expected)
    for name, ref in expected.items():
        assert weights[name].tobytes() == np.asarray(ref).tobytes(), name
