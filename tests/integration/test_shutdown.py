"""What a server's shutdown waits for: calls that end by themselves get the grace; streams
that end only when their client leaves (a health Watch, a reflection conversation, the
coordinator's watch and heartbeat streams) do not hold it."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from devtools.cluster import Cluster
from tests.integration.support import eventually, rollout_status
from weightsync.client import CoordinatorClient

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
            for answer in stub.Watch(health_pb2.HealthCheckRequest(service=""), timeout=60):
                self.statuses.append(health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status))
                self._first.set()
        except grpc.RpcError as e:
            self.statuses.append(e.code().name)

    def close(self) -> None:
        self._thread.join(10)
        self._channel.close()


def test_a_health_watch_does_not_hold_any_server_at_shutdown(cluster: Cluster) -> None:
    """A health Watch kept open held each server's SIGTERM for its whole 5 s grace: the
    server waited for a call only its client ends. Each now stops within a second, and the
    watch sees NOT_SERVING before its call is ended."""
    coord = cluster.start_coordinator()
    trainer = cluster.start_trainer("t1", coord.address, "job", [*TINY, "--steps", "1", "--hold"])
    rollout = cluster.start_rollout("r0", coord.address, "job")
    eventually(lambda: rollout_status(rollout.address).current_version == 1, what="r0 at version 1")
    for proc in (rollout, trainer, coord):
        watch = HealthWatch(proc.address)
        t0 = time.monotonic()
        assert cluster.stop(proc.name) == 0
        stopped_s = time.monotonic() - t0
        watch.close()
        assert stopped_s < 1.5, f"{proc.name} took {stopped_s:.1f}s to stop (a health watch was open)"
        assert watch.statuses[0] == "SERVING" and "NOT_SERVING" in watch.statuses, watch.statuses
        assert watch.statuses[-1] in ("UNAVAILABLE", "CANCELLED"), watch.statuses


def test_a_call_in_flight_at_shutdown_still_gets_its_grace(tmp_path: Path) -> None:
    """The other half: a GetStatus that takes a second, in flight when the coordinator
    stops, is answered (not cancelled), while a watch stream open beside it ends."""
    from tests.conftest import coordinator_in_process

    answering = threading.Event()

    def slow_status(servicer) -> None:  # noqa: ANN001
        reply = servicer._status.reply

        def slowly(request):  # noqa: ANN001, ANN202
            answering.set()
            time.sleep(1.0)
            return reply(request)

        servicer._status.reply = slowly

    results: dict[str, object] = {}
    with coordinator_in_process(tmp_path / "c.db", grace_s=5.0, prepare=slow_status) as running:
        client = CoordinatorClient(running.address)
        client.open_session("job", trainer=False)

        def call(name, fn) -> None:  # noqa: ANN001
            try:
                results[name] = fn()
            except Exception as e:  # noqa: BLE001 - how it ended is the check
                results[name] = e

        threads = [
            threading.Thread(target=call, args=("watch", lambda: list(client.watch("job", 0, timeout_s=30)))),
            threading.Thread(target=call, args=("status", lambda: client.status("job"))),
        ]
        for t in threads:
            t.start()
        assert answering.wait(10)
        t0 = time.monotonic()
    stopped_s = time.monotonic() - t0
    for t in threads:
        t.join(10)
    client.close()
    assert results["watch"] == []  # ended by the coordinator as a return
    assert not isinstance(results["status"], Exception), results["status"]
    assert results["status"].session == "job"
    assert 0.5 < stopped_s < 2.5, stopped_s


def test_a_follower_stops_at_once_though_its_watch_waits(tmp_path: Path) -> None:
    """A rollout stopping set its follow loop's event and joined the thread for up to a
    second: the thread sat in its watch stream until the next event, so every rollout's
    SIGTERM took a second more (1.6 s, now 0.6 s). Stopping cancels the stream."""
    from rollout_agent.follow import FollowStop, follow_servable
    from tests.conftest import coordinator_in_process

    with coordinator_in_process(tmp_path / "c.db") as running, CoordinatorClient(running.address) as client:
        client.open_session("job", trainer=False)
        stop = FollowStop()
        seen: list[int] = []
        thread = threading.Thread(target=follow_servable, args=(client, "job", lambda v, g: seen.append(v), stop))
        thread.start()
        eventually(lambda: running.calls.by_method().get("/weightsync.v1.Coordinator/WatchVersions") == 1)
        t0 = time.monotonic()
        stop.set()
        thread.join(5)
        assert not thread.is_alive() and time.monotonic() - t0 < 0.5
        eventually(lambda: "/weightsync.v1.Coordinator/WatchVersions" not in running.calls.by_method())
        assert seen == []
