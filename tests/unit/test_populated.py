"""The arena, the readers' mappings of it and a rollout's receive buffers are populated when
they are made: the first stage and the first pull of each slot fault in nothing (a fault a
page is what made the v5e host's first pull of a slot 0.05 GB/s under gVisor)."""

from __future__ import annotations

import resource

import numpy as np
import pytest

from trainer_agent.serve.arena import Arena
from weightsync import populated
from weightsync.host_memory import faults_counted, minor_faults
from weightsync.manifest import Endpoint
from weightsync.transports.base import FetchRequest
from weightsync.transports.hostshm import shared_array
from weightsync.transports.shm import ShmTransport

SLOT = 32 << 20
PAGES = SLOT // 4096
# a few faults from the interpreter itself; one fault per 16 pages (Linux's fault-around)
# would be 512 here, one a page 8192
FEW = 64

counted = pytest.mark.skipif(
    not faults_counted(), reason="this kernel counts no page faults (gVisor): the chip's demo measures the rate"
)


def _faults_during(dst: np.ndarray, src: np.ndarray) -> int:
    """The page faults of copying `src` into `dst` on this thread."""
    before = minor_faults(resource.RUSAGE_THREAD)
    np.copyto(dst, src)
    after = minor_faults(resource.RUSAGE_THREAD)
    assert before is not None and after is not None
    return after - before


@pytest.fixture
def arena():
    a = Arena("shared-maps-test", slots=2)
    a.ensure_slot_bytes(SLOT)
    yield a
    a.close()


@counted
def test_the_arenas_first_stage_into_each_slot_faults_in_nothing(arena: Arena) -> None:
    src = np.full(SLOT, 7, np.uint8)
    for index in range(arena.slots):
        assert _faults_during(arena.slot(index), src) < FEW, f"slot {index}"


@counted
def test_a_rollouts_first_read_of_each_slot_faults_in_nothing(arena: Arena) -> None:
    for index in range(arena.slots):
        arena.slot(index)[:] = index + 1
    dst = np.full(SLOT, 255, np.uint8)  # the rollout's own buffer, faulted in already
    shm = ShmTransport()
    try:
        for index in range(arena.slots):
            shm.open(Endpoint(transports=("shm",), shm_path=str(arena.path), shm_offset=index * arena.slot_bytes))
            request = FetchRequest("s", 1, 0, [0], 1.0, spans=[(0, SLOT)])
            view = np.frombuffer(next(iter(shm.fetch(request))).data, np.uint8)
            assert _faults_during(dst, view) < FEW, f"slot {index} ({PAGES} pages)"
            assert dst[0] == dst[-1] == index + 1
            del view
    finally:
        shm.close()


@counted
def test_a_relays_shared_buffer_takes_its_first_version_without_faults() -> None:
    buf = shared_array(SLOT)
    src = np.full(SLOT, 3, np.uint8)
    assert _faults_during(buf, src) < FEW


@counted
def test_a_rollouts_receive_buffer_takes_its_first_version_without_faults() -> None:
    buf = populated.empty(SLOT)
    assert buf.nbytes == SLOT and buf.flags.writeable and not buf.any()
    src = np.full(SLOT, 5, np.uint8)
    assert _faults_during(buf, src) < FEW
    assert populated.empty(0).nbytes == 0


def test_memory_that_cannot_be_had_is_a_memory_error_as_np_empty_raises() -> None:
    import subprocess
    import sys

    code = (
        "import resource; from weightsync import populated\n"
        "resource.setrlimit(resource.RLIMIT_AS, (1 << 31, resource.RLIM_INFINITY))\n"
        "try:\n    populated.empty(1 << 32)\nexcept MemoryError as e:\n    print('MemoryError', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.startswith("MemoryError cannot map 4294967296 bytes"), out
