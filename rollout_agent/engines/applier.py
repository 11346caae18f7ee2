"""Appliers hand verified tensors to an engine; `DictApplier` keeps NumPy arrays."""

from __future__ import annotations

import re
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import numpy as np

from rollout_agent.engines.apply_report import ApplyReport
from rollout_agent.engines.audit_reading import AuditReading, Expected, compare, damage, fingerprint
from weightsync import native
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

    def prepare(self, version: int, tensors: Mapping[str, np.ndarray]) -> None:
        """Called once every tensor of the version verified, before `begin_update`, while
        the engine still serves (atomic applies only): an applier that checks the engine's
        copy against the host bytes takes its reference here. The default does nothing."""
        return None

    def host_bytes(self, tensors: Mapping[str, TensorSpec]) -> int:
        """Host memory an apply of these tensors takes beyond the pulled bytes, at most:
        the engine's copies (staged or cast tensors; weights an engine keeps in host
        memory). The default says none."""
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


class DictApplier(Applier):
    """Keeps the weights as persistent NumPy arrays (overwritten in place every version).

    Readers use `snapshot()`, which waits for an update round to finish, so they never
    see a torn mix of two versions.

    Args:
        dump_dir: when set, each committed version is also written to
            `<dump_dir>/v<version>.safetensors` (for inspection and tests).
    """

    def __init__(self, dump_dir: str | None = None) -> None:
        self.weights: dict[str, np.ndarray] = {}
        self.version = 0
        self._dump_dir = Path(dump_dir) if dump_dir else None
        self._round = threading.Lock()
        self._consumed: list[str] = []
        self._expected: Mapping[str, TensorSpec] = {}
        self._verified: dict[str, Expected] = {}  # the audit's reference: the last version applied whole
        self._verified_version = 0
        self._taking: dict[str, Expected] = {}  # the open round's
        self._prepared: tuple[int, dict[str, Expected]] = (0, {})  # taken in `prepare`, off the apply

    def host_bytes(self, tensors: Mapping[str, TensorSpec]) -> int:
        """The arrays it does not hold yet at the tensor's shape (the rest are overwritten in place)."""
        return sum(
            spec.nbytes
            for name, spec in tensors.items()
            if (held := self.weights.get(name)) is None or held.shape != tuple(spec.shape)
        )

    def prepare(self, version: int, tensors: Mapping[str, np.ndarray]) -> None:
        """Takes the audit's reference from the verified bytes while the engine serves
        (a streamed apply, which has no `prepare`, takes it as it applies)."""
        self._prepared = (version, {name: Expected(fingerprint(arr), (name,)) for name, arr in tensors.items()})

    def begin_update(self, version: int, tensors: Mapping[str, TensorSpec]) -> None:
        self._round.acquire()
        self._consumed = []
        self._expected = tensors
        prepared_version, prepared = self._prepared
        self._taking = dict(prepared) if prepared_version == version else {}
        self._prepared = (0, {})

    def apply(self, group: Sequence[tuple[str, np.ndarray]]) -> None:
        in_place: list[tuple[np.ndarray, np.ndarray]] = []
        for name, arr in group:
            if name not in self._expected:
                raise KeyError(f"{name!r} is not part of this update")
            dst = self.weights.get(name)
            if dst is None or dst.shape != arr.shape or dst.dtype != arr.dtype:
                self.weights[name] = np.array(arr, copy=True)
            elif native.available() and arr.flags.c_contiguous:
                in_place.append((dst, arr))
            else:
                np.copyto(dst, arr)
            if name not in self._taking:
                self._taking[name] = Expected(fingerprint(arr), (name,))  # of the verified bytes
            self._consumed.append(name)
        if in_place:
            native.copy_many(in_place)  # the group's bytes split over every core, streaming stores

    def commit_update(self, version: int) -> list[str]:
        try:
            for name in [n for n in self.weights if n not in self._expected]:
                del self.weights[name]
            self.version = version
            self._verified = {n: e for n, e in self._taking.items() if n in self.weights}
            self._verified_version = version
            if self._dump_dir is not None:
                from safetensors.numpy import save_file

                self._dump_dir.mkdir(parents=True, exist_ok=True)
                tmp = self._dump_dir / f".v{version}.safetensors.tmp"
                save_file(self.weights, str(tmp), metadata={"version": str(version)})
                tmp.replace(self._dump_dir / f"v{version}.safetensors")
            return list(self._consumed)
        finally:
            self._round.release()

    def abort_update(self) -> None:
        if self._round.locked():
            self._round.release()

    def audit(self, *, engine_held: bool = False) -> AuditReading:
        """The arrays as they are now against the version last applied whole (an aborted
        round's overwritten arrays differ from it: they are not that version). Reading
        them beside the engine is safe: `engine_held` changes nothing."""
        with self._round:
            live = {name: fingerprint(arr) for name, arr in self.weights.items()}
            return compare(self._verified_version, self._verified, live, method="host")

    def inject(self, kind: str) -> str:
        """Testing only: damages the live array of the first (flip) or last (overwrite)
        tensor in name order (`audit_reading.damage`); returns its name."""
        with self._round:
            names = sorted(self._verified)
            name = names[0] if kind == "flip" else names[-1]
            damage(self.weights[name], kind)
            return name

    def snapshot(self) -> tuple[int, dict[str, np.ndarray]]:
        """(version, copies of the weights), consistent with one version."""
        with self._round:
            return self.version, {k: v.copy() for k, v in self.weights.items()}
