"""What an audit reads and compares: the fingerprint of what each engine entry must hold,
taken from the verified host bytes while the applier applies them (`Expected`), and the
outcome of comparing it with the entry's live fingerprint (`AuditReading`).

The fingerprint is `engines.fingerprint`'s: wrapping uint32 sums of the elements' bits,
plain and weighted by each axis' index. It is exact (no float tolerance: a single flipped
bit changes the plain sum, an element moved a weighted one) and a few integers per entry,
so an audit keeps and moves no copy of the model. It guards against faults, not an
adversary: several changes can be made to cancel in every sum.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from rollout_agent.engines.fingerprint import Fingerprint, array_fingerprint, bits


class VerifiedDigests(Protocol):
    """The tensor check of a verified version (`pull.assembly.TensorCheck`): the digests
    its bytes matched, and the same digest of any arrays that hold its tensors. An engine
    that keeps the verified bytes as they are (the NumPy engine: same dtype, shape and
    layout) audits against these instead of fingerprinting the bytes once more: the check
    already read them."""

    def expected(self) -> Mapping[str, int]: ...

    def digests(self, arrays: Mapping[str, np.ndarray]) -> Mapping[str, int]: ...


@dataclass(frozen=True)
class Expected:
    """What one engine entry must hold: its fingerprint, and the checkpoint tensors in it."""

    fingerprint: Fingerprint
    tensors: tuple[str, ...]


@dataclass(frozen=True)
class AuditReading:
    """One audit's outcome as an applier found it."""

    version: int  # the version the entries were compared with (0: none applied yet)
    compared: int  # checkpoint tensors compared
    mismatched: dict[str, str] = field(default_factory=dict)  # tensor -> what differs
    unaudited: dict[str, str] = field(default_factory=dict)  # tensor -> why it cannot be read back exactly
    method: str = ""  # how the live weights were read

    @property
    def exact(self) -> bool:
        return not self.mismatched


def fingerprint(a: np.ndarray) -> Fingerprint:
    """The exact fingerprint of an array's bits in its own layout (`engines.fingerprint`)."""
    return array_fingerprint(bits(a))


def compare(
    version: int,
    expected: Mapping[str, Expected],
    live: Mapping[str, Fingerprint | str],
    *,
    method: str,
    unaudited: Mapping[str, str] | None = None,
) -> AuditReading:
    """Every checkpoint tensor whose entry's live fingerprint differs from the expected one
    (a `str` in `live` is a problem found reading the entry: replicas that disagree, an
    entry gone), named with what differs."""
    mismatched: dict[str, str] = {}
    for entry, want in expected.items():
        got = live.get(entry, "not in the engine")
        if got == want.fingerprint:
            continue
        why = got if isinstance(got, str) else f"live fingerprint {list(got)}, verified {list(want.fingerprint)}"
        where = f"{entry}: " if want.tensors != (entry,) else ""
        for name in want.tensors:
            mismatched[name] = f"{where}{why}"
    compared = len({name for want in expected.values() for name in want.tensors})
    return AuditReading(version, compared, mismatched, dict(unaudited or {}), method)


def damage(buf: np.ndarray, kind: str) -> None:
    """Testing only: writes a fault into `buf` (a writable view of an engine's own memory)
    in place: "flip" one bit of its middle byte, or "overwrite" every byte."""
    flat = buf.reshape(-1).view(np.uint8)
    if kind == "flip":
        flat[flat.size // 2] ^= 0x10
    elif kind == "overwrite":
        flat[...] = 0x3C if flat[0] != 0x3C else 0x3D
    else:
        raise ValueError(f"unknown fault {kind!r}")
