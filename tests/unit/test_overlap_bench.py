"""bench/train_overlap.py's phase settings and stall traces (overlap_publishers.py,
overlap_phases.py), its JSON's keys, and bench/stall_dumper.py, with the real interpreter
(no model is trained here, but for the keys and the block trace)."""

from __future__ import annotations

import ctypes
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import overlap_phases  # noqa: E402
import overlap_publishers  # noqa: E402
import overlap_report  # noqa: E402
import stall_dumper  # noqa: E402

from weightsync.host_memory import faults_counted  # noqa: E402

BASE = overlap_publishers.Variant(1 << 30, 18 << 20, 0, 10)
_PR_SET_NAME = 15


def test_a_variant_names_what_it_changes_and_refuses_unknown_keys_and_values() -> None:
    v = overlap_publishers.parse_variant("block=8M,malloc=held,release=thread,requests=lazy", BASE)
    assert (v.block_bytes, v.malloc, v.release, v.window_bytes) == (8 << 20, "held", "thread", 1 << 30)
    assert v.label() == "window=1024M,block=8M,threads=0,nice=10,malloc=held,release=thread,requests=lazy"
    assert BASE.label() == "window=1024M,block=18M,threads=0,nice=10"
    with pytest.raises(SystemExit, match="malloc='kept'"):
        overlap_publishers.parse_variant("malloc=kept", BASE)
    with pytest.raises(SystemExit, match="unknown key 'heap'"):
        overlap_publishers.parse_variant("heap=held", BASE)


def test_a_stall_past_the_threshold_leaves_every_threads_stack_and_a_quick_iteration_none(tmp_path: Path) -> None:
    path = tmp_path / "stalls.txt"
    traces = overlap_phases.StallTraces(str(path), threshold_ms=50)
    traces.label = "phase"
    try:
        traces.arm(0)
        traces.disarm()  # well within 50 ms: nothing dumped
        traces.arm(1)
        time.sleep(0.3)
        traces.disarm()
    finally:
        traces.close()
    text = path.read_text()
    assert "== phase iteration 0" in text and "== phase iteration 1" in text
    quick, slow = text.split("== phase iteration 1")
    assert "Timeout" not in quick
    assert slow.count("Timeout") == 1  # once per iteration, not repeated
    assert "test_a_stall_past_the_threshold" in slow  # the sleeping thread's own frame


def _py_spy_or_skip() -> None:
    try:
        spy = stall_dumper.py_spy()
    except SystemExit:
        pytest.skip("no py-spy here (make setup installs it)")
    probe = subprocess.run([spy, "dump", "--pid", str(os.getpid())], capture_output=True, text=True, timeout=60)
    if probe.returncode != 0:
        pytest.skip(f"py-spy may not trace processes here: {probe.stderr.strip()[:200]}")


def test_a_stall_gets_one_native_dump_naming_the_thread_that_holds_the_interpreter(tmp_path: Path) -> None:
    _py_spy_or_skip()
    out = tmp_path / "stalls.native"

    def spin() -> None:  # pure Python: holds the interpreter lock but at switch points
        ctypes.CDLL(None).prctl(_PR_SET_NAME, b"the-spinner", 0, 0, 0)  # its name in /proc
        end = time.monotonic() + 1.5
        while time.monotonic() < end:
            sum(range(1000))

    with stall_dumper.StallDumper(str(out), threshold_ms=100) as dumper:
        dumper.arm(0)
        dumper.disarm()  # quick: no dump
        dumper.arm(1)
        spinner = threading.Thread(target=spin, name="the-spinner")
        spinner.start()
        spinner.join()
        dumper.disarm()
    text = out.read_text()
    stalls = re.findall(r"== iteration (\d+), (\d+) ms in", text)
    assert 1 <= len(stalls) <= 3 and {i for i, _ in stalls} == {"1"}  # a few dumps, all of the stall
    assert all(int(b) - int(a) >= 150 for (_, a), (_, b) in zip(stalls, stalls[1:]))  # spaced
    assert '(active+gil): "the-spinner"' in text  # the thread holding the lock, marked
    assert "spin (" in text  # and its frame, by name
    busy = re.search(r"threads busy over 50 ms \(\d+ threads\):\n((?:  .*\n)+)", text)
    assert busy and "the-spinner" in busy.group(1).splitlines()[0]  # the busiest thread, named


