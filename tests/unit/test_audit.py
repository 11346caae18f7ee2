"""The audit of served weights in one process: NumPy and JAX appliers read back exact
after an apply, name every tensor whose live copy was damaged (one bit, or the whole
tensor) and nothing else, see an aborted round as not the last whole version; an audit
never overlaps an apply; the Auditor's schedule, heal hooks and heal limit; the
coordinator's board of reported audits. Real processes: tests/integration/test_audit.py."""

from __future__ import annotations

import threading
import time
from typing import Any

import jax
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.audit import AuditBoard, check_audit
from coordinator.records import AgentRecord
from rollout_agent.audit.audited import Audited
from rollout_agent.audit.auditor import HEAL_LIMIT, MAX_SHARE, Auditor
from rollout_agent.engines.applier import layer_groups
from rollout_agent.engines.audit_reading import damage, fingerprint
from rollout_agent.engines.dict_applier import DictApplier
from rollout_agent.engines.jax.applier import JaxApplier
from rollout_agent.engines.jax.audit import damaged_on_device
from rollout_agent.engines.jax.model import PROFILES, empty_leaves, family_map, mesh_of
from rollout_agent.engines.jax.targets import WeightsHolder
from tests.unit.test_jax_applier import TINY, specs, version
from weightsync._proto import types_pb2 as tpb
from weightsync.errors import InvalidArgument
from weightsync.failpoints import Failpoints
from weightsync.manifest import Endpoint
from weightsync.metrics import build_metrics


def apply(applier: Audited, v: int, tensors: dict[str, np.ndarray]) -> None:
    applier.check(v, specs(tensors))
    applier.prepare(v, tensors)
    applier.begin_update(v, specs(tensors))
    try:
        for group in layer_groups(tensors):
            applier.apply([(n, tensors[n]) for n in group])
    except Exception:
        applier.abort_update()
        raise
    applier.commit_update(v)


def jax_applier(mode: str, fingerprint: str = "auto", refresh: Any = None) -> tuple[Audited, WeightsHolder]:
    name_map = family_map("qwen3", "tpu_inference", TINY)
    devs = jax.devices()
    holder = WeightsHolder(
        empty_leaves(name_map, TINY, TINY.layers, TINY.tied, mesh_of((1, len(devs)), devs), PROFILES["tpu_inference"])
    )
    return Audited(JaxApplier(holder, name_map, mode=mode, fingerprint=fingerprint, refresh=refresh)), holder


def appliers() -> list[Any]:
    return [
        lambda: Audited(DictApplier()),
        lambda: jax_applier("swap")[0],
        lambda: jax_applier("inplace")[0],
        lambda: jax_applier("swap", fingerprint="jit")[0],  # the accelerators' programs, on the CPU
    ]


@pytest.mark.parametrize("make", appliers(), ids=["numpy", "jax-swap", "jax-inplace", "jax-jit"])
def test_an_applied_version_audits_exact_and_each_damaged_tensor_is_named(make: Any) -> None:
    audited = make()
    before = audited.audit()
    assert before.version == 0 and before.exact and before.compared == 0  # nothing applied yet
    v1 = version(1)
    apply(audited, 1, v1)
    clean = audited.audit()
    assert (clean.version, clean.compared, clean.mismatched) == (1, len(v1), {})
    assert audited.audit() == clean  # audits change nothing
    flipped = audited.inner.inject("flip")
    assert flipped == min(v1)
    assert set(audited.audit().mismatched) == {flipped}
    overwritten = audited.inner.inject("overwrite")
    assert overwritten == max(v1)
    assert set(audited.audit().mismatched) == {flipped, overwritten}
    apply(audited, 2, version(2))  # a whole version applied again: exact
    assert audited.audit().exact and audited.audit().version == 2


def test_a_round_aborted_part_way_is_not_the_last_whole_version() -> None:
    audited = Audited(DictApplier())
    v1, v2 = version(1), version(2)
    apply(audited, 1, v1)
    groups = layer_groups(v2)
    audited.begin_update(2, specs(v2))
    audited.apply([(n, v2[n]) for n in groups[0]])  # the engine took part of version 2, then failed
    audited.abort_update()
    found = audited.audit()
    assert found.version == 1 and set(found.mismatched) == set(groups[0])


