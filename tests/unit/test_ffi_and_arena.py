"""JAX FFI staging versus the host path, the use_ffi contract, and the persistent arena."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trainer_agent.publish.publisher import WeightPublisher
from trainer_agent.serve.arena import Arena
from trainer_agent.settings import PublisherSettings
from trainer_agent.stage.ffi_staging import FfiStager, staged_meta
from trainer_agent.stage.params import choose_staging_path, host_shards
from trainer_agent.stage.staging import HostShard, plan_layout, stage_shards
from weightsync import native


@pytest.fixture(autouse=True)
def _on_the_cpu() -> Iterator[None]:
    """Arrays these tests build live on the CPU (the FFI handler's platform), also where
    JAX's default device is an accelerator."""
    with jax.default_device(jax.devices("cpu")[0]):
        yield


def test_ffi_handler_is_built() -> None:
    assert native.ffi_available(), native.ffi_missing_reason()


@pytest.mark.parametrize("weight_dtype", ["", "bfloat16", "float16"])
def test_ffi_and_host_paths_give_identical_arenas_and_digests(weight_dtype: str) -> None:
    key = jax.random.PRNGKey(0)
    params = {
        "model.embed_tokens.weight": jax.random.normal(key, (513, 64)),
        "model.layers.0.mlp.up_proj.weight": jax.random.normal(jax.random.fold_in(key, 1), (96, 64)),
        "model.norm.weight": jnp.linspace(0.5, 1.5, 64),
        "model.empty": jnp.zeros((0, 3)),
    }
    chunk = 8192
    metas = [HostShard(n, staged_meta(v, weight_dtype), tuple(v.shape), (0,) * v.ndim) for n, v in params.items()]
    layout = plan_layout(metas)
    arena = np.full(2 * (1 << 20), 0xCD, np.uint8)
    stager = FfiStager(threads=2)
    specs_f, chunks_f = stager.stage(arena, 1 << 20, list(params.values()), layout, chunk, weight_dtype)
    host = [s for n, v in params.items() for s in host_shards(n, v, weight_dtype)]
    slot = np.zeros(1 << 20, np.uint8)
    specs_h, chunks_h = stage_shards(slot, host, plan_layout(host), chunk, engine="python")
    assert np.array_equal(arena[1 << 20 : (1 << 20) + layout.total_bytes], slot[: layout.total_bytes])
    assert chunks_f == chunks_h
    assert [(s.xxh3, s.offset, s.nbytes) for s in specs_f] == [(s.xxh3, s.offset, s.nbytes) for s in specs_h]
    assert np.allclose([s.sum for s in specs_f], [s.sum for s in specs_h], rtol=1e-9, atol=1e-6)
    # another slot, same layout: no recompilation
    stager.stage(arena, 0, list(params.values()), layout, chunk, weight_dtype)
    assert stager.compiles == 1


def _jax_like(platform: str) -> SimpleNamespace:
    shard = SimpleNamespace(device=SimpleNamespace(platform=platform, __str__=lambda: f"{platform}:0"), replica_id=0)
    return SimpleNamespace(addressable_shards=[shard], shape=(2,), ndim=1, dtype=np.float32)


def test_use_ffi_contract_per_platform() -> None:
    def path(values: list, use_ffi: bool | None, built: bool = True, dtype: str = "") -> str:
        return choose_staging_path(values, use_ffi, ffi_built=built, ffi_missing="not built", weight_dtype=dtype)

    arrays = [jnp.ones(3), jnp.zeros(2)]  # single-device CPU
    assert path(arrays, None) == "ffi" and path(arrays, True) == "ffi"
    assert path(arrays, None, built=False) == "host" and path(arrays, False) == "host"
    assert path(arrays, False, dtype="bfloat16") == "device"  # the cast runs on the device, tensor by tensor
    assert path([np.ones(3)], None) == "host"
    assert path([np.ones(3, np.float32)], None, dtype="bfloat16") == "device"  # never a whole cast copy
    assert path([np.ones(3, np.float32)], None, dtype="float32") == "host"
    with pytest.raises(RuntimeError, match="use_ffi=True but the FFI staging handler is unavailable: not built"):
        path(arrays, True, built=False)
    with pytest.raises(RuntimeError, match="single-device"):
        path([np.ones(3)], True)
    # accelerator arrays: the device path, or FFI refused naming the platform's reason
    for platform in ("tpu", "cuda"):
        assert path([_jax_like(platform)], None) == "device"
        assert path([_jax_like(platform)], False) == "device"
        assert path([_jax_like(platform)], None, built=False) == "device"
    with pytest.raises(RuntimeError, match="tpu: XLA TPU custom calls are not open to user code"):
        path([_jax_like("tpu")], True)
    with pytest.raises(RuntimeError, match="cuda: the FFI staging handler is registered for cpu only"):
        path([_jax_like("cuda")], True)


def test_publisher_use_ffi_true_without_handler_fails_before_connecting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native, "ffi_available", lambda: False)
    monkeypatch.setattr(
        native, "ffi_missing_reason", lambda: "built without the JAX FFI handler; build it with `make native`"
    )
    with pytest.raises(RuntimeError, match="use_ffi=True .*`make native`"):
        WeightPublisher(PublisherSettings(coordinator="127.0.0.1:1", session="job", use_ffi=True))


