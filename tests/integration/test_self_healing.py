"""Transient faults heal by themselves: real processes, real signals, short leases.

Each test is one scenario of docs/failures.md, reproduced the way an
operator met it (SIGSTOP past the lease, a coordinator outage during a sync, a fenced
trainer, kill -9 and restart, SIGTERM, a pod without a shared /dev/shm).
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import numpy as np
import pytest

from devtools.cluster import Cluster, Proc
from devtools.scrape import metric_value, scrape
from tests.integration.support import eventually, free_port, rollout_status, serving, state_name
from tests.unit.helpers import damage
from trainer_agent.publish.publisher import WeightPublisher
from trainer_agent.settings import PublisherSettings
from weightsync._proto import rollout_agent_pb2 as rpb
from weightsync._proto import rollout_agent_pb2_grpc as rpb_grpc
from weightsync.arena_files import owner_alive
from weightsync.client import CoordinatorClient
from weightsync.errors import SessionNotFound, StaleGeneration
from weightsync.manifest import Endpoint

TINY = ["--model-size", "tiny"]
TTL = 2.0  # every lease in these tests; agents beat every 0.5 s (weightsync.lease)


def agents(client: CoordinatorClient, session: str = "job") -> dict[str, object]:
    return {a.agent_id: a for a in client.status(session).agents}


def test_a_rollout_paused_past_its_lease_registers_again_and_catches_up(cluster: Cluster) -> None:
    coord = cluster.start_coordinator(args=["--lease-ttl-s", str(TTL)])
    r0 = cluster.start_rollout("r0", coord.address, "job")
    cluster.start_trainer("t1", coord.address, "job", [*TINY, "--steps", "1", "--hold"])
    eventually(lambda: rollout_status(r0.address).current_version == 1, what="r0 at version 1")
    r0.popen.send_signal(signal.SIGSTOP)
    with CoordinatorClient(coord.address) as client:
        eventually(lambda: not agents(client)["r0"].alive, what="r0's lease to expire", timeout_s=3 * TTL)
        cluster.stop("t1")
        # published while r0 is frozen: READY, waiting for a rollout (min_rollouts 1)
        cluster.start_trainer(
            "t2",
            coord.address,
            "job",
            [*TINY, "--steps", "1", "--start-version", "2", "--wait-commit", "false", "--hold"],
        )
        assert state_name(client.wait_for_version("job", 2, states=("READY",), timeout_s=60)) == "READY"
        time.sleep(TTL)
        r0.popen.send_signal(signal.SIGCONT)
        t0 = time.monotonic()
        assert state_name(client.wait_for_version("job", 2, timeout_s=3 * TTL)) == "COMMITTED"
        eventually(lambda: rollout_status(r0.address).current_version == 2, what="r0 at version 2", timeout_s=3 * TTL)
        assert time.monotonic() - t0 < 3 * TTL
        assert agents(client)["r0"].alive
    assert "registering again" in r0.log()


def test_agents_notice_a_paused_coordinator_and_renew_their_leases_once_it_runs(cluster: Cluster) -> None:
    """A coordinator frozen (SIGSTOP) past the lease keeps its connections open: the beats on
    the open Heartbeats stream go unanswered, which ends the stream; once it runs again the
    agent beats on a new one (registering again if its lease lapsed)."""
    coord = cluster.start_coordinator(args=["--lease-ttl-s", str(TTL)])
    r0 = cluster.start_rollout("r0", coord.address, "job")
    with CoordinatorClient(coord.address) as client:
        eventually(lambda: agents(client).get("r0") is not None and agents(client)["r0"].alive, what="r0 registered")
        coord.popen.send_signal(signal.SIGSTOP)
        try:
            time.sleep(2 * TTL)
        finally:
            coord.popen.send_signal(signal.SIGCONT)
        t0 = time.monotonic()
        eventually(lambda: agents(client)["r0"].alive, what="r0's lease renewed", timeout_s=3 * TTL)
        assert time.monotonic() - t0 < 3 * TTL
        time.sleep(TTL)  # and it stays renewed
        assert agents(client)["r0"].alive
    assert "no answer to a heartbeat" in r0.log()
    assert r0.alive()
    # SIGTERM ends the agents' open heartbeat streams rather than waiting out the grace
    # period: the server waits only for calls that end by themselves
    # (tests/integration/test_shutdown.py), and its log says when a grace ran out.
    assert cluster.stop(coord.name, timeout_s=60) == 0
    assert "grace is over" not in coord.log(), "the coordinator waited out its grace for open streams"


def test_a_handshake_lost_in_a_coordinator_outage_is_delivered_after_it(cluster: Cluster) -> None:
    db = str(cluster.workdir / "coordinator.db")
    coord = cluster.start_coordinator(db_path=db, args=["--lease-ttl-s", str(TTL)])
    port = int(coord.address.rsplit(":", 1)[1])
    r0 = cluster.start_rollout("r0", coord.address, "job", ["--failpoints", "sync.pause_before_report=1"])
    cluster.start_trainer("t1", coord.address, "job", [*TINY, "--steps", "1", "--hold"])
    eventually(lambda: "pausing 3 s before the handshake" in r0.log(), what="r0 to hold its handshake")
    cluster.kill("coordinator")  # SIGKILL while r0 holds verified, applied bytes and an unsent report
    time.sleep(2 * TTL)  # the outage outlives every lease
    cluster.start_coordinator(name="coordinator-2", db_path=db, port=port, args=["--lease-ttl-s", str(TTL)])
    with CoordinatorClient(coord.address) as client:
        assert state_name(client.wait_for_version("job", 1, timeout_s=60)) == "COMMITTED"
        (hs,) = [h for h in client.status("job").handshakes if h.version == 1]
        assert hs.agent_id == "r0" and hs.ok
    eventually(lambda: rollout_status(r0.address).current_version == 1, what="r0 at version 1", timeout_s=3 * TTL)
    assert "not delivered" in r0.log()


def test_an_engine_that_fails_to_take_a_version_is_reported_and_the_rollout_tries_again(cluster: Cluster) -> None:
    """The applier (the engine) raising its own exception, not a weightsync error, must not
    end the rollout's sync thread: the round is a local failure, reported (the version goes
    PARTIAL) and retried. The trainer, waiting for each commit, serves the version on
    through PARTIAL; the retry commits it and training goes on to its last step."""
    coord = cluster.start_coordinator(args=["--lease-ttl-s", str(TTL)])
    r0 = cluster.start_rollout("r0", coord.address, "job", ["--failpoints", "applier.raise=1"])
    trainer = cluster.start_trainer("t1", coord.address, "job", [*TINY, "--steps", "3"])  # --wait-commit: default
    assert trainer.popen.wait(120) == 0, trainer.log()
    with CoordinatorClient(coord.address) as client:
        states = [state_name(v) for v in sorted(client.status("job").versions, key=lambda v: v.version)]
        assert states == ["RELEASED", "COMMITTED", "COMMITTED"]  # 1's slot took version 3
        events = []
        for e in client.watch("job", 0, timeout_s=30):
            events.append((e.version.version, state_name(e.version)))
            if events[-1] == (3, "COMMITTED"):
                break
        assert (1, "PARTIAL") in events and (1, "COMMITTED") in events  # healed, not ended, by the retry
    assert "applying version 1 failed: RuntimeError: failpoint applier.raise" in r0.log()
    assert "step=1 version=1 state=COMMITTED" in trainer.log()
    eventually(lambda: rollout_status(r0.address).current_version == 3, what="r0 at version 3")


def test_a_replaced_trainers_refused_version_leaves_the_committed_one_servable(cluster: Cluster) -> None:
    """Generation 1 publishes version 1 and every rollout applies it; a new incarnation
    (generation 2) publishes version 2, which every rollout refuses (each chunk it serves
    comes corrupted): PARTIAL. Past several lease TTLs and sweeps, version 1 is still
    COMMITTED and what `latest` names, and servable: a rollout started afterwards syncs
    `latest` and applies version 1 from the first trainer (fenced, serving on)."""
    coord = cluster.start_coordinator(args=["--lease-ttl-s", str(TTL)])
    rollouts = [cluster.start_rollout(f"r{i}", coord.address, "job") for i in range(2)]
    cluster.start_trainer(
        "t1", coord.address, "job", [*TINY, "--steps", "1", "--hold", "--stay-fenced", "--incarnation", "first"]
    )
    for r in rollouts:
        eventually(lambda r=r: rollout_status(r.address).current_version == 1, what=f"{r.name} at version 1")
    corrupting = ["--weight-sync-mode", "grpc", "--failpoints", "chunk_server.corrupt_chunk=1000000"]
    second = [*TINY, "--start-version", "2", "--steps", "1", "--hold", "--incarnation", "second", *corrupting]
    cluster.start_trainer("t2", coord.address, "job", second)
    with CoordinatorClient(coord.address) as client:
        assert state_name(client.wait_for_version("job", 2, timeout_s=120)) == "PARTIAL"
        time.sleep(3 * TTL)  # sweeps run; the rollouts retry version 2 and give up on it
        states = {v.version: state_name(v) for v in client.status("job").versions}
        assert states == {1: "COMMITTED", 2: "PARTIAL"}
        header, _ = client.get_manifest("job", 0)
        assert header.version.version == 1
    late = cluster.start_rollout("late", coord.address, "job", ["--follow", "false"])
    with grpc.insecure_channel(late.address) as channel:
        synced = rpb_grpc.RolloutAgentStub(channel).Sync(rpb.SyncRequest(version=0), timeout=60)
    assert synced.ok and synced.version == 1
    for r in rollouts:
        assert rollout_status(r.address).current_version == 1  # serving the committed version throughout


def test_a_database_another_process_holds_locked_is_waited_out_not_fatal(cluster: Cluster) -> None:
    """An operator's sqlite3 shell or a backup holding the database's write lock past
    SQLite's 5 s busy timeout: write RPCs meanwhile are UNAVAILABLE naming `database`
    (retryable, not INTERNAL), and the coordinator lives on, its housekeeping trying again
    until the lock is gone."""
    import sqlite3

    from weightsync.errors import TransportUnavailable

    db = str(cluster.workdir / "coordinator.db")
    coord = cluster.start_coordinator(db_path=db, args=["--lease-ttl-s", str(TTL)])
    with CoordinatorClient(coord.address, retries=0) as client:
        client.open_session("job", trainer=False)
        client.register_agent("job", "r0", trainer=False, endpoint=Endpoint())  # and never beats again
        other = sqlite3.connect(db, isolation_level=None)
        try:
            other.execute("BEGIN IMMEDIATE")
            with pytest.raises(TransportUnavailable, match="database: another process holds") as refused:
                client.register_agent("job", "r1", trainer=False, endpoint=Endpoint())
            assert refused.value.field == "database"
            eventually(lambda: "housekeeping failed" in coord.log(), timeout_s=20, what="a failed sweep")
        finally:
            other.execute("ROLLBACK")
            other.close()
        eventually(lambda: "housekeeping recovered" in coord.log(), timeout_s=20, what="the sweeps again")
        assert coord.alive()
        assert not agents(client)["r0"].alive  # its lease was swept once the lock was gone
        client.register_agent("job", "r1", trainer=False, endpoint=Endpoint())


def test_a_disk_that_fails_the_database_is_unavailable_and_the_fleet_goes_on_once_it_heals(cluster: Cluster) -> None:
    """A disk failing the database's writes (an I/O error, a file system remounted
    read-only, a quota; here a file-size limit the WAL runs into): every write, the
    trainer's publishes among them, is UNAVAILABLE naming `database`, not INTERNAL with a
    traceback; agents and the trainer try again, and go on once the disk does."""
    db, coord, r0, _trainer = _publishing_fleet(cluster)
    largest = max(f.stat().st_size for f in cluster.workdir.glob("coordinator.db*"))
    limit = ["prlimit", "--pid", str(coord.pid)]
    subprocess.run([*limit, f"--fsize={largest + (64 << 10)}:unlimited"], check=True)
    with CoordinatorClient(coord.address) as client:
        eventually(
            lambda: "the coordinator's disk failed the database" in cluster.procs["t1"].log() + r0.log(),
            timeout_s=60,
            what="a write refused by the disk",
        )
        subprocess.run([*limit, "--fsize=unlimited:unlimited"], check=True)
        later = client.status("job").versions[0].version + 1

        def committed_since() -> bool:
            return any(v.version >= later and state_name(v) == "COMMITTED" for v in client.status("job").versions)

        eventually(committed_since, timeout_s=60, what=f"a version >= {later} committed")
    eventually(lambda: rollout_status(r0.address).current_version >= later, what="r0 on versions since")
    assert coord.alive() and "Traceback" not in coord.log() and "INTERNAL" not in coord.log()


def _publishing_fleet(cluster: Cluster) -> tuple[Path, Proc, Proc, Proc]:
    """(database, coordinator, rollout r0, trainer): a trainer publishing every 0.5 s to
    one rollout, once version 2 has committed."""
    db = cluster.workdir / "coordinator.db"
    coord = cluster.start_coordinator(db_path=str(db), args=["--lease-ttl-s", str(TTL)])
    r0 = cluster.start_rollout("r0", coord.address, "job")
    trainer = cluster.start_trainer(
        "t1",
        coord.address,
        "job",
        [*TINY, "--steps", "200", "--step-interval-s", "0.5", "--wait-commit", "false", "--hold"],
    )
    with CoordinatorClient(coord.address) as client:
        client.wait_for_version("job", 2, states=("COMMITTED",), timeout_s=60)
    return db, coord, r0, trainer


def _restart_on_a_new_database_and_go_on(cluster: Cluster, db: Path, coord: Proc, r0: Proc) -> None:
    """Starts a coordinator where `coord` was and waits until a version published since
    commits and reaches r0."""
    port = int(coord.address.rsplit(":", 1)[1])
    cluster.start_coordinator(name="coordinator-2", db_path=str(db), port=port, args=["--lease-ttl-s", str(TTL)])
    with CoordinatorClient(coord.address) as client:
        first = eventually(lambda: client.status("job").versions, timeout_s=30, what="a version in the new database")
        later = first[-1].version + 1  # a rollout syncs the newest version: it may skip this one

        def committed_since() -> bool:
            return any(v.version >= later and state_name(v) == "COMMITTED" for v in client.status("job").versions)

        eventually(committed_since, timeout_s=60, what=f"a version >= {later} committed")
    eventually(lambda: rollout_status(r0.address).current_version >= later, what="r0 on the new coordinator's versions")


def test_a_coordinator_back_without_its_database_is_reattached_by_the_trainer(cluster: Cluster) -> None:
    """A coordinator rescheduled without its volume (emptyDir) comes back knowing no
    session: the trainer's next publish meets SessionNotFound, opens the session again as
    the same incarnation and trains on, and the fleet goes on from its next version (the
    rollouts would otherwise wait for a session nobody opens)."""
    db, coord, r0, trainer = _publishing_fleet(cluster)
    cluster.kill("coordinator")
    for f in cluster.workdir.glob("coordinator.db*"):
        f.unlink()  # the database, its WAL and its lock: a new volume
    _restart_on_a_new_database_and_go_on(cluster, db, coord, r0)
    assert trainer.alive() and "opening it again as incarnation" in trainer.log()


def test_a_library_publish_rides_out_a_coordinator_restart(cluster: Cluster) -> None:
    """A training loop as the README writes it (`pub.publish(params, version=step)`)
    rides out a coordinator restart longer than the client's own retries (8, ~11 s; cut
    to 2 here, under a second, so that a 4 s outage outlasts them): `publish` tries again
    for `publish_wait_s`, staging the version once and sending its part again, and so
    does `publish_stream`, which reads its items once."""
    args = ["--lease-ttl-s", str(TTL)]
    coord = cluster.start_coordinator(args=args)
    port = int(coord.address.rsplit(":", 1)[1])
    cluster.start_rollout("r0", coord.address, "job")
    # a free slot for each version: the outage meets the part's publish, not a release first
    settings = PublisherSettings(coordinator=coord.address, session="job", weight_dtype="float32", slots=3)
    weights = {"w": np.arange(4096, dtype=np.float32).reshape(64, 64)}
    publishes: dict[int, Callable[[WeightPublisher], object]] = {
        2: lambda pub: pub.publish({"w": weights["w"] + 1}, version=2),
        3: lambda pub: pub.publish_stream(iter([("w", weights["w"] + 2)]), 3, capacity_bytes=weights["w"].nbytes + 256),
    }
    with WeightPublisher(settings) as pub:
        pub._client.retries = 2
        pub.publish(weights, version=1)
        assert pub.wait_committed(1, 60) == "COMMITTED"
        for version, publish in publishes.items():
            cluster.kill("coordinator")
            outage_s = 4.0  # past the client's retries
            back = threading.Timer(outage_s, lambda: cluster.start_coordinator(port=port, args=args))
            back.start()
            started = time.monotonic()
            try:
                publish(pub)
            finally:
                back.join()
            assert time.monotonic() - started >= outage_s - 1
            assert pub.wait_committed(version, 60) == "COMMITTED"
        staged = pub.metrics.registry.get_sample_value(
            "weightsync_transfer_bytes_total", {"role": "trainer", "direction": "staged"}
        )
        assert staged == 3 * weights["w"].nbytes  # each version once


def test_a_session_made_again_is_followed_from_its_first_version(cluster: Cluster) -> None:
    """A new job on a session deleted and made again (or on a coordinator that lost its
    database) publishes from version 1. A rollout at version 3 of the old session,
    registering again, finds the session's identity changed and syncs the newest version
    of the new one, rather than taking 1 and 2 for versions it has passed (its old weights
    serving on, and the new versions waiting READY for its handshake). Both ways in turn:
    deleted (3 -> the new job's 2), then the database lost (2 -> a third job's 1)."""
    db = cluster.workdir / "coordinator.db"
    coord = cluster.start_coordinator(db_path=str(db), args=["--lease-ttl-s", str(TTL)])
    r0 = cluster.start_rollout("r0", coord.address, "job")
    cluster.start_trainer("old", coord.address, "job", [*TINY, "--steps", "3", "--hold"])
    eventually(lambda: rollout_status(r0.address).current_version == 3, what="r0 at the old job's version 3")
    port = int(coord.address.rsplit(":", 1)[1])
    for how, previous, job, steps in (("deleted", "old", "new", 2), ("database lost", "new", "third", 1)):
        made_again = r0.log().count("was made again")  # counted first: the rollout may register anew at once
        cluster.kill(previous)
        if how == "deleted":
            with CoordinatorClient(coord.address) as client:
                client.delete_session("job", force=True)
        else:
            cluster.kill("coordinator")
            for f in cluster.workdir.glob("coordinator.db*"):
                f.unlink()
            cluster.start_coordinator(name="again", db_path=str(db), port=port, args=["--lease-ttl-s", str(TTL)])
        eventually(lambda n=made_again: r0.log().count("was made again") > n, what=f"r0 to register anew ({how})")
        cluster.start_trainer(job, coord.address, "job", [*TINY, "--steps", str(steps), "--seed", "7", "--hold"])
        with CoordinatorClient(coord.address) as client:
            assert state_name(client.wait_for_version("job", steps, timeout_s=60)) == "COMMITTED", how
        eventually(
            lambda v=steps: rollout_status(r0.address).current_version == v, what=f"r0 at {job} job's version {steps}"
        )


def test_a_coordinator_whose_database_is_damaged_moves_it_aside_and_the_fleet_goes_on(cluster: Cluster) -> None:
    """A database damaged under a running coordinator (a torn write, a bad disk): the
    coordinator answers UNAVAILABLE naming `database`, moves the file aside and exits 4,
    rather than failing every request while its health says SERVING; restarted (as
    Kubernetes would), it begins a new database and the fleet attaches again, as after a
    lost volume."""
    db, coord, r0, trainer = _publishing_fleet(cluster)
    damage(db)
    assert cluster.wait_exit("coordinator", 30) == 4  # the next heartbeat's write meets it
    assert "the database is damaged" in coord.log() and "INTERNAL" not in coord.log()
    assert len(list(cluster.workdir.glob("coordinator.db.corrupt-*"))) >= 1
    _restart_on_a_new_database_and_go_on(cluster, db, coord, r0)
    assert trainer.alive()


def test_agents_started_before_their_coordinator_wait_for_it(cluster: Cluster) -> None:
    """Pods start in any order. A trainer whose coordinator is not up yet waits up to
    `attach_wait_s` (120 s) to open its session, well past the client's retries (~9 s); a
    rollout's beats register it once the coordinator answers."""
    port = free_port()
    address = f"127.0.0.1:{port}"
    trainer = cluster.start_trainer("t1", address, "job", [*TINY, "--steps", "1", "--hold"], wait=False)
    r0 = cluster.start_rollout("r0", address, "job")
    eventually(lambda: "attaching to coordinator" in trainer.log(), what="the trainer waiting for its coordinator")
    time.sleep(12)  # past the old give-up
    assert trainer.alive() and r0.alive()
    cluster.start_coordinator(port=port)
    with CoordinatorClient(address) as client:
        eventually(lambda: client.status("job"), what="the session opened")
        assert state_name(client.wait_for_version("job", 1, timeout_s=60)) == "COMMITTED"
    serving(r0.address, 1)


