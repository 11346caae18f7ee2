"""The native shim against the Python reference: digests bit for bit, sums within tolerance."""

from __future__ import annotations

import gc
import mmap
import os
import socket
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer_agent.stage.staging import HostShard, plan_layout, stage_shards
from weightsync import native
from weightsync.errors import InvalidArgument
from weightsync.layout import plan_chunks

DTYPES = [np.float32, np.float16, ml_dtypes.bfloat16, np.float64, np.int8, np.int32, np.int64, np.uint8, np.bool_]


def test_shim_is_built() -> None:
    assert native.available(), native.missing_reason()


def _arrays(draw_sizes: list[tuple[int, int]], seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    out = []
    for n, d in draw_sizes:
        dt = np.dtype(DTYPES[d % len(DTYPES)])
        if dt == np.bool_:
            out.append(rng.integers(0, 2, n).astype(np.bool_))
        elif dt.kind in "iu":
            out.append(rng.integers(-100 if dt.kind == "i" else 0, 100, n).astype(dt))
        else:
            out.append(rng.standard_normal(n).astype(dt))
    return out


def _both_engines(arrays: list[np.ndarray], chunk: int, threads: int = 0):  # noqa: ANN202
    shards = [HostShard(f"t.{i}", a, a.shape, (0,)) for i, a in enumerate(arrays)]
    layout = plan_layout(shards)
    out = []
    for engine in ("python", "native"):
        slot = np.full(layout.total_bytes + 512, 0xAB, np.uint8)  # dirty: gaps must be zeroed
        specs, chunks = stage_shards(slot, shards, layout, chunk, engine=engine, threads=threads)
        out.append((slot[: layout.total_bytes], specs, chunks))
    return out


def _assert_same(py, nat) -> None:  # noqa: ANN001
    (slot_p, specs_p, chunks_p), (slot_n, specs_n, chunks_n) = py, nat
    assert np.array_equal(slot_p, slot_n)
    assert chunks_p == chunks_n
    for a, b in zip(specs_p, specs_n):
        assert (a.offset, a.nbytes, a.xxh3) == (b.offset, b.nbytes, b.xxh3)
        assert np.isclose(a.sum, b.sum, rtol=1e-9, atol=1e-6), (a.sum, b.sum)


@settings(max_examples=120, deadline=None)
@given(
    sizes=st.lists(st.tuples(st.integers(0, 5000), st.integers(0, 8)), min_size=1, max_size=12),
    chunk=st.integers(4096, 70_000),
    threads=st.integers(1, 3),
    seed=st.integers(0, 2**16),
)
def test_native_equals_python_reference(sizes: list[tuple[int, int]], chunk: int, threads: int, seed: int) -> None:
    py, nat = _both_engines(_arrays(sizes, seed), chunk, threads)
    _assert_same(py, nat)


def test_large_spans_cut_by_thread_boundaries_and_many_tiny_tensors() -> None:
    arrays = _arrays([(3_000_001, 2), (7, 1), (1_500_000, 0)] + [(n % 5, n) for n in range(1000)], seed=3)
    py, nat = _both_engines(arrays, 65_536, threads=2)
    _assert_same(py, nat)
    _, nat1 = _both_engines(arrays, 65_536, threads=1)
    # thread count never changes bytes or digests (sums only by summation order)
    assert nat1[2] == nat[2] and [s.xxh3 for s in nat1[1]] == [s.xxh3 for s in nat[1]]
    assert np.allclose([s.sum for s in nat1[1]], [s.sum for s in nat[1]], rtol=1e-9)


def test_overlapping_spans_and_bad_chunk_plans_are_refused() -> None:
    a = np.ones(100, np.float32)
    with pytest.raises(InvalidArgument):
        native.stage(np.zeros(1024, np.uint8), 600, [600], 4096, [(a, 0, 1), (a, 200, 1)])
    with pytest.raises(InvalidArgument):
        native.stage(np.zeros(1024, np.uint8), 300, [300], 4096, [(a, 0, 1)])  # leaves [0, total)
    with pytest.raises(InvalidArgument, match="chunk_lengths"):
        native.stage(np.zeros(1024, np.uint8), 400, [300], 4096, [(a, 0, 1)])  # chunks stop short of total
    with pytest.raises(InvalidArgument, match="chunk_lengths"):
        native.stage(np.zeros(1024, np.uint8), 400, [400, 0], 4096, [(a, 0, 1)])  # an empty chunk


def test_digest_ranges_beyond_4_gib(tmp_path: Path) -> None:
    path = tmp_path / "sparse"
    size = (5 << 30) + 4096
    with open(path, "wb") as f:
        f.truncate(size)
    fd = os.open(path, os.O_RDWR)
    try:
        mm = mmap.mmap(fd, size)
        payload = os.urandom(10_000)
        mm[(4 << 30) + 123 : (4 << 30) + 123 + len(payload)] = payload
        buf = np.frombuffer(mm, np.uint8)
        offsets = [(4 << 30) + 123, (5 << 30) - 7, 0]
        lengths = [len(payload), 4096, 0]
        got = native.digest_ranges(buf, offsets, lengths)
        assert list(got) == [
            xxhash.xxh3_64_intdigest(payload),
            xxhash.xxh3_64_intdigest(bytes(4096)),
            xxhash.xxh3_64_intdigest(b""),
        ]
        with pytest.raises(InvalidArgument):
            native.digest_ranges(buf, [size - 1], [2])
        del buf
        mm.close()
    finally:
        os.close(fd)


def test_chunk_digests_match_xxhash_over_the_slot() -> None:
    arrays = _arrays([(40_000, 0), (3, 2), (100, 1), (9_000, 0)], seed=1)
    _, (slot, specs, chunks) = _both_engines(arrays, 4096)
    spans = [(s.offset, s.nbytes) for s in specs]
    assert [(c.offset, c.length) for c in chunks] == plan_chunks(len(slot), 4096, spans)
    for c in chunks:
        assert c.xxh3 == xxhash.xxh3_64_intdigest(slot[c.offset : c.offset + c.length])


@settings(max_examples=80, deadline=None)
@given(
    sizes=st.lists(st.tuples(st.integers(0, 40_000), st.integers(0, 8)), min_size=1, max_size=10),
    chunk=st.integers(4096, 20_000),
    seed=st.integers(0, 2**16),
)
def test_large_shards_digest_from_their_chunks(sizes: list[tuple[int, int]], chunk: int, seed: int) -> None:
    """The hash-once contract: a shard above the pack limit is tiled by chunks of its own,
    one per piece, so its piecewise digest is made of exactly those chunk digests."""
    from weightsync.digests import piecewise_xxh3
    from weightsync.layout import pack_limit

    _, (slot, specs, chunks) = _both_engines(_arrays(sizes, seed), chunk)
    by_offset = {c.offset: c for c in chunks}
    for s in specs:
        assert s.xxh3 == piecewise_xxh3(slot[s.offset : s.offset + s.nbytes], chunk)
        if s.nbytes <= pack_limit(chunk):
            continue
        pieces = [by_offset[o] for o in range(s.offset, s.offset + s.nbytes, chunk)]
        assert [c.length for c in pieces] == [
            min(chunk, s.offset + s.nbytes - o) for o in range(s.offset, s.offset + s.nbytes, chunk)
        ]
        expected = (
            pieces[0].xxh3
            if len(pieces) == 1
            else xxhash.xxh3_64_intdigest(np.array([c.xxh3 for c in pieces], "<u8").tobytes())
        )
        assert s.xxh3 == expected


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.tuples(st.integers(0, 300_000), st.integers(0, 8)), min_size=1, max_size=10),
    piece=st.integers(1, 400_000),
    threads=st.integers(1, 3),
    seed=st.integers(0, 2**16),
)
def test_digest_arrays_equals_python(sizes: list[tuple[int, int]], piece: int, threads: int, seed: int) -> None:
    from weightsync.digests import float64_sum, piecewise_xxh3
    from weightsync.dtypes import native_code

    arrays = _arrays(sizes, seed)
    digests, sums = native.digest_arrays([(a, native_code(a.dtype)) for a in arrays], piece, threads=threads)
    for a, d, s in zip(arrays, digests, sums):
        assert int(d) == piecewise_xxh3(a.view(np.uint8), piece)
        assert np.isclose(s, float64_sum(a), rtol=1e-9, atol=1e-6), (a.dtype, s, float64_sum(a))


