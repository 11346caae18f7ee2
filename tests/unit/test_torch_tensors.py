"""Torch tensors as the publisher's host arrays: zero-copy CPU views (bf16 too), the
requires_grad and non-contiguous ones, casts, refused dtypes named, and planned streams."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from trainer_agent.publish.async_publish import held_params  # noqa: E402
from trainer_agent.publish.stage_plan import follow_plan, plan_stream  # noqa: E402
from trainer_agent.settings import PublisherSettings  # noqa: E402
from trainer_agent.stage import torch_tensors  # noqa: E402
from trainer_agent.stage.params import check_param, choose_staging_path, device_stream, host_shards, shard_metas  # noqa: E402
from weightsync.errors import InvalidArgument  # noqa: E402

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "int8": torch.int8}


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8)


def _torch_bits(t: torch.Tensor) -> np.ndarray:
    """The tensor's values as bytes in C order, read by torch itself (not our view)."""
    dense = torch.empty(t.shape, dtype=t.dtype).copy_(t.detach().cpu())  # fresh C-order strides
    return dense.reshape(-1).view(torch.uint8).numpy().copy()


def _same_bytes(a: np.ndarray, t: torch.Tensor) -> bool:
    """Whether `a` is a view of `t`'s own memory (starts where it starts, steps as it steps)."""
    strides = tuple(n * t.element_size() for n in t.stride())
    return a.ctypes.data == t.data_ptr() and a.strides == strides


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_a_cpu_tensor_that_requires_grad_is_staged_from_a_view_of_its_own_bytes(dtype: str) -> None:
    t = torch.randn(6, 10).to(DTYPES[dtype]).requires_grad_(dtype != "int8")
    (shard,) = host_shards("w", t)
    assert shard.data.dtype.name == dtype and shard.global_shape == (6, 10)
    assert _same_bytes(shard.data, t)  # no copy of the tensor
    assert np.array_equal(_bits(shard.data), _torch_bits(t))
    if dtype == "bfloat16":
        assert shard.data.dtype == np.dtype(ml_dtypes.bfloat16)
        np.testing.assert_array_equal(shard.data.astype(np.float32), t.detach().float().numpy())


def test_a_non_contiguous_tensor_keeps_its_values_and_strides() -> None:
    base = torch.randn(8, 12, dtype=torch.bfloat16)
    t = base.t()[::2]  # transposed and strided
    assert not t.is_contiguous()
    (shard,) = host_shards("w", t)
    assert shard.data.shape == (6, 8) and _same_bytes(shard.data, t)
    assert np.array_equal(_bits(shard.data), _torch_bits(t))


def test_a_cast_runs_in_torch_and_then_reads_the_cast_tensor() -> None:
    t = torch.randn(4, 5, requires_grad=True)
    (shard,) = host_shards("w", t, "bfloat16")
    assert shard.data.dtype == np.dtype(ml_dtypes.bfloat16)
    assert np.array_equal(_bits(shard.data), _torch_bits(t.detach().bfloat16()))
    (meta,) = shard_metas("w", t, "bfloat16")
    assert meta.data.shape == (4, 5) and meta.data.dtype == np.dtype(ml_dtypes.bfloat16)


@pytest.mark.parametrize(
    "dtype", ["complex64", "float8_e4m3fn", "float8_e5m2", "uint16", "uint32", "uint64", "complex128"]
)
def test_a_dtype_weightsync_cannot_carry_is_refused_naming_the_tensor(dtype: str) -> None:
    t = torch.zeros(3, dtype=getattr(torch, dtype))
    name = "model.layers.3.mlp.up_proj.weight"
    for call in (lambda: check_param(name, t), lambda: host_shards(name, t), lambda: list(device_stream([(name, t)]))):
        with pytest.raises(InvalidArgument) as e:
            call()
        assert e.value.field == f"params[{name!r}]" and dtype in e.value.message, e.value.message


def test_tensors_without_readable_bytes_are_refused_naming_them() -> None:
    with pytest.raises(InvalidArgument, match=r"params\['s'\].*sparse"):
        check_param("s", torch.zeros(3, 3).to_sparse())
    with pytest.raises(InvalidArgument, match=r"params\['m'\].*meta"):
        check_param("m", torch.zeros(3, device="meta"))


def test_cpu_tensors_take_the_host_path_unless_cast() -> None:
    values = [torch.zeros(2, dtype=torch.bfloat16), torch.zeros(3)]
    assert choose_staging_path(values, None, ffi_built=True, ffi_missing="") == "host"
    assert choose_staging_path(values, None, ffi_built=True, ffi_missing="", weight_dtype="bfloat16") == "device"
    with pytest.raises(RuntimeError, match="single-device JAX arrays"):
        choose_staging_path(values, True, ffi_built=True, ffi_missing="")


