"""Torch tensors as the publisher's host arrays: CPU tensors as zero-copy NumPy views
(bfloat16 through a uint16 view), tensors on other devices copied to host memory one at a
time, `requires_grad` and non-contiguous ones as they are. Torch is never imported here:
a value is a tensor only when the caller's process already imported torch.
"""

from __future__ import annotations

import sys
from typing import Any

import ml_dtypes
import numpy as np

from weightsync.dtypes import ALLOWED
from weightsync.errors import InvalidArgument

# torch dtype name -> the NumPy dtype its bytes stage as (each in weightsync.dtypes.ALLOWED)
_NUMPY = {
    "float32": np.dtype(np.float32),
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float64": np.dtype(np.float64),
    "int8": np.dtype(np.int8),
    "int16": np.dtype(np.int16),
    "int32": np.dtype(np.int32),
    "int64": np.dtype(np.int64),
    "uint8": np.dtype(np.uint8),
    "bool": np.dtype(np.bool_),
}


def is_tensor(value: Any) -> bool:
    """Whether `value` is a torch.Tensor (torch itself is not imported to find out)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def _field(name: str) -> str:
    return f"params[{name!r:.200}]"


def numpy_dtype(name: str, dtype: Any) -> np.dtype:
    """The NumPy dtype a tensor of torch `dtype` stages as, or InvalidArgument naming
    `params[name]` for one weightsync cannot carry (complex, float8, unsigned 16-64 bit)."""
    short = str(dtype).removeprefix("torch.")
    if short not in _NUMPY:
        raise InvalidArgument(
            f"torch dtype {short} cannot be carried by weightsync; cast it to one of {', '.join(ALLOWED)}",
            field=_field(name),
        )
    return _NUMPY[short]


def platform(tensor: Any) -> str:
    """Where a tensor's bytes live: "cpu", "cuda", ... (torch's device type)."""
    return str(tensor.device.type)


def checked(name: str, tensor: Any) -> Any:
    """The tensor detached from autograd, or InvalidArgument naming it where its bytes
    cannot be read: a sparse, meta or distributed (DTensor) tensor."""
    if tensor.layout != sys.modules["torch"].strided:
        raise InvalidArgument(f"is a {tensor.layout} tensor; publish dense tensors", field=_field(name))
    if tensor.device.type == "meta":
        raise InvalidArgument("is on the meta device: it holds no values", field=_field(name))
    if callable(getattr(tensor, "full_tensor", None)):
        raise InvalidArgument(
            "is a DTensor: publish its full_tensor() (vLLM's ModuleSource gathers it)", field=_field(name)
        )
    numpy_dtype(name, tensor.dtype)
    return tensor.detach()


def cast(name: str, tensor: Any, dtype: np.dtype) -> Any:
    """`tensor` in `dtype` (on its own device; the same tensor where it already is)."""
    torch = sys.modules["torch"]
    target = getattr(torch, dtype.name)
    tensor = checked(name, tensor)
    return tensor if tensor.dtype == target else tensor.to(target)


def host_array(name: str, tensor: Any) -> np.ndarray:
    """A NumPy view of a CPU tensor's bytes (strided as the tensor is; no copy), or a host
    copy of a tensor on another device (this tensor only)."""
    tensor = checked(name, tensor)
    if tensor.device.type != "cpu":
        tensor = tensor.to("cpu")
    return _view(tensor.resolve_neg())


def _view(tensor: Any) -> np.ndarray:
    torch = sys.modules["torch"]
    if tensor.dtype == torch.bfloat16:  # NumPy has no bfloat16: the bits, read as ml_dtypes'
        return tensor.view(torch.uint16).numpy().view(ml_dtypes.bfloat16)
    return tensor.numpy()


class PendingCopy:
    """A device tensor's copy to pinned host memory, issued on its own stream when
    `copy_to_host_async` is called (as `params.device_stream` does for JAX arrays) and
    waited for when the bytes are read (`np.asarray`)."""

    def __init__(self, name: str, tensor: Any) -> None:
        self.name = name
        self._tensor: Any = checked(name, tensor)
        self.shape = tuple(self._tensor.shape)
        self.dtype = numpy_dtype(name, self._tensor.dtype)
        self._host: Any = None
        self._done: Any = None

    def copy_to_host_async(self) -> None:
        torch = sys.modules["torch"]
        src = self._tensor
        if src.device.type != "cuda":  # no streams to overlap on: copied when read
            return
        self._host = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
        stream = torch.cuda.Stream(device=src.device)
        stream.wait_stream(torch.cuda.current_stream(src.device))  # what produced src runs first
        with torch.cuda.stream(stream):
            self._host.copy_(src, non_blocking=True)
            self._done = torch.cuda.Event()
            self._done.record(stream)
        src.record_stream(stream)  # its memory is not reused before the copy ends
        self._tensor = None

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        if self._host is None:
            host = host_array(self.name, self._tensor)
        else:
            self._done.synchronize()
            host = _view(self._host)
        return host if dtype is None else host.astype(dtype)


def snapshot(tensor: Any) -> Any:
    """A copy of `tensor` on its own device that the caller's training step cannot change."""
    return tensor.detach().clone()