def test_native_copy() -> None:
    src = np.random.default_rng(0).integers(0, 255, 3_000_017, dtype=np.uint8)
    dst = np.zeros_like(src)
    native.copy(dst, src, threads=2)
    assert np.array_equal(dst, src)


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.sampled_from([0, 1, 7, 4096, 300_001, 1 << 20]), max_size=12), threads=st.integers(1, 5))
def test_copy_many_copies_every_pair_whatever_the_split(sizes: list[int], threads: int) -> None:
    rng = np.random.default_rng(len(sizes))
    srcs = [rng.integers(0, 255, n, dtype=np.uint8) for n in sizes]
    # destinations are slices of one buffer with 3-byte gaps that nobody asked to write
    whole = np.full(sum(sizes) + 3 * (len(sizes) + 1), 0xAB, np.uint8)
    starts = np.cumsum([3] + [n + 3 for n in sizes])[:-1]
    dsts = [whole[a : a + n] for a, n in zip(starts, sizes)]
    native.copy_many(list(zip(dsts, srcs)), threads=threads)
    assert all(np.array_equal(d, s) for d, s in zip(dsts, srcs))
    gaps = np.ones(whole.size, bool)
    for a, n in zip(starts, sizes):
        gaps[a : a + n] = False
    assert (whole[gaps] == 0xAB).all()


