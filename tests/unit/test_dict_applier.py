"""The NumPy engine's build aside (`DictApplier.stage`): an atomic flip's pause is a swap,
the live arrays serve untouched until it, and an abandoned build leaves them as they are."""

from __future__ import annotations

import numpy as np
import pytest

from rollout_agent.engines.dict_applier import DictApplier
from weightsync.manifest import TensorSpec


def _tensors(value: float) -> dict[str, np.ndarray]:
    return {"a": np.full((64, 64), value, np.float32), "b": np.full(128, value, np.float32)}


def _specs(tensors: dict[str, np.ndarray]) -> dict[str, TensorSpec]:
    return {n: TensorSpec(name=n, dtype="float32", shape=list(t.shape)) for n, t in tensors.items()}


def _groups(tensors: dict[str, np.ndarray]) -> list[list[tuple[str, np.ndarray]]]:
    return [[(n, t)] for n, t in tensors.items()]


def _exact(applier: DictApplier, version: int) -> bool:
    """The audit reads the live arrays as `version`, every tensor exact."""
    reading = applier.audit()
    return reading.version == version and reading.compared == 2 and reading.exact


def _applied(applier: DictApplier, version: int, tensors: dict[str, np.ndarray]) -> None:
    applier.begin_update(version, _specs(tensors))
    for group in _groups(tensors):
        applier.apply(group)
    applier.commit_update(version)


def test_a_version_built_aside_serves_only_after_its_commit_swaps_it_in() -> None:
    applier = DictApplier()
    _applied(applier, 1, _tensors(1.0))
    live_a = applier.weights["a"]
    v2 = _tensors(2.0)
    whole = sum(t.nbytes for t in v2.values())
    assert applier.host_bytes(_specs(v2)) == 0  # in place: the apply overwrites
    # the first build aside allocates the whole version: no spares yet (the limit must see it)
    assert applier.host_bytes(_specs(v2), aside=True) == whole
    assert applier.stage(2, _specs(v2), _groups(v2))
    assert applier.host_bytes(_specs(v2), aside=True) == whole  # (none until the swap)
    v2["a"][:] = 9.0  # the pulled bytes change after the build: the build holds its own copy
    version, served = applier.snapshot()  # readers are not held by a build aside
    assert version == 1 and (served["a"] == 1.0).all() and applier.weights["a"] is live_a
    assert sorted(applier.commit_update(2)) == ["a", "b"]
    assert applier.version == 2 and (applier.weights["a"] == 2.0).all() and (applier.weights["b"] == 2.0).all()
    assert _exact(applier, 2)
    v3 = _tensors(3.0)
    assert applier.host_bytes(_specs(v3), aside=True) == 0  # the spares are there to be written again
    assert applier.host_bytes(_specs(v3)) == 0
    assert applier.stage(3, _specs(v3), _groups(v3))
    assert applier._staged["a"] is live_a  # the spares: the arrays version 1 held, written again
    applier.commit_update(3)
    assert (applier.weights["a"] == 3.0).all() and _exact(applier, 3)


def test_an_abandoned_build_leaves_the_live_arrays_and_the_round_free() -> None:
    applier = DictApplier()
    _applied(applier, 1, _tensors(1.0))
    v2 = _tensors(2.0)
    applier.stage(2, _specs(v2), _groups(v2))
    with applier._round:  # a reader in its snapshot while the flip is abandoned
        applier.abort_update()
        assert applier._round.locked(), "the abort released a lock it did not hold"
    assert applier.version == 1 and (applier.weights["a"] == 1.0).all() and _exact(applier, 1)
    _applied(applier, 3, _tensors(3.0))  # the next version's round opens as ever
    assert applier.version == 3 and (applier.weights["b"] == 3.0).all()


def test_a_commit_of_another_version_than_the_one_built_aside_is_refused() -> None:
    applier = DictApplier()
    _applied(applier, 1, _tensors(1.0))
    v2 = _tensors(2.0)
    applier.stage(2, _specs(v2), _groups(v2))
    with pytest.raises(RuntimeError, match="version 3 is not the one built aside"):
        applier.commit_update(3)
    assert applier.version == 1 and (applier.weights["a"] == 1.0).all()
