"""The dtype whitelist: names, item sizes, NumPy dtypes and proto enum values."""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

from weightsync.errors import InvalidArgument


@dataclass(frozen=True)
class DTypeInfo:
    """One allowed element type."""

    name: str
    itemsize: int
    numpy: np.dtype
    proto: int  # weightsync.v1.DType value


_INFOS = [
    DTypeInfo("float32", 4, np.dtype(np.float32), 1),
    DTypeInfo("float16", 2, np.dtype(np.float16), 2),
    DTypeInfo("bfloat16", 2, np.dtype(ml_dtypes.bfloat16), 3),
    DTypeInfo("float64", 8, np.dtype(np.float64), 4),
    DTypeInfo("int8", 1, np.dtype(np.int8), 5),
    DTypeInfo("int16", 2, np.dtype(np.int16), 6),
    DTypeInfo("int32", 4, np.dtype(np.int32), 7),
    DTypeInfo("int64", 8, np.dtype(np.int64), 8),
    DTypeInfo("uint8", 1, np.dtype(np.uint8), 9),
    DTypeInfo("bool", 1, np.dtype(np.bool_), 10),
]
BY_NAME = {i.name: i for i in _INFOS}
# by NumPy dtype: equal dtypes hash alike, and a lookup is a hash, not ml_dtypes' slow
# comparisons (a publish asks once per tensor, beside the training loop)
_BY_NUMPY = {i.numpy: i.name for i in _INFOS}
BY_PROTO = {i.proto: i for i in _INFOS}
ALLOWED = tuple(BY_NAME)


def dtype_info(name: str, field: str = "dtype") -> DTypeInfo:
    """Looks up an allowed dtype by name; InvalidArgument lists the allowed ones."""
    try:
        return BY_NAME[name]
    except KeyError:
        raise InvalidArgument(f"dtype {name!r} is not allowed; use one of {', '.join(ALLOWED)}", field=field) from None


def dtype_from_proto(value: int, field: str = "dtype") -> DTypeInfo:
    """Looks up an allowed dtype by its proto enum value."""
    try:
        return BY_PROTO[value]
    except KeyError:
        raise InvalidArgument(
            f"dtype enum {value} is not allowed; use one of {', '.join(ALLOWED)}", field=field
        ) from None


def dtype_name_of(array_dtype: object, field: str = "dtype") -> str:
    """The whitelist name of a NumPy/JAX dtype, or InvalidArgument naming `field`."""
    dt = np.dtype(array_dtype)  # type: ignore[call-overload]
    name = _BY_NUMPY.get(dt)
    if name is not None:
        return name
    raise InvalidArgument(f"dtype {dt} is not allowed; use one of {', '.join(ALLOWED)}", field=field)


def native_code(dtype: np.dtype) -> int:
    """The native shim's element-type code (the proto DType value) of a NumPy dtype."""
    return dtype_info(dtype_name_of(dtype)).proto
