"""A version's tensors where a rollout's puller leaves them: views of one receive buffer,
each at an offset aligned as a part places its shards (`SHARD_ALIGN_BYTES`). Tests and
benches hand appliers these, not fresh arrays, because the buffer is overwritten by the
next pull and anything that kept a view of it instead of a copy serves what lands there."""

from __future__ import annotations

import numpy as np

from weightsync.layout import SHARD_ALIGN_BYTES, align_up


def as_received(tensors: dict[str, np.ndarray]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """(the buffer, each tensor as a view of it): copies of `tensors`, laid out in order."""
    offsets, end = [], 0
    for a in tensors.values():
        offsets.append(end)
        end = align_up(end + a.nbytes, SHARD_ALIGN_BYTES)
    raw = np.zeros(end + SHARD_ALIGN_BYTES, np.uint8)
    buf = raw[(-raw.ctypes.data) % SHARD_ALIGN_BYTES :][:end]
    views = {}
    for (name, a), offset in zip(tensors.items(), offsets):
        views[name] = buf[offset : offset + a.nbytes].view(a.dtype).reshape(a.shape)
        views[name][...] = a
    return buf, views