def test_thread_cpu_names_each_thread_of_a_process_with_its_state_and_time() -> None:
    threads = stall_dumper.thread_cpu(os.getpid())
    name, state, ticks = threads[os.getpid()]  # the main thread's id is the process's
    assert state in "RSDI" and ticks > 0 and name


def test_repeated_phases_of_an_abab_comparison_get_labels_of_their_own() -> None:
    lazy = overlap_publishers.parse_variant("requests=lazy", BASE)
    first = overlap_publishers.parse_variant("requests=first", BASE)
    labels = overlap_publishers.phase_labels([BASE, lazy, first, lazy])
    assert labels == [BASE.label(), lazy.label(), BASE.label() + " #2", lazy.label() + " #2"]


class _Client:
    """The client's raw PublishVersion call as the timeline wraps it."""

    def _publish_bytes(self, requests: object, timeout: float, metadata: object) -> str:
        time.sleep(0.01)
        return "answer"


class _Steps:
    """A publisher's two steps as the timeline wraps them (no publisher behind); the send
    makes its call through the client."""

    def __init__(self) -> None:
        self.client = _Client()

    def _stage(self, params: object, version: int, key: object) -> str:
        time.sleep(0.02)
        return f"staged {version}"

    def _send(self, staged: str, deadline: float) -> str:
        time.sleep(0.02)
        return f"sent {staged}: {self.client._publish_bytes(iter(()), timeout=1.0, metadata=None)}"


def test_the_timeline_records_each_publish_step_and_names_those_a_slow_iteration_overlaps() -> None:
    pub = _Steps()
    started = time.perf_counter()
    timeline = overlap_phases.PublishTimeline(pub, started)
    assert pub._send(pub._stage({}, 7, None), 0.0) == "sent staged 7: answer"  # wrapped, answers unchanged
    (stage, v1, a1, b1, *heap1), (rpc, v3, a3, b3, *_), (send, v2, a2, b2, *heap2) = timeline.events
    assert (stage, rpc, send, v1, v3, v2) == ("stage", "rpc", "send", 7, 7, 7)
    assert 0 <= a1 < b1 <= a2 < a3 < b3 <= b2 and b1 - a1 >= 19 and b2 - a2 >= 29 and b3 - a3 >= 9
    assert timeline.during(b1 + 1, b1 + 2) == [f"send v7 {a2}-{b2}"]
    slow = overlap_phases.slow_iterations([10.0, 10.0, 40.0, 10.0], [0.0, 10.0, a1, 200.0], timeline)
    within = [f"rpc v7 {a3}-{b3}"] if a3 < a1 + 40 else []
    within += [f"send v7 {a2}-{b2}"] if a2 < a1 + 40 else []
    assert slow == [", ".join([f"it 2 40 ms: stage v7 {a1}-{b1}", *within])]
    # glibc's account not read unless asked (it locks arenas): unknown; the process's page
    # faults always, where the kernel counts them (gVisor does not: unknown there too)
    assert all(m[:4] == (None,) * 4 for m in (*heap1, *heap2))
    assert all((m[4] > 0) if faults_counted() else (m[4] is None) for m in (*heap1, *heap2))