def test_a_leaf_another_loader_replaced_on_the_device_is_named() -> None:
    audited, holder = jax_applier("swap")
    apply(audited, 1, version(1))
    path = "model.layers.0.mlp.down_proj.weight"  # the leaf (its layout: transposed)
    leaves = dict(holder.get())
    assert path in leaves, sorted(leaves)
    holder.replace({path: damaged_on_device(leaves[path], "flip")})
    (name,) = audited.audit().mismatched
    assert name == "model.layers.0.mlp.down_proj.weight"


def test_an_audit_waits_for_an_apply_in_progress_and_an_apply_for_an_audit() -> None:
    audited = Audited(DictApplier())
    apply(audited, 1, version(1))
    v2 = version(2)
    audited.begin_update(2, specs(v2))
    got: list[Any] = []
    t = threading.Thread(target=lambda: got.append(audited.audit()))
    t.start()
    for group in layer_groups(v2):
        audited.apply([(n, v2[n]) for n in group])
        time.sleep(0.01)
        assert not got  # no audit sees a version half applied
    audited.commit_update(2)
    t.join(5)
    assert got[0].version == 2 and got[0].exact


def test_audits_beside_versions_staged_aside_and_committed_are_all_exact() -> None:
    """A JAX engine that swaps: each version is built aside while audits go on (the live
    leaves untouched), and only its commit takes the audit lock; no audit sees a mix."""
    # an engine's refresh between the swap and the commit's end: a window an audit must not see
    audited, _ = jax_applier("swap", refresh=lambda: time.sleep(0.005))
    versions = [version(s) for s in range(4)]
    apply(audited, 1, versions[0])
    found: list[Any] = []
    done = threading.Event()

    def audits() -> None:
        while not done.is_set():
            found.append(audited.audit())

    t = threading.Thread(target=audits)
    t.start()
    try:
        for v in range(2, 22):
            tensors = versions[v % len(versions)]
            audited.prepare(v, tensors)
            groups = [[(n, tensors[n]) for n in g] for g in layer_groups(tensors)]
            assert audited.stage(v, specs(tensors), groups)
            audited.commit_update(v)
    finally:
        done.set()
        t.join(10)
    assert len(found) > 20 and all(f.exact for f in found), [f.mismatched for f in found if not f.exact][:2]
    assert len({f.version for f in found}) > 5  # they interleaved with the commits


def test_a_failpoint_damages_the_live_weights_right_after_an_apply() -> None:
    audited = Audited(DictApplier(), Failpoints("audit.flip_live_bit=1,audit.overwrite_tensor=1"))
    v1 = version(1)
    apply(audited, 1, v1)
    assert set(audited.audit().mismatched) == {min(v1), max(v1)}
    apply(audited, 1, v1)  # spent: the re-apply holds
    assert audited.audit().exact


@settings(max_examples=60, deadline=None)
@given(
    dtype=st.sampled_from(["float32", "bfloat16", "float16", "int8", "float64", "bool"]),
    shape=st.lists(st.integers(1, 7), min_size=0, max_size=3),
    seed=st.integers(0, 2**32 - 1),
)
def test_any_single_bit_flipped_anywhere_changes_the_fingerprint(dtype: str, shape: list[int], seed: int) -> None:
    rng = np.random.default_rng(seed)
    a = rng.integers(0, 256, size=int(np.prod(shape)) * np.dtype(_np(dtype)).itemsize, dtype=np.uint8)
    a = a.view(_np(dtype)).reshape(shape)
    b = a.copy()
    byte = int(rng.integers(b.nbytes))
    b.reshape(-1).view(np.uint8)[byte] ^= np.uint8(1 << int(rng.integers(8)))
    assert fingerprint(a) == fingerprint(a.copy())
    assert fingerprint(a) != fingerprint(b)


def _np(dtype: str) -> Any:
    return ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)


def test_damage_flips_one_bit_or_overwrites_every_byte() -> None:
    a = np.zeros(16, np.uint8)
    damage(a, "flip")
    assert np.count_nonzero(a) == 1 and a[8] == 0x10
    damage(a, "overwrite")
    assert (a == 0x3C).all()