def test_copy_many_refuses_mismatched_or_read_only_pairs() -> None:
    a, b = np.zeros(8, np.uint8), np.zeros(9, np.uint8)
    with pytest.raises(InvalidArgument, match=r"pairs\[1\].*8 bytes != source 9"):
        native.copy_many([(a, a.copy()), (a, b)])
    ro = np.zeros(8, np.uint8)
    ro.flags.writeable = False
    with pytest.raises(InvalidArgument, match=r"pairs\[0\].*writeable"):
        native.copy_many([(ro, a)])


def test_cuda_variant_builds_where_a_toolkit_is() -> None:
    import shutil

    if shutil.which("nvcc") is None:
        pytest.skip("no CUDA toolkit here: the CUDA variant is not expected")
    if os.environ.get("WEIGHTSYNC_KIT"):
        pytest.skip("the shim is the TPU kit's, built on another machine (devtools/tpu_kit.sh)")
    assert native.cuda_built(), "nvcc is present but libweightsync_native_cuda.so was not built"


@pytest.mark.gpu
@pytest.mark.parametrize("nbytes", [0, 1, 4097, 3 << 20])
def test_cuda_variant_stages_device_buffers(nbytes: int) -> None:
    pattern, staged = native.cuda_selftest(nbytes)
    assert pattern == staged


@settings(max_examples=60, deadline=None)
@given(data=st.binary(max_size=3 << 16))
def test_copy_digest_copies_and_hashes_in_one_pass(data: bytes) -> None:
    src = np.frombuffer(data, np.uint8)
    dst = np.full(len(data), 0xAB, np.uint8)
    assert native.copy_digest(dst, src) == xxhash.xxh3_64_intdigest(data)
    assert dst.tobytes() == data


