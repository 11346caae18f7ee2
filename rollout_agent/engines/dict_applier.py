"""DictApplier: the NumPy engine, a dict of arrays overwritten in place every version."""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from rollout_agent.engines.applier import Applier
from rollout_agent.engines.audit_reading import AuditReading, Expected, compare, damage, fingerprint
from weightsync import native
from weightsync.manifest import TensorSpec


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