def test_a_fenced_trainer_changes_nothing_and_exits(cluster: Cluster) -> None:
    coord = cluster.start_coordinator(args=["--lease-ttl-s", str(TTL)])
    cluster.start_rollout("r0", coord.address, "job")
    old = cluster.start_trainer("old", coord.address, "job", [*TINY, "--steps", "2", "--incarnation", "a", "--hold"])
    with CoordinatorClient(coord.address) as client:
        assert state_name(client.wait_for_version("job", 2, timeout_s=60)) == "COMMITTED"
        generation = client.status("job").generation
        rng = np.random.default_rng(0)
        params = {"model.norm.weight": rng.standard_normal(64).astype(np.float32)}
        with WeightPublisher(
            PublisherSettings(coordinator=coord.address, session="job", incarnation="b", slots=1)
        ).start(next_version=3) as fenced:
            fenced.publish(params, 3)
            assert client.wait_for_version("job", 3, timeout_s=60)
            # a third incarnation takes the session; `fenced` may not release or publish anything
            with CoordinatorClient(coord.address) as third:
                third.open_session("job", trainer=True, incarnation="c", next_version=5)
            before = [(v.version, v.state) for v in client.status("job").versions]
            with pytest.raises(StaleGeneration):
                fenced.client.release_version("job", 3, generation=fenced.generation, force=True)
            with pytest.raises(StaleGeneration):
                fenced.publish(params, 4)  # its slot holds version 3: the release is refused first
            assert [(v.version, v.state) for v in client.status("job").versions] == before
            eventually(lambda: fenced.fenced, what="the heartbeat to notice the fence")
            assert fenced.metrics.fenced.labels(session="job")._value.get() == 1  # noqa: SLF001 - the gauge's value
        # the old process noticed too: it logs once and exits (no --stay-fenced)
        assert cluster.wait_exit("old", 30) == 3
        assert old.log().count("fenced: session job moved to generation") == 1
        status = client.status("job")
        assert status.generation == generation + 2
        gens = {a.agent_id: a.generation for a in status.agents if a.role == 1}
        assert sorted(gens.values())[0] == generation  # status shows who is behind


