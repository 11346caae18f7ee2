"""What the NumPy engine answers a `Sample` with: tokens read out of the arrays it serves.

The NumPy engine holds weights and runs no model. So that its responses still say which
bytes made them (and a test can check a response's version against what was served), a
completion is a function of the arrays at the moment it is sampled: each tensor's readout
(its name, shape, dtype and up to `READ_ELEMENTS` elements at an even stride) hashed
together with xxh3-64, then per token the hash of that, the prompt, the seed, the
completion's index and the tokens before it, modulo `VOCAB`. Every token is equally likely
under this rule: its log-prob is -log(VOCAB). Two versions whose readouts differ give other
tokens; a torn mix gives tokens neither version gives.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping

import numpy as np
import xxhash

from rollout_agent.sampling import SampleSpec, check_fits

VOCAB = 32768
MAX_MODEL_LEN = 1 << 16
READ_ELEMENTS = 256  # of each tensor, at an even stride: a version's values, not its bytes' digest
LOGPROB = -math.log(VOCAB)


def weights_readout(weights: Mapping[str, np.ndarray]) -> int:
    """The xxh3-64 of every tensor's readout, in name order."""
    h = xxhash.xxh3_64()
    for name in sorted(weights):
        arr = weights[name]
        flat = arr.reshape(-1)
        step = max(1, flat.size // READ_ELEMENTS)
        h.update(f"{name}|{arr.dtype.str}|{arr.shape}|".encode())
        h.update(np.ascontiguousarray(flat[::step][:READ_ELEMENTS]).tobytes())
    return h.intdigest()


def readout_tokens(readout: int, spec: SampleSpec) -> list[tuple[int, ...]]:
    """`spec.n` completions of `spec.max_tokens` tokens each from a weights readout."""
    check_fits(spec, VOCAB, MAX_MODEL_LEN)
    prompt = struct.pack(f"<{len(spec.prompt)}I", *spec.prompt)
    completions = []
    for index in range(spec.n):
        state = xxhash.xxh3_64_intdigest(struct.pack("<QQI", readout, spec.seed, index) + prompt)
        tokens = []
        for _ in range(spec.max_tokens):
            state = xxhash.xxh3_64_intdigest(struct.pack("<Q", state))
            tokens.append(state % VOCAB)
        completions.append(tuple(tokens))
    return completions
