"""The process's one device-to-host thread (`trainer_agent.device.d2h_thread`): what a generator
run there yields, in order; its failures raised in the caller; an early stop that closes it
there and waits for it; and the device path's copies issued there, whichever thread
publishes, with the same bytes as on the caller's thread."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from tests.unit.helpers import python_path
from trainer_agent.device import device_blocks as device_blocks_module
from trainer_agent.device.d2h_thread import THREAD_NAME, blocks_on_d2h_thread
from trainer_agent.publish.stage_plan import stage_device
from trainer_agent.settings import PublisherSettings
from trainer_agent.stage import params as params_module
from trainer_agent.stage.params import shard_metas
from trainer_agent.stage.staging import plan_layout


def test_items_come_in_order_from_the_d2h_thread_whichever_thread_asks() -> None:
    seen: list[str] = []

    def numbers() -> Iterator[int]:
        for i in range(50):
            seen.append(threading.current_thread().name)
            yield i

    assert list(blocks_on_d2h_thread(numbers)) == list(range(50))
    got: list[int] = []
    t = threading.Thread(target=lambda: got.extend(blocks_on_d2h_thread(numbers)))
    t.start()
    t.join()
    assert got == list(range(50))
    assert len(set(seen)) == 1 and seen[0].startswith(THREAD_NAME)


def test_a_failure_on_the_thread_is_raised_in_the_caller_and_the_thread_goes_on() -> None:
    def failing() -> Iterator[int]:
        yield 1
        raise ValueError("bad block")

    gen = blocks_on_d2h_thread(failing)
    assert next(gen) == 1
    with pytest.raises(ValueError, match="bad block"):
        next(gen)
    assert list(blocks_on_d2h_thread(lambda: iter(range(3)))) == [0, 1, 2]


def test_stopping_early_closes_the_generator_on_the_thread_and_waits_for_it() -> None:
    room = threading.Event()  # the generator waits for room the caller never makes, until on_stop
    closed: list[str] = []

    def waiting() -> Iterator[int]:
        try:
            yield 0
            room.wait(30)
            yield 1
            yield 2
        finally:
            closed.append(threading.current_thread().name)

    gen = blocks_on_d2h_thread(waiting, on_stop=room.set)
    assert next(gen) == 0
    gen.close()  # returns only once the generator on the thread has ended
    assert closed and closed[0].startswith(THREAD_NAME)
    assert room.is_set()


def test_on_the_d2h_thread_itself_nothing_is_handed_over() -> None:
    def inner() -> Iterator[str]:
        yield threading.current_thread().name

    def outer() -> Iterator[str]:
        yield from blocks_on_d2h_thread(inner)  # would wait for itself if handed to its own thread

    assert [n.startswith(THREAD_NAME) for n in blocks_on_d2h_thread(outer)] == [True]


@pytest.mark.parametrize("one_thread", [True, False])
def test_the_device_paths_copies_run_on_the_d2h_thread_with_the_same_bytes(
    one_thread: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(params_module, "HOST_MEMORY_PLATFORMS", frozenset())  # CPU devices cut blocks
    real = device_blocks_module.slicers()
    threads: set[str] = set()

    def recording(fn):  # type: ignore[no-untyped-def]
        def run(*args, **kwargs):  # type: ignore[no-untyped-def]
            threads.add(threading.current_thread().name)
            return fn(*args, **kwargs)

        return run

    monkeypatch.setattr(device_blocks_module, "slicers", lambda: tuple(recording(f) for f in real))
    params = {f"w{i}": jnp.arange(64 * 512, dtype=jnp.float32).reshape(64, 512) + i for i in range(4)}
    layout = plan_layout([m for n, v in params.items() for m in shard_metas(n, v)])
    settings = PublisherSettings(
        coordinator="127.0.0.1:1", chunk_bytes=4096, d2h_block_bytes=8192, d2h_one_thread=one_thread
    )
    slot = np.zeros(layout.total_bytes, np.uint8)
    stage_device(slot, layout, params, settings)
    for (off, n), (name, value) in zip(zip(layout.offsets, layout.nbytes, strict=True), params.items(), strict=True):
        assert slot[off : off + n].tobytes() == np.asarray(value).tobytes(), name
    on_d2h = {name.startswith(THREAD_NAME) for name in threads}
    assert on_d2h == {one_thread}


_FORK = """
import os, signal, sys
from trainer_agent.device.d2h_thread import blocks_on_d2h_thread
assert list(blocks_on_d2h_thread(lambda: iter(range(3)))) == [0, 1, 2]  # the parent's thread exists
pid = os.fork()
if pid == 0:  # the child has none of its parent's threads: it would wait forever for that one
    signal.alarm(20)  # and then end
    os._exit(0 if list(blocks_on_d2h_thread(lambda: iter(range(3)))) == [0, 1, 2] else 1)
_, status = os.waitpid(pid, 0)
sys.exit(os.waitstatus_to_exitcode(status))
"""


def test_a_forked_child_starts_a_d2h_thread_of_its_own() -> None:
    """In a process of its own without JAX (which warns at every fork)."""
    root = Path(__file__).resolve().parents[2]
    run = subprocess.run(
        [sys.executable, "-c", _FORK], cwd=root, env={"PYTHONPATH": python_path(root)}, capture_output=True, timeout=60
    )
    assert run.returncode == 0, run.stderr[-2000:]