def test_a_killed_trainers_arena_is_reclaimed_and_a_refused_restart_bumps_nothing(cluster: Cluster) -> None:
    coord = cluster.start_coordinator(args=["--lease-ttl-s", str(TTL)])
    cluster.start_rollout("r0", coord.address, "job")
    t1 = cluster.start_trainer("t1", coord.address, "job", [*TINY, "--steps", "1", "--hold"])
    with CoordinatorClient(coord.address) as client:
        client.wait_for_version("job", 1, timeout_s=60)
        arenas = sorted(Path("/dev/shm").glob(f"weightsync-job-r0-{t1.pid}-*"))
        assert len(arenas) == 1 and owner_alive(arenas[0])
        cluster.kill("t1")  # SIGKILL: no cleanup
        assert arenas[0].exists() and not owner_alive(arenas[0])
        generation = client.status("job").generation
        bad = cluster.start_trainer(
            "t2", coord.address, "job", [*TINY, "--steps", "1", "--start-version", "1"], wait=False
        )
        assert bad.popen.wait(60) != 0
        assert "not newer than the session's latest version 1" in bad.log()
        assert client.status("job").generation == generation  # the refused restart fenced nobody
        cluster.start_trainer("t3", coord.address, "job", [*TINY, "--steps", "1", "--start-version", "2", "--hold"])
        assert not arenas[0].exists()  # reclaimed by the next trainer on this host
        assert state_name(client.wait_for_version("job", 2, timeout_s=60)) == "COMMITTED"