def test_arena_is_persistent_and_reallocates_only_when_it_must(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    arena = Arena("t", slots=2, directory=str(tmp_path))
    assert arena.ensure_slot_bytes(1000) is True
    path, base = arena.path, arena.slot(0).ctypes.data
    arena.slot(1)[:10] = 7
    assert arena.ensure_slot_bytes(1 << 20) is False  # fits: same pages, same address
    assert arena.path == path and arena.slot(0).ctypes.data == base and arena.allocations == 1
    with caplog.at_level(logging.WARNING):
        assert arena.ensure_slot_bytes(3 << 20) is True
    assert "reallocating" in caplog.text and arena.allocations == 2 and not path.exists()
    new_path = arena.path
    arena.close()
    assert not new_path.exists() and list(tmp_path.iterdir()) == []


class _DeviceShardData:
    """A fake device buffer: counts transfers issued, and in flight when read."""

    log: list[str] = []

    def __init__(self, value: np.ndarray, tag: str) -> None:
        self.value, self.tag = value, tag
        self.shape, self.dtype = value.shape, value.dtype

    def copy_to_host_async(self) -> None:
        self.log.append(f"issue {self.tag}")

    def __array__(self, dtype=None, copy=None) -> np.ndarray:  # noqa: ANN001
        self.log.append(f"read {self.tag}")
        return self.value


def test_the_device_stream_issues_shard_by_shard_within_the_window() -> None:
    from trainer_agent.stage.params import device_stream, shard_metas

    rows = np.arange(4 * 1024, dtype=np.float32).reshape(4, 1024)  # 4 shards of 4 KiB
    shards = [
        SimpleNamespace(
            data=_DeviceShardData(rows[i : i + 1], f"w{i}"), index=(slice(i, i + 1), slice(None)), replica_id=0
        )
        for i in range(4)
    ]
    value = SimpleNamespace(addressable_shards=shards, shape=(4, 1024), ndim=2, dtype=np.dtype(np.float32))
    _DeviceShardData.log = []
    got = list(device_stream([("w", value), ("b", [1.0, 2.0])], "", window_bytes=4096))
    # one 4 KiB shard in flight at a time: a tensor of many shards is not brought over whole
    assert _DeviceShardData.log == [f"{op} w{i}" for i in range(4) for op in ("issue", "read")]
    assert [(s.name, s.start) for s in got] == [("w", (i, 0)) for i in range(4)] + [("b", (0,))]
    assert np.array_equal(np.concatenate([s.data for s in got[:4]]), rows)
    # a plain list plans and stages like the array NumPy reads it, cast included
    (meta,) = shard_metas("b", [1.0, 2.0], "bfloat16")
    assert meta.data.shape == (2,) and meta.data.nbytes == 4
    assert choose_staging_path([[1.0, 2.0]], None, ffi_built=True, ffi_missing="", weight_dtype="bfloat16") == "device"
    assert choose_staging_path([[1.0, 2.0]], None, ffi_built=True, ffi_missing="", weight_dtype="float64") == "host"