def _threads_in_child(env: dict[str, str], cpus: set[int] | None = None) -> int:
    """native.default_threads() of a fresh process (it is decided once per process)."""
    pin = f"os.sched_setaffinity(0, {sorted(cpus)!r}); " if cpus else ""
    code = f"import os; {pin}from weightsync import native; print(native.default_threads())"
    run = subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 0, run.stderr
    return int(run.stdout)


def test_default_threads_follow_the_affinity_and_the_override() -> None:
    """A pod pinned to some cores (or limited by a quota, below) runs its passes on those,
    not on every core of the node; WEIGHTSYNC_NATIVE_THREADS overrides both, a value that
    is not a positive integer is ignored."""
    plain = {"WEIGHTSYNC_NATIVE_THREADS": ""}
    assert _threads_in_child(plain) == min(len(os.sched_getaffinity(0)), native.cpu_limit() or 10**6)
    assert _threads_in_child(plain, {min(os.sched_getaffinity(0))}) == 1
    assert _threads_in_child({"WEIGHTSYNC_NATIVE_THREADS": "3"}, {min(os.sched_getaffinity(0))}) == 3
    for bad in ("0", "-2", "two", "3x", "+3", " 3", "99999", "00003", "\u00b2"):
        assert _threads_in_child({"WEIGHTSYNC_NATIVE_THREADS": bad}, {min(os.sched_getaffinity(0))}) == 1