class _Engine:
    """An Audited DictApplier holding version 1, for the Auditor's tests."""

    def __init__(self) -> None:
        self.audited = Audited(DictApplier())
        self.v1 = version(1)
        apply(self.audited, 1, self.v1)


def test_a_mismatch_marks_the_version_unserved_calls_the_hooks_and_an_exact_audit_after_the_heal_clears_it() -> None:
    e = _Engine()
    metrics = build_metrics("rollout")
    auditor = Auditor(e.audited, session="s", metrics=metrics).start()
    healed: list[int] = []
    auditor.on_mismatch.append(healed.append)
    try:
        assert auditor.audit().exact and auditor.unserved == 0
        e.audited.inner.inject("flip")
        found = auditor.audit()
        assert not found.exact and found.unserved_version == 1 and [m.tensor for m in found.mismatches] == [min(e.v1)]
        assert healed == [1] and auditor.unserved == 1
        apply(e.audited, 1, e.v1)  # the heal: after its commit the auditor audits again by itself
        deadline = time.monotonic() + 10
        while auditor.unserved and time.monotonic() < deadline:
            time.sleep(0.01)
        summary = auditor.summary()
        assert summary is not None and summary.exact and summary.unserved_version == 0 and summary.heals == 1
        assert summary.audits == 3
    finally:
        auditor.stop()
    text = metrics.registry.get_sample_value(
        "weightsync_audit_mismatches_total", {"role": "rollout", "session": "s", "tensor": min(e.v1)}
    )
    assert text == 1
    assert metrics.registry.get_sample_value(
        "weightsync_audits_total", {"role": "rollout", "session": "s", "result": "exact"}
    ) == 2  # fmt: skip
    assert metrics.registry.get_sample_value("weightsync_audit_age_seconds", {"role": "rollout", "session": "s"}) >= 0


def test_after_heal_limit_re_applies_that_did_not_hold_the_hooks_are_not_called_again() -> None:
    e = _Engine()
    auditor = Auditor(e.audited, session="s")
    healed: list[int] = []
    auditor.on_mismatch.append(healed.append)
    e.audited.inner.inject("flip")
    for _ in range(HEAL_LIMIT + 2):
        assert not auditor.audit().exact
    assert healed == [1] * HEAL_LIMIT and auditor.unserved == 1


def test_periodic_audits_keep_to_the_interval_and_to_their_share_of_the_time() -> None:
    e = _Engine()
    auditor = Auditor(e.audited, session="s", interval_s=0.05)
    assert 0 < auditor._due_in() <= 0.05
    auditor.start()
    try:
        time.sleep(1.0)
        n = auditor.audits
        assert 2 <= n <= 21, n
        summary = auditor.summary()
        assert summary is not None and summary.exact
        # an audit that took 1 s is not followed by another for 1 / MAX_SHARE s
        auditor._last.seconds = 1.0  # type: ignore[union-attr]
        assert auditor._due_in() > 1 / MAX_SHARE - 1
    finally:
        auditor.stop()


def test_a_coordinator_request_is_audited_once_and_answered_with_its_number() -> None:
    e = _Engine()
    auditor = Auditor(e.audited, session="s").start()  # no periodic audits
    try:
        for _ in range(3):  # every beat answer repeats the request
            auditor.requested(77)
        deadline = time.monotonic() + 10
        while auditor.audits < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.1)
        summary = auditor.summary()
        assert auditor.audits == 1 and summary is not None and summary.request_seq == 77
    finally:
        auditor.stop()


def _rollout(agent_id: str, version: int = 3) -> AgentRecord:
    return AgentRecord(agent_id, "ROLLOUT", Endpoint("", ("grpc",), "h"), 0, time.time() + 10, version, True)


