"""What the service check compares: each version changes every tensor, and the logits
bound sees one stale leaf, the smallest kind included (a norm), while the same model's
logits pass; the host memory figures it reads are this process's."""

from __future__ import annotations

import mmap
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from devtools.tpu_service_check import _compare, make_base, reference_logits, version_of
from weightsync import host_memory as host_memory_module
from weightsync.host_memory import (
    LACKS_VARIABLE,
    faults_counted,
    host_memory,
    lacks,
    mem_available,
    minor_faults,
    parse_status,
)

PRESET = "small"
TOKENS = np.random.default_rng(0).integers(0, 8192, (2, 16))


def test_every_tensor_changes_from_one_version_to_the_next() -> None:
    base = make_base(PRESET)
    v1, v2 = version_of(base, 1), version_of(base, 2)
    assert all(not np.array_equal(v1[n].view(np.uint16), v2[n].view(np.uint16)) for n in base)
    assert all(np.isfinite(a.astype(np.float32)).all() for a in v1.values())


@pytest.mark.parametrize("stale", ["model.norm.weight", "model.layers.3.self_attn.k_norm.weight",
                                   "model.layers.0.mlp.down_proj.weight"])  # fmt: skip
def test_one_stale_leaf_is_far_outside_the_bound_and_the_same_model_inside(stale: str) -> None:
    base = make_base(PRESET)
    v1, v2 = version_of(base, 1), version_of(base, 2)
    want = reference_logits(v2, PRESET, TOKENS)
    assert _compare(want.copy(), want, None, 1e-4)["logits_ok"]
    served = reference_logits({**v2, stale: v1[stale]}, PRESET, TOKENS)  # one leaf of the version before
    got = _compare(served, want, None, 1e-4)
    assert not got["logits_ok"] and got["logits_rel_err"] > 1e-2, got


def test_a_status_without_kinds_counts_all_of_rss_as_the_process_own() -> None:
    """gVisor's /proc/PID/status: VmRSS, no RssAnon/RssFile/RssShmem, no VmHWM."""
    gvisor = parse_status(["Name:\tpython3\n", "VmRSS:\t 1024 kB\n", "Threads:\t4\n"])
    assert (gvisor.rss, gvisor.by_kind, gvisor.own, gvisor.peak) == (1 << 20, False, 1 << 20, 0)
    linux = parse_status(["VmHWM:\t 4096 kB\n", "VmRSS:\t 3072 kB\n", "RssAnon:\t 1024 kB\n", "RssFile:\t 2048 kB\n"])
    assert (linux.by_kind, linux.own, linux.peak) == (True, 1 << 20, 4 << 20)


def test_this_process_memory_is_read_by_kind() -> None:
    m = host_memory()
    assert m.rss > 0 and m.peak >= m.rss
    assert set(m.as_dict()) == {"rss", "anon", "file", "shmem", "peak"}  # byte counts only (metric kinds)
    if m.by_kind:  # Linux; gVisor (the TPU host) reports VmRSS alone
        assert m.anon > 0 and m.own == m.anon
        assert m.anon + m.file + m.shmem == pytest.approx(m.rss, rel=0.05)
    else:
        assert m.own == m.rss
    assert host_memory(2**22 + 7).rss == 0  # no such process: zeros, not an error
    assert mem_available() > 0


@pytest.fixture
def proc_lacks(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[str], None]]:
    """Sets $WEIGHTSYNC_PROC_LACKS for this test (the readers read it once a process)."""

    def set_lacks(value: str) -> None:
        monkeypatch.setenv(LACKS_VARIABLE, value)
        lacks.cache_clear()
        faults_counted.cache_clear()

    yield set_lacks
    lacks.cache_clear()
    faults_counted.cache_clear()


def test_the_proc_readers_read_as_gvisor_where_asked(proc_lacks: Callable[[str], None]) -> None:
    """`gvisor` names what gVisor lacks: this process's memory then reads by VmRSS alone, its
    peak from getrusage, and its page faults as unknown (None), not 0."""
    proc_lacks("gvisor")
    assert lacks() == host_memory_module.GVISOR_LACKS and "minflt" in lacks()
    m = host_memory()
    assert m.rss > 0 and not m.by_kind and m.own == m.rss and m.anon == 0 and m.peak >= m.rss
    assert not faults_counted() and minor_faults() is None
    proc_lacks(" VmHWM , minflt")
    assert lacks() == {"VmHWM", "minflt"}
    assert not [line for line in host_memory_module.status_lines() if line.startswith("VmHWM:")]
    assert host_memory().peak > 0  # this process's own: getrusage's


def test_page_faults_are_counted_where_the_kernel_counts_them(proc_lacks: Callable[[str], None]) -> None:
    proc_lacks("")
    if not faults_counted():
        pytest.skip("this kernel counts no page faults (gVisor)")
    before = minor_faults()
    with mmap.mmap(-1, 64 * mmap.PAGESIZE) as fresh:  # not a heap's pages, touched before
        for offset in range(0, len(fresh), mmap.PAGESIZE):
            fresh[offset] = 1
    assert before is not None and (minor_faults() or 0) > before