def test_device_stream_yields_each_tensor_as_host_bytes() -> None:
    items = [("a", torch.randn(3, 4, requires_grad=True)), ("b", torch.randn(5).half()[::2])]
    shards = list(device_stream(items, window_bytes=16))
    assert [s.name for s in shards] == ["a", "b"]
    for s, (_, t) in zip(shards, items):
        assert np.array_equal(_bits(s.data), _torch_bits(t))


def test_a_snapshot_holds_a_copy_the_training_step_cannot_change() -> None:
    t = torch.ones(4, requires_grad=True)
    held = held_params({"w": t}, snapshot=True)["w"]
    with torch.no_grad():
        t.add_(1.0)  # an optimizer step, in place
    assert torch.equal(held, torch.ones(4)) and not held.requires_grad


def _settings(**kw: object) -> PublisherSettings:
    return PublisherSettings(coordinator="127.0.0.1:1", session="s", **kw)  # type: ignore[arg-type]


def test_a_planned_stream_checks_each_item_against_its_spec() -> None:
    specs = [("a", torch.float32, (2, 3)), ("b", "bfloat16", [4])]
    plan = plan_stream(specs, _settings())
    assert plan.path == "device" and [t.name for t in plan.layout.tensors] == ["a", "b"]
    good = [("a", torch.zeros(2, 3)), ("b", torch.zeros(4, dtype=torch.bfloat16))]
    assert [n for n, _ in follow_plan(good, plan, "")] == ["a", "b"]
    cases = {
        "shape": [("a", torch.zeros(3, 2))],
        "dtype": [("a", torch.zeros(2, 3, dtype=torch.float16))],
        "name": [("c", torch.zeros(2, 3))],
    }
    for why, items in cases.items():
        with pytest.raises(InvalidArgument, match="the specs put 'a' \\[2, 3\\] float32 there"):
            list(follow_plan(items, plan, ""))
        assert why
    with pytest.raises(InvalidArgument, match="ended after 1 of 2 tensors; 'b'"):
        list(follow_plan(good[:1], plan, ""))
    with pytest.raises(InvalidArgument, match="runs on past the 2 tensors.*'c'"):
        list(follow_plan([*good, ("c", torch.zeros(1))], plan, ""))
    with pytest.raises(InvalidArgument, match=r"params\['x'\].*float8"):
        plan_stream([("x", torch.float8_e4m3fn, (2,))], _settings())
    with pytest.raises(InvalidArgument, match="specs"):
        plan_stream([], _settings())
    cast = plan_stream([("a", torch.float32, (2, 3))], _settings(weight_dtype="bfloat16"))
    assert cast.layout.tensors[0].dtype == "bfloat16"
    assert [n for n, _ in follow_plan(good[:1], cast, "bfloat16")] == ["a"]


@settings(max_examples=60, deadline=None)
@given(
    dtype=st.sampled_from(list(DTYPES)),
    shape=st.lists(st.integers(1, 5), min_size=0, max_size=3),
    transpose=st.booleans(),
    step=st.integers(1, 3),
)
def test_host_bytes_are_torchs_own_for_any_layout(dtype: str, shape: list[int], transpose: bool, step: int) -> None:
    t = torch.randn(*shape).to(DTYPES[dtype]) if shape else torch.tensor(1.5).to(DTYPES[dtype])
    if transpose and t.ndim >= 2:
        t = t.transpose(0, 1)
    if t.ndim:
        t = t[::step]
    (shard,) = host_shards("w", t)
    assert shard.data.shape == tuple(t.shape)
    assert np.array_equal(_bits(shard.data), _torch_bits(t))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device visible to torch")
def test_a_cuda_tensor_is_copied_to_pinned_host_memory_through_the_window() -> None:
    items = [("a", torch.randn(64, 32, device="cuda", requires_grad=True)), ("b", torch.randn(8, device="cuda"))]
    shards = list(device_stream(items, "bfloat16", window_bytes=1 << 20))
    for s, (_, t) in zip(shards, items):
        assert s.data.dtype == np.dtype(ml_dtypes.bfloat16)
        assert np.array_equal(_bits(s.data), _torch_bits(t.detach().bfloat16().cpu()))
    pending = torch_tensors.PendingCopy("a", items[0][1])
    pending.copy_to_host_async()
    assert np.array_equal(_bits(np.asarray(pending)), _torch_bits(items[0][1].cpu()))
