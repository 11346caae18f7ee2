"""In-process coordinator server against SQLite in tmp_path: watch fan-out, wsctl, client errors."""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import re
import subprocess
import sys
import threading
import time
from typing import Any

import grpc
import pytest

from tests.integration.support import eventually
from tests.unit.helpers import make_part, sample_arrays
from weightsync import wire
from weightsync._proto import coordinator_pb2 as cpb
from weightsync._proto import types_pb2 as tpb
from weightsync.client import CoordinatorClient
from weightsync.errors import AgentIdHeld, DeadlineExceeded, FailedPrecondition, InvalidArgument, NotFound
from weightsync.manifest import Endpoint, Part
from weightsync.server import RunningServer


def test_watch_fans_out_to_many_watchers(inprocess_coordinator: RunningServer) -> None:
    n = 64
    with CoordinatorClient(inprocess_coordinator.address) as client:
        gen = client.open_session("job", trainer=True, incarnation="a").generation
        ready = threading.Barrier(n + 1)
        seen: list[list[str]] = [[] for _ in range(n)]

        def watch(i: int) -> None:
            with CoordinatorClient(inprocess_coordinator.address) as c:
                stream = c.watch("job", 0, timeout_s=30)
                ready.wait()
                for ev in stream:
                    seen[i].append(tpb.VersionState.Name(ev.version.state))
                    if seen[i][-1] == "READY":
                        return

        threads = [threading.Thread(target=watch, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        ready.wait()
        part, _ = make_part(sample_arrays())
        client.publish_part("job", generation=gen, version=1, idempotency_key="k", part=part)
        for t in threads:
            t.join(30)
        assert all(s == ["STAGING", "READY"] for s in seen), seen


def test_client_raises_typed_errors_with_fields(inprocess_coordinator: RunningServer) -> None:
    with CoordinatorClient(inprocess_coordinator.address) as client:
        with pytest.raises(NotFound):
            client.status("missing")
        with pytest.raises(InvalidArgument) as exc:
            client.open_session("Bad Name", trainer=False)
        assert exc.value.field == "session"
        old = client.open_session("job", trainer=True, incarnation="a").generation
        client.open_session("job", trainer=True, incarnation="b")
        part, _ = make_part(sample_arrays())
        with pytest.raises(FailedPrecondition, match="generation"):
            client.publish_part("job", generation=old, version=1, idempotency_key="k", part=part)


def test_wsctl_watch_json_and_errors(inprocess_coordinator: RunningServer) -> None:
    with CoordinatorClient(inprocess_coordinator.address) as client:
        gen = client.open_session("job", trainer=True, incarnation="a").generation
        part, _ = make_part(sample_arrays())
        client.publish_part("job", generation=gen, version=1, idempotency_key="k", part=part)
    base = [sys.executable, "-m", "weightsync.cli", "--coordinator", inprocess_coordinator.address, "--session", "job"]
    out = subprocess.run(
        [*base, "--json", "watch", "--count", "2"], capture_output=True, text=True, timeout=60, check=True
    )
    events = [json.loads(line) for line in out.stdout.splitlines()]
    assert [e["version"]["state"] for e in events] == ["STAGING", "READY"]
    # --json after the subcommand; timestamps are google.protobuf.Timestamp: RFC 3339 in JSON
    out = subprocess.run([*base, "versions", "--json"], capture_output=True, text=True, timeout=60, check=True)
    (v1,) = json.loads(out.stdout)
    assert v1["state"] == "READY" and "committedAt" not in v1 and "committed_at" not in v1
    ready = v1.get("readyAt", v1.get("ready_at"))
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?Z", ready), ready
    bad = subprocess.run([*base, "manifest", "7"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "NOT_FOUND" in bad.stderr
    human = subprocess.run([*base, "status"], capture_output=True, text=True, timeout=60, check=True)
    assert "READY" in human.stdout and "generation 1" in human.stdout
    with CoordinatorClient(inprocess_coordinator.address) as client:  # a newer incarnation fences "t-a"
        client.register_agent("job", "t-a", trainer=True, endpoint=Endpoint(), generation=gen)
        client.open_session("job", trainer=True, incarnation="b")
    fenced = subprocess.run(
        [*base, "status"], capture_output=True, text=True, timeout=60, check=True, env={**os.environ, "COLUMNS": "200"}
    )
    assert "generation 2" in fenced.stdout and "1 (fenced)" in fenced.stdout


def test_heartbeats_follow_the_lease_ttl_the_coordinator_returns(tmp_path) -> None:  # noqa: ANN001
    from tests.conftest import coordinator_in_process
    from weightsync.heartbeat import Heartbeat
    from weightsync.lease import heartbeat_interval_s, relay_fresh_s

    assert heartbeat_interval_s(10.0) == 2.5 and heartbeat_interval_s(60.0) == 15.0 and relay_fresh_s(2.0) == 2 * 0.5
    with (
        coordinator_in_process(tmp_path / "c.db", lease_ttl_s=SHORT_TTL_S) as running,
        CoordinatorClient(running.address) as client,
    ):
        client.open_session("job", trainer=False)
        registrations = []

        def register() -> float:
            registrations.append(1)
            return client.register_agent("job", "r0", trainer=False, endpoint=Endpoint()).lease_ttl_seconds

        beat = Heartbeat(client, "job", "r0", current_version=lambda: 7, register=register).start()
        try:
            assert beat.interval_s == heartbeat_interval_s(SHORT_TTL_S) == 0.5
            renewed_for_leases(client, 2)  # kept only because beats came at the TTL's pace
            (agent,) = client.status("job").agents
            assert agent.alive and agent.current_version == 7
            assert registrations == [1]  # never lost the lease
            # the beats travelled on one Heartbeats stream, not as unary calls
            assert rpc_count(running, "Heartbeat") == 0 and rpc_count(running, "Heartbeats") == 0  # still open
            client.deregister_agent("job", "r0")  # the coordinator forgets it: NOT_FOUND ends the stream
            eventually(lambda: len(registrations) == 2, what="the agent to register again")
            eventually(lambda: bool(client.status("job").agents), what="the agent listed again")
            # the server counts a call when its handler returns, which can trail the client seeing the status
            eventually(lambda: rpc_count(running, "Heartbeats") == 1, what="the first stream counted as ended")
        finally:
            beat.stop()
        # the client cancelled the second stream; the server sees the cancellation a moment later
        eventually(lambda: rpc_count(running, "Heartbeats") == 2, timeout_s=10, what="the second stream counted")
        assert rpc_count(running, "Heartbeat") == 0


def test_a_heartbeat_outlives_an_exception_of_its_own_callbacks(tmp_path) -> None:  # noqa: ANN001
    """The lease lives on the heartbeat thread: an exception that is not a weightsync error
    (here from registering again after the lease was lost) must not end it, or the agent
    stays unregistered while it goes on as if it held a lease."""
    from tests.conftest import coordinator_in_process
    from weightsync.heartbeat import Heartbeat

    registrations = []
    with (
        coordinator_in_process(tmp_path / "c.db", lease_ttl_s=0.6) as running,
        CoordinatorClient(running.address) as client,
    ):
        client.open_session("job", trainer=False)

        def register() -> float:
            registrations.append(1)
            if len(registrations) == 2:
                raise RuntimeError("a bug in the agent's registration")
            return client.register_agent("job", "r0", trainer=False, endpoint=Endpoint()).lease_ttl_seconds

        beat = Heartbeat(client, "job", "r0", current_version=lambda: 7, register=register).start()
        try:
            client.deregister_agent("job", "r0")  # the coordinator forgets it: the beat registers again
            eventually(lambda: len(registrations) >= 3, timeout_s=10, what="registering again after the exception")
            eventually(lambda: [a.alive for a in client.status("job").agents] == [True], what="the agent listed again")
        finally:
            beat.stop()


def rpc_count(running: RunningServer, method: str, code: str = "") -> float:
    return sum(
        s.value
        for m in running.metrics.registry.collect()
        if m.name == "weightsync_rpc_requests"
        for s in m.samples
        if s.name.endswith("_total") and s.labels.get("method") == method and (not code or s.labels.get("code") == code)
    )


# A lease the default pace of beats (2.5 s, for a 10 s TTL) does not keep, while its own
# pace (0.5 s) keeps it through a stall of over a second.
SHORT_TTL_S = 2.0


def renewed_for_leases(client: CoordinatorClient, leases: int) -> None:
    """Waits until r0's lease, as first granted, has been renewed `leases` TTLs further."""

    def expires() -> datetime.datetime:
        (agent,) = client.status("job").agents
        return agent.lease_expires_at.ToDatetime()

    first = expires()
    further = datetime.timedelta(seconds=leases * SHORT_TTL_S)
    eventually(lambda: expires() - first >= further, what=f"the lease renewed for {leases} TTLs")


def test_heartbeats_fall_back_to_unary_calls_on_a_coordinator_without_the_stream(tmp_path) -> None:  # noqa: ANN001
    """A coordinator from before Heartbeats (UNIMPLEMENTED) still renews the lease."""
    from coordinator.servicer import CoordinatorServicer
    from tests.conftest import coordinator_in_process
    from weightsync._proto import coordinator_pb2_grpc as pb_grpc
    from weightsync.heartbeat import Heartbeat

    old = CoordinatorServicer.Heartbeats
    CoordinatorServicer.Heartbeats = pb_grpc.CoordinatorServicer.Heartbeats  # the generated UNIMPLEMENTED
    try:
        with (
            coordinator_in_process(tmp_path / "c.db", lease_ttl_s=SHORT_TTL_S) as running,
            CoordinatorClient(running.address) as client,
        ):
            client.open_session("job", trainer=False)
            registrations = []

            def register() -> float:
                registrations.append(1)
                return client.register_agent("job", "r0", trainer=False, endpoint=Endpoint()).lease_ttl_seconds

            beat = Heartbeat(client, "job", "r0", current_version=lambda: 0, register=register).start()
            try:
                renewed_for_leases(client, 2)
                assert [a.alive for a in client.status("job").agents] == [True] and registrations == [1]
                # two leases on need two renewals at least, and the stream was refused
                assert rpc_count(running, "Heartbeat", "OK") >= 2
                from weightsync._proto import coordinator_pb2 as pb

                assert beat.carry("get_manifest", pb.GetManifestRequest(session="job"), 1) is None  # the RPC
            finally:
                beat.stop()
    finally:
        CoordinatorServicer.Heartbeats = old


def test_reflection_answers_v1_and_streams_are_not_timed(inprocess_coordinator: RunningServer) -> None:
    """grpcurl asks grpc.reflection.v1 first; a watch's hours must not swamp rpc_seconds."""
    from grpc_reflection.v1alpha import reflection_pb2

    with grpc.insecure_channel(inprocess_coordinator.address) as channel:
        call = channel.stream_stream(
            "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
            request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
            response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
        )
        (reply,) = list(call(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5))
        assert "weightsync.v1.Coordinator" in {s.name for s in reply.list_services_response.service}
    with CoordinatorClient(inprocess_coordinator.address) as client:
        client.open_session("job", trainer=False)
        with pytest.raises(DeadlineExceeded):
            list(client.watch("job", 0, timeout_s=0.5))
        client.status("job")
    from prometheus_client import generate_latest

    text = generate_latest(inprocess_coordinator.metrics.registry).decode()
    timed = [line for line in text.splitlines() if line.startswith("weightsync_rpc_seconds_count")]
    assert any('method="GetStatus"' in line for line in timed)
    assert not any('method="WatchVersions"' in line for line in timed)


def test_a_local_failure_is_answered_not_diagnosed_as_data_loss(inprocess_coordinator: RunningServer) -> None:
    from weightsync._proto import coordinator_pb2 as pb
    from weightsync.errors import DataLoss

    with CoordinatorClient(inprocess_coordinator.address) as client:
        gen = client.open_session("job", trainer=True, incarnation="a", min_rollouts=1).generation
        client.register_agent("job", "r0", trainer=False, endpoint=Endpoint())
        part, _ = make_part(sample_arrays())
        client.publish_part("job", generation=gen, version=1, idempotency_key="k", part=part)
        header, _ = client.get_manifest("job", 1, agent_id="r0")
        local = pb.ReportAppliedRequest(
            session="job",
            version=1,
            agent_id="r0",
            manifest_digest=header.version.manifest_digest,
            local_error="cannot open /dev/shm/x: permission denied",
        )
        answer = client.report_applied(local)  # recorded and answered: not a corruption
        assert not answer.ok and "permission denied" in answer.mismatch
        (hs,) = [h for h in client.status("job").handshakes if h.version == 1]
        assert not hs.ok and "permission denied" in hs.mismatch
        wrong = pb.ReportAppliedRequest(
            session="job", version=1, agent_id="r0", manifest_digest="0" * 64, consumed_names=["x"]
        )
        with pytest.raises(DataLoss, match="manifest digest"):
            client.report_applied(wrong)


def test_a_rollout_carries_its_lease_and_handshake_on_its_heartbeat_stream(tmp_path) -> None:  # noqa: ANN001
    """No new RPC per rollout per version: the leased GetManifest and ReportApplied travel
    on the Heartbeats stream, are answered as the RPCs would be, and a refusal (DATA_LOSS,
    NOT_FOUND) is an answer that leaves the stream beating."""
    from devtools.synthetic import good_report
    from tests.conftest import coordinator_in_process
    from weightsync._proto import coordinator_pb2 as pb
    from weightsync.errors import DigestMismatch, VersionNotFound
    from weightsync.heartbeat import Heartbeat

    with (
        coordinator_in_process(tmp_path / "c.db", lease_ttl_s=2.0) as running,
        CoordinatorClient(running.address) as trainer,
        CoordinatorClient(running.address) as client,
    ):
        gen = trainer.open_session("job", trainer=True, incarnation="a", min_rollouts=2).generation
        part, _ = make_part(sample_arrays())
        trainer.publish_part("job", generation=gen, version=1, idempotency_key="k", part=part)
        beats = {}
        for agent in ("r0", "r1"):
            client.register_agent("job", agent, trainer=False, endpoint=Endpoint())
            beats[agent] = Heartbeat(client, "job", agent, current_version=lambda: 0, register=lambda: 2.0).start()
        try:
            eventually(lambda: beats["r0"].carry("get_manifest", pb.GetManifestRequest(session="job"), 5) is not None)
            client.carrier = beats["r0"]
            header, manifest = client.get_manifest("job", 1, agent_id="r0")
            unary_header, unary_manifest = trainer.get_manifest("job", 1)  # no agent: not carried
            assert manifest.digest() == unary_manifest.digest() == header.version.manifest_digest
            assert header.access_token and unary_header.access_token == ""  # a leased read
            assert trainer.status("job").versions[0].leases == 1
            report = good_report("job", 1, header.version.manifest_digest, manifest)
            report.agent_id = "r0"
            assert client.report_applied(report).ok

            client.carrier = beats["r1"]
            header1, _ = client.get_manifest("job", 1, agent_id="r1")
            wrong = good_report("job", 1, header1.version.manifest_digest, manifest)
            wrong.agent_id = "r1"
            wrong.tensors[0].xxh3 ^= 1
            with pytest.raises(DigestMismatch, match=wrong.tensors[0].name):
                client.report_applied(wrong)
            with pytest.raises(VersionNotFound):
                client.get_manifest("job", 99, agent_id="r1")
            assert {a.agent_id for a in trainer.status("job").agents if a.alive} == {"r0", "r1"}
            assert rpc_count(running, "Heartbeats") == 0  # both streams still open after the refusals
            assert rpc_count(running, "Heartbeats.GetManifest") == 4  # the probe, r0, r1, version 99
            assert rpc_count(running, "Heartbeats.ReportApplied") == 2
            assert rpc_count(running, "GetManifest") == 1 and rpc_count(running, "ReportApplied") == 0
            (v1,) = [h for h in trainer.status("job").handshakes if h.agent_id == "r1"]
            assert not v1.ok and wrong.tensors[0].name in v1.mismatch
        finally:
            for beat in beats.values():
                beat.stop()
        client.carrier = beats["r0"]  # stopped: no stream carries, the RPC does
        client.get_manifest("job", 1, agent_id="r0")
        assert rpc_count(running, "GetManifest") == 2


def test_a_deleted_session_ends_its_watches_and_its_name_starts_afresh(inprocess_coordinator: RunningServer) -> None:
    """Deleting a finished job's session drops its retained versions and handshakes (kept
    for good otherwise) and ends its watches; its name starts afresh."""
    address = inprocess_coordinator.address
    with CoordinatorClient(address) as client:
        gen = client.open_session("job", trainer=True, incarnation="a").generation
        client.register_agent("job", "r0", trainer=False, endpoint=Endpoint())
        part, _ = make_part(sample_arrays())
        client.publish_part("job", generation=gen, version=1, idempotency_key="k", part=part)
        assert [v.version for v in client.status("job").versions] == [1]
        ended: list[BaseException] = []

        def watch() -> None:
            try:
                for _ in client.watch("job", 0, timeout_s=30):
                    pass
            except BaseException as e:  # noqa: BLE001 - what ended the stream is the check
                ended.append(e)

        watcher = threading.Thread(target=watch)
        watcher.start()
        with pytest.raises(FailedPrecondition, match="live lease, first 'r0'"):
            client.delete_session("job")
        assert [v.version for v in client.status("job").versions] == [1]  # refused: nothing changed
        base = [sys.executable, "-m", "weightsync.cli", "--coordinator", address, "--json"]
        out = subprocess.run([*base, "delete-session", "job", "--force"], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout) == {"versions": "1", "agents": 1}
        watcher.join(10)
        assert not watcher.is_alive() and isinstance(ended[0], NotFound)
        with pytest.raises(NotFound):
            client.status("job")
        again = subprocess.run([*base, "delete-session", "job"], capture_output=True, text=True, timeout=60)
        assert again.returncode == 2 and "NOT_FOUND" in again.stderr
        gen = client.open_session("job", trainer=True, incarnation="b").generation
        st = client.status("job")
        assert gen == 1 and list(st.versions) == [] and list(st.agents) == [] and list(st.handshakes) == []


def test_shutdown_ends_a_watch_that_waits_on_a_store_read_at_once(tmp_path) -> None:  # noqa: ANN001
    """A watch waiting on its feed's store read, not on the hub, is ended by the hub's
    close, as a return, wherever it waits, not after the server's whole grace (5 s)."""
    import asyncio

    from tests.conftest import coordinator_in_process

    reading = threading.Event()

    async def a_read_that_hangs(session: str, after_seq: int) -> list:
        reading.set()
        await asyncio.sleep(3600)
        return []

    def hang_reads(servicer) -> None:  # noqa: ANN001
        servicer._feed.after = a_read_that_hangs

    ended: list[object] = []
    # A grace no correct stop comes near: one that waits for the watch takes all 60 s.
    with coordinator_in_process(tmp_path / "c.db", grace_s=60.0, prepare=hang_reads) as running:
        client = CoordinatorClient(running.address)
        client.open_session("job", trainer=False)

        def watch() -> None:
            try:
                ended.append(list(client.watch("job", 0, timeout_s=300)))
            except BaseException as e:  # noqa: BLE001 - how it ended is the check
                ended.append(e)

        watcher = threading.Thread(target=watch)
        watcher.start()
        assert reading.wait(30)
        t0 = time.monotonic()
    stopped_s = time.monotonic() - t0  # the hub closed, then the server stopped
    watcher.join(30)
    client.close()
    assert ended == [[]]  # ended by the hub, as a return: no events, no error, not cancelled
    assert stopped_s < 20, f"the server waited {stopped_s:.1f}s of its 60 s grace for the watch"


def test_wsctl_aborts_and_releases_versions_for_the_current_trainer(inprocess_coordinator: RunningServer) -> None:
    """An operator unsticks a session without grpcurl or the trainer's generation: a version
    that cannot commit is aborted with a reason, and one a wedged rollout still leases is
    released only when forced; bad input is refused naming what is wrong, changing nothing."""
    with CoordinatorClient(inprocess_coordinator.address) as client:
        gen = client.open_session("job", trainer=True, incarnation="a").generation
        for version in (1, 2):
            part, _ = make_part(sample_arrays())
            client.publish_part("job", generation=gen, version=version, idempotency_key=f"k{version}", part=part)
        client.register_agent("job", "r9", trainer=False, endpoint=Endpoint())
        client.get_manifest("job", 1, agent_id="r9")  # r9 leases version 1 (and never reports)
        client.open_session("job", trainer=True, incarnation="b")  # the trainer restarted: generation 2
    base = [sys.executable, "-m", "weightsync.cli", "--coordinator", inprocess_coordinator.address, "--session", "job"]

    def wsctl(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*base, *args], capture_output=True, text=True, timeout=60)

    def states() -> dict[int, str]:
        with CoordinatorClient(inprocess_coordinator.address) as client:
            return {v.version: tpb.VersionState.Name(v.state) for v in client.status("job").versions}

    leased = wsctl("release-version", "1")
    assert leased.returncode == 2 and "FAILED_PRECONDITION" in leased.stderr and "r9" in leased.stderr
    for refused, says in (
        (wsctl("release-version", "0"), "expected a number in [1"),
        (wsctl("abort-version", "2"), "--reason"),
        (wsctl("abort-version", "7", "--reason", "x"), "NOT_FOUND"),
        (wsctl("abort-version", "2", "--reason", "x", "--generation", str(gen)), "FAILED_PRECONDITION"),  # fenced
    ):
        assert refused.returncode == 2 and says in refused.stderr, refused.stderr
    assert states() == {1: "READY", 2: "READY"}
    forced = wsctl("release-version", "1", "--force", "--json")
    assert forced.returncode == 0, forced.stderr
    assert json.loads(forced.stdout)["state"] == "RELEASED"
    aborted = wsctl("abort-version", "2", "--reason", "bad batch at step 2")
    assert aborted.returncode == 0 and "FAILED" in aborted.stdout and "bad batch" in aborted.stdout, aborted.stdout
    assert states() == {1: "RELEASED", 2: "FAILED"}
    again = wsctl("abort-version", "2", "--reason", "twice")
    assert again.returncode == 2 and "FAILED_PRECONDITION" in again.stderr


def _publish_noting_threads(address: str, session: str, part: Part, requests: str) -> tuple[set[str], Any]:
    """Publishes `part` as version 1 of `session` (`publish_requests` = `requests`): (the
    threads that built its DescriptorBatches, the committed manifest)."""
    built_in: set[str] = set()
    real = tpb.DescriptorBatch

    def noting(*args: Any, **kwargs: Any) -> tpb.DescriptorBatch:
        built_in.add(threading.current_thread().name)
        return real(*args, **kwargs)

    with CoordinatorClient(address) as client:
        client.publish_requests = requests
        gen = client.open_session(session, trainer=True, incarnation="a").generation
        wire._tpb.DescriptorBatch = noting  # type: ignore[misc]
        try:
            client.publish_part(session, generation=gen, version=1, idempotency_key="k", part=part)
        finally:
            wire._tpb.DescriptorBatch = real  # type: ignore[misc]
        return built_in, client.get_manifest(session, 1)[1]


def test_a_part_serialized_before_its_call_commits_what_a_lazily_read_stream_does(
    inprocess_coordinator: RunningServer,
) -> None:
    """publish_part serializes its requests in the caller's thread (gRPC's per-call thread,
    or the client's loop thread, only sends bytes); the version it commits is the one the
    generated stub's lazily read stream commits, descriptor for descriptor."""
    part, _ = make_part(sample_arrays())
    here = {threading.current_thread().name}
    lazy_threads, lazy = _publish_noting_threads(inprocess_coordinator.address, "lazy", part, "lazy")
    assert lazy_threads and lazy_threads.isdisjoint(here)
    for requests in ("first", "loop"):
        threads, manifest = _publish_noting_threads(inprocess_coordinator.address, requests, part, requests)
        assert threads == here
        assert manifest.tensors and dataclasses.replace(lazy, session=requests) == manifest


def test_the_loop_sender_starts_no_thread_per_call_and_answers_typed_errors(
    inprocess_coordinator: RunningServer,
) -> None:
    part, _ = make_part(sample_arrays())
    with CoordinatorClient(inprocess_coordinator.address) as client:
        client.publish_requests = "loop"
        old = client.open_session("job", trainer=True, incarnation="a").generation
        gen = client.open_session("job", trainer=True, incarnation="b").generation
        with pytest.raises(FailedPrecondition, match="generation"):  # the status and its field, mapped
            client.publish_part("job", generation=old, version=1, idempotency_key="k", part=part)
        started = []
        real_start = threading.Thread.start
        caller = threading.current_thread()

        def noting_start(self: threading.Thread) -> None:
            # those the publishing thread starts: the in-process server's executor starts
            # its own workers, from its threads, as its load asks
            if threading.current_thread() is caller:
                started.append(self.name)
            real_start(self)

        threading.Thread.start = noting_start  # type: ignore[method-assign]
        try:
            for v in (1, 2, 3):
                client.publish_part("job", generation=gen, version=v, idempotency_key=f"k{v}", part=part)
        finally:
            threading.Thread.start = real_start  # type: ignore[method-assign]
        assert started == []  # the loop's thread serves every call
        assert [v.version for v in client.status("job").versions][0] == 3
        client.publish_requests = "sometimes"
        with pytest.raises(InvalidArgument) as bad:
            client.publish_part("job", generation=gen, version=4, idempotency_key="k4", part=part)
        assert bad.value.field == "publish_requests"
    names = {t.name for t in threading.enumerate()}
    assert "weightsync-publish-send" not in names  # closed with its client


class _RegistersFirst:
    """A call carrier that, asked to carry a call, registers its agent through the same client
    first (the heartbeat thread's registration answering while the call, keyed before it,
    is on its way) and then has the client make the RPC."""

    def __init__(self, client: CoordinatorClient) -> None:
        self.client = client
        self.asked: list[str] = []

    def carry(self, call: str, request: Any, timeout_s: float) -> None:
        if not self.asked:
            self.client.register_agent("job", request.agent_id, trainer=False, endpoint=Endpoint(), instance="i0")
        self.asked.append(request.agent_key)


def test_a_call_keyed_before_its_agent_s_registration_answered_is_sent_again_with_the_key(
    inprocess_coordinator: RunningServer,
) -> None:
    """A rollout's sync keyed its GetManifest while the heartbeat re-registered the id (the
    coordinator came up after the rollout): the coordinator bound the id before the call
    came, and refused it for want of the key. The client sends it once more with the key
    the registration answered; a call refused for another process's key is not sent again."""
    with CoordinatorClient(inprocess_coordinator.address, retries=0) as client:
        client.open_session("job", trainer=False)
        carrier = client.carrier = _RegistersFirst(client)
        with pytest.raises(NotFound) as exc:  # the key passed: no version 1 yet
            client.get_manifest("job", 1, agent_id="r0")
        assert type(exc.value).__name__ == "VersionNotFound"
        assert len(carrier.asked) == 2 and carrier.asked[0] == "" and len(carrier.asked[1]) == 64
        with CoordinatorClient(inprocess_coordinator.address, retries=0) as other:
            with pytest.raises(AgentIdHeld) as held:
                other.report_applied(cpb.ReportAppliedRequest(session="job", version=1, agent_id="r0"))
            assert held.value.field == "agent_id" and "registered by another rollout process" in held.value.message
            with pytest.raises(AgentIdHeld):
                other.heartbeat("job", "r0")
        assert client.heartbeat("job", "r0").lease_ttl_seconds > 0


def test_a_handshake_refused_while_another_process_holds_the_id_waits_in_the_outbox(tmp_path) -> None:  # noqa: ANN001
    """r0's lease lapsed and another process registered r0: r0's handshake is refused for
    its key. That is no verdict on the version: the outbox keeps it and sends it again once
    r0 registered again, and only the coordinator's answer then reaches the rollout."""
    from rollout_agent.sync.outbox import ReportOutbox
    from tests.conftest import coordinator_in_process

    with coordinator_in_process(tmp_path / "c.db", lease_ttl_s=0.5) as running:
        addr = running.address
        with CoordinatorClient(addr) as r0, CoordinatorClient(addr) as twin:
            gen = r0.open_session("job", trainer=True, incarnation="a").generation
            part, _ = make_part(sample_arrays())
            r0.publish_part("job", generation=gen, version=1, idempotency_key="k1", part=part)
            r0.register_agent("job", "r0", trainer=False, endpoint=Endpoint(), instance="first")
            r0.get_manifest("job", 1, agent_id="r0")
            time.sleep(1.0)  # r0 beats no more: its lease lapses
            twin.register_agent("job", "r0", trainer=False, endpoint=Endpoint(), instance="second")
            verdicts: list[tuple[int, bool, str]] = []
            outbox = ReportOutbox(r0, lambda v, ok, why: verdicts.append((v, ok, why)), max_backoff_s=0.2)
            try:
                outbox.put(cpb.ReportAppliedRequest(session="job", version=1, agent_id="r0"))
                time.sleep(1.5)  # several refused sends
                assert outbox.pending_version == 1 and verdicts == []
                time.sleep(1.0)  # the twin's lease lapses too
                r0.register_agent("job", "r0", trainer=False, endpoint=Endpoint(), instance="first")
                eventually(lambda: verdicts, what="the handshake delivered")
                assert outbox.pending_version == 0 and [v for v, _, _ in verdicts] == [1]
            finally:
                outbox.close()
