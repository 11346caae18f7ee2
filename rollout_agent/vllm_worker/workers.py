"""The workers of one vLLM engine agree on a version before any of them applies it.

vLLM runs `update_weights` on every worker of an engine (each tensor-parallel and
pipeline rank) at once, and each worker pulls, verifies and dry-runs the version on its
own. A defect only one shard sees (a row too few for rank 1's heads) would have rank 0
apply while rank 1 refuses: the engine then serves a torn mix. So every worker, after its
own checks and before its first weight changes, meets the others over the engine's CPU
process group (vLLM's world group, gloo) and shares its verdict:

1. one all-gather of a fixed-size record per worker: ready or not, the version, how
   many tensors, and why not (UTF-8, cut to `REASON_BYTES`);
2. only if every worker is ready with the same version: one all-reduce summing the
   elements of each tensor every worker's shard takes (`loader_check`), so a tensor no
   worker takes whole is refused by all.

Every worker reaches both steps (the caller holds no exception back from them), and both
are decided by what every worker saw, so the workers never disagree on whether a second
collective comes. An engine of one worker agrees with itself without a collective.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

REASON_BYTES = 1024
_HEADER = 3  # state, version, tensor count (int64 each), then the reason's length
_REFUSED, _READY, _ECHO = 0, 1, 2


@dataclass(frozen=True)
class Verdict:
    """What a worker brings to the agreement: its version, and why it cannot apply it ("" when it can)."""

    version: int
    refusal: str = ""
    taken: Mapping[str, int] | None = None  # elements of each tensor its shard takes
    echo: bool = False  # the refusal repeats another worker's (the first own one is reported)


@dataclass(frozen=True)
class Agreement:
    """What the workers agreed: every one ready (`refusal` empty), else the first refusal
    named by its worker; the summed counts of the tensors (when all were ready)."""

    refusal: str
    taken: dict[str, int]
    workers: int


class EngineWorkers:
    """This worker's place among its engine's workers, and their agreement."""

    def __init__(self, group: Any = None, rank: int = 0, size: int = 1) -> None:
        self.group, self.rank, self.size = group, rank, size

    @classmethod
    def of_engine(cls) -> EngineWorkers:
        """vLLM's world group of this process (all the engine's workers), or a worker alone
        where vLLM set up none (a TPU engine's single worker)."""
        try:
            from vllm.distributed.parallel_state import get_world_group

            world = get_world_group()
        except (ImportError, AssertionError):
            return cls()
        if world.world_size <= 1:
            return cls(rank=world.rank_in_group)
        return cls(world.cpu_group, world.rank_in_group, world.world_size)

    @property
    def last(self) -> bool:
        """The worker whose reply vLLM's `collective_rpc` reads last (see `backend`)."""
        return self.rank == self.size - 1

    def agree(self, verdict: Verdict, names: Sequence[str]) -> Agreement:
        """Every worker's verdict on the version (`names`: its tensors, in manifest order)."""
        taken = dict(verdict.taken or {})
        if self.size == 1:
            return Agreement(verdict.refusal, taken, 1)
        import torch
        import torch.distributed as dist

        mine = _record(verdict, len(names))
        records = [torch.empty_like(mine) for _ in range(self.size)]
        dist.all_gather(records, mine, group=self.group)
        refusal = _first_refusal([r.numpy() for r in records], verdict.version, len(names))
        if refusal:
            return Agreement(refusal, {}, self.size)
        counts = torch.tensor([int(taken.get(n, 0)) for n in names], dtype=torch.int64)
        dist.all_reduce(counts, group=self.group)
        return Agreement("", dict(zip(names, (int(c) for c in counts.tolist()))), self.size)


def _record(verdict: Verdict, tensors: int) -> Any:
    import torch

    reason = verdict.refusal.encode("utf-8", "replace")[:REASON_BYTES]
    out = np.zeros(_HEADER * 8 + 8 + REASON_BYTES, np.uint8)
    state = _READY if not verdict.refusal else _ECHO if verdict.echo else _REFUSED
    header = np.array([state, verdict.version, tensors, len(reason)], np.int64)
    out[: header.nbytes] = header.view(np.uint8)
    out[header.nbytes : header.nbytes + len(reason)] = np.frombuffer(reason, np.uint8)
    return torch.from_numpy(out)


def _first_refusal(records: Sequence[np.ndarray], version: int, tensors: int) -> str:
    """The first worker's own refusal (else the first echo of one), in rank order, as
    "worker r: why"; a worker on another version (each resolved "latest" itself) or
    another manifest refuses too."""
    headers = [record[: (_HEADER + 1) * 8].view(np.int64) for record in records]
    refused = [r for r, h in enumerate(headers) if h[0] == _REFUSED]
    refused = refused or [r for r, h in enumerate(headers) if h[0] == _ECHO]
    if refused:
        rank = refused[0]
        why = bytes(records[rank][(_HEADER + 1) * 8 :][: headers[rank][3]]).decode("utf-8", "replace")
        return f"worker {rank}: {why}"
    for rank, (_, their_version, their_tensors, _) in enumerate(headers):
        if their_version != version or their_tensors != tensors:
            return (
                f"worker {rank}: has version {their_version} ({their_tensors} tensors), not {version} "
                f"({tensors}); name the version rather than 'latest'"
            )
    return ""
