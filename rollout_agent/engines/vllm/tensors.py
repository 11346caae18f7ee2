"""NumPy arrays as torch tensors, for the applier's loads and the audit's expected bytes."""

from __future__ import annotations

from typing import Any

import numpy as np


def to_torch(arr: np.ndarray) -> Any:
    """A torch view of a NumPy array (bfloat16 through an int16 view; no copy), or of a
    copy when the array is read-only: a view of the trainer's arena (shm) must never
    become engine memory, and torch tensors are writable."""
    import torch

    if not arr.flags.writeable:
        arr = np.array(arr)
    if arr.dtype.name == "bfloat16":
        return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(arr)
