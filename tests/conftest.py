"""Shared fixtures: process clusters on loopback, leak checks for arenas; what this host
offers (a GPU, a TPU chip, inet sockets), detected, for the markers that need them."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from devtools.cluster import Cluster
from weightsync.addresses import inet_refused
from weightsync.arena_files import ARENA_GLOB, owner_alive, owner_pid
from weightsync.security import Security
from weightsync.server import RunningServer

# One JAX compilation cache for the run, inherited by every trainer process the tests
# start (about sixty): a tiny trainer's first init and step compile for 2-2.5 s, read
# back from the cache in 0.3-0.5 s (measured here). Set before anything imports JAX; a
# partly written entry another process reads is a warning and a compile (jax's cache).
# A developer's own JAX_COMPILATION_CACHE_DIR is used as it is and kept.
_OWN_JAX_CACHE = None if "JAX_COMPILATION_CACHE_DIR" in os.environ else tempfile.mkdtemp(prefix="weightsync-jax-")
if _OWN_JAX_CACHE is not None:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _OWN_JAX_CACHE
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

# JAX_PLATFORMS: unset, the suite runs JAX on the CPU (CI); set, even empty (JAX's default
# platform: the chip on a TPU host), this process keeps it: JAX reads it once, at import.
# Every process the tests start then gets JAX_PLATFORMS=cpu unless the test passes its own
# (devtools.cluster's processes too): one process may hold a TPU chip, and a second one
# that opens it fails instead of falling back to the CPU.
_SUITE_PLATFORMS = os.environ.get("JAX_PLATFORMS", "cpu")
if _SUITE_PLATFORMS != "cpu":
    import jax  # noqa: F401
os.environ["JAX_PLATFORMS"] = "cpu"


def pytest_sessionfinish(session: pytest.Session) -> None:
    if _OWN_JAX_CACHE is not None:
        shutil.rmtree(_OWN_JAX_CACHE, ignore_errors=True)


def unmapped(paths: set[Path]) -> set[Path]:
    """Those of `paths` no live process maps (another process's are left alone)."""
    held: set[Path] = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        with contextlib.suppress(OSError):
            text = maps.read_text()
            held |= {p for p in paths if str(p) in text}
    return paths - held


@pytest.fixture(scope="session", autouse=True)
def no_shm_leak() -> Iterator[None]:
    """Fails the run if it leaves files in /dev/shm that no live process maps: arenas,
    receive buffers, and the shared memory vLLM's engines make (TP groups' `vllm_dist_*`,
    the message queues' `psm_*`). Each test removes what its processes made; a process
    killed before it could is the test's to clean up after."""
    shm = Path("/dev/shm")
    before = set(shm.iterdir()) if shm.is_dir() else set()
    yield
    if not shm.is_dir():
        return
    deadline = time.monotonic() + 10.0  # processes the last tests stopped may still be exiting
    files = lambda: {p for p in shm.iterdir() if not p.is_dir()}  # noqa: E731 - a folder there maps nothing
    while (left := unmapped(_own(files() - before))) and time.monotonic() < deadline:
        time.sleep(0.5)
    for path in left:  # removed, so that the next run starts clean; the run still fails
        path.unlink(missing_ok=True)
    assert not left, f"the run left shared memory behind: {sorted(p.name for p in left)}"


def _own(paths: set[Path]) -> set[Path]:
    """Those of `paths` this user owns: another user's (a shared host's other runs) are not
    this run's, and not this user's to remove."""
    own = set()
    for path in paths:
        with contextlib.suppress(OSError):
            if path.stat().st_uid == os.geteuid():
                own.add(path)
    return own


def _arenas() -> set[str]:
    """Arena files in /dev/shm, and hidden half-made ones (a maker that died mid-creation)."""
    return {p.name for pattern in (ARENA_GLOB, f".{ARENA_GLOB}") for p in Path("/dev/shm").glob(pattern)}


# Process tests reach their servers on 127.0.0.1: every test under these needs inet sockets
# unless it is marked unix_only.
INET_DIRS = ("integration", "e2e", "chaos")


def missing_inet() -> str:
    """Why TCP over 127.0.0.1 does not work on this host ("" where it does)."""
    return inet_refused()


def missing_tpu() -> str:
    """Why this process has no TPU chip ("" where jax.devices() has one)."""
    import jax

    platforms = {d.platform for d in jax.devices()}
    if "tpu" in platforms:
        return ""
    hint = "; the suite runs JAX on the CPU unless JAX_PLATFORMS is set, empty for JAX's default platform"
    return f"needs a TPU chip (JAX sees {', '.join(sorted(platforms))}{hint if _SUITE_PLATFORMS == 'cpu' else ''})"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked gpu, tpu or needs_inet run only where this host has what they need."""
    for item in items:
        if item.path.parent.name in INET_DIRS and not item.get_closest_marker("unix_only"):
            item.add_marker(pytest.mark.needs_inet)
    needs: dict[str, Callable[[], str]] = {"gpu": _missing_gpu, "tpu": missing_tpu, "needs_inet": missing_inet}
    for marker, missing in needs.items():
        marked = [item for item in items if item.get_closest_marker(marker)]
        why = missing() if marked else ""
        for item in marked if why else ():
            item.add_marker(pytest.mark.skip(reason=why))


def _missing_gpu() -> str:
    from weightsync import native

    return "" if native.cuda_device_count() > 0 else "needs a GPU (none visible to the CUDA staging variant)"


def _owner_gone_or_us(name: str) -> bool:
    """A leak is an arena whose owner died (nobody holds its lock), or this process's own."""
    return owner_pid(name) == os.getpid() or not owner_alive(Path("/dev/shm") / name)


@pytest.fixture
def no_arena_leak() -> Iterator[None]:
    """Fails the test if it leaves new weightsync arenas in /dev/shm (live strangers' excepted)."""
    before = _arenas()
    yield
    leaked = {n for n in _arenas() - before if _owner_gone_or_us(n)}
    assert not leaked, f"arenas left behind: {sorted(leaked)}"


@pytest.fixture
def sockets() -> Iterator[Path]:
    """A short private directory for socket files (pytest's tmp_path can pass sun_path's 107 bytes)."""
    directory = Path(tempfile.mkdtemp(prefix="ws-"))
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def cluster(tmp_path: Path, request: pytest.FixtureRequest, no_arena_leak: None) -> Iterator[Cluster]:
    """A Cluster in tmp_path; dumps every process log when the test fails."""
    c = Cluster(tmp_path / "cluster")
    try:
        yield c
    finally:
        c.close()
        rep = getattr(request.node, "rep_call", None)
        if rep is not None and rep.failed:
            for proc in c.procs.values():
                print(f"===== {proc.name} (exit {proc.popen.returncode}) =====\n{proc.log()[-6000:]}")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # noqa: ANN201 - pytest hook
    rep = yield
    setattr(item, f"rep_{rep.when}", rep)
    return rep


@contextlib.contextmanager
def coordinator_in_process(
    db_path: Path,
    security: Security | None = None,
    lease_ttl_s: float = 10.0,
    *,
    grace_s: float = 0.5,
    prepare: Callable[[Any], None] | None = None,
) -> Iterator[RunningServer]:
    """A Coordinator server in this process on 127.0.0.1:<free port> (TLS/tokens per
    `security`); `prepare(servicer)` runs before it serves, and leaving the context stops
    it as the coordinator's main does (the hub closed first, then `grace_s` for calls)."""
    from coordinator.config import CoordinatorConfig
    from coordinator.servicer import CoordinatorServicer, coordinator_service
    from coordinator.store import SessionStore
    from coordinator.watch import WatchHub
    from weightsync.metrics import build_metrics
    from weightsync.server import start_server

    hub = WatchHub()
    store = SessionStore(db_path, listener=hub, lease_ttl_s=lease_ttl_s)
    metrics = build_metrics("coordinator")
    servicer = CoordinatorServicer(store, hub, metrics)
    if prepare is not None:
        prepare(servicer)
    running = start_server(
        [coordinator_service(servicer)],
        host="127.0.0.1",
        port=0,
        metrics=metrics,
        metrics_port=-1,
        max_workers=CoordinatorConfig.max_workers,
        security=security,
    )
    try:
        yield running
    finally:
        hub.close()
        running.stop(grace_s)
        servicer.close()
        store.close()


@pytest.fixture
def inprocess_coordinator(tmp_path: Path) -> Iterator[RunningServer]:
    """A Coordinator server in this process, on 127.0.0.1:<free port>, SQLite in tmp_path."""
    with coordinator_in_process(tmp_path / "c.db") as running:
        yield running
