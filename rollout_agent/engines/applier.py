"""The Applier contract: how a sync round hands a verified version to an engine, a layer at a time."""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from rollout_agent.engines.apply_report import ApplyReport
from rollout_agent.engines.audit_reading import VerifiedDigests
from weightsync.manifest import TensorSpec

_LAYER_RE = re.compile(r"^(.*?\.layers\.\d+)\.")


def layer_groups(names: Iterable[str]) -> list[list[str]]:
    """Names grouped by transformer layer (`...layers.N.`), in first-seen order.

    Fused projections (q/k/v, gate/up, a layer's experts) share a layer prefix, so they
    always travel in one group; names outside layers form one group of their own.
    """
    groups: dict[str, list[str]] = {}
    for name in names:
        m = _LAYER_RE.match(name)
        groups.setdefault(m.group(1) if m else "", []).append(name)
    return list(groups.values())


class Applier(ABC):
    """Receives one verified version: begin, apply groups, commit (or abort).

    `begin_update` is called only after every chunk of the version verified, so an
    atomic applier never sees bytes of a bad version.
    """

    def check(self, version: int, tensors: Mapping[str, TensorSpec]) -> None:
        """Refuses a version the engine cannot take (`InvalidArgument` naming
        `manifest.tensors`) from its manifest alone, before a byte of it is pulled.
        The default takes any; `begin_update` must refuse the same versions."""
        return None

    def taken(self, version: int, tensors: Mapping[str, TensorSpec]) -> Mapping[str, int] | None:
        """How many elements of each tensor this engine shard takes (a worker of a
        tensor-parallel engine takes its slice), where the applier counts them: its
        engine's workers add their counts, and a tensor they do not take whole is refused
        (`vllm_worker.workers`). None by default: not counted."""
        return None

    def prepare(self, version: int, tensors: Mapping[str, np.ndarray], check: VerifiedDigests | None = None) -> None:
        """Called once every tensor of the version verified, before `begin_update`, while
        the engine still serves (atomic applies only): an applier that checks the engine's
        copy against the host bytes takes its reference here. `check`: the tensor check
        that verified them (its digests, and the rule to digest arrays by), for an engine
        that holds the bytes as they are. The default does nothing."""
        return None

    def host_bytes(self, tensors: Mapping[str, TensorSpec], *, aside: bool = False) -> int:
        """Host memory an apply of these tensors takes beyond the pulled bytes, at most:
        the engine's copies (staged or cast tensors; weights an engine keeps in host
        memory). `aside`: the version is to be built aside the live weights (`stage`, an
        atomic session's prepare). The default says none."""
        return 0

    def stage(
        self, version: int, tensors: Mapping[str, TensorSpec], groups: Sequence[Sequence[tuple[str, np.ndarray]]]
    ) -> bool:
        """Builds a verified version aside while the engine serves, so that its apply is
        only the commit: an update round opened and every group applied, left open for
        `commit_update` (or `abort_update`). True where it did; the default does not
        (its apply writes the live weights)."""
        return False

    @abstractmethod
    def begin_update(self, version: int, tensors: Mapping[str, TensorSpec]) -> None:
        """Starts an update round."""

    @abstractmethod
    def apply(self, group: Sequence[tuple[str, np.ndarray]]) -> None:
        """Applies one group of tensors (a layer's worth)."""

    @abstractmethod
    def commit_update(self, version: int) -> list[str]:
        """Finishes the round; returns the names the engine consumed."""

    @abstractmethod
    def abort_update(self) -> None:
        """Abandons the round."""

    def last_report(self) -> ApplyReport | None:
        """What the last committed round did, where the applier says (its mode, how long
        the engine could not serve, memory); None by default."""
        return None