def test_the_board_keeps_each_rollouts_last_audit_aged_and_knows_who_answered_a_request() -> None:
    board = AuditBoard()
    seq = board.request("s")
    assert board.requested("s") == seq and board.request("s") == seq + 1
    seq += 1
    board.note("s", "r1", tpb.AuditResult(version=3, exact=True, request_seq=seq, age_seconds=1.0))
    board.note("s", "gone", tpb.AuditResult(version=3, exact=True))
    assert not board.answered("s", ["r1", "r2"], seq)
    board.note("s", "r2", tpb.AuditResult(version=3, exact=False, mismatch_count=1, request_seq=seq))
    assert board.answered("s", ["r1", "r2"], seq)
    rows = board.rows("s", [_rollout("r2"), _rollout("r1"), _rollout("r3")], seq)
    assert [r.agent_id for r in rows] == ["r1", "r2", "r3"]
    assert rows[0].answered and rows[0].audit.age_seconds >= 1.0 and not rows[2].HasField("audit")
    assert not rows[1].audit.exact
    assert board.rows("s", [_rollout("gone")]) and len(board.rows("s", [])) == 0
    assert not board.rows("s", [_rollout("gone")])[0].HasField("audit")  # forgotten when it left


@pytest.mark.parametrize(
    ("audit", "field"),
    [
        (tpb.AuditResult(mismatches=[tpb.AuditMismatch(tensor="t")] * 65), "audit.mismatches"),
        (tpb.AuditResult(mismatches=[tpb.AuditMismatch(tensor="t" * 5000)]), "audit.mismatches"),
        (tpb.AuditResult(method="m" * 65), "audit.method"),
        (tpb.AuditResult(seconds=float("nan")), "audit.seconds"),
        (tpb.AuditResult(age_seconds=-1.0), "audit.age_seconds"),
    ],
)
def test_a_reported_audit_out_of_bounds_is_refused_naming_the_field(audit: tpb.AuditResult, field: str) -> None:
    with pytest.raises(InvalidArgument) as e:
        check_audit(audit)
    assert e.value.field == field


@settings(max_examples=40, deadline=None)
@given(
    dtype=st.sampled_from(["float32", "bfloat16", "float16", "int8", "float64", "uint8"]),
    shape=st.lists(st.integers(0, 6), min_size=0, max_size=3),
    rows_per_step=st.integers(0, 3),
    seed=st.integers(0, 2**32 - 1),
)
def test_torchs_fingerprint_where_a_tensor_lives_equals_numpys(
    dtype: str, shape: list[int], rows_per_step: int, seed: int
) -> None:
    """What a vLLM audit computes on an accelerator (torch's integer sums, a few rows at a
    time) is the host's fingerprint of the same bits."""
    torch = pytest.importorskip("torch")
    from rollout_agent.engines.vllm.audit import _bits, torch_fingerprint

    rng = np.random.default_rng(seed)
    t = torch.from_numpy(np.asarray(rng.standard_normal(shape) * 100, np.float64)).to(getattr(torch, dtype))
    assert torch_fingerprint(t, rows_per_step) == fingerprint(_bits(t.contiguous()))


@settings(max_examples=40, deadline=None)
@given(
    dtype=st.sampled_from(["float32", "bfloat16", "float16"]),
    shape=st.lists(st.integers(0, 6), min_size=0, max_size=3),
    special=st.sampled_from([0.0, -0.0, 1e-45, -1e-40, 6e-8, float("nan"), float("inf")]),
    seed=st.integers(0, 2**32 - 1),
)
def test_a_kernels_reference_from_the_bits_equals_torchs_canonical_copy(
    dtype: str, shape: list[int], special: float, seed: int
) -> None:
    """The one-pass reference of a kernel region (exponent bits: zeros and subnormals as +0,
    NaN and infinity counted) is the fingerprint of torch's canonical copy, and names the
    tensors torch finds non-finite."""
    torch = pytest.importorskip("torch")
    from rollout_agent.engines.fingerprint import canonical_fingerprint
    from rollout_agent.engines.vllm.audit import _bits, _canonical, _exponent_mask, _fingerprint

    rng = np.random.default_rng(seed)
    values = np.asarray(rng.standard_normal(shape) * 100, np.float64)
    values.reshape(-1)[: values.size // 2] = special
    t = torch.from_numpy(values).to(getattr(torch, dtype))
    want = fingerprint(_bits(_canonical(t).contiguous()))
    got, nonfinite = canonical_fingerprint(_bits(t.contiguous()), _exponent_mask(t.dtype))
    assert got == want == _fingerprint(t, True)
    assert nonfinite == int((~torch.isfinite(t)).sum())
