"""The device path on the chip: bf16 and f32 JAX arrays living on a TPU, one device each and
sharded, staged into an arena by `stage_plan.stage_device` (what a publish of device arrays
runs: large shards cut on their device into blocks, each staged as it lands), bit-exact
against each array's own host copy and with the specs the host path computes from those
bytes. The same checks run on CPU devices everywhere (whole shards read in place, and the
accelerator's blocks forced): in this process, and over eight CPU devices in a child
process (real shards)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from trainer_agent.device.device_blocks import cuts
from trainer_agent.publish.stage_plan import stage_device
from trainer_agent.settings import PublisherSettings
from trainer_agent.stage import params as params_module
from trainer_agent.stage.params import choose_staging_path, shard_metas
from trainer_agent.stage.staging import HostShard, plan_layout, stage_shards
from weightsync.dtypes import dtype_info

ROOT = Path(__file__).resolve().parents[2]
PLATFORMS = [pytest.param("cpu"), pytest.param("tpu", marks=pytest.mark.tpu)]
CHUNK_BYTES = 8192
WINDOW_BYTES = 16384  # several batches in flight and landed: the window really moves
BLOCK_BYTES = 16384  # two chunks: large shards travel in several blocks


def params_on(devices: list[jax.Device]) -> dict[str, jax.Array]:
    """bf16 and f32 arrays living on `devices`: on one device, sharded over a mesh of all of them
    (rows over "fsdp", columns over "tp"), replicated, odd-sized and empty; integers over 64,
    so that every float64 sum is exact in any order."""
    mesh = Mesh(np.array(devices).reshape(-1, 2 if len(devices) % 2 == 0 else 1), ("fsdp", "tp"))
    one = SingleDeviceSharding(devices[0])
    rng = np.random.default_rng(7)
    specs = {
        "model.embed_tokens.weight": ((1024, 96), jnp.bfloat16, NamedSharding(mesh, PartitionSpec("fsdp", "tp"))),
        "model.layers.0.mlp.up_proj.weight": ((96, 200), jnp.float32, NamedSharding(mesh, PartitionSpec("fsdp"))),
        "model.layers.0.mlp.down_proj.weight": (
            (200, 96),
            jnp.bfloat16,
            NamedSharding(mesh, PartitionSpec(None, "tp")),
        ),
        "model.layers.0.self_attn.q_proj.weight": ((64, 64), jnp.bfloat16, one),
        "model.layers.0.input_layernorm.weight": ((96,), jnp.float32, NamedSharding(mesh, PartitionSpec())),
        "model.odd": ((7, 13), jnp.float32, one),
        "model.empty": ((0, 3), jnp.bfloat16, one),
    }
    out = {}
    for name, (shape, dtype, sharding) in specs.items():  # made on the host, put on the devices: no compiles
        out[name] = jax.device_put((rng.integers(-128, 128, shape) / 64).astype(dtype), sharding)
    return jax.block_until_ready(out)


@contextlib.contextmanager
def accelerator_branch(forced: bool):  # noqa: ANN201
    """With `forced`, CPU devices are treated as an accelerator's (shards cut into blocks)."""
    saved = params_module.HOST_MEMORY_PLATFORMS
    if forced:
        params_module.HOST_MEMORY_PLATFORMS = frozenset()
    try:
        yield
    finally:
        params_module.HOST_MEMORY_PLATFORMS = saved


def check_device_path(platform: str, weight_dtype: str, blocks: bool = False) -> dict[str, int]:
    """Stages fresh arrays on `platform`'s devices by the device path (`blocks`: cut into
    blocks even on CPU devices), then compares the slot and every spec with the host path
    over the arrays' host copies (read afterwards: JAX keeps a host copy once read, and the
    device path must do the reading)."""
    devices = jax.devices(platform)
    params = params_on(devices)
    assert {d.platform for v in params.values() for d in v.sharding.device_set} == {platform}
    layout = plan_layout([m for n, v in params.items() for m in shard_metas(n, v, weight_dtype)])
    slot = np.full(layout.total_bytes + 64, 0xCD, np.uint8)  # garbage: padding must be zeroed
    settings = PublisherSettings(
        coordinator="127.0.0.1:1",
        weight_dtype=weight_dtype,
        chunk_bytes=CHUNK_BYTES,
        d2h_window_bytes=WINDOW_BYTES,
        d2h_block_bytes=BLOCK_BYTES,
    )
    with accelerator_branch(blocks):
        cut = cuts(params.values())
        specs, chunks, encodings = stage_device(slot, layout, params, settings)

    cast = dtype_info(weight_dtype).numpy if weight_dtype else None
    wanted = {n: np.asarray(v if cast is None else v.astype(cast)) for n, v in params.items()}  # the device's cast
    host = [
        HostShard(name, wanted[name][tuple(slice(a, b) for a, b in zip(start, stop))], wanted[name].shape, start)
        for name, start, stop in layout.boxes
    ]
    ref = np.full(layout.total_bytes, 0xAB, np.uint8)
    ref_specs, ref_chunks = stage_shards(ref, host, layout, CHUNK_BYTES, engine="python")
    assert slot[: layout.total_bytes].tobytes() == ref.tobytes()
    assert (specs, chunks, encodings) == (ref_specs, ref_chunks, [])
    return {
        "devices": len(devices),
        "tensors": len(params),
        "shards": len(specs),
        "bytes": layout.total_bytes,
        "cut": cut,
    }


@pytest.mark.parametrize("weight_dtype", ["", "bfloat16"])
@pytest.mark.parametrize("platform", PLATFORMS)
def test_the_device_path_stages_device_arrays_bit_exact(platform: str, weight_dtype: str) -> None:
    got = check_device_path(platform, weight_dtype)
    assert got["shards"] >= got["tensors"]
    assert got["cut"] == (platform != "cpu")  # blocks on an accelerator, shards read in place on CPU


@pytest.mark.parametrize("weight_dtype", ["", "bfloat16"])
def test_the_accelerator_branch_cuts_cpu_arrays_into_blocks_bit_exact(weight_dtype: str) -> None:
    assert check_device_path("cpu", weight_dtype, blocks=True)["cut"]


@pytest.mark.tpu
def test_arrays_on_the_chip_take_the_device_path_and_ffi_is_refused_naming_why() -> None:
    values = list(params_on(jax.devices("tpu")).values())
    for built in (True, False):
        assert choose_staging_path(values, None, ffi_built=built, ffi_missing="not built") == "device"
    with pytest.raises(RuntimeError, match="tpu: XLA TPU custom calls are not open to user code"):
        choose_staging_path(values, True, ffi_built=True, ffi_missing="")


_CHILD = """
import json, sys
from tests.unit.test_tpu_device_path import check_device_path
print(json.dumps([check_device_path("cpu", d, blocks) for d in ("", "bfloat16") for blocks in (False, True)]))
"""


def test_the_device_path_over_eight_cpu_devices() -> None:
    """The same checks with every sharded array split over eight CPU devices, whole shards and
    blocks (XLA reads the device count once per process: a child)."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    run = subprocess.run([sys.executable, "-c", _CHILD], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-4000:]
    results = json.loads(run.stdout.strip().splitlines()[-1])
    assert [got["cut"] for got in results] == [False, True, False, True]
    for got in results:
        assert got["devices"] == 8 and got["shards"] > 2 * got["tensors"]
