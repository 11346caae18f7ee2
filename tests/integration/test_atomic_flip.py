"""Atomic flips with real processes (docs/design.md "Atomic flips"): a coordinator, rollout
sidecars (NumPy engines) and a publisher in the test, an ATOMIC session, faults by kill -9
and failpoints.

Every test checks the flip's two promises from the rollouts' own accounts: no rollout
applied a version before its flip was decided (each applied report's flip time, the
rollout's clock, against the decision's, the coordinator's; one host), and once a version
committed every live rollout serves it. The fault tests run a fleet of 8 and sample every
rollout throughout (`Responses`: the NumPy engine answers with a readout of the arrays it
serves), checking each response as a client would: from a version that committed, with
its manifest digest, and the bytes of that version whole; and, once a flip completed,
every rollout answering from the same version.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import grpc
import numpy as np
import pytest
from google.protobuf.timestamp_pb2 import Timestamp
from grpc_health.v1 import health_pb2, health_pb2_grpc

from devtools.cluster import Cluster, Proc
from devtools.scrape import metric_value, scrape
from rollout_agent.agent import SERVICE_NAME
from rollout_agent.engines.readout import readout_tokens, weights_readout
from rollout_agent.sampling import sample_spec
from tests.integration.support import eventually, rollout_status, serving, state_name
from trainer_agent import synthetic
from trainer_agent.publish.publisher import WeightPublisher
from trainer_agent.settings import PublisherSettings
from weightsync._proto import coordinator_pb2 as cpb
from weightsync._proto import coordinator_pb2_grpc as cpb_grpc
from weightsync._proto import rollout_agent_pb2 as rpb
from weightsync._proto import rollout_agent_pb2_grpc as rpb_grpc
from weightsync._proto import types_pb2 as tpb
from weightsync.client import CoordinatorClient
from weightsync.errors import InvalidArgument
from weightsync.manifest import Endpoint
from weightsync.server import RunningServer
from weightsync.wire import unix_seconds

pytestmark = pytest.mark.slow
TTL = 2.0  # every lease here; agents beat every 0.5 s
CLOCKS_S = 0.01  # the coordinator's steady wall clock and a rollout's time.time(), one host
WEIGHTS = {f"layer.{i}.weight": np.full((64, 64), float(i), dtype=np.float32) for i in range(4)}
FLEET = 8  # the fault tests' rollouts
ASK = rpb.SampleRequest(prompt_token_ids=[1, 2], n=1, max_tokens=3, seed=5)


def weights(version: int) -> dict[str, np.ndarray]:
    return {name: w + version for name, w in WEIGHTS.items()} if version else {}


def answer_of(version: int) -> tuple[int, ...]:
    """What a NumPy rollout serving `version` answers `ASK` (0: the empty engine)."""
    spec = sample_spec(list(ASK.prompt_token_ids), ASK.n, ASK.max_tokens, ASK.seed)
    return readout_tokens(weights_readout(weights(version)), spec)[0]


def sample(address: str) -> rpb.SampledCompletion:
    with grpc.insecure_channel(address) as channel:
        return rpb_grpc.RolloutAgentStub(channel).Sample(ASK, timeout=10).completions[0]


class Responses:
    """Samples each rollout of `fleet` in turn on a thread while a test runs, as a client
    of the fleet would: what each answered (a killed one answers nothing)."""

    def __init__(self, fleet: list[Proc]) -> None:
        self.got: list[tuple[str, rpb.SampledCompletion]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(list(fleet),), daemon=True)
        self._thread.start()

    def _run(self, fleet: list[Proc]) -> None:
        channels = [(p.name, grpc.insecure_channel(p.address)) for p in fleet]
        try:
            while not self._stop.is_set():
                for name, channel in channels:
                    try:
                        answer = rpb_grpc.RolloutAgentStub(channel).Sample(ASK, timeout=2)
                    except grpc.RpcError:
                        continue
                    self.got.append((name, answer.completions[0]))
        finally:
            for _, channel in channels:
                channel.close()

    def __enter__(self) -> Responses:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)

    def check(self, coordinator: str) -> None:
        """Every response came from a version that committed (or the empty engine), named
        that version's manifest digest and was that version's bytes, whole."""
        with CoordinatorClient(coordinator) as client:
            versions = {v.version: v for v in client.status("job").versions}
        assert len(self.got) >= 10, f"{len(self.got)} responses sampled"
        for name, c in self.got:
            if c.version:
                v = versions[c.version]
                assert state_name(v) == "COMMITTED", (name, c.version, state_name(v), v.reason)
                assert c.manifest_digest == v.manifest_digest, (name, c.version)
            assert tuple(c.token_ids) == answer_of(c.version), (name, c.version)


def answering(fleet: list[Proc], version: int) -> None:
    """Every rollout of `fleet` answers from `version` (after a flip completed: no two differ)."""
    assert {p.name: sample(p.address).version for p in fleet} == {p.name: version for p in fleet}


def start_fleet(cluster: Cluster, coord: Proc, failpoints: dict[str, str] | None = None, n: int = FLEET) -> list[Proc]:
    """`n` rollouts r0.. started together, each with its failpoints."""
    procs = [
        cluster.start_rollout(
            f"r{i}", coord.address, "job", ["--failpoints", (failpoints or {}).get(f"r{i}", "")], wait=False
        )
        for i in range(n)
    ]
    return [cluster.wait_ready(p) for p in procs]


def publisher(coord: Proc, rollouts: int, **flip: str) -> WeightPublisher:
    settings = PublisherSettings(
        coordinator=coord.address, session="job", slots=3, min_rollouts=rollouts, flip_policy="atomic", **flip
    )
    return WeightPublisher(settings)


def registered(client: CoordinatorClient, names: list[str]) -> None:
    eventually(
        lambda: {a.agent_id for a in client.status("job").agents if a.alive} >= set(names),
        what=f"{names} registered",
    )


def check_flipped_together(client: CoordinatorClient, version: int, rollouts: list[Proc]) -> tpb.VersionInfo:
    """`version` COMMITTED; every applied report of it came after its decision; each of
    `rollouts` serves it."""
    v = client.wait_for_version("job", version, timeout_s=60)
    assert state_name(v) == "COMMITTED", v.reason
    v = next(x for x in client.status("job").versions if x.version == version)
    decided = unix_seconds(v.flip_decided_at)
    assert decided and v.flip_policy == tpb.ATOMIC
    applied = [h for h in client.status("job").handshakes if h.version == version]
    assert applied and all(h.ok for h in applied)
    for h in applied:  # nobody served the version before its flip was decided
        assert unix_seconds(h.flipped_at) >= decided - CLOCKS_S, (h.agent_id, unix_seconds(h.flipped_at), decided)
    for p in rollouts:
        serving(p.address, version)
    return v


def check_nobody_flipped(client: CoordinatorClient, version: int, rollouts: list[Proc], served: int) -> None:
    """`version` has no applied report, and each of `rollouts` still serves `served`."""
    assert not [h for h in client.status("job").handshakes if h.version == version]
    for p in rollouts:
        assert rollout_status(p.address).current_version == served, p.name


def test_an_atomic_session_flips_every_rollout_after_the_decision_and_reports_the_skew(cluster: Cluster) -> None:
    coord = cluster.start_coordinator(args=["--lease-ttl-s", str(TTL)])
    fleet = start_fleet(cluster, coord, n=3)
    with CoordinatorClient(coord.address) as client, publisher(coord, len(fleet)) as pub:
        registered(client, [p.name for p in fleet])
        for version in (1, 2):
            pub.publish(weights(version), version)
            v = check_flipped_together(client, version, fleet)
            assert v.prepared == len(fleet) and v.HasField("flip_skew_seconds")
        st = client.status("job")
        assert (st.flip_policy, st.prepared_loss, st.prepare_timeout_seconds) == (tpb.ATOMIC, tpb.FLIP_WITHOUT, 300)
    text = scrape(coord.ready["metrics_port"])
    assert metric_value(text, "weightsync_flip_skew_seconds_count", session="job", flip_policy="atomic") == 2
    wsctl = [sys.executable, "-m", "weightsync.cli", "--coordinator", coord.address, "--session", "job"]
    human = subprocess.run([*wsctl, "status"], capture_output=True, text=True, timeout=60, check=True).stdout
    assert "flip atomic" in human and "skew ms" in human
    raw = subprocess.run([*wsctl, "--json", "status"], capture_output=True, text=True, timeout=60, check=True).stdout
    assert json.loads(raw)["flip_policy"] == "ATOMIC"


def ready(address: str) -> bool:
    """The rollout's gRPC health for its service (its readiness probe): SERVING or not."""
    with grpc.insecure_channel(address) as channel:
        answer = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=5
        )
    return answer.status == health_pb2.HealthCheckResponse.SERVING


