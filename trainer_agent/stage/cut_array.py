"""A parameter already cut into the device path's blocks on its device: what an async
publish's snapshot holds of a single-device array on an accelerator
(`trainer_agent.device.snapshot.device_copy` with a block size).

Cutting blocks when the copies are issued costs a device program per block, dispatched
from the publish's thread while the training steps run: each waits its turn behind the
steps queued on the device. The snapshot's one program writes the blocks instead, right
behind the step that made the parameters, and the publish only issues copies. The blocks
are the ones `device_blocks.cut_blocks` would cut (whole chunks from the tensor's first
byte), so staging and the manifest are the same.

Tensors no larger than a block are packed: consecutive ones share one device buffer (a
pack of at most a block), and each is a `PackSlice` of it. A model's many small tensors
(norms, biases, the projections of a small model) then cost one device-to-host copy per
pack instead of one each: every copy has a fixed cost on the host (its Python, the
runtime's setup, on a TPU host some 0.1 ms or more), paid while the training loop waits
for the interpreter.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from weightsync.errors import FailedPrecondition


@dataclass(frozen=True)
class PackSlice:
    """Elements [start, start + count) of `pack`, a flat device array several tensors share.
    Its copy to host is the pack's (issued once however many slices ask); in host memory
    (`np.asarray`) it is a view of the pack's host copy."""

    pack: Any
    start: int
    count: int

    @property
    def size(self) -> int:
        return self.count

    def copy_to_host_async(self) -> None:
        self.pack.copy_to_host_async()

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        view = np.asarray(self.pack).reshape(-1)[self.start : self.start + self.count]
        if dtype is not None:
            return view.astype(dtype, copy=bool(copy))
        return view.copy() if copy else view


@dataclass
class CutArray:
    """A tensor of `shape` and staged `dtype` on one device of `platform`, as flat blocks
    (byte offset, bytes, device array or `PackSlice`) covering it in order. The blocks are handed out
    once (`take`): each goes as soon as its copy is staged, with the host copy JAX keeps
    of it."""

    shape: tuple[int, ...]
    dtype: np.dtype
    platform: str
    blocks: list[tuple[int, int, Any]] = field(repr=False)
    taken: bool = False

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def take(self, name: str) -> Iterator[tuple[int, int, Any]]:
        """The blocks in order, each dropped from here as it is handed out.

        Raises FailedPrecondition (field `params[name]`) when they were taken before: a
        snapshot is staged once."""
        if self.taken:
            raise FailedPrecondition(
                "its snapshot's blocks were staged once already; publish the parameters again",
                field=f"params[{name!r:.200}]",
            )
        self.taken = True
        while self.blocks:
            yield self.blocks.pop(0)
