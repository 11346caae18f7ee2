"""What a server's shutdown waits for: calls that end by themselves get the grace; streams
that end only when their client leaves (a health Watch, a reflection conversation, the
coordinator's watch and heartbeat streams) do not hold it."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from devtools.cluster import Cluster
from tests.integration.support import eventually, rollout_status
from weightsync.client import CoordinatorClient
from weightsync.errors import WeightsyncError

TINY = ["--model-size", "tiny"]


class HealthWatch:
    """A grpc health Watch held open on `address`, as a client with grpc's health-checking
    service config (or `grpcurl ... grpc.health.v1.Health/Watch`) holds one."""

    def __init__(self, address: str) -> None:
        self._channel = grpc.insecure_channel(address)
        self.statuses: list[object] = []
        self._first = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()
        assert self._first.wait(10), f"no health status from {address}"

    def _watch(self) -> None:
        stub = health_pb2_grpc.HealthStub(self._channel)
        try:
            for answer in stub.Watch(health_pb2.HealthCheckRequest(service=""), timeout=300):
                self.statuses.append(health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status))
                self._first.set()
        except grpc.RpcError as e:
            self.statuses.append(e.code().name)

    def close(self) -> None:
        self._thread.join(10)
        self._channel.close()


# What a server logs at shutdown, by the path it took: only streams that end when their
# client leaves were open (ended after ENDLESS_GRACE_S), or the grace ran out on others.
ENDED_ENDLESS = "ending streams that end only when their client leaves: "
GRACE_OVER = "grace is over; ending calls still open: "
HEALTH_WATCH = "/grpc.health.v1.Health/Watch"
GET_STATUS = "/weightsync.v1.Coordinator/GetStatus"
# A grace no correct stop comes near: a stop that waits it out takes LONG_GRACE_S, one that
# does not takes well under a second on a quiet machine, a few on a loaded one.
LONG_GRACE_S = 60.0
STOPPED_WITHIN_S = 20.0


def test_a_health_watch_does_not_hold_any_server_at_shutdown(cluster: Cluster) -> None:
    """A health Watch kept open must not hold a server's SIGTERM for its whole grace (a call
    only its client ends): each server ends it as such a stream (its log says which path
    the shutdown took), and the watch sees NOT_SERVING before its call is ended."""
    coord = cluster.start_coordinator()
    trainer = cluster.start_trainer("t1", coord.address, "job", [*TINY, "--steps", "1", "--hold"])
    rollout = cluster.start_rollout("r0", coord.address, "job")
    eventually(lambda: rollout_status(rollout.address).current_version == 1, what="r0 at version 1")
    for proc in (rollout, trainer, coord):
        watch = HealthWatch(proc.address)
        assert cluster.stop(proc.name) == 0
        watch.close()
        log = proc.log()
        assert f"{ENDED_ENDLESS}{HEALTH_WATCH} x1" in log, log[-3000:]
        assert GRACE_OVER not in log, log[-3000:]
        assert watch.statuses[0] == "SERVING" and "NOT_SERVING" in watch.statuses, watch.statuses
        assert watch.statuses[-1] in ("UNAVAILABLE", "CANCELLED"), watch.statuses


def test_a_health_watch_does_not_hold_the_grace(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """In process, with a grace no correct stop comes near: the watch is ended as a stream
    only its client ends, and the stop takes nothing like the grace."""
    from tests.conftest import coordinator_in_process

    caplog.set_level(logging.INFO, logger="weightsync.server")
    with coordinator_in_process(tmp_path / "c.db", grace_s=LONG_GRACE_S) as running:
        watch = HealthWatch(running.address)
        eventually(lambda: running.calls.by_method().get(HEALTH_WATCH) == 1, what="the watch open")
        t0 = time.monotonic()
    stopped_s = time.monotonic() - t0
    watch.close()
    messages = [r.getMessage() for r in caplog.records if r.name == "weightsync.server"]
    assert f"{ENDED_ENDLESS}{HEALTH_WATCH} x1" in messages, messages
    assert not any(GRACE_OVER in m for m in messages), messages
    assert stopped_s < STOPPED_WITHIN_S, f"the stop took {stopped_s:.1f}s of its {LONG_GRACE_S:.0f}s grace"
    assert watch.statuses[-1] in ("UNAVAILABLE", "CANCELLED"), watch.statuses


def refused_new_calls(address: str) -> bool:
    """True once `address` takes no new call: its server has begun to stop."""
    with grpc.insecure_channel(address) as channel:
        try:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        except grpc.RpcError:
            return True
    return False


def test_a_call_in_flight_at_shutdown_still_gets_its_grace(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The other half: a GetStatus in flight when the coordinator stops, which returns only
    once the server refuses new calls (it is stopping), is answered, not cancelled, while a
    watch stream open beside it ends and does not hold the stop."""
    from tests.conftest import coordinator_in_process

    caplog.set_level(logging.INFO, logger="weightsync.server")
    answering = threading.Event()
    address: list[str] = []

    def slow_status(servicer) -> None:  # noqa: ANN001
        reply = servicer._status.reply

        def slowly(request):  # noqa: ANN001, ANN202
            answering.set()
            eventually(lambda: refused_new_calls(address[0]), interval_s=0.05, what="the server stopping")
            return reply(request)

        servicer._status.reply = slowly

    results: dict[str, object] = {}
    with coordinator_in_process(tmp_path / "c.db", grace_s=LONG_GRACE_S, prepare=slow_status) as running:
        address.append(running.address)
        client = CoordinatorClient(running.address)
        client.open_session("job", trainer=False)

        def call(name, fn) -> None:  # noqa: ANN001
            try:
                results[name] = fn()
            except Exception as e:  # noqa: BLE001 - how it ended is the check
                results[name] = e

        threads = [
            threading.Thread(target=call, args=("watch", lambda: list(client.watch("job", 0, timeout_s=120)))),
            threading.Thread(target=call, args=("status", lambda: client.status("job"))),
        ]
        for t in threads:
            t.start()
        assert answering.wait(30)
        eventually(lambda: running.calls.by_method().get("/weightsync.v1.Coordinator/WatchVersions") == 1)
        t0 = time.monotonic()
    stopped_s = time.monotonic() - t0
    for t in threads:
        t.join(30)
    client.close()
    assert results["watch"] == []  # ended by the coordinator as a return
    assert not isinstance(results["status"], Exception), results["status"]
    assert results["status"].session == "job"
    assert stopped_s < STOPPED_WITHIN_S, f"the stop took {stopped_s:.1f}s of its {LONG_GRACE_S:.0f}s grace"
    messages = [r.getMessage() for r in caplog.records if r.name == "weightsync.server"]
    assert not any(GRACE_OVER in m for m in messages), messages


