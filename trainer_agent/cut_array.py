"""A parameter already cut into the device path's blocks on its device: what an async
publish's snapshot holds of a single-device array on an accelerator
(`trainer_agent.snapshot.device_copy` with a block size).

Cutting blocks when the copies are issued costs a device program per block, dispatched
from the publish's thread while the training steps run: each waits its turn behind the
steps queued on the device. The snapshot's one program writes the blocks instead, right
behind the step that made the parameters, and the publish only issues copies. The blocks
are the ones `device_blocks.cut_blocks` would cut (whole chunks from the tensor's first
byte), so staging and the manifest are the same.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from weightsync.errors import FailedPrecondition


@dataclass
class CutArray:
    """A tensor of `shape` and staged `dtype` on one device of `platform`, as flat blocks
    (byte offset, bytes, device array) covering it in order. The blocks are handed out
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
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize

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
