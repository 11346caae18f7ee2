"""JaxApplier on this process' devices (one CPU device in the suite; the chip where the
tests run on a TPU host): swap and in-place applies read back bit for bit, a bit flipped
after the host check is caught by the device fingerprint with the old leaves serving on,
and the three kinds of target. Meshes of 8 devices: test_jax_mesh.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import ml_dtypes
import numpy as np
import pytest

from devtools.receive_buffer import as_received
from rollout_agent.engines.applier import layer_groups
from rollout_agent.engines.dict_applier import DictApplier
from rollout_agent.engines.jax.applier import JaxApplier
from rollout_agent.engines.jax.model import PROFILES, empty_leaves, family_map, mesh_of
from rollout_agent.engines.jax.names import reference_leaf
from rollout_agent.engines.jax.targets import CallbackTarget, InPlaceTree, WeightsHolder
from weightsync.errors import DataLoss, InvalidArgument
from weightsync.manifest import TensorSpec
from weightsync.model_shapes import ModelShape, param_shapes

TINY = ModelShape(64, 2, 4, 2, 32, 128, 256, tied=False)
NAME_MAP = family_map("qwen3", "tpu_inference", TINY)


def version(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {n: rng.standard_normal(s, dtype=np.float32).astype(ml_dtypes.bfloat16)
            for n, s in param_shapes(TINY).items()}  # fmt: skip


def specs(tensors: dict[str, np.ndarray]) -> dict[str, TensorSpec]:
    return {n: TensorSpec(n, "bfloat16", a.shape) for n, a in tensors.items()}


def leaves() -> dict[str, jax.Array]:
    devs = jax.devices()
    return empty_leaves(NAME_MAP, TINY, TINY.layers, TINY.tied, mesh_of((1, len(devs)), devs),
                        PROFILES["tpu_inference"])  # fmt: skip


def apply(applier: JaxApplier, v: int, tensors: dict[str, np.ndarray], prepare: bool = True) -> list[str]:
    """A version in the layer groups `sync.apply_prefetched` hands an applier."""
    applier.check(v, specs(tensors))
    if prepare:
        applier.prepare(v, tensors)
    applier.begin_update(v, specs(tensors))
    try:
        for group in layer_groups(tensors):
            applier.apply([(name, tensors[name]) for name in group])
    except Exception:
        applier.abort_update()
        raise
    return applier.commit_update(v)


def assert_holds(tree: dict[str, Any], applier: JaxApplier, tensors: dict[str, np.ndarray]) -> None:
    plans = applier._plan({n: (a.shape, "bfloat16") for n, a in tensors.items()})
    for path, plan in plans.items():
        got = np.asarray(tree[path])
        assert np.array_equal(got.view(np.uint16), reference_leaf(plan, tensors).view(np.uint16)), path


@pytest.mark.parametrize("transfer", ["host", "device"])
def test_a_swap_builds_aside_then_swaps_once_and_reads_back_bit_exact(transfer: str) -> None:
    holder = WeightsHolder(leaves())
    refreshed: list[Any] = []
    applier = JaxApplier(
        holder, NAME_MAP, mode="swap", transfer=transfer, refresh=lambda: refreshed.append(holder.get())
    )
    before = holder.get()
    v1 = version(1)
    names = apply(applier, 1, v1)
    assert sorted(names) == sorted(v1)
    after = holder.get()
    assert after is not before and len(refreshed) == 1 and refreshed[0] is after  # refreshed after the swap
    assert all(not a.is_deleted() for a in before.values())  # a reader of the old tree still has it
    assert_holds(after, applier, v1)
    for path, arr in after.items():
        assert arr.sharding == before[path].sharding
    r = applier.last_report()
    assert r is not None and r.mode == "swap" and r.leaves == len(before) and r.pause_seconds is not None
    assert r.pause_seconds <= r.swap_seconds + r.refresh_seconds + 0.05
    assert r.transfer in ("host", "device", "device+host") and r.bytes == sum(a.nbytes for a in after.values())
    v2 = version(2)  # a second version over the first
    apply(applier, 2, v2, prepare=False)
    assert_holds(holder.get(), applier, v2)
    applier.close()


def test_in_place_writes_leaf_by_leaf_into_the_callers_own_tree_and_frees_each_old_leaf() -> None:
    tree = leaves()
    old = dict(tree)
    applier = JaxApplier(tree, NAME_MAP, mode="inplace")  # a plain dict: written in place
    v1 = version(3)
    apply(applier, 1, v1)
    assert_holds(tree, applier, v1)
    assert all(old[p].is_deleted() for p in tree)  # each buffer freed (or donated) as its leaf was replaced
    r = applier.last_report()
    assert r is not None and r.mode == "inplace" and r.pause_seconds is not None
    assert r.pause_seconds >= r.build_seconds  # the engine waits for the whole apply in place
    applier.close()


@pytest.mark.parametrize("layout", ["tpu_inference", "hf"])
@pytest.mark.parametrize(("mode", "transfer"), [("swap", "host"), ("swap", "device"), ("inplace", "host")])
def test_the_applied_leaves_own_their_memory_when_the_pulled_bytes_are_overwritten(
    layout: str, mode: str, transfer: str
) -> None:
    """A CPU device keeps an aligned, contiguous host array as its own buffer, whatever
    device_put's may_alias says (jax#37830): the engine would then serve whatever the next
    pull writes into the receive buffer. Every leaf must hold its own copy."""
    name_map = family_map("qwen3", layout, TINY)
    devs = jax.devices()
    holder = WeightsHolder(empty_leaves(name_map, TINY, TINY.layers, TINY.tied, mesh_of((1, len(devs)), devs),
                                        PROFILES["tpu_inference"]))  # fmt: skip
    applier = JaxApplier(holder, name_map, mode=mode, transfer=transfer)
    v1 = version(11)
    buf, views = as_received(v1)
    apply(applier, 1, views)
    buf[:] = 0xFF  # the next pull lands in the same buffer
    assert_holds(holder.get(), applier, v1)
    applier.close()


@pytest.mark.parametrize("fingerprint", ["auto", "jit"])
@pytest.mark.parametrize("mode", ["swap", "inplace"])
def test_a_bit_flipped_after_the_host_check_is_caught_and_never_serves(mode: str, fingerprint: str) -> None:
    holder = WeightsHolder(leaves())
    applier = JaxApplier(holder, NAME_MAP, mode=mode, fingerprint=fingerprint)
    v1, v2 = version(4), version(5)
    apply(applier, 1, v1)
    served = holder.get()
    # the host fingerprints are taken from the verified bytes; then a bit of the host copy flips
    applier.prepare(2, v2)
    bad = {n: a.copy() for n, a in v2.items()}
    name = "model.layers.1.mlp.down_proj.weight"
    bad[name].reshape(-1).view(np.uint8)[7] ^= 0x04
    applier.begin_update(2, specs(bad))
    for group in layer_groups(bad):
        applier.apply([(n, bad[n]) for n in group])
    with pytest.raises(DataLoss, match="leaf 'model.layers.1.mlp.down_proj.weight' on the device does not match"):
        applier.commit_update(2)
    if mode == "swap":
        assert holder.get() is served and all(not a.is_deleted() for a in served.values())
        assert_holds(served, applier, v1)
        assert not applier.torn
    else:
        assert applier.torn  # in place there is no old copy left to serve: the next version repairs it
    assert applier.last_report() is not None and applier.last_report().version == 1  # type: ignore[union-attr]
    apply(applier, 3, v2)
    assert_holds(holder.get(), applier, v2)
    assert not applier.torn
    applier.close()


@pytest.mark.parametrize(("transfer", "fingerprint"), [("host", "auto"), ("device", "auto"), ("device", "jit"),
                                                      ("auto", "jit")])  # fmt: skip
def test_bits_damaged_on_their_way_to_the_device_never_serve(transfer: str, fingerprint: str) -> None:
    """Swap refuses the version and the old leaves serve on; in place (no old copy left)
    the damaged leaf is built again from the verified host bytes, checked again, and the
    version then serves whole. (jit: checked a layer's group at a time.)"""
    holder = WeightsHolder(leaves())
    fire = iter([True, False])
    applier = JaxApplier(holder, NAME_MAP, mode="swap", transfer=transfer, fingerprint=fingerprint,
                         corrupt_next=lambda: next(fire))  # fmt: skip
    served = holder.get()
    with pytest.raises(DataLoss, match="does not match the verified bytes"):
        apply(applier, 1, version(6))
    assert holder.get() is served
    apply(applier, 2, version(6))
    assert_holds(holder.get(), applier, version(6))

    applier = JaxApplier(holder, NAME_MAP, mode="inplace", transfer=transfer, fingerprint=fingerprint,
                         corrupt_next=lambda: True)  # fmt: skip
    apply(applier, 3, version(8))
    assert_holds(holder.get(), applier, version(8))
    report = applier.last_report()
    assert report is not None and report.version == 3 and len(report.repaired_leaves) == 1
    assert not applier.torn
    applier.close()


@pytest.mark.parametrize("mode", ["swap", "inplace"])
@pytest.mark.parametrize("transfer", ["auto", "device"])
def test_a_layer_goes_over_in_one_transfer_call_and_one_program(mode: str, transfer: str) -> None:
    """Leaves checked by a jitted fingerprint go over a group at a time: one group per
    layer, one for the leaves outside the layers (as sync hands them), read back bit for
    bit; in place each old leaf is donated to its group's program or freed once the
    group stands. The same version applied leaf by leaf (group=False) agrees."""
    tree = leaves()
    old = dict(tree)
    applier = JaxApplier(tree, NAME_MAP, mode=mode, transfer=transfer, fingerprint="jit")
    v1 = version(12)
    apply(applier, 1, v1)
    assert_holds(tree, applier, v1)
    r = applier.last_report()
    assert r is not None and r.mode == mode and r.fingerprint == "jit"
    assert r.groups == TINY.layers + 1 and r.leaves == len(tree)
    assert 0 <= r.wait_seconds <= r.build_seconds
    assert ("device" in r.transfer) == (transfer == "device")
    if mode == "inplace":
        assert all(old[p].is_deleted() and not tree[p].is_deleted() for p in tree)
    else:
        assert not any(old[p].is_deleted() for p in tree)  # a swap target's readers keep the old tree
    v2 = version(13)
    apply(applier, 2, v2)
    assert_holds(tree, applier, v2)
    applier.close()

    by_leaf = JaxApplier(WeightsHolder(leaves()), NAME_MAP, mode=mode, transfer=transfer, fingerprint="jit",
                         group=False)  # fmt: skip
    apply(by_leaf, 1, v1)
    assert_holds(by_leaf.target.get(), by_leaf, v1)  # type: ignore[attr-defined]
    assert by_leaf.last_report().groups == 0  # type: ignore[union-attr]
    by_leaf.close()


def test_jit_and_view_fingerprints_and_both_transfers_agree() -> None:
    v1 = version(7)
    reports = []
    for transfer in ("host", "device"):
        for fingerprint in ("jit", "view"):
            holder = WeightsHolder(leaves())
            applier = JaxApplier(holder, NAME_MAP, transfer=transfer, fingerprint=fingerprint)
            apply(applier, 1, v1, prepare=False)
            assert_holds(holder.get(), applier, v1)
            reports.append(applier.last_report())
    assert {r.fingerprint for r in reports if r} == {"jit", "view"}


def test_a_version_that_does_not_fit_the_engine_is_refused_before_a_byte_moves() -> None:
    holder = WeightsHolder(leaves())
    applier = JaxApplier(holder, NAME_MAP)
    v1 = version(8)
    wrong = {**specs(v1), "model.layers.0.mlp.up_proj.weight": TensorSpec("model.layers.0.mlp.up_proj.weight",
                                                                           "bfloat16", (64, 64))}  # fmt: skip
    with pytest.raises(InvalidArgument, match="manifest.tensors"):
        applier.check(1, wrong)
    missing = {n: s for n, s in specs(v1).items() if "lm_head" not in n}
    with pytest.raises(InvalidArgument, match="writes the engine's leaf 'lm_head.weight'"):
        applier.begin_update(1, missing)
    with pytest.raises(InvalidArgument, match="mode"):
        JaxApplier(holder, NAME_MAP, mode="twice")


@jax.tree_util.register_pytree_with_keys_class
@dataclass
class Variable:
    """A variable holding its array in `.value` (as Flax NNX's do): a pytree node."""

    value: Any

    def tree_flatten_with_keys(self) -> tuple[Any, None]:
        return ((jax.tree_util.GetAttrKey("value"), self.value),), None

    @classmethod
    def tree_unflatten(cls, aux: None, children: Any) -> Variable:
        return cls(*children)


def _nested(flat: dict[str, Any]) -> dict[str, Any]:
    """model.layers.0.x.weight -> {'model': {'layers': [{...}]}} with Variables as leaves."""
    root: dict[str, Any] = {}
    for path, arr in flat.items():
        node = root
        keys = path.split(".")
        for i, k in enumerate(keys[:-1]):
            if keys[i + 1].isdigit():
                node = node.setdefault(k, [])
            elif isinstance(node, list):
                while len(node) <= int(k):
                    node.append({})
                node = node[int(k)]
            else:
                node = node.setdefault(k, {})
        node[keys[-1]] = Variable(arr)
    return root


def test_variables_in_nested_dicts_and_lists_are_written_through_their_value() -> None:
    tree = _nested(leaves())
    applier = JaxApplier(InPlaceTree(tree), NAME_MAP)
    v1 = version(9)
    apply(applier, 1, v1)
    q = tree["model"]["layers"][1]["self_attn"]["q_proj"]["weight"]
    assert isinstance(q, Variable)
    flat = {n: leaf for n, leaf in InPlaceTree(tree).leaves().items()}
    assert "model.layers.1.self_attn.q_proj.weight" in flat  # the trailing .value is dropped
    assert_holds(flat, applier, v1)


def test_a_callback_target_gets_every_new_leaf_in_one_call() -> None:
    state = {"tree": leaves()}
    calls: list[int] = []

    def replace(new: Any) -> None:
        calls.append(len(new))
        state["tree"] = {**state["tree"], **new}

    applier = JaxApplier(CallbackTarget(lambda: state["tree"], replace), NAME_MAP, mode="swap")
    apply(applier, 1, version(10))
    assert calls == [len(state["tree"])]
    assert_holds(state["tree"], applier, version(10))


def test_a_tuple_cannot_be_written_in_place_and_says_what_to_use() -> None:
    tree = {"a": (jax.numpy.zeros(2),)}
    with pytest.raises(InvalidArgument, match="cannot set a leaf of a tuple in place.*WeightsHolder"):
        InPlaceTree(tree).replace({"a.0": jax.numpy.ones(2)})
    assert WeightsHolder(tree).leaves().keys() == {"a.0"}


@pytest.mark.tpu
def test_on_the_chip_auto_mode_reports_the_memory_peak_and_catches_a_flipped_bit() -> None:
    holder = WeightsHolder(leaves())
    applier = JaxApplier(holder, NAME_MAP)  # auto: the chip has memory stats
    v1 = version(11)
    apply(applier, 1, v1)
    r = applier.last_report()
    assert r is not None and r.mode == "swap" and r.hbm_peak_bytes and r.hbm_limit_bytes
    assert r.transfer.startswith("device") and r.fingerprint == "jit"
    assert_holds(holder.get(), applier, v1)
    served = holder.get()
    applier.corrupt_next = lambda: True
    with pytest.raises(DataLoss):
        apply(applier, 2, version(12))
    assert holder.get() is served
    applier.corrupt_next = None
    inplace = JaxApplier(holder, NAME_MAP, mode="inplace")
    apply(inplace, 3, version(12))
    assert_holds(holder.get(), inplace, version(12))


def test_host_bytes_counts_the_new_leaves_a_cpu_engine_builds_in_host_memory() -> None:
    """On CPU devices the leaves are host memory: a swap builds every new leaf aside the
    old ones, in place one leaf at a time. A dict engine allocates only arrays it lacks."""
    v1 = version(14)
    tree = leaves()
    swap = JaxApplier(WeightsHolder(tree), NAME_MAP, mode="swap")
    inplace = JaxApplier(WeightsHolder(tree), NAME_MAP, mode="inplace")
    assert swap.host_bytes(specs(v1)) == sum(a.nbytes for a in tree.values())
    assert inplace.host_bytes(specs(v1)) == max(a.nbytes for a in tree.values())
    engine = DictApplier()
    assert engine.host_bytes(specs(v1)) == sum(a.nbytes for a in v1.values())
    engine.begin_update(1, specs(v1))
    engine.apply(list(v1.items()))
    engine.commit_update(1)
    assert engine.host_bytes(specs(version(15))) == 0  # overwritten in place
