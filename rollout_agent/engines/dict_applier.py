"""DictApplier: the NumPy engine, a dict of arrays overwritten in place every version."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np

from rollout_agent.engines.applier import Applier
from rollout_agent.engines.audit_reading import AuditReading, Expected, VerifiedDigests, compare, damage, fingerprint
from rollout_agent.engines.readout import LOGPROB, readout_tokens, weights_readout
from rollout_agent.sampling import SampledCompletion, SampleSpec
from weightsync import native
from weightsync.errors import FailedPrecondition
from weightsync.manifest import TensorSpec
from weightsync.provenance import Provenance, VersionSpan


def _overwrite(pairs: Sequence[tuple[np.ndarray, np.ndarray]]) -> None:
    """Copies each source into its destination of the same shape and dtype: the contiguous
    ones in one native call (the bytes split over every core, streaming stores)."""
    native_pairs = [(dst, arr) for dst, arr in pairs if native.available() and arr.flags.c_contiguous]
    if native_pairs:
        native.copy_many(native_pairs)
    for dst, arr in pairs:
        if not (native.available() and arr.flags.c_contiguous):
            np.copyto(dst, arr)


def _destination(dst: np.ndarray | None, arr: np.ndarray, in_place: list[tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
    """Where `arr` goes: `dst` where it has `arr`'s shape and dtype (the copy queued in
    `in_place`, for `_overwrite`), else a fresh copy of `arr`."""
    if dst is None or dst.shape != arr.shape or dst.dtype != arr.dtype:
        return np.array(arr, copy=True)
    in_place.append((dst, arr))
    return dst


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
        self.torn = False  # an in-place round was abandoned after it wrote: a mix until the next commit
        self._dump_dir = Path(dump_dir) if dump_dir else None
        self._round = threading.Lock()
        self._consumed: list[str] = []
        self._expected: Mapping[str, TensorSpec] = {}
        self._verified: dict[str, Expected] = {}  # the audit's reference: the last version applied whole
        self._verified_version = 0
        # the rule its references were taken by: that version's tensor check (xxh3 digests),
        # or None (fingerprints)
        self._verified_check: VerifiedDigests | None = None
        self._taking: dict[str, Expected] = {}  # the open round's
        self._taking_check: VerifiedDigests | None = None
        # taken in `prepare`, off the apply
        self._prepared: tuple[int, dict[str, Expected], VerifiedDigests | None] = (0, {}, None)
        # `stage`: the version built aside (0: none) and its arrays; the spares, arrays of
        # the version before, which the next build aside writes into
        self._staged_version = 0
        self._staged: dict[str, np.ndarray] = {}
        self._spare: dict[str, np.ndarray] = {}

    def host_bytes(self, tensors: Mapping[str, TensorSpec], *, aside: bool = False) -> int:
        """The arrays it does not hold yet at the tensor's shape, those it allocates: among
        the live ones for an apply in place; among the spares for a build `aside` (an
        atomic session's; none before its first, so the whole version then)."""

        def lacking(held: Mapping[str, np.ndarray]) -> int:
            return sum(
                spec.nbytes
                for name, spec in tensors.items()
                if (arr := held.get(name)) is None or arr.shape != tuple(spec.shape)
            )

        return lacking(self._spare if aside else self.weights)

    def prepare(self, version: int, tensors: Mapping[str, np.ndarray], check: VerifiedDigests | None = None) -> None:
        """Takes the audit's reference of the verified bytes while the engine serves. With
        the tensor `check` that verified them, its digests: the arrays keep the verified
        bytes as they are (dtype, shape, layout), so an audit digests them by the same rule
        and nothing reads the version once more on its way in. Without, each array's
        fingerprint (a pass over its bytes; a streamed apply, which has no `prepare`, takes
        them as it applies)."""
        if check is not None:
            expected = check.expected()
            self._prepared = (version, {name: Expected((expected[name],), (name,)) for name in tensors}, check)
        else:
            refs = {name: Expected(fingerprint(arr), (name,)) for name, arr in tensors.items()}
            self._prepared = (version, refs, None)

    def stage(
        self, version: int, tensors: Mapping[str, TensorSpec], groups: Sequence[Sequence[tuple[str, np.ndarray]]]
    ) -> bool:
        """Builds the version into arrays of its own while the live ones serve (the spares:
        the arrays the version before the live one held), so that `commit_update` swaps
        them in under the round's lock: the pause of an atomic flip is the swap. Readers
        and the audit are not held meanwhile."""
        self._drop_staged()
        prepared_version, prepared, check = self._prepared
        fresh = prepared_version == version
        self._prepared = (0, {}, None)
        taking = dict(prepared) if fresh else {}
        self._taking_check = check if fresh else None
        built: dict[str, np.ndarray] = {}
        in_place: list[tuple[np.ndarray, np.ndarray]] = []
        for group in groups:
            for name, arr in group:
                if name not in tensors:
                    raise KeyError(f"{name!r} is not part of this update")
                built[name] = _destination(self._spare.pop(name, None), arr, in_place)
                if name not in taking:
                    taking[name] = Expected(self._reference(name, arr), (name,))
        _overwrite(in_place)
        self._spare.clear()
        self._staged_version, self._staged = version, built
        self._staged_expected, self._staged_taking = tensors, taking
        return True

    def _drop_staged(self) -> None:
        """Keeps a version built aside and not committed as the spares of the next one."""
        if self._staged_version:
            self._spare = self._staged
        self._staged_version, self._staged = 0, {}

    def begin_update(self, version: int, tensors: Mapping[str, TensorSpec]) -> None:
        self._drop_staged()
        self._round.acquire()
        self._consumed = []
        self._expected = tensors
        prepared_version, prepared, check = self._prepared
        fresh = prepared_version == version
        self._taking = dict(prepared) if fresh else {}
        self._taking_check = check if fresh else None
        self._prepared = (0, {}, None)

    def apply(self, group: Sequence[tuple[str, np.ndarray]]) -> None:
        in_place: list[tuple[np.ndarray, np.ndarray]] = []
        for name, arr in group:
            if name not in self._expected:
                raise KeyError(f"{name!r} is not part of this update")
            self.weights[name] = _destination(self.weights.get(name), arr, in_place)
            if name not in self._taking:  # of the verified bytes, by the round's rule
                self._taking[name] = Expected(self._reference(name, arr), (name,))
            self._consumed.append(name)
        _overwrite(in_place)

    def _reference(self, name: str, arr: np.ndarray) -> tuple[int, ...]:
        """`arr`'s audit reference by the open round's rule (its digest or its fingerprint)."""
        if self._taking_check is not None:
            return (self._taking_check.digests({name: arr})[name],)
        return fingerprint(arr)

    def commit_update(self, version: int) -> list[str]:
        if self._staged_version:
            if self._staged_version != version:
                self._drop_staged()
                raise RuntimeError(f"version {version} is not the one built aside")
            self._round.acquire()
            self._expected, self._taking = self._staged_expected, self._staged_taking
            self._consumed = list(self._staged)
            self._spare, self.weights = self.weights, self._staged
            self._staged_version, self._staged = 0, {}
        try:
            for name in [n for n in self.weights if n not in self._expected]:
                del self.weights[name]
            self.version = version
            self.torn = False
            self._verified = {n: e for n, e in self._taking.items() if n in self.weights}
            self._verified_version = version
            self._verified_check = self._taking_check
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
        if self._staged_version:  # built aside: no round was opened, the live arrays untouched
            self._drop_staged()
        elif self._round.locked():
            self.torn = bool(self._consumed)  # arrays of the round were written: no version whole
            self._round.release()

    def audit(self, *, engine_held: bool = False) -> AuditReading:
        """The arrays as they are now against the version last applied whole (an aborted
        round's overwritten arrays differ from it: they are not that version). Reading
        them beside the engine is safe: `engine_held` changes nothing."""
        with self._round:
            check = self._verified_check
            if check is None:
                live = {name: fingerprint(arr) for name, arr in self.weights.items()}
            else:
                present = {name: self.weights[name] for name in self._verified if name in self.weights}
                live = {name: (d,) for name, d in check.digests(present).items()}
            return compare(self._verified_version, self._verified, live, method="host")

    def inject(self, kind: str) -> str:
        """Testing only: damages the live array of the first (flip) or last (overwrite)
        tensor in name order (`audit_reading.damage`); returns its name."""
        with self._round:
            names = sorted(self._verified)
            name = names[0] if kind == "flip" else names[-1]
            damage(self.weights[name], kind)
            return name

    def sample(self, spec: SampleSpec, provenance: Callable[[int], Provenance]) -> list[SampledCompletion]:
        """Completions read out of the arrays it serves (`readout`), under the round's lock:
        one version's bytes, tagged with that version and `provenance(version)`'s digest.
        FailedPrecondition while it holds a mix (an in-place apply abandoned part way)."""
        with self._round:
            if self.torn:
                raise FailedPrecondition(
                    f"the engine holds a mix of versions (an apply after version {self.version} stopped part way); "
                    "nothing is sampled until a version applies whole"
                )
            version, readout = self.version, weights_readout(self.weights)
        weights = provenance(version) if version else Provenance(0)
        out = []
        for tokens in readout_tokens(readout, spec):
            span = VersionSpan(0, len(tokens), version, weights.manifest_digest)
            out.append(SampledCompletion(tokens, (LOGPROB,) * len(tokens), (span,)))
        return out

    def snapshot(self) -> tuple[int, dict[str, np.ndarray]]:
        """(version, copies of the weights), consistent with one version."""
        with self._round:
            return self.version, {k: v.copy() for k, v in self.weights.items()}