@pytest.mark.parametrize(
    ("files", "cores"),
    [
        ({"cpu.max": "max 100000\n"}, 0),
        ({"cpu.max": "200000 100000\n"}, 2),
        ({"cpu.max": "150000 100000\n"}, 2),  # 1.5 CPUs: two threads, each throttled a little
        ({"cpu.max": "5000 100000\n"}, 1),
        ({"cpu.max": "9000000000000000000 1000\n"}, 4096),  # absurd quotas are capped
        ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, 0),
        ({"cpu/cpu.cfs_quota_us": "300000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 3),
        ({"cpu,cpuacct/cpu.cfs_quota_us": "50000\n", "cpu,cpuacct/cpu.cfs_period_us": "100000\n"}, 1),
        ({"cpu/cpu.cfs_quota_us": "300000\n"}, 0),  # no period: not a quota it can read
        ({}, 0),
    ],
)
def test_cpu_limit_reads_cgroup_v2_and_v1_quotas(tmp_path: Path, files: dict[str, str], cores: int) -> None:
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert native.cpu_limit(str(tmp_path)) == cores


@settings(max_examples=150, deadline=None)
@given(
    rows=st.integers(0, 40),
    cols=st.sampled_from([0, 1, 3, 4095, 4096, 4097, 9000]),
    itemsize=st.sampled_from([1, 2, 4]),
    seed=st.integers(0, 2**32 - 1),
)
def test_matrix_sums_equal_numpys_wrapping_reductions(rows: int, cols: int, itemsize: int, seed: int) -> None:
    """One native pass, column blocks of 4096 and all: the same uint32 sums (modulo 2^32) as
    NumPy's two reductions, extremes included (every element at its maximum wraps)."""
    dtype = {1: np.uint8, 2: np.uint16, 4: np.uint32}[itemsize]
    rng = np.random.default_rng(seed)
    m = rng.integers(0, np.iinfo(dtype).max, (rows, cols), dtype=dtype, endpoint=True)
    if seed % 3 == 0:
        m[...] = np.iinfo(dtype).max
    got_rows, got_cols = native.matrix_sums(m)
    assert np.array_equal(got_rows, np.add.reduce(m, axis=1, dtype=np.uint32))
    assert np.array_equal(got_cols, np.add.reduce(m, axis=0, dtype=np.uint32))


@settings(max_examples=100, deadline=None)
@given(
    rows=st.integers(0, 12),
    cols=st.sampled_from([0, 1, 5, 4097]),
    mask=st.sampled_from([(np.uint16, 0x7F80), (np.uint16, 0x7C00), (np.uint32, 0x7F800000)]),
    seed=st.integers(0, 2**32 - 1),
)
def test_float_matrix_sums_count_zero_exponents_as_zero_and_count_non_finite(
    rows: int, cols: int, mask: tuple[type, int], seed: int
) -> None:
    """Floats' bits with every element whose exponent bits are all 0 taken as 0 (the sums of
    NumPy's canonical copy) and the elements whose exponent bits are all 1 counted; random
    bits hit zeros, subnormals, NaN and infinity often once the exponent is forced."""
    dtype, exponent = mask
    rng = np.random.default_rng(seed)
    m = rng.integers(0, np.iinfo(dtype).max, (rows, cols), dtype=dtype, endpoint=True)
    force = rng.integers(0, 3, m.shape)
    m[force == 0] &= dtype(~exponent & np.iinfo(dtype).max)  # zero or subnormal (either sign)
    m[force == 1] |= dtype(exponent)  # NaN or infinity
    canonical = np.where(m & dtype(exponent) == 0, dtype(0), m)
    got_rows, got_cols, nonfinite = native.float_matrix_sums(m, exponent)
    assert np.array_equal(got_rows, np.add.reduce(canonical, axis=1, dtype=np.uint32))
    assert np.array_equal(got_cols, np.add.reduce(canonical, axis=0, dtype=np.uint32))
    assert nonfinite == int(np.count_nonzero(m & dtype(exponent) == dtype(exponent)))


def test_matrix_sums_refuse_what_they_cannot_read() -> None:
    with pytest.raises(InvalidArgument, match="matrix"):
        native.matrix_sums(np.zeros((4, 4), np.uint16).T[:, :3])  # not C-contiguous
    with pytest.raises(InvalidArgument, match="matrix"):
        native.matrix_sums(np.zeros((4, 4), np.float32))
    with pytest.raises(InvalidArgument, match="matrix"):
        native.matrix_sums(np.zeros(4, np.uint16))
    with pytest.raises(InvalidArgument, match="exponent_mask"):
        native.float_matrix_sums(np.zeros((4, 4), np.uint16), 0x7F800000)  # wider than the elements


def test_native_calls_leave_no_reference_cycles() -> None:
    """Every call passes its arrays by address: no ctypes casts or per-length array types,
    whose reference cycles the collector had to find (a few objects a call; a rollout
    receiving a version makes thousands of calls)."""
    a = np.arange(4096, dtype=np.float32)
    halves = a.view(np.uint16)
    base, slot, out = np.zeros(a.nbytes, np.uint8), np.zeros(a.nbytes, np.uint8), np.zeros(a.nbytes, np.uint8)
    encoded, _ = native.delta16_encode(halves, halves + 1)
    assert encoded is not None

    def calls() -> None:
        native.stage(base, a.nbytes, [a.nbytes // 2] * 2, 4096, [(a, 0, 1)])
        native.stage(slot, a.nbytes, [a.nbytes // 2] * 2, 4096, [(a + 1, 0, 1)], base=base)
        native.rebuild_digest(slot.copy(), [a.nbytes], 4096, [(0, a.nbytes, 1)], np.frombuffer(encoded, np.uint8),
                              [(0, 0, len(encoded))])  # fmt: skip
        native.digest_arrays([(a, 1)], 4096)
        native.digest_ranges(base, [0, 64], [64, 64])
        native.copy_many([(out, base)])
        native.copy_digest(out, base)
        native.delta16_encode(halves, halves)
        left, right = socket.socketpair()
        with left, right:
            native.send_views(left.fileno(), [base[:1024]])
            assert native.recv_verify(right.fileno(), out, [(0, 1024)], [xxhash.xxh3_64_intdigest(base[:1024])]).all()

    calls()  # anything made once (the library's functions) is made
    gc.collect()
    gc.disable()
    try:
        calls()
        assert gc.collect() == 0
    finally:
        gc.enable()
