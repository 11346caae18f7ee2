"""Real processes on loopback: coordinator, JAX trainer(s) and rollout agents."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import grpc
import numpy as np
import pytest
from safetensors.numpy import load_file

from devtools.cluster import Cluster, Proc
from devtools.scrape import metric_value, scrape
from tests.integration.support import eventually, reflected_services, rollout_status, serving, state_name
from trainer_agent import synthetic
from weightsync._proto import rollout_agent_pb2 as rpb
from weightsync._proto import rollout_agent_pb2_grpc as rpb_grpc
from weightsync.client import CoordinatorClient

pytestmark = pytest.mark.slow
TINY = ["--model-size", "tiny"]


def test_publish_to_two_rollouts_commits_and_every_server_is_observable(cluster: Cluster) -> None:
    coord = cluster.start_coordinator()
    r0 = cluster.start_rollout("r0", coord.address, "job")
    r1 = cluster.start_rollout("r1", coord.address, "job")
    trainer = cluster.start_trainer(
        "trainer", coord.address, "job", [*TINY, "--steps", "2", "--min-rollouts", "2", "--hold"]
    )
    with CoordinatorClient(coord.address) as client:
        v2 = client.wait_for_version("job", 2, timeout_s=120)
        assert state_name(v2) == "COMMITTED"
        st = client.status("job")
        assert [state_name(v) for v in st.versions] == ["COMMITTED", "COMMITTED"]
        assert sorted((h.version, h.agent_id, h.ok) for h in st.handshakes) == [
            (1, "r0", True),
            (1, "r1", True),
            (2, "r0", True),
            (2, "r1", True),
        ]
    serving(r0.address, 2)
    serving(r1.address, 2)
    # a NumPy engine answers with a readout of the arrays it serves: the same bytes, the same
    # tokens; tagged with the version and its manifest digest
    ask = rpb.SampleRequest(prompt_token_ids=[5, 7], n=2, max_tokens=4, seed=3)
    answers = []
    for r in (r0, r1):
        with grpc.insecure_channel(r.address) as channel:
            answers.append(rpb_grpc.RolloutAgentStub(channel).Sample(ask, timeout=10).completions)
    digest = next(v.manifest_digest for v in st.versions if v.version == 2)
    assert [list(c.token_ids) for c in answers[0]] == [list(c.token_ids) for c in answers[1]]
    assert len(answers[0]) == 2 and answers[0][0].token_ids != answers[0][1].token_ids
    for c in (*answers[0], *answers[1]):
        assert (c.version, c.manifest_digest, len(c.token_ids)) == (2, digest, 4)
        assert c.fingerprint == f"weightsync:v2:{digest[:16]}"
    with grpc.insecure_channel(r0.address) as channel:
        with pytest.raises(grpc.RpcError) as e:
            rpb_grpc.RolloutAgentStub(channel).Sample(
                rpb.SampleRequest(prompt_token_ids=[1 << 20], n=1, max_tokens=1), timeout=10
            )
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompt_token_ids" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:  # checked before the engine is asked
            rpb_grpc.RolloutAgentStub(channel).Sample(
                rpb.SampleRequest(prompt_token_ids=[5], n=0, max_tokens=1), timeout=10
            )
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details().startswith("n: ")

    for proc, service in ((coord, "Coordinator"), (r0, "RolloutAgent"), (trainer, "TrainerAgent")):
        services = reflected_services(proc.address)
        assert f"weightsync.v1.{service}" in services and "grpc.health.v1.Health" in services
        text = scrape(proc.ready["metrics_port"])
        assert "weightsync_build_info{" in text and "weightsync_rpc_requests_total" in text
    assert metric_value(scrape(r0.ready["metrics_port"]), "weightsync_transfer_bytes_total", direction="pulled") > 0
    assert metric_value(scrape(r0.ready["metrics_port"]), "weightsync_current_version", role="rollout") == 2
    assert metric_value(scrape(trainer.ready["metrics_port"]), "weightsync_phase_seconds_count", phase="stage") == 2
    assert metric_value(scrape(coord.ready["metrics_port"]), "weightsync_session_version", kind="committed") == 2
    # the rollouts' leases and handshakes rode their heartbeat streams: no new call per version
    calls = scrape(coord.ready["metrics_port"])
    for method, carried in (("GetManifest", 4), ("ReportApplied", 4)):
        assert metric_value(calls, "weightsync_rpc_requests_total", method=f"Heartbeats.{method}", code="OK") == carried
        assert metric_value(calls, "weightsync_rpc_requests_total", method=method) == 0

    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "weightsync.cli",
            "--coordinator",
            coord.address,
            "--session",
            "job",
            "--json",
            "versions",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert [v["state"] for v in json.loads(out.stdout)] == ["COMMITTED", "COMMITTED"]
    human = subprocess.run(
        [sys.executable, "-m", "weightsync.cli", "--coordinator", coord.address, "--session", "job", "manifest", "2"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert "model.layers.1.mlp.down_proj.weight" in human.stdout
    assert cluster.stop("trainer") == 0  # SIGTERM: clean exit, arena unlinked (checked by the fixture)


def test_two_trainer_ranks_assemble_bit_exactly_and_stay_staging_until_both_seal(cluster: Cluster, tmp_path) -> None:  # noqa: ANN001
    coord = cluster.start_coordinator()
    dump = tmp_path / "dump"
    r0 = cluster.start_rollout("r0", coord.address, "job", ["--dump-dir", str(dump)])
    common = [
        *TINY,
        "--steps",
        "1",
        "--world-size",
        "2",
        "--incarnation",
        "run-a",
        "--weight-dtype",
        "float32",
        "--wait-commit",
        "false",
        "--hold",
    ]
    cluster.start_trainer("rank0", coord.address, "job", [*common, "--rank", "0"])
    with CoordinatorClient(coord.address) as client:
        v = eventually(lambda: client.status("job").versions, what="version 1 to appear")[0]
        assert state_name(v) == "STAGING" and v.sealed_ranks == 1 and v.trainer_ranks == 2
        assert rollout_status(r0.address).current_version == 0
        cluster.start_trainer("rank1", coord.address, "job", [*common, "--rank", "1"])
        assert state_name(client.wait_for_version("job", 1, timeout_s=120)) == "COMMITTED"
        st = client.status("job")
        assert st.generation == 1 and sorted(p.rank for p in st.parts) == [0, 1]
    got = load_file(str(dump / "v1.safetensors"))
    expected = synthetic.params_after("tiny", 0, 1)
    assert set(got) == set(expected)
    for name, value in expected.items():
        ref = np.asarray(value)
        assert got[name].dtype == ref.dtype and np.array_equal(got[name], ref), name


def test_a_following_rollout_refuses_to_go_back_and_one_that_does_not_follow_says_where_it_went(
    cluster: Cluster,
) -> None:
    """`Sync(version=1)` on a rollout following at version 2 is FAILED_PRECONDITION (applied,
    the engine would serve the older weights for good while its status, its heartbeats and
    the coordinator said 2); a rollout that does not follow goes back and says so."""
    coord = cluster.start_coordinator()
    follower = cluster.start_rollout("r0", coord.address, "job")
    chooser = cluster.start_rollout("r1", coord.address, "job", ["--follow", "false"])
    cluster.start_trainer(
        "trainer", coord.address, "job", [*TINY, "--steps", "2", "--slots", "3", "--wait-commit", "false", "--hold"]
    )
    eventually(lambda: rollout_status(follower.address).current_version == 2, what="r0 at version 2")

    def sync(proc: Proc, version: int) -> rpb.SyncResponse:
        with grpc.insecure_channel(proc.address) as channel:
            return rpb_grpc.RolloutAgentStub(channel).Sync(rpb.SyncRequest(version=version), timeout=60)

    with pytest.raises(grpc.RpcError) as refused:
        sync(follower, 1)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert refused.value.details().startswith("version: 1 is older than the applied version 2")
    assert rollout_status(follower.address).current_version == 2
    assert sync(follower, 2).ok  # the same version again: allowed
    assert sync(chooser, 2).ok and rollout_status(chooser.address).current_version == 2
    assert sync(chooser, 1).ok and rollout_status(chooser.address).current_version == 1


def test_a_rollout_with_nothing_to_sync_says_why(cluster: Cluster) -> None:
    """A rollout started with a session name no trainer publishes under says why it has
    nothing: past `--no-version-warn-s` it logs it once, and its status's last_error says
    it: no trainer opened the session, or one did and published nothing yet. A rollout
    that has a version says nothing."""
    coord = cluster.start_coordinator()
    quick = ["--no-version-warn-s", "1"]
    typo = cluster.start_rollout("typo", coord.address, "jbo", quick)
    cluster.start_trainer("trainer", coord.address, "job", [*TINY, "--steps", "0", "--hold"])
    early = cluster.start_rollout("early", coord.address, "job", quick)
    cluster.start_trainer(
        "trainer2", coord.address, "job2", [*TINY, "--steps", "1", "--wait-commit", "false", "--hold"]
    )
    with CoordinatorClient(coord.address) as client:
        eventually(lambda: client.status("job2", 1).versions, what="job2's version 1")
    fed = cluster.start_rollout("fed", coord.address, "job2", quick)
    said = eventually(lambda: rollout_status(typo.address).last_error, timeout_s=30, what="typo's warning")
    assert "no version of session 'jbo' to sync" in said and "no trainer has opened it" in said
    assert said in typo.log()
    said = eventually(lambda: rollout_status(early.address).last_error, timeout_s=30, what="early's warning")
    assert "trainer (generation 1) has published no version yet" in said
    eventually(lambda: rollout_status(fed.address).current_version == 1, what="fed at version 1")
    time.sleep(1.5)  # past its warning time
    assert "no version of session" not in fed.log()


@pytest.mark.parametrize("mode", ["grpc", "tcp"])
def test_chunk_corrupted_in_flight_is_refetched(cluster: Cluster, mode: str) -> None:
    coord = cluster.start_coordinator()
    r0 = cluster.start_rollout("r0", coord.address, "job")
    # Two corruptions, one fewer than the puller's 3 attempts: lanes race, so both may hit the
    # same chunk (its first fetch and its re-fetch), and the third attempt must still succeed.
    # Each flips a chunk's last byte, which may be alignment padding between tensors: no
    # tensor check sees that one, and nothing reads it, so 1 or 2 chunks are re-fetched.
    cluster.start_trainer(
        "trainer",
        coord.address,
        "job",
        [
            *TINY,
            "--steps",
            "1",
            "--chunk-bytes",
            "65536",
            "--weight-sync-mode",
            mode,
            "--failpoints",
            "chunk_server.corrupt_chunk=2",
        ],
    )
    assert cluster.wait_exit("trainer", 120) == 0  # waited for COMMITTED
    status = serving(r0.address, 1)
    assert 1 <= status.chunk_retries <= 2 and status.syncs_failed == 0
    failures = metric_value(scrape(r0.ready["metrics_port"]), "weightsync_digest_failures_total")
    assert failures == status.chunk_retries


def test_wrong_assembled_byte_fails_handshake_and_next_version_applies(cluster: Cluster, tmp_path) -> None:  # noqa: ANN001
    coord = cluster.start_coordinator()
    good = cluster.start_rollout("good", coord.address, "job")
    bad = cluster.start_rollout(
        "bad", coord.address, "job", ["--failpoints", "puller.corrupt_assembled=2", "--dump-dir", str(tmp_path / "bad")]
    )
    cluster.start_trainer(
        "trainer",
        coord.address,
        "job",
        [*TINY, "--steps", "1", "--min-rollouts", "2", "--wait-commit", "false", "--hold"],
    )
    with CoordinatorClient(coord.address) as client:
        v1 = client.wait_for_version("job", 1, timeout_s=120)
        assert state_name(v1) == "PARTIAL" and "bad" in v1.reason
        hs = {h.agent_id: h for h in client.status("job").handshakes if h.version == 1}
        assert hs["good"].ok and not hs["bad"].ok and "model.embed_tokens.weight" in hs["bad"].mismatch
    assert rollout_status(bad.address).current_version == 0  # live weights untouched
    assert not (tmp_path / "bad" / "v1.safetensors").exists()
    serving(good.address, 1)
    cluster.stop("trainer")
    cluster.start_trainer(
        "trainer2", coord.address, "job", [*TINY, "--steps", "1", "--start-version", "2", "--min-rollouts", "2"]
    )
    assert cluster.wait_exit("trainer2", 120) == 0
    serving(bad.address, 2)


def test_a_manifest_that_does_not_check_is_reported_failed_and_the_retry_commits(cluster: Cluster) -> None:
    """A manifest whose body does not check (its digest, a batch that does not build) is
    the round's failure, reported in a handshake: the version goes PARTIAL naming the
    rollout (it would otherwise wait READY on a rollout that never reports it), and the
    retry commits it."""
    from trainer_agent.publish.publisher import WeightPublisher
    from trainer_agent.settings import PublisherSettings

    coord = cluster.start_coordinator()
    r0 = cluster.start_rollout("r0", coord.address, "job", ["--failpoints", "puller.unchecked_manifest=1"])
    weights = {"model.norm.weight": np.arange(64, dtype=np.float32)}
    events = []
    with WeightPublisher(PublisherSettings(coordinator=coord.address, session="job")) as pub:
        pub.publish(weights, version=1)
        for e in pub.client.watch("job", 0, timeout_s=30):
            events.append((state_name(e.version), e.version.reason))
            if events[-1][0] == "COMMITTED":
                break
    assert events == [("STAGING", ""), ("READY", ""), ("PARTIAL", "handshake failed for r0"), ("COMMITTED", "")]
    metrics = scrape(r0.ready["metrics_port"])
    assert metric_value(metrics, "weightsync_sync_failures_total", reason="data_loss") == 1
    assert "does not check: failpoint puller.unchecked_manifest" in r0.log()


def test_coordinator_killed_and_restarted_keeps_session_and_continues(cluster: Cluster) -> None:
    from trainer_agent.publish.publisher import WeightPublisher
    from trainer_agent.settings import PublisherSettings

    coord = cluster.start_coordinator()
    port = coord.address.rsplit(":", 1)[1]
    r0 = cluster.start_rollout("r0", coord.address, "job")
    rng = np.random.default_rng(0)
    params = {
        "model.embed_tokens.weight": rng.standard_normal((256, 64)).astype(np.float32),
        "model.norm.weight": rng.standard_normal(64).astype(np.float32),
    }
    with WeightPublisher(
        PublisherSettings(coordinator=coord.address, session="job", min_rollouts=1, incarnation="run-1")
    ) as pub:
        pub.publish(params, 1)
        assert pub.wait_committed(1, 60) == "COMMITTED"
        generation = pub.generation
        cluster.kill("coordinator")  # SIGKILL: no graceful shutdown
        cluster.start_coordinator(name="coordinator-2", port=int(port))
        params = {k: v + 1 for k, v in params.items()}
        result = pub.publish(params, 2)
        assert result.state == "READY"
        assert pub.wait_committed(2, 60) == "COMMITTED"
        st = pub.client.status("job")
        assert st.generation == generation
        assert [(v.version, state_name(v)) for v in st.versions] == [(2, "COMMITTED"), (1, "COMMITTED")]
    eventually(lambda: rollout_status(r0.address).current_version == 2, what="rollout at version 2")


RELAY_TRAINER = ["--model-size", "small", "--steps", "1", "--chunk-bytes", "65536", "--weight-sync-mode", "relay"]


def _relay_chain_with_r1_stalled(cluster: Cluster, rollout_args: list[str]) -> tuple[str, dict[str, Proc], Proc]:
    """Coordinator, relays r0 -> r1 -> r2 -> r3 and a trainer publishing version 1, once r1
    has stalled mid-reply to r2 (a failpoint): (coordinator address, r0/r2/r3, trainer)."""
    coord = cluster.start_coordinator(args=["--lease-ttl-s", "2"])
    relay = ["--weight-sync-mode", "relay", "--window-chunks", "4", *rollout_args]
    rollouts = {name: cluster.start_rollout(name, coord.address, "job", relay) for name in ("r0", "r2", "r3")}
    cluster.start_rollout("r1", coord.address, "job", [*relay, "--failpoints", "relay.stall_after_chunks=5"])
    trainer = cluster.start_trainer("trainer", coord.address, "job", [*RELAY_TRAINER, "--min-rollouts", "3", "--hold"])
    eventually(
        lambda: "stalling this reply" in cluster.procs["r1"].log(), what="r1 to stall mid-transfer", timeout_s=120
    )
    return coord.address, rollouts, trainer


def test_a_frozen_relays_child_reads_from_the_trainer_within_the_relay_wait(cluster: Cluster) -> None:
    """A relay frozen (SIGSTOP) mid-reply keeps its connection open and sends nothing: a
    read from a relay gives it `--relay-wait-s` + 5 s of silence (a working relay sends a
    byte or gives up within its wait), far less than the data-plane deadline (120 s), before
    the child goes to the trainer. The rollouts after the child stay with their relays: when
    r2 ends its reply after its own wait, before it has left r1, r3 finds r2 still answering
    and asks it again, rather than reading the rest of the version from the trainer."""
    coordinator, rollouts, trainer = _relay_chain_with_r1_stalled(cluster, ["--relay-wait-s", "2"])
    cluster.procs["r1"].popen.send_signal(signal.SIGSTOP)
    try:
        with CoordinatorClient(coordinator) as client:
            assert state_name(client.wait_for_version("job", 1, timeout_s=60)) == "COMMITTED"
            hs = {h.agent_id: h.ok for h in client.status("job").handshakes if h.version == 1}
            assert all(hs[name] for name in rollouts), hs
            model_bytes = client.get_manifest("job", 1)[1].parts[0].total_bytes
        assert "no byte moved for 7s): pulling the rest from the trainer" in cluster.procs["r2"].log()
        r3 = cluster.procs["r3"].log()
        assert "still answers: asking it again" in r3 and "pulling the rest from the trainer" not in r3
        served = metric_value(
            scrape(trainer.ready["metrics_port"]), "weightsync_transfer_bytes_total", direction="served"
        )
        assert served <= 2 * model_bytes  # r0's whole version and what r2 never got from r1
    finally:
        cluster.procs["r1"].popen.send_signal(signal.SIGCONT)


def test_relay_killed_mid_transfer_its_child_finishes_from_the_trainer(cluster: Cluster) -> None:
    coordinator, rollouts, trainer = _relay_chain_with_r1_stalled(cluster, [])
    cluster.kill("r1")  # SIGKILL while r2 is reading from it
    with CoordinatorClient(coordinator) as client:
        assert state_name(client.wait_for_version("job", 1, timeout_s=120)) == "COMMITTED"
        hs = {h.agent_id: h.ok for h in client.status("job").handshakes if h.version == 1}
        assert all(hs[name] for name in rollouts), hs
        served_v1 = metric_value(
            scrape(trainer.ready["metrics_port"]), "weightsync_transfer_bytes_total", direction="served"
        )
        model_bytes = client.get_manifest("job", 1)[1].parts[0].total_bytes
        assert model_bytes < served_v1 <= 2 * model_bytes  # r2 re-read what r1 never sent, from the trainer
        assert "pulling the rest from the trainer" in cluster.procs["r2"].log()
        # once r1's lease is gone the chain is r0 -> r2 -> r3: the trainer sends version 2 once
        eventually(
            lambda: not any(a.alive for a in client.status("job").agents if a.agent_id == "r1"),
            what="r1's lease to end",
        )
        cluster.stop("trainer")
        trainer2 = cluster.start_trainer(
            "trainer2", coordinator, "job", [*RELAY_TRAINER, "--start-version", "2", "--hold"]
        )
        assert state_name(client.wait_for_version("job", 2, timeout_s=120)) == "COMMITTED"
        served = metric_value(
            scrape(trainer2.ready["metrics_port"]), "weightsync_transfer_bytes_total", direction="served"
        )
        assert served == model_bytes
    for proc in rollouts.values():
        serving(proc.address, 2)


@pytest.mark.parametrize("mode", ["tcp", "relay"])
def test_every_server_listens_and_syncs_on_ipv6(cluster: Cluster, mode: str) -> None:
    """IPv6-only and dual-stack clusters: `--host ::1` listens on `[::1]:port` (`::1:0`
    would be read by gRPC as `[::0.1.0.0]:443`), and the tcp data plane binds an IPv6
    socket for an IPv6 address."""
    v6 = ["--host", "::1"]
    coord = cluster.start_coordinator(args=v6)
    assert coord.address.startswith("[::1]:")
    r0 = cluster.start_rollout("r0", coord.address, "job", [*v6, "--weight-sync-mode", mode])
    r1 = cluster.start_rollout("r1", coord.address, "job", [*v6, "--weight-sync-mode", mode])
    cluster.start_trainer(
        "trainer",
        coord.address,
        "job",
        [*TINY, *v6, "--weight-sync-mode", mode, "--min-rollouts", "2", "--steps", "1", "--hold"],
    )  # one version: with more, a rollout may be on the next one when asked
    with CoordinatorClient(coord.address) as client:
        assert state_name(client.wait_for_version("job", 1, timeout_s=120)) == "COMMITTED"
        endpoints = [a.endpoint for a in client.status("job").agents]
    assert all(e.address.startswith("[::1]:") for e in endpoints)
    assert all(e.tcp_address.startswith("[::1]:") for e in endpoints if e.tcp_address)
    assert any(e.tcp_address for e in endpoints)  # the native data plane served
    serving(r0.address, 1)
    serving(r1.address, 1)


def _running(pid: int) -> bool:
    """Whether `pid` runs (a zombie no one reaped yet has ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_sigterm_to_the_process_holding_a_cluster_stops_its_processes(tmp_path) -> None:
    """Its processes run in sessions of their own: the holder's SIGTERM unwinds its `with`,
    which stops them, rather than ending it and leaving them running (a bench cut short)."""
    holder_code = (
        "import signal, sys, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_DFL)  # as a shell starts it, whatever started this test\n"
        "from devtools.cluster import Cluster\n"
        f"with Cluster({str(tmp_path)!r}) as c:\n"
        f"    print(c.start_coordinator(host='unix:{tmp_path}/c.sock').pid, flush=True)\n"
        "    for _ in range(1200): time.sleep(0.1)  # at work: a SIGTERM another thread took still runs the handler\n"
    )
    with subprocess.Popen([sys.executable, "-c", holder_code], stdout=subprocess.PIPE, text=True) as holder:
        try:
            assert holder.stdout is not None
            coordinator = int(holder.stdout.readline())
            assert _running(coordinator)
            holder.send_signal(signal.SIGTERM)
            assert holder.wait(30) == 128 + signal.SIGTERM
            eventually(lambda: not _running(coordinator), timeout_s=15, what="the coordinator stopped")
        finally:
            holder.kill()
