"""weightsync.gc_freeze: survivors of middle and full collections are frozen; refresh reclaims cycles."""

from __future__ import annotations

import gc
import threading
import weakref
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry

from coordinator.config import CoordinatorConfig
from weightsync.config import load_config
from weightsync.gc_freeze import FreezingCollector
from weightsync.metrics import build_metrics


class Node:
    """A weak-referenceable object that can sit in a reference cycle."""

    def __init__(self) -> None:
        self.me = self


@pytest.fixture
def collector() -> Iterator[tuple[FreezingCollector, CollectorRegistry]]:
    metrics = build_metrics("coordinator", CollectorRegistry())
    c = FreezingCollector(refresh_s=3600.0, pauses=metrics.gc_pause_seconds, frozen=metrics.gc_frozen_objects).install()
    try:
        yield c, metrics.registry
    finally:
        c.uninstall()


def test_a_full_collection_freezes_what_survived(collector: tuple[FreezingCollector, CollectorRegistry]) -> None:
    c, registry = collector
    survivors = [Node() for _ in range(1000)]
    frozen, freezes = gc.get_freeze_count(), c.freezes
    gc.collect()
    assert c.freezes == freezes + 1
    assert gc.get_freeze_count() >= frozen + 1000  # the survivors are out of the collector's walk
    assert all(gc.is_tracked(n) for n in survivors)  # frozen, not untracked: refresh finds them again
    c.flush()
    assert registry.get_sample_value("weightsync_gc_pause_seconds_count", {"generation": "2"}) >= 1
    assert registry.get_sample_value("weightsync_gc_frozen_objects") >= frozen + 1000


def test_a_middle_collection_freezes_what_survived_and_a_young_one_does_not(
    collector: tuple[FreezingCollector, CollectorRegistry],
) -> None:
    # A fleet's new streams are frozen at the first middle collection after they opened,
    # so no later full collection walks them (56-63 ms once per run at 500 agents).
    c, _ = collector
    freezes = c.freezes
    gc.collect(0)
    assert c.freezes == freezes
    survivors = [Node() for _ in range(1000)]
    frozen = gc.get_freeze_count()
    gc.collect(1)
    assert c.freezes == freezes + 1
    assert gc.get_freeze_count() >= frozen + 1000
    assert all(gc.is_tracked(n) for n in survivors)


def test_a_collection_inside_the_histograms_own_lock_does_not_deadlock() -> None:
    # A collection starts at whatever allocation crosses the threshold: here, one made by
    # a thread holding the pause histogram's (non-reentrant) lock, as a /metrics scrape does.
    metrics = build_metrics("coordinator", CollectorRegistry())
    c = FreezingCollector(refresh_s=3600.0, pauses=metrics.gc_pause_seconds).install()
    try:
        done = threading.Event()

        def scrape_and_collect() -> None:
            with metrics.gc_pause_seconds._lock:
                gc.collect()
            done.set()

        threading.Thread(target=scrape_and_collect, daemon=True).start()
        assert done.wait(10), "the collector's callback waited on a lock its own thread held"
        c.flush()
        assert metrics.registry.get_sample_value("weightsync_gc_pause_seconds_count", {"generation": "2"}) >= 1
    finally:
        c.uninstall()


def test_a_cycle_that_dies_frozen_waits_for_refresh_and_no_longer(
    collector: tuple[FreezingCollector, CollectorRegistry],
) -> None:
    c, _ = collector
    node = Node()
    ref = weakref.ref(node)
    gc.collect()  # node survives and is frozen
    del node  # garbage now, but only reachable by the walk the freeze skips
    gc.collect()
    assert ref() is not None
    c.refresh()
    assert ref() is None
    assert not c.refresh_due()


def test_garbage_that_is_not_a_cycle_goes_at_once(collector: tuple[FreezingCollector, CollectorRegistry]) -> None:
    class Leaf:
        pass

    leaf = Leaf()
    ref = weakref.ref(leaf)
    gc.collect()
    del leaf  # reference counting frees frozen objects as it frees any other
    assert ref() is None


def test_uninstall_gives_the_collector_back() -> None:
    c = FreezingCollector(refresh_s=1.0).install()
    c.uninstall()
    assert gc.get_freeze_count() == 0
    freezes = c.freezes
    gc.collect()
    assert c.freezes == freezes


def test_refresh_period_is_checked() -> None:
    with pytest.raises(ValueError, match="refresh_s"):
        FreezingCollector(refresh_s=0)
    with pytest.raises(SystemExit):
        load_config(CoordinatorConfig, "coordinator", ["--gc-refresh-s", "-1"], {})
    assert load_config(CoordinatorConfig, "coordinator", ["--gc-refresh-s", "0"], {}).gc_refresh_s == 0