def test_the_timeline_names_a_step_that_faulted_in_a_thousand_pages_or_more() -> None:
    timeline = overlap_phases.PublishTimeline(object(), 100.0)
    timeline.events = [
        ("stage", 4, 0.0, 10.0, (0, 0, 0, 0, 500), (0, 0, 0, 0, 27_037)),
        ("send", 4, 10.0, 30.0, (0, 0, 0, 0, 27_037), (0, 0, 0, 0, 27_900)),
    ]
    assert timeline.during(0.0, 40.0) == ["stage v4 0.0-10.0 26,537 faults", "send v4 10.0-30.0"]
    unknown = (None, None, None, None, None)  # gVisor counts no faults; glibc's account not asked for
    timeline.events = [("stage", 4, 0.0, 10.0, unknown, unknown)]
    assert timeline.during(0.0, 40.0) == ["stage v4 0.0-10.0"]
    assert overlap_report.count(None) == "unknown" and overlap_report.count(26_537) == "26,537"


def test_the_timeline_names_what_memory_did_in_a_step_and_the_collections_in_a_slow_iteration() -> None:
    timeline = overlap_phases.PublishTimeline(object(), 100.0)
    timeline.events = [
        ("stage", 3, 0.0, 10.0, (4_000_000_000, 0, 10, 0, 100), (4_000_010_000, 0, 20, 0, 120)),
        (
            "send",
            3,
            10.0,
            30.0,
            (4_850_000_000, 5_000_000_000, 1000, 5, 120),
            (2_790_000_000, 5_000_000_000, 1_210_000, 3000, 999),
        ),
    ]
    assert timeline.during(0.0, 40.0) == [
        "stage v3 0.0-10.0 20 free chunks, 0 in fastbins",
        "send v3 10.0-30.0 heap -2.06 GB 1,210,000 free chunks, 3,000 in fastbins",
    ]
    pauses = overlap_phases.GcPauses()
    pauses.pauses = [(2, 0.07, 100.012), (0, 0.001, 100.013), (1, 0.02, 100.5)]
    slow = overlap_phases.slow_iterations([5.0, 5.0, 30.0, 5.0], [-20.0, -10.0, 10.0, 45.0], timeline, pauses)
    assert slow == ["it 2 30 ms: send v3 10.0-30.0 heap -2.06 GB 1,210,000 free chunks, 3,000 in fastbins, gc2 70 ms"]
    assert pauses.summary()["gen2"] == {"count": 1, "total_ms": 70.0, "max_ms": 70.0}


def test_the_offer_and_requests_variants_name_themselves() -> None:
    v = overlap_publishers.parse_variant("offer=idle,requests=loop", BASE)
    assert (v.offer, v.requests) == ("idle", "loop") and v.label() == BASE.label() + ",requests=loop,offer=idle"
    with pytest.raises(SystemExit, match="offer"):
        overlap_publishers.parse_variant("offer=sometimes", BASE)


def test_each_choice_s_first_value_is_the_variant_s_default() -> None:
    """A label names what differs from the first value of each of CHOICES: that value must
    be the field's default, or a default phase would be labelled as a variant."""
    assert {key: getattr(BASE, key) for key in overlap_publishers.CHOICES} == {
        key: values[0] for key, values in overlap_publishers.CHOICES.items()
    }
    assert overlap_publishers.parse_variant("work=d2h,switch=500,gc=off", BASE).label() == (
        BASE.label() + ",work=d2h,switch=500,gc=off"
    )