def test_a_call_past_the_grace_is_ended_and_named(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A call still running when the grace is over is cancelled, and the log says the grace
    ran out and names it."""
    from tests.conftest import coordinator_in_process

    caplog.set_level(logging.INFO, logger="weightsync.server")
    answering = threading.Event()
    release = threading.Event()

    def stuck_status(servicer) -> None:  # noqa: ANN001
        reply = servicer._status.reply

        def stuck(request):  # noqa: ANN001, ANN202
            answering.set()
            release.wait(120)
            return reply(request)

        servicer._status.reply = stuck

    results: list[object] = []
    try:
        with coordinator_in_process(tmp_path / "c.db", grace_s=0.5, prepare=stuck_status) as running:
            client = CoordinatorClient(running.address, retries=0)
            client.open_session("job", trainer=False)

            def call() -> None:
                try:
                    results.append(client.status("job"))
                except Exception as e:  # noqa: BLE001 - how it ended is the check
                    results.append(e)

            thread = threading.Thread(target=call)
            thread.start()
            assert answering.wait(30)
        thread.join(30)
    finally:
        release.set()
    client.close()
    assert len(results) == 1 and isinstance(results[0], WeightsyncError), results
    messages = [r.getMessage() for r in caplog.records if r.name == "weightsync.server"]
    assert f"the 0.5s {GRACE_OVER}{GET_STATUS} x1" in messages, messages
    assert not any(ENDED_ENDLESS in m for m in messages), messages


def test_a_follower_stops_at_once_though_its_watch_waits(tmp_path: Path) -> None:
    """Stopping a rollout cancels its follow loop's watch stream, so the thread ends at
    once though no event comes (here: none does), and SIGTERM does not wait for one."""
    from rollout_agent.sync.follow import FollowStop, follow_servable
    from tests.conftest import coordinator_in_process

    with coordinator_in_process(tmp_path / "c.db") as running, CoordinatorClient(running.address) as client:
        client.open_session("job", trainer=False)
        stop = FollowStop()
        seen: list[int] = []
        thread = threading.Thread(target=follow_servable, args=(client, "job", lambda v, g: seen.append(v), stop))
        thread.start()
        eventually(lambda: running.calls.by_method().get("/weightsync.v1.Coordinator/WatchVersions") == 1)
        stop.set()
        thread.join(30)
        assert not thread.is_alive(), "the follow loop still waits in its watch stream"
        eventually(lambda: "/weightsync.v1.Coordinator/WatchVersions" not in running.calls.by_method())
        assert seen == []


def _sigterm_to_a_thread_not_main(pid: int) -> int:
    """SIGTERM to one of `pid`'s threads other than its main one that does not block it, as
    the kernel may give a process's SIGTERM to any such thread; that thread's id."""
    for tid in sorted(int(t) for t in os.listdir(f"/proc/{pid}/task") if int(t) != pid):
        with open(f"/proc/{pid}/task/{tid}/status") as f:
            blocked = int(next(line for line in f if line.startswith("SigBlk:")).split()[1], 16)
        if not blocked & (1 << (signal.SIGTERM - 1)):
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.tgkill(pid, tid, signal.SIGTERM) != 0:
                raise OSError(ctypes.get_errno(), f"tgkill {pid} {tid}")
            return tid
    raise AssertionError(f"no thread of {pid} but its main one takes SIGTERM")


def test_each_server_stops_on_a_sigterm_a_thread_other_than_main_took(cluster: Cluster) -> None:
    """A server's main thread waits for its stop in slices (weightsync.signal_wait): a
    SIGTERM another thread took (4 to 15 of 40 here) still runs its handler, and the server
    stops as on any SIGTERM. A rollout's unbounded `stop.wait()` slept through it."""
    coord = cluster.start_coordinator()
    trainer = cluster.start_trainer("t1", coord.address, "job", [*TINY, "--steps", "1", "--hold"])
    rollout = cluster.start_rollout("r0", coord.address, "job")
    eventually(lambda: rollout_status(rollout.address).current_version == 1, what="r0 at version 1")
    for proc in (rollout, trainer, coord):
        _sigterm_to_a_thread_not_main(proc.pid)
        try:
            code = proc.popen.wait(STOPPED_WITHIN_S)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{proc.name} still runs {STOPPED_WITHIN_S}s after its SIGTERM") from None
        assert code == 0, f"{proc.name} exited {code}"
        assert "received SIGTERM, shutting down" in proc.log(), proc.log()[-3000:]