def http_ready(proc: Proc) -> int:
    """The status of the rollout's GET /ready on its metrics port (the TLS manifests' probe)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{proc.ready['metrics_port']}/ready", timeout=5) as answer:
            return int(answer.status)
    except urllib.error.HTTPError as e:
        return e.code


def test_a_joining_rollout_is_not_ready_until_it_serves_the_committed_version(cluster: Cluster) -> None:
    """r2 joins once version 1 committed; its handshake is held 3 s (failpoint): it holds
    the bytes, unconfirmed, and says NOT_SERVING until the coordinator confirmed them. It
    then flips version 2 with the fleet, ready throughout. Every "ready" it logged names a
    version that committed."""
    coord = cluster.start_coordinator(args=["--lease-ttl-s", str(TTL)])
    fleet = start_fleet(cluster, coord, n=FLEET - 1)
    with CoordinatorClient(coord.address) as client, publisher(coord, len(fleet)) as pub:
        registered(client, [p.name for p in fleet])
        pub.publish(weights(1), 1)
        check_flipped_together(client, 1, fleet)
        eventually(lambda: all(ready(p.address) for p in fleet), what="the fleet ready")
        name = f"r{FLEET - 1}"
        joiner = cluster.start_rollout(name, coord.address, "job", ["--failpoints", "sync.pause_before_report=1"])
        assert not ready(joiner.address)
        with Responses([*fleet, joiner]) as responses:
            eventually(lambda: "sync.pause_before_report" in joiner.log(), what=f"{name} holding version 1 unconfirmed")
            st = rollout_status(joiner.address)
            assert (st.ready, st.current_version, st.committed_version) == (False, 0, 1) and not ready(joiner.address)
            assert http_ready(joiner) == 503
            eventually(lambda: ready(joiner.address), what=f"{name} ready")
            assert http_ready(joiner) == 200
            assert rollout_status(joiner.address).current_version == 1
            fleet.append(joiner)
            registered(client, [p.name for p in fleet])
            pub.publish(weights(2), 2)
            check_flipped_together(client, 2, fleet)
            answering(fleet, 2)
        responses.check(coord.address)
        assert all(ready(p.address) and rollout_status(p.address).committed_version == 2 for p in fleet)
        committed = {v.version for v in client.status("job").versions if state_name(v) == "COMMITTED"}
    said = [int(m) for m in re.findall(r"\bpid=\d+ ready: serving version (\d+)", joiner.log())]
    assert said and set(said) <= committed, (said, committed)


def test_a_rollout_killed_while_it_prepares_aborts_the_version_and_nobody_flips(cluster: Cluster) -> None:
    coord = cluster.start_coordinator(args=["--lease-ttl-s", str(TTL)])
    fleet = start_fleet(cluster, coord, {"r2": "flip.pause_before_prepared=1"})
    rest = [p for p in fleet if p.name != "r2"]
    with CoordinatorClient(coord.address) as client, publisher(coord, 2) as pub, Responses(fleet) as responses:
        registered(client, [p.name for p in fleet])
        pub.publish(weights(1), 1)
        eventually(lambda: "before reporting version 1 PREPARED" in fleet[2].log(), what="r2 holding version 1")
        cluster.kill("r2")
        v1 = client.wait_for_version("job", 1, timeout_s=30)
        assert state_name(v1) == "FAILED" and "'r2' was lost" in v1.reason and v1.prepared == len(rest), v1.reason
        check_nobody_flipped(client, 1, rest, served=0)
        pub.publish(weights(2), 2)  # the fleet that is left flips the next one
        check_flipped_together(client, 2, rest)
        answering(rest, 2)
    responses.check(coord.address)


def test_a_rollout_whose_prepared_digest_differs_aborts_the_version_naming_it(cluster: Cluster) -> None:
    coord = cluster.start_coordinator(args=["--lease-ttl-s", str(TTL)])
    fleet = start_fleet(cluster, coord, {"r1": "flip.wrong_prepared_digest=1"})
    with CoordinatorClient(coord.address) as client, publisher(coord, len(fleet)) as pub, Responses(fleet) as responses:
        registered(client, [p.name for p in fleet])
        pub.publish(weights(1), 1)
        v1 = client.wait_for_version("job", 1, timeout_s=30)
        assert state_name(v1) == "FAILED" and "rollout 'r1'" in v1.reason and "xxh3" in v1.reason, v1.reason
        check_nobody_flipped(client, 1, fleet, served=0)
        pub.publish(weights(2), 2)
        check_flipped_together(client, 2, fleet)
        answering(fleet, 2)
    responses.check(coord.address)


def test_a_coordinator_lost_right_after_the_decision_has_every_rollout_flip_once_it_is_back(cluster: Cluster) -> None:
    db = str(cluster.workdir / "coordinator.db")
    args = ["--lease-ttl-s", str(TTL)]
    exits = ["--failpoints", "coordinator.exit_after_flip_decision=1"]
    coord = cluster.start_coordinator(db_path=db, args=[*args, *exits])
    port = int(coord.address.rsplit(":", 1)[1])
    fleet = start_fleet(cluster, coord)
    with CoordinatorClient(coord.address) as client, publisher(coord, len(fleet)) as pub, Responses(fleet) as responses:
        registered(client, [p.name for p in fleet])
        pub.publish(weights(1), 1)
        assert cluster.wait_exit("coordinator", 30) == 17  # the decision written, nobody told
        time.sleep(1.0)
        cluster.start_coordinator(name="coordinator-2", db_path=db, port=port, args=args)
        check_flipped_together(client, 1, fleet)
        answering(fleet, 1)
    responses.check(coord.address)
    assert "failpoint coordinator.exit_after_flip_decision" in coord.log()


@pytest.mark.parametrize("loss", ["flip_without", "abort_flip"])
def test_a_rollout_lost_after_it_prepared_follows_the_sessions_rule(cluster: Cluster, loss: str) -> None:
    """r2 prepares and is killed while r1 still prepares (paused past r2's lease): under
    flip_without r0 and r1 flip and commit, and r2, started again, comes back at the
    version; under abort_flip the version fails naming r2, and nobody flips."""
    coord = cluster.start_coordinator(args=["--lease-ttl-s", str(TTL)])
    fleet = start_fleet(cluster, coord, {"r1": "flip.pause_before_prepared=1"})
    rest = [p for p in fleet if p.name != "r2"]
    with (
        CoordinatorClient(coord.address) as client,
        publisher(coord, 2, prepared_loss=loss) as pub,
        Responses(fleet) as responses,
    ):
        registered(client, [p.name for p in fleet])
        pub.publish(weights(1), 1)
        eventually(lambda: "version 1 prepared" in fleet[2].log(), what="r2 to prepare version 1")
        cluster.kill("r2")
        v1 = client.wait_for_version("job", 1, timeout_s=30)
        if loss == "abort_flip":
            assert state_name(v1) == "FAILED" and "'r2' was lost after it prepared" in v1.reason, v1.reason
            dropped = ("not flipped", "version 1 is FAILED")  # prepared, or not yet when it failed
            eventually(lambda: all(any(d in p.log() for d in dropped) for p in rest), what="v1 dropped")
            check_nobody_flipped(client, 1, rest, served=0)
            answering(rest, 0)
        else:
            check_flipped_together(client, 1, rest)
            back = cluster.start("r2-again", "rollout_agent", ["--coordinator", coord.address, "--session", "job",
                                                               "--agent-id", "r2"])  # fmt: skip
            serving(back.address, 1)
            answering([*rest, back], 1)
    responses.check(coord.address)


def test_a_jax_rollout_and_a_numpy_one_flip_together_the_jax_one_from_what_it_built_aside(cluster: Cluster) -> None:
    """A JAX engine that swaps builds the version on its devices while it prepares, so its
    flip is the swap alone: its pause is a fraction of its apply."""
    coord = cluster.start_coordinator(args=["--lease-ttl-s", str(TTL)])
    jx = cluster.start_rollout("jx", coord.address, "job", ["--engine", "jax", "--jax-preset", "tiny"], wait=False)
    fleet = [cluster.start_rollout("np", coord.address, "job", wait=False), jx]
    fleet = [cluster.wait_ready(p) for p in fleet]
    with CoordinatorClient(coord.address) as client, publisher(coord, len(fleet)) as pub:
        registered(client, [p.name for p in fleet])
        pub.publish({k: np.asarray(v) for k, v in synthetic.params_after("tiny", 0, 1).items()}, 1)
        check_flipped_together(client, 1, fleet)
        (h,) = [h for h in client.status("job").handshakes if h.agent_id == "jx"]
        assert 0 < h.timings.pause_seconds < h.timings.apply_seconds
    assert metric_value(scrape(jx.ready["metrics_port"]), "weightsync_applies_total", session="job", mode="swap") == 1


def test_the_flip_fields_of_a_request_are_checked_naming_each_and_a_refusal_changes_nothing(
    inprocess_coordinator: RunningServer,
) -> None:
    address = inprocess_coordinator.address
    with CoordinatorClient(address) as client, grpc.insecure_channel(address) as channel:
        client.open_session("job", trainer=True, incarnation="a", flip_policy="atomic", prepare_timeout_s=30)
        stub = cpb_grpc.CoordinatorStub(channel)
        for bad, field in (
            ({"flip_policy": 7}, "flip_policy"),
            ({"prepared_loss": 9}, "prepared_loss"),
            ({"prepare_timeout_seconds": -1.0}, "prepare_timeout_seconds"),
            ({"prepare_timeout_seconds": float("nan")}, "prepare_timeout_seconds"),
        ):
            request = cpb.OpenSessionRequest(session="job", role=tpb.TRAINER, incarnation="b", **bad)
            with pytest.raises(grpc.RpcError) as e:
                stub.OpenSession(request, timeout=10)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details().startswith(f"{field}: ")
        st = client.status("job")
        assert (st.generation, st.flip_policy, st.prepare_timeout_seconds) == (1, tpb.ATOMIC, 30)
        client.register_agent("job", "r0", trainer=False, endpoint=Endpoint())
        flipped = Timestamp(seconds=1_700_000_000)
        for bad, field in (
            ({"prepared": True, "consumed_names": ["w"]}, "consumed_names"),
            ({"prepared": True, "flipped_at": flipped}, "flipped_at"),
            ({"flipped_at": Timestamp(seconds=-5)}, "flipped_at"),
            ({"flipped_at": Timestamp(seconds=1_700_000_000, nanos=2_000_000_000)}, "flipped_at"),
        ):
            request = cpb.ReportAppliedRequest(session="job", version=1, agent_id="r0", **bad)
            with pytest.raises(InvalidArgument) as refused:
                client.report_applied(request, retries=0)
            assert refused.value.field == field
