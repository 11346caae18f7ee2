"""bench/compare.py: blocks from the transfer bench's JSON, each of this tree's blocks paired
with the REF block before it, median paired ratios per mode and role, the verdict; the
reference clone with its native shim."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import compare  # noqa: E402

from tests.unit.test_doc_references import no_history_here  # noqa: E402


def row(mode: str, seconds: float, cpu: float, n: int = 1, method: str = "weightsync", gloo: float = 0.0) -> dict:
    return {
        "method": method,
        "mode": mode,
        "rollouts": n,
        "seconds": seconds,
        "cpu_seconds": cpu,
        "cpu_roles": {"trainer": cpu / 2, "rollouts": cpu / 2},
        "paired_ratio_to_gloo": gloo,
        "paired_rounds": 5 if gloo else 0,
    }


def test_a_block_holds_the_weightsync_rows_at_the_asked_n() -> None:
    rows = [row("shm", 0.5, 0.8, gloo=1.1), row("shm", 0.9, 1.5, n=2), row("tcp", 0.4, 0.4, method="gloo")]
    b = compare.block_from_rows("ref", rows, 1)
    assert (b.wall, b.cpu, b.gloo) == ({"shm": 0.5}, {"shm": 0.8}, {"shm": 1.1})
    assert b.roles == {"shm": {"trainer": 0.4, "rollouts": 0.4}}


def block(tree: str, wall: float, cpu: float) -> compare.Block:
    return compare.block_from_rows(tree, [row("shm", wall, cpu, gloo=wall / 0.5)], 1)


def test_each_block_of_this_tree_pairs_with_the_ref_block_before_it() -> None:
    blocks = [block("ref", 1.0, 1.0), block("this", 1.2, 1.1), block("ref", 2.0, 1.0), block("this", 2.2, 1.3)]
    pairs = compare.paired(blocks)
    assert [(a.wall["shm"], b.wall["shm"]) for a, b in pairs] == [(1.0, 1.2), (2.0, 2.2)]
    r = compare.ratios(pairs, "shm")
    # drift doubled the second pair's seconds: the paired ratios do not see it
    assert r["wall"] == pytest.approx((1.2 + 1.1) / 2)
    assert r["cpu"] == pytest.approx((1.1 + 1.3) / 2)
    assert r["cpu_trainer"] == pytest.approx(r["cpu"]) and r["vs_gloo"] == pytest.approx(r["wall"])
    assert compare.ratios(pairs, "tcp") == {}  # a mode neither ran


def test_the_verdict_names_each_judged_ratio_over_the_threshold() -> None:
    by_mode = {"shm": {"wall": 1.25, "cpu": 1.05}, "tcp": {"wall": 1.02, "cpu": 1.11}}
    assert compare.verdicts(by_mode, ["cpu", "wall"], 0.10) == [
        "shm: wall 1.250x REF (more than 10% slower)",
        "tcp: cpu 1.110x REF (more than 10% slower)",
    ]
    assert compare.verdicts(by_mode, ["cpu"], 0.15) == []


def test_the_reference_is_a_clone_at_ref_with_a_native_shim(tmp_path: Path) -> None:
    if compare.native_lib(compare.ROOT) is None:
        pytest.skip("this tree's native shim is not built")
    if why := no_history_here():
        pytest.skip(f"no history to clone a reference from: {why}")
    head = compare.git("rev-parse", "HEAD")
    native_same = not compare.git("diff", "--name-only", head, "--", "native/")
    if not native_same:
        pytest.skip("native/ differs from HEAD in this tree: the clone would build it (minutes)")
    tree = compare.make_reference("HEAD", tmp_path)
    assert subprocess.run(["git", "rev-parse", "HEAD"], cwd=tree, capture_output=True, text=True).stdout.strip() == head
    assert compare.native_lib(tree) is not None
    assert compare.make_reference("HEAD", tmp_path) == tree  # kept and reused