@pytest.mark.parametrize("block_heaps", ["steer", "count"])
def test_the_block_trace_has_each_blocks_buffer_and_when_it_was_freed(tmp_path: Path, block_heaps: str) -> None:
    """The overlap bench on 8 CPU devices with blocks cut (the accelerator's branch): each
    block's buffer traced as it landed and freed by the run's end, the heaps the blocks
    landed in on the heap lines, and the window's room as the heaps leave it."""
    trace = tmp_path / "blocks.json"
    args = ["--force-blocks", "--stage-only", "--steps", "2", "--blocking-steps", "1", "--block-heaps", block_heaps]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    out = subprocess.run(
        [sys.executable, str(BENCH / "train_overlap.py"), *args, "--trace-blocks", str(trace)],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    doc = json.loads(trace.read_text())
    rows = [dict(zip(doc["columns"], r)) for r in doc["rows"]]
    owners = [r for r in rows if r["t_freed"] is not None]  # a pack's first entry: its finalizer
    assert owners and all(r["t_freed"] >= r["t_landed"] for r in owners)
    assert all(0 < r["block_bytes"] <= r["owner_bytes"] for r in rows)  # a block, or a pack's entry, in its buffer
    assert [r["t_landed"] for r in rows] == sorted(r["t_landed"] for r in rows)
    assert all(r["t_issued"] <= r["t_landed"] and r["window_used_at_issue"] > 0 for r in rows)  # each copy's issue
    assert doc["block_heaps"] >= 1 and "<malloc" in doc["malloc_info"]
    assert f"blocks in {doc['block_heaps']} heaps" in out.stderr
    assert all(r["window_room"] == 1 << 30 for r in rows)  # a small model's blocks: far from a heap past it


# The JSON's keys as bench/train_overlap.py has written them (the chip's headline figures
# are read from them): the run's, an async phase's (a variant's adds its steps alone after
# it), the blocking phase's and an RSS bound's.
RUN_KEYS = {
    "preset", "platform", "device_kind", "param_bytes", "tensors", "batch", "seq", "steps", "donate", "read_loss",
    "mode", "coordinator_address", "coordinator_in_process", "variant", "heaps", "blocks_forced",
    "tpu_transfer_env", "compile_s", "heap_after_warm_up", "step_s", "gc_pauses_alone", "blocking", "async",
    "variants", "device_memory", "rss_baseline_bytes", "rss_phase_peak_bytes", "rss_async_bounds",
    "rss_within_bound", "rss_process_peak_bytes", "rss_process_peak_after_publishing",
}  # fmt: skip
ASYNC_KEYS = {
    "iteration_s", "step_dispatch_s", "publish_async_call_s", "cpu_s_per_step", "faults_per_step", "gc_pauses",
    "heap_at_end", "each_ms", "publish_steps_ms", "slow_iterations", "not_offered", "async_ratio", "overlap_ratio",
    "overlapped_steps", "published", "skipped", "published_per_step", "publish_to_ready_s",
    "publish_to_ready_steps", "d2h_stage_gbps", "held_bytes_max", "flush_s",
}  # fmt: skip
STATS_KEYS = {"mean", "median", "max", "total"}


def test_the_json_keeps_its_keys(tmp_path: Path) -> None:
    """A short run on CPU (stage-only, a variant) writes the keys the chip's figures are
    read from, each phase's the same."""
    args = ["--stage-only", "--steps", "2", "--blocking-steps", "1", "--variant", "work=snapshot"]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run(
        [sys.executable, str(BENCH / "train_overlap.py"), *args, "--out", str(tmp_path / "overlap.json")],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    doc = json.loads((tmp_path / "overlap.json").read_text())
    assert set(doc) == RUN_KEYS
    assert set(doc["async"]) == ASYNC_KEYS
    ((label, variant),) = doc["variants"].items()
    assert label.endswith("work=snapshot") and set(variant) == ASYNC_KEYS | {"alone_after_s"}
    assert set(doc["step_s"]) == {"alone", "alone2", "dispatch"}
    assert all(set(doc["step_s"][k]) == STATS_KEYS for k in doc["step_s"])
    assert set(doc["blocking"]) == {"iteration_s", "publish_s", "ratio", "d2h_stage_gbps"}
    assert set(doc["async"]["iteration_s"]) == STATS_KEYS
    assert set(doc["async"]["each_ms"]) == {"iteration", "dispatch", "call", "start", "published_ready_at"}
    assert len(doc["rss_async_bounds"]) == 2 and label in doc["rss_async_bounds"]
    for bound in doc["rss_async_bounds"].values():
        assert set(bound) == {"baseline_bytes", "peak_bytes", "bound_bytes", "within"}
    assert {"arena", "free", "arenas", "block_heaps"} <= set(doc["async"]["heap_at_end"])