def _peer_ports(pid: int) -> set[int]:
    """The remote ports of a process's TCP sockets (from /proc: its socket inodes, then
    the kernel's tables), closed and half-closed ones included."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            link = str(fd.readlink())
        except OSError:  # closed meanwhile
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    ports = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[9] in inodes:
                ports.add(int(fields[2].rsplit(":", 1)[1], 16))
    return ports


def _arenas_mapped(pid: int) -> list[str]:
    """The pids of the trainers whose arenas a process maps (unlinked ones included)."""
    maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
    return sorted({Path(line.split(None, 5)[-1]).name.split("-")[3] for line in maps if "/dev/shm/weightsync-" in line})


def test_a_rollout_lets_go_of_a_restarted_trainers_old_sources(cluster: Cluster) -> None:
    """Each trainer incarnation serves at a new address. A version closes the sources it
    does not read: no socket per lane per restart (tcp), and in shm no mapping of the old
    arena, whose pages (two slots of the model) would stay in memory after the arena was
    unlinked."""
    coord = cluster.start_coordinator(args=["--lease-ttl-s", str(TTL)])
    by_tcp = cluster.start_rollout("by_tcp", coord.address, "job", ["--weight-sync-mode", "tcp"])
    by_shm = cluster.start_rollout("by_shm", coord.address, "job", ["--weight-sync-mode", "shm"])
    killed: set[int] = set()  # the data ports of the trainers killed so far
    with CoordinatorClient(coord.address) as client:
        for version in (1, 2, 3):
            name = f"t{version}"
            trainer = cluster.start_trainer(
                name, coord.address, "job", [*TINY, "--steps", "1", "--start-version", str(version), "--hold"]
            )
            assert state_name(client.wait_for_version("job", version, timeout_s=60)) == "COMMITTED"
            for r in (by_tcp, by_shm):
                eventually(
                    lambda r=r, v=version: rollout_status(r.address).current_version == v, what=f"{r.name} at {version}"
                )
            assert not killed & _peer_ports(by_tcp.pid), "a socket to a killed trainer is still open"
            # the arena of this version's trainer, none of the killed ones'
            assert _arenas_mapped(by_shm.pid) == [str(trainer.pid)]
            endpoint = client.get_manifest("job", version)[1].parts[0].endpoint
            killed.add(int(endpoint.tcp_address.rsplit(":", 1)[1]))
            cluster.kill(name)


def test_what_a_killed_trainer_left_is_released_and_its_store_parts_removed(cluster: Cluster) -> None:
    """A version is released, and its fs part removed, by the trainer that published it,
    when it reuses the version's slot. For a trainer killed and replaced, the coordinator
    releases its versions once superseded by a newer COMMITTED one (1 by 2 as soon as the
    new generation attaches; 2, the newest committed, only once the new trainer commits
    4), and the new trainer removes their parts at its next publish, and those of a
    version it never published (a trainer killed between writing its part and publishing
    it)."""
    from weightsync.transports.fs import FsStore

    store = cluster.workdir / "store"
    fs = ["--weight-sync-mode", "fs", "--fs-root", str(store)]
    coord = cluster.start_coordinator(args=["--lease-ttl-s", str(TTL)])
    r0 = cluster.start_rollout("r0", coord.address, "job", fs)
    trainer = [*TINY, *fs, "--slots", "2", "--steps", "2", "--hold"]
    cluster.start_trainer("t1", coord.address, "job", trainer)
    with CoordinatorClient(coord.address) as client:
        assert state_name(client.wait_for_version("job", 2, timeout_s=60)) == "COMMITTED"
        cluster.kill("t1")
        FsStore(str(store)).write_part("job", 3, 0, b"its part, never published", content="0" * 16)
        cluster.start_trainer("t2", coord.address, "job", [*trainer, "--start-version", "4"])
        assert state_name(client.wait_for_version("job", 5, timeout_s=60)) == "COMMITTED"
        eventually(lambda: rollout_status(r0.address).current_version == 5, what="r0 at 5")
        states = {v.version: (state_name(v), v.reason) for v in client.status("job").versions}
        assert states[1] == ("RELEASED", "superseded by version 2 of trainer generation 1")
        assert states[2] == ("RELEASED", "superseded by version 4 of trainer generation 2")
        assert states[4][0] == states[5][0] == "COMMITTED" and 3 not in states
    assert FsStore(str(store)).versions("job") == [4, 5]  # nothing the replaced trainers left stays


def test_a_trainer_restarted_with_fewer_ranks_leaves_no_buffers_of_the_old_ones(cluster: Cluster) -> None:
    """After a 2-rank trainer comes back as 1 rank, a rollout keeps neither rank 1's
    receive buffer nor the joined copy of each tensor that was split across ranks (kept,
    they would hold 382 MiB beside a 255 MiB model's new part). `weightsync_held_bytes`
    says what it keeps."""
    coord = cluster.start_coordinator(args=["--lease-ttl-s", str(TTL)])
    r0 = cluster.start_rollout("r0", coord.address, "job")
    fp32 = [*TINY, "--weight-dtype", "float32", "--steps", "1", "--hold"]

    def held(kind: str) -> float:
        return metric_value(scrape(r0.ready["metrics_port"]), "weightsync_held_bytes", kind=kind)

    with CoordinatorClient(coord.address) as client:
        two = [*fp32, "--world-size", "2", "--incarnation", "two", "--wait-commit", "false"]
        for rank in (0, 1):
            cluster.start_trainer(f"rank{rank}", coord.address, "job", [*two, "--rank", str(rank)])
        assert state_name(client.wait_for_version("job", 1, timeout_s=120)) == "COMMITTED"
        model_bytes = sum(p.total_bytes for p in client.get_manifest("job", 1)[1].parts)
        eventually(lambda: rollout_status(r0.address).current_version == 1, what="r0 at version 1")
        assert held("receive") == model_bytes and held("assembly") > 0.9 * model_bytes  # nearly all split by rows
        cluster.kill("rank0")
        cluster.kill("rank1")
        cluster.start_trainer("one", coord.address, "job", [*fp32, "--start-version", "2"])
        assert state_name(client.wait_for_version("job", 2, timeout_s=120)) == "COMMITTED"
        eventually(lambda: rollout_status(r0.address).current_version == 2, what="r0 at version 2")
        part_bytes = client.get_manifest("job", 2)[1].parts[0].total_bytes
        assert (held("receive"), held("assembly")) == (part_bytes, 0)


def _leases(client: CoordinatorClient, version: int) -> int:
    return next((v.leases for v in client.status("job").versions if v.version == version), 0)


@pytest.mark.parametrize(
    ("mode", "applies"),
    [("tcp", ("atomic", "streaming")), ("grpc", ("atomic",)), ("relay", ("atomic", "atomic"))],
    ids=["tcp", "grpc", "relay"],
)
def test_a_pull_from_a_frozen_trainer_is_abandoned_for_its_replacements_version(
    cluster: Cluster, mode: str, applies: tuple[str, ...]
) -> None:
    """A trainer frozen (or its host cut off) mid-transfer keeps its connections open and
    sends nothing. A newer version from a newer trainer generation abandons the pull at
    once, not after `--timeout-s` per read, three reads (six minutes at the defaults); no
    handshake is sent for the abandoned version (nothing failed: it is not PARTIAL). In a
    relay chain the relay's child, left by its relay, leaves the frozen trainer too. One
    rollout per apply mode in `applies` (a streaming apply pulls in its own rounds)."""
    coord = cluster.start_coordinator(args=["--lease-ttl-s", str(TTL)])
    procs = [
        cluster.start_rollout(f"r{i}", coord.address, "job", ["--weight-sync-mode", mode, "--apply-mode", apply])
        for i, apply in enumerate(applies)
    ]
    rollouts = len(procs)
    for proc in procs:  # so that they pull version 1 from a frozen trainer
        proc.popen.send_signal(signal.SIGSTOP)
    trainer = ["--model-size", "small", "--steps", "1", "--weight-sync-mode", mode, "--hold"]
    t1 = cluster.start_trainer("t1", coord.address, "job", trainer)
    with CoordinatorClient(coord.address) as client:
        client.wait_for_version("job", 1, states=("READY",), timeout_s=60)
        t1.popen.send_signal(signal.SIGSTOP)
        try:
            for proc in procs:
                proc.popen.send_signal(signal.SIGCONT)
            eventually(lambda: _leases(client, 1) == rollouts, what="the rollouts pulling version 1, frozen")
            t0 = time.monotonic()
            cluster.start_trainer("t2", coord.address, "job", [*trainer, "--start-version", "2"])
            eventually(
                lambda: all(rollout_status(p.address).current_version == 2 for p in procs),
                what="every rollout at 2",
                timeout_s=60,
            )
            assert time.monotonic() - t0 < 60  # the frozen reads' own deadline alone is 120 s
            st = client.status("job")
            assert [h.version for h in st.handshakes] == [2] * rollouts
            # Version 1 got no handshake (not failed), and the frozen trainer will never
            # release it: the coordinator does, once nothing holds it.
            eventually(
                lambda: (
                    [(v.version, state_name(v), v.reason) for v in client.status("job").versions]
                    == [(2, "COMMITTED", ""), (1, "RELEASED", "superseded by version 2 of trainer generation 2")]
                ),
                what="version 1 released by the coordinator",
            )
        finally:
            t1.popen.send_signal(signal.SIGCONT)
    for proc in procs:
        assert "pull of version 1 abandoned: version 2 is servable from trainer generation 2" in proc.log()
        failures = scrape(proc.ready["metrics_port"])
        assert metric_value(failures, "weightsync_sync_failures_total", reason="abandoned") == 1


def _replace_while_pulling(
    cluster: Cluster, client: CoordinatorClient, t1: Proc, trainer: list[str], pull: threading.Thread, what: str
) -> None:
    """Freezes `t1` once its version 1 is READY, starts `pull` (of version 1), has a
    replacement publish version 2, and waits for `pull` to end: well before the frozen
    reads' own deadline (120 s, three times). The caller sends `t1` SIGCONT."""
    client.wait_for_version("job", 1, states=("READY",), timeout_s=60)
    t1.popen.send_signal(signal.SIGSTOP)
    pull.start()
    eventually(lambda: _leases(client, 1) == 1, what="version 1 pulled from the frozen trainer")
    cluster.start_trainer("t2", client.address, "job", [*trainer, "--start-version", "2"])
    client.wait_for_version("job", 2, states=("READY",), timeout_s=60)
    pull.join(timeout=20)
    assert not pull.is_alive(), f"{what} of version 1 still waits on the frozen trainer"


@pytest.mark.parametrize("apply_mode", ["atomic", "streaming"])
def test_a_pull_its_caller_chose_from_a_frozen_trainer_is_abandoned_once_its_replacement_publishes(
    cluster: Cluster, apply_mode: str
) -> None:
    """A vLLM worker without prefetch (`prefetch` off, or a streaming apply) has no follow
    loop: its update of version 1 from a frozen trainer would hold the engine for
    `--timeout-s` per read, three reads, while the replacement's version 2 is servable.
    Its `StaleWatch` ends that pull once version 2 is announced, and the next update
    takes 2."""
    from rollout_agent.engines.dict_applier import DictApplier
    from rollout_agent.pull.puller import WeightPuller
    from rollout_agent.sync.follow import StaleWatch
    from rollout_agent.sync.round import SyncResult, sync_version

    coord = cluster.start_coordinator(args=["--lease-ttl-s", "60"])  # the test's rollout beats no lease
    trainer = ["--model-size", "small", "--steps", "1", "--weight-sync-mode", "tcp", "--hold"]
    t1 = cluster.start_trainer("t1", coord.address, "job", trainer)
    client = CoordinatorClient(coord.address)
    client.register_agent("job", "r0", trainer=False, endpoint=Endpoint())
    puller = WeightPuller(client, "job", "r0", mode="tcp")
    watch = StaleWatch(puller)
    results: list[SyncResult] = []
    update = threading.Thread(
        target=lambda: results.append(sync_version(puller, DictApplier(), 1, apply_mode=apply_mode))
    )
    try:
        _replace_while_pulling(cluster, client, t1, trainer, update, "the update")
        (abandoned,) = results
        assert not abandoned.ok and abandoned.failure == "abandoned"
        assert "version 2 is servable from trainer generation 2" in abandoned.mismatch
        retried = sync_version(puller, DictApplier(), 0, apply_mode=apply_mode)
        assert (retried.version, retried.ok) == (2, True), retried.mismatch
    finally:
        t1.popen.send_signal(signal.SIGCONT)
        update.join(timeout=130)
        watch.close()
        puller.close()
        client.close()


def test_a_sync_its_orchestrator_chose_from_a_frozen_trainer_ends_once_the_replacement_publishes(
    cluster: Cluster,
) -> None:
    """A sidecar started with `--follow false` follows no version, but its `Sync` of
    version 1 from a frozen trainer ends, not OK, once version 2 is announced (not after
    `--timeout-s` per read, three reads), and the orchestrator's `Sync` of the
    replacement's version 2, queued behind it, applies 2."""
    coord = cluster.start_coordinator(args=["--lease-ttl-s", str(TTL)])
    chooser = cluster.start_rollout("r0", coord.address, "job", ["--follow", "false"])
    trainer = ["--model-size", "small", "--steps", "1", "--hold"]
    t1 = cluster.start_trainer("t1", coord.address, "job", trainer)

    def sync(version: int) -> rpb.SyncResponse:
        with grpc.insecure_channel(chooser.address) as channel:
            return rpb_grpc.RolloutAgentStub(channel).Sync(rpb.SyncRequest(version=version), timeout=400)

    replies: list[rpb.SyncResponse] = []
    first = threading.Thread(target=lambda: replies.append(sync(1)))
    with CoordinatorClient(coord.address) as client:
        try:
            _replace_while_pulling(cluster, client, t1, trainer, first, "the Sync")
            (abandoned,) = replies
            assert (abandoned.version, abandoned.ok) == (1, False)
            assert "version 2 is servable from trainer generation 2" in abandoned.mismatch
            assert sync(2).ok and rollout_status(chooser.address).current_version == 2
        finally:
            t1.popen.send_signal(signal.SIGCONT)
            first.join(timeout=400)
    assert (
        metric_value(scrape(chooser.ready["metrics_port"]), "weightsync_sync_failures_total", reason="abandoned") == 1
    )


def _vm_size(pid: int) -> int:
    return int(Path(f"/proc/{pid}/status").read_text().split("VmSize:")[1].split()[0]) * 1024


def test_a_rollout_that_cannot_allocate_its_receive_buffer_reports_it_and_syncs_once_it_can(cluster: Cluster) -> None:
    """A receive buffer that cannot be allocated (`MemoryError`: a host short of memory,
    an address-space limit) is the round's local failure, as an engine's own is: reported
    (the version goes `PARTIAL`, naming it, rather than waiting `READY` on a rollout alive
    and required), and a later sync commits it."""
    coord = cluster.start_coordinator(args=["--lease-ttl-s", str(TTL)])
    r0 = cluster.start_rollout("r0", coord.address, "job", ["--weight-sync-mode", "tcp"])
    # room for the process's threads, not for the 255 MiB model (the soft limit only: any
    # process may raise it back to the hard one)
    subprocess.run(["prlimit", f"--pid={r0.pid}", f"--as={_vm_size(r0.pid) + 150 * 2**20}:"], check=True)
    medium = ["--model-size", "medium", "--steps", "1", "--weight-sync-mode", "tcp", "--wait-commit", "false"]
    cluster.start_trainer("t1", coord.address, "job", [*medium, "--hold"])
    with CoordinatorClient(coord.address) as client:
        assert state_name(client.wait_for_version("job", 1, timeout_s=120)) == "PARTIAL"
        (first, *_) = [h for h in client.status("job").handshakes if h.version == 1]
        assert not first.ok and "pulling version 1 failed: MemoryError" in first.mismatch
        subprocess.run(["prlimit", f"--pid={r0.pid}", "--as=unlimited:"], check=True)
        with grpc.insecure_channel(r0.address) as channel:
            assert rpb_grpc.RolloutAgentStub(channel).Sync(rpb.SyncRequest(version=1), timeout=60).ok
        assert state_name(client.wait_for_version("job", 1, states=("COMMITTED",), timeout_s=30)) == "COMMITTED"
    serving(r0.address, 1)


def test_sigterm_flips_health_deregisters_and_exits_quickly(cluster: Cluster) -> None:
    coord = cluster.start_coordinator(args=["--lease-ttl-s", "30"])  # a long lease: only deregistering ends it soon
    cluster.start_rollout("r0", coord.address, "job")
    r1 = cluster.start_rollout("r1", coord.address, "job")
    cluster.start_trainer("t1", coord.address, "job", [*TINY, "--steps", "1", "--hold"])
    with CoordinatorClient(coord.address) as client:
        client.wait_for_version("job", 1, timeout_s=60)
        assert cluster.stop("r1", timeout_s=60) == 0  # a rollout that hangs on SIGTERM is killed: -9
        assert "grace is over" not in r1.log(), "r1 waited out its grace"
        assert "r1" not in agents(client)  # gone at once, not after its 30 s lease
        cluster.stop("t1")
        cluster.start_trainer("t2", coord.address, "job", [*TINY, "--steps", "1", "--start-version", "2", "--hold"])
        assert state_name(client.wait_for_version("job", 2, timeout_s=60)) == "COMMITTED"  # r1 is not waited for


@pytest.mark.parametrize(
    ("role", "flag", "code"),
    [
        ("coordinator", "--port", 2),
        ("rollout", "--metrics-port", 2),
        ("rollout", "--relay-port", 2),  # the rollout's own flag, not the trainer's tcp_port
        ("trainer", "--tcp-port", 1),
    ],
)
def test_a_port_taken_is_one_line_naming_the_flag(cluster: Cluster, role: str, flag: str, code: int) -> None:
    """A process whose port is taken (the coordinator, a trainer or rollout sidecar) exits
    with its code and one line naming the flag, not a traceback (grpc's RuntimeError
    "Failed to bind", an OSError from the metrics or tcp listener), whichever of its
    listeners was refused."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        if role == "coordinator":
            proc = cluster.start("coordinator", "coordinator", ["--db-path", ":memory:", flag, str(port)], wait=False)
        else:
            coord = cluster.start_coordinator()
            start = cluster.start_rollout if role == "rollout" else cluster.start_trainer
            relay = ["--weight-sync-mode", "relay"] if flag == "--relay-port" else []
            proc = start(role, coord.address, "job", [*relay, flag, str(port)], wait=False)
        assert cluster.wait_exit(role, 60) == code
    field = flag.removeprefix("--").replace("-", "_")
    assert f"{field}: cannot listen on 127.0.0.1:{port}" in proc.log() and "Traceback" not in proc.log()


def test_a_second_coordinator_on_the_same_database_refuses_to_start(cluster: Cluster) -> None:
    coord = cluster.start_coordinator()
    second = cluster.start(
        "coordinator-2", "coordinator", ["--db-path", coord.ready["db_path"], "--port", "0"], wait=False
    )
    assert second.popen.wait(30) == 2
    assert "in use by another coordinator" in second.log()


def test_agents_gone_past_the_window_are_forgotten_and_a_returning_one_registers_again(cluster: Cluster) -> None:
    """Rollout pods that come and go under new names leave every status reply once they
    are gone past the window, and so does a session only a rollout made (a mistyped
    --session) once it left; one that returns registers again."""
    coord = cluster.start_coordinator(args=["--lease-ttl-s", str(TTL), "--forget-agents-after-s", "1"])
    with CoordinatorClient(coord.address) as client:
        client.open_session("jbo", trainer=False)
        client.register_agent("jbo", "typo", trainer=False, endpoint=Endpoint())
        client.open_session("job", trainer=True, incarnation="x")
        for i in range(50):
            client.register_agent("job", f"pod-{i}", trainer=False, endpoint=Endpoint())
        assert len(agents(client)) == 50
        eventually(lambda: agents(client) == {}, timeout_s=TTL + 10, what="expired agents forgotten")
        assert "agent(s) expired over 1s ago forgotten" in coord.log()
        client.register_agent("job", "pod-7", trainer=False, endpoint=Endpoint())
        assert list(agents(client)) == ["pod-7"]
        eventually(lambda: "left empty forgotten: jbo" in coord.log(), timeout_s=3 * TTL + 10, what="jbo forgotten")
        with pytest.raises(SessionNotFound):
            client.status("jbo")


def test_a_second_process_under_a_live_rollouts_id_is_refused_and_a_restart_gets_it_back(cluster: Cluster) -> None:
    """Two rollout processes under one agent id (a Deployment whose template sets it)
    would beat one lease and answer for each other (one's handshake counted for both, one
    endpoint listed). The second is refused while the first's lease is live, and exits
    once it has waited three lease TTLs (the coordinator's, so a 60 s lease is waited out
    too); a container restarted after `kill -9` under the same id waits out its old lease
    and syncs."""
    coord = cluster.start_coordinator(args=["--lease-ttl-s", str(TTL)])
    r0 = cluster.start_rollout("r0", coord.address, "job")
    cluster.start_trainer("t1", coord.address, "job", [*TINY, "--steps", "1", "--hold"])
    eventually(lambda: rollout_status(r0.address).current_version == 1, what="r0 at version 1")
    twin = cluster.start_rollout("twin", coord.address, "job", ["--agent-id", "r0"], wait=False)
    with CoordinatorClient(coord.address) as client:
        assert cluster.wait_exit("twin", timeout_s=30) == 2
        assert "agent ids must be unique" in twin.log() and f"waiting up to {3 * TTL:.0f}s" in twin.log()
        (a,) = [x for x in client.status("job").agents if x.agent_id == "r0"]
        assert a.agent_id == "r0" and a.alive and a.endpoint.address == r0.address
        assert r0.alive()
        cluster.kill("r0")
        again = cluster.start_rollout("again", coord.address, "job", ["--agent-id", "r0"])
        eventually(lambda: rollout_status(again.address).current_version == 1, what="the restarted r0 at version 1")
        (a,) = [x for x in client.status("job").agents if x.agent_id == "r0"]
        assert a.alive and a.endpoint.address == again.address


def test_a_rollout_paused_while_another_process_took_its_id_takes_it_back_once_that_one_is_gone(
    cluster: Cluster,
) -> None:
    """Frozen past its lease, r0's id is registered by another process. Back, r0's beats
    carry r0's agent key and are refused (they would renew the other's lease under r0's id:
    one row, two processes answering for it), and r0 registers again once the other's lease
    lapses."""
    coord = cluster.start_coordinator(args=["--lease-ttl-s", str(TTL)])
    r0 = cluster.start_rollout("r0", coord.address, "job")
    cluster.start_trainer("t1", coord.address, "job", [*TINY, "--steps", "1", "--hold"])
    eventually(lambda: rollout_status(r0.address).current_version == 1, what="r0 at version 1")
    with CoordinatorClient(coord.address) as client:
        r0.popen.send_signal(signal.SIGSTOP)
        eventually(lambda: not agents(client)["r0"].alive, what="r0's lease to expire", timeout_s=3 * TTL)
        twin = cluster.start_rollout("twin", coord.address, "job", ["--agent-id", "r0"])
        r0.popen.send_signal(signal.SIGCONT)
        until = time.monotonic() + 2 * TTL
        while time.monotonic() < until:  # r0 beats and registers meanwhile: refused both ways
            (a,) = [x for x in client.status("job").agents if x.agent_id == "r0"]
            assert a.endpoint.address == twin.address
            time.sleep(0.2)
        eventually(lambda: "registered by another rollout process" in r0.log(), what="r0's beats refused")
        cluster.kill("twin")
        eventually(lambda: agents(client)["r0"].endpoint.address == r0.address, what="r0 registered again")
        assert agents(client)["r0"].alive and r0.alive()


def test_a_rollout_whose_id_another_process_holds_syncs_the_version_it_was_refused_once_it_is_back(
    cluster: Cluster,
) -> None:
    """Thawed while another process holds its id, r0 is announced version 1 and its lease of
    the manifest is refused (its key is not the holder's). That refusal is no verdict on the
    version: r0 tries again, and applies it once its beats took the id back. (It gave the
    version up for good: a rollout serving nothing while its coordinator saw it live.)"""
    coord = cluster.start_coordinator(args=["--lease-ttl-s", str(TTL)])
    r0 = cluster.start_rollout("r0", coord.address, "job")
    with CoordinatorClient(coord.address) as client:
        eventually(lambda: agents(client)["r0"].alive, what="r0 registered")
        r0.popen.send_signal(signal.SIGSTOP)
        eventually(lambda: not agents(client)["r0"].alive, what="r0's lease to expire", timeout_s=3 * TTL)
        twin = cluster.start_rollout("twin", coord.address, "job", ["--agent-id", "r0"])
        r0.popen.send_signal(signal.SIGCONT)
        cluster.start_trainer("t1", coord.address, "job", [*TINY, "--steps", "1", "--hold"])
        assert state_name(client.wait_for_version("job", 1, timeout_s=60)) == "COMMITTED"
        eventually(lambda: "sync of version 1 waits for this rollout's agent id" in r0.log(), what="r0 refused")
        assert rollout_status(twin.address).current_version == 1 and rollout_status(r0.address).current_version == 0
        cluster.kill("twin")
        eventually(lambda: rollout_status(r0.address).current_version == 1, what="r0 at version 1", timeout_s=60)
        assert agents(client)["r0"].endpoint.address == r0.address and "skipped" not in r0.log()


def private_dev_shm(setup: str = "mount -t tmpfs tmpfs /dev/shm") -> list[str]:
    """A command prefix running a process in its own mount namespace, where `setup` has
    mounted a /dev/shm of its own (skips the test where no namespace can be made)."""
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare(1) for a private /dev/shm")
    probe = subprocess.run(["unshare", "--mount", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot create a mount namespace here: {probe.stderr.decode().strip()}")
    return ["unshare", "--mount", "sh", "-c", f'{setup} && exec "$@"', "sh"]


def test_shm_without_a_shared_dev_shm_falls_back_to_tcp_without_spending_attempts(cluster: Cluster) -> None:
    private_shm = private_dev_shm()
    coord = cluster.start_coordinator()
    r0 = cluster.start_rollout("r0", coord.address, "job", ["--weight-sync-mode", "shm"], wrapper=private_shm)
    cluster.start_trainer("t1", coord.address, "job", [*TINY, "--steps", "1", "--hold"])
    with CoordinatorClient(coord.address) as client:
        assert state_name(client.wait_for_version("job", 1, timeout_s=60)) == "COMMITTED"
    st = serving(r0.address, 1)
    assert st.chunk_retries == 0
    assert "arena not mappable here" in r0.log() and "pulling over tcp" in r0.log()
    assert metric_value(scrape(r0.ready["metrics_port"]), "weightsync_digest_failures_total") == 0


def test_a_dev_shm_without_room_for_the_arena_is_refused_and_retried_until_there_is(cluster: Cluster) -> None:
    """A /dev/shm too small for the arena (a pod gets 64 MiB unless a memory emptyDir is
    mounted; here 8 MiB, 6 of them taken, for a 4 MiB arena): a sparse file would die of
    SIGBUS at the first page that finds none. The trainer says what it needs, tries again,
    and publishes once room is made."""
    small_shm = private_dev_shm(
        "mount -t tmpfs -o size=8m tmpfs /dev/shm && head -c 6291456 /dev/zero > /dev/shm/ballast"
    )
    coord = cluster.start_coordinator()
    r0 = cluster.start_rollout("r0", coord.address, "job")
    t1 = cluster.start_trainer("t1", coord.address, "job", [*TINY, "--steps", "1", "--hold"], wrapper=small_shm)
    eventually(lambda: "bytes do not fit in /dev/shm" in t1.log(), what="the arena refused for want of room")
    eventually(lambda: "trying again" in t1.log(), what="the publish tried again")
    assert t1.alive()
    Path(f"/proc/{t1.pid}/root/dev/shm/ballast").unlink()  # the file, seen from inside its namespace
    with CoordinatorClient(coord.address) as client:
        assert state_name(client.wait_for_version("job", 1, timeout_s=60)) == "COMMITTED"
    serving(r0.address, 1)


def test_a_trainer_without_a_writable_dev_shm_says_so_in_one_line(cluster: Cluster) -> None:
    """A read-only (or missing) /dev/shm: the sidecar names the directory, the reason and
    the fix in one line at its first publish, and exits 1."""
    read_only = private_dev_shm("mount -t tmpfs -o ro tmpfs /dev/shm")
    coord = cluster.start_coordinator()
    t1 = cluster.start_trainer("t1", coord.address, "job", [*TINY, "--steps", "1"], wait=False, wrapper=read_only)
    assert cluster.wait_exit("t1", 60) == 1
    assert "arena: cannot create a file in /dev/shm: Read-only file system" in t1.log()
    assert "Traceback" not in t1.log()


def test_shm_rounds_verify_what_they_apply_under_a_racing_writer(inprocess_coordinator, no_arena_leak: None) -> None:  # noqa: ANN001
    """Another process toggling an arena byte while the trainer stages and a rollout reads
    over shm: a round may fail, but every round that says ok applied exactly the trainer's
    bytes. (Found by the chaos suite: staging hashed small shards a second time from the
    arena, and the shm copy re-read the mapping to hash it instead of hashing what it had
    written; together a toggled byte passed both checks.)"""
    from rollout_agent.engines.dict_applier import DictApplier
    from rollout_agent.pull.puller import WeightPuller
    from rollout_agent.sync.round import sync_version

    rng = np.random.default_rng(7)
    params = {f"model.layers.{i}.input_layernorm.weight": rng.standard_normal(64).astype(np.float32) for i in range(8)}
    client = CoordinatorClient(inprocess_coordinator.address)
    client.open_session("job", trainer=False)
    ok = failed = 0
    rounds = 60
    with WeightPublisher(
        PublisherSettings(coordinator=inprocess_coordinator.address, session="job", chunk_bytes=65536)
    ) as pub:
        client.register_agent("job", "r0", trainer=False, endpoint=pub.endpoint)
        puller = WeightPuller(client, "job", "r0", mode="shm", max_attempts=1)
        pub.publish(params, 1)  # lays the arena out; every version keeps this layout
        shard = {s.tensor_name: s for s in client.get_manifest("job", 1)[1].parts[0].shards}[
            "model.layers.3.input_layernorm.weight"
        ]
        offsets = [slot * pub.arena.slot_bytes + shard.offset + 7 for slot in range(pub.arena.slots)]
        toggler = subprocess.Popen(
            [sys.executable, "-c", TOGGLER, str(pub.arena.path), *map(str, offsets)], stdin=subprocess.DEVNULL
        )
        try:
            for version in range(2, 2 + rounds):
                params = {k: v + 1 for k, v in params.items()}
                pub.publish(params, version)
                applier = DictApplier()
                outcome = sync_version(puller, applier, version)
                if outcome.ok:
                    ok += 1
                    for k, v in params.items():
                        assert applier.weights[k].tobytes() == v.tobytes(), f"version {version} {k}"
                else:  # refused by the rollout's own checks, before anything reached the engine
                    failed += 1
                    assert applier.version == 0 and not applier.weights, f"version {version}: {outcome.mismatch}"
                    assert "digest mismatch" in outcome.mismatch or "refusing to apply" in outcome.mismatch
        finally:
            toggler.kill()
            toggler.wait()
        puller.close()
    client.close()
    assert ok + failed == rounds
    print(f"racing writer: {ok} rounds ok, {failed} refused")


# Toggles bytes of a file mapping as fast as it can, until killed.
TOGGLER = """
import mmap, os, sys
fd = os.open(sys.argv[1], os.O_RDWR)
m = mmap.mmap(fd, 0)
offsets = [int(a) for a in sys.argv[2:]]
while True:
    for o in offsets:
        m[o] ^= 1
"""
