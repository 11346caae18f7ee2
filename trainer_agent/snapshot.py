"""An on-device copy of a parameter tree: new buffers, at the device's memory bandwidth."""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp

from weightsync.dtypes import dtype_info


@partial(jax.jit, static_argnums=1)
def _copy(arrays: dict[str, jax.Array], weight_dtype: str) -> dict[str, jax.Array]:
    cast = dtype_info(weight_dtype).numpy if weight_dtype else None
    # jnp.copy: an output that is an input unchanged would be the same buffer, which the
    # caller's next donating step deletes
    return {k: x.astype(cast) if cast is not None and x.dtype != cast else jnp.copy(x) for k, x in arrays.items()}


def device_copy(arrays: dict[str, Any], weight_dtype: str = "") -> dict[str, Any]:
    """Copies of `arrays` in new buffers on the same devices and shardings (cast to
    `weight_dtype` on the way when set), dispatched without waiting for them."""
    return _copy(arrays, weight_dtype)
