"""Attacks on a session from another process on the coordinator's host, with real processes:
under the default (the coordinator's own credential), under role tokens with the session's
rollout ids or count, and under per-workload credentials (`wsctl credential`), where a
credential acts for its own ids only and is refused from its next call once revoked. Each
attack is answered with the status named, the session unchanged; where role tokens let an
attack through, the test says so, as docs/operations.md's threat model does."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from devtools.cluster import Cluster, Proc
from devtools.scrape import metric_value, scrape
from devtools.synthetic import good_report
from tests.integration.support import eventually, state_name
from tests.unit.helpers import make_part, sample_arrays
from weightsync import rpc
from weightsync._proto import rollout_agent_pb2 as rpb
from weightsync._proto import rollout_agent_pb2_grpc as rpb_grpc
from weightsync.cli import main as wsctl_main
from weightsync.client import CoordinatorClient
from weightsync.credentials import CREDENTIAL_ENV
from weightsync.errors import Unauthenticated, WeightsyncError, status_name_for
from weightsync.manifest import Endpoint
from weightsync.security import Security, agent_credential

pytestmark = pytest.mark.slow
TOKENS = {"trainer": "t" * 24, "rollout": "r" * 24, "admin": "a" * 24}
TINY = ["--model-size", "tiny"]
LEASE_TTL_S = 2.0  # the guarded coordinator's: a stopped rollout's lease lapses within it


def start_attack(tmp_path: Path, address: str, session: str, *args: str) -> subprocess.Popen[str]:
    """Starts the attacker (tests/integration/attacker.py) as another process with a HOME of
    its own and no credential variable: what another user of the host has."""
    home = tmp_path / "attacker-home"
    home.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != CREDENTIAL_ENV}
    return subprocess.Popen(
        [sys.executable, "-m", "tests.integration.attacker", address, session, *args],
        env={**env, "HOME": str(home)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def outcomes_of(attacker: subprocess.Popen[str]) -> dict[str, str]:
    """Each attack's outcome: "OK", or the status answered and its message."""
    out, err = attacker.communicate(timeout=120)
    assert attacker.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1])


def attack(tmp_path: Path, address: str, session: str, *args: str) -> dict[str, str]:
    """Runs the attacker to its end (`start_attack`)."""
    return outcomes_of(start_attack(tmp_path, address, session, *args))


def snapshot(client: CoordinatorClient, session: str) -> dict[str, Any]:
    """What an attack must leave as it was."""
    st = client.status(session)
    return {
        "generation": st.generation,
        "versions": [(v.version, state_name(v)) for v in st.versions],
        "agents": sorted((a.agent_id, a.role) for a in st.agents),
        "handshakes": sorted((h.version, h.agent_id, h.ok) for h in st.handshakes),
    }


def test_no_local_process_without_the_credential_takes_over_a_session(cluster: Cluster, tmp_path: Path) -> None:
    """The default: the coordinator keeps a credential only its user may read (0600), its
    clients find it with nothing set, and another process without it is refused every call
    (UNAUTHENTICATED): it can neither attach as the trainer, fence it and publish v1000, nor
    release or abort v1, delete the session, take r0's id, or register and refuse a version."""
    coord = cluster.start_coordinator()
    credential = Path(coord.ready["credential"])
    assert stat.S_IMODE(credential.stat().st_mode) == 0o600
    assert metric_value(scrape(coord.ready["metrics_port"]), "weightsync_auth_open") == 0
    cluster.start_rollout("r0", coord.address, "job")
    cluster.start_trainer("trainer", coord.address, "job", [*TINY, "--steps", "2", "--hold"])
    with CoordinatorClient(coord.address) as client:  # finds the credential as admin
        assert state_name(client.wait_for_version("job", 2, timeout_s=120)) == "COMMITTED"
        before = snapshot(client, "job")
        for token in ("", "x" * 43):  # none, and a guessed one
            outcomes = attack(tmp_path, coord.address, "job", "--token", token)
            assert len(outcomes) == 9 and all(o.startswith("UNAUTHENTICATED") for o in outcomes.values()), outcomes
        assert snapshot(client, "job") == before
    # the project's clients found it with nothing set: wsctl too
    out = subprocess.run(
        [sys.executable, "-m", "weightsync.cli", "--coordinator", coord.address, "--session", "job", "versions"],
        capture_output=True,
        text=True,
        timeout=60,
        env={k: v for k, v in os.environ.items() if k != CREDENTIAL_ENV},
    )
    assert out.returncode == 0 and "COMMITTED" in out.stdout, out.stderr
    # and anyone given the file's path through the one variable
    stranger = {**os.environ, "HOME": str(tmp_path / "attacker-home"), CREDENTIAL_ENV: str(credential)}
    out = subprocess.run(
        [sys.executable, "-m", "weightsync.cli", "--coordinator", coord.address, "--session", "job", "versions"],
        capture_output=True,
        text=True,
        timeout=60,
        env=stranger,
    )
    assert out.returncode == 0 and "COMMITTED" in out.stdout, out.stderr


def test_with_auth_none_any_local_process_takes_over_a_session(cluster: Cluster, tmp_path: Path) -> None:
    """`--auth none`: another process without any credential attaches as the trainer
    (fencing it), publishes v1000, force-releases v1, takes r0's id, registers a rollout and
    reports a failure, and deletes the session: the open mode the default closes."""
    coord = cluster.start_coordinator(args=["--auth", "none"])
    with CoordinatorClient(coord.address) as trainer:
        gen = trainer.open_session("job", trainer=True).generation
        for version in (1, 2):
            _publish(trainer, "job", gen, version)
    takeover = ("open_session_as_trainer", "publish_v1000", "force_release_v1", "register_r0")
    takeover += ("register_and_refuse_v2", "delete_session_force")
    only = [f"--only={name}" for name in takeover]
    outcomes = attack(tmp_path, coord.address, "job", "--generation", str(gen + 1), *only)
    assert set(outcomes.values()) == {"OK"} and len(outcomes) == 6, outcomes


def _publish(trainer: CoordinatorClient, session: str, generation: int, version: int) -> None:
    part, _ = make_part(sample_arrays(version))
    trainer.publish_part(session, generation=generation, version=version, idempotency_key=f"k{version}", part=part)


def _report_ok(rollout: CoordinatorClient, session: str, agent_id: str, version: int) -> None:
    header, manifest = rollout.get_manifest(session, version, agent_id=agent_id)
    report = good_report(session, version, header.version.manifest_digest, manifest)
    report.agent_id = agent_id
    rollout.report_applied(report)


def test_a_rollout_token_cannot_refuse_versions_under_ids_the_session_does_not_expect(
    cluster: Cluster, tmp_path: Path
) -> None:
    """Role tokens: whoever holds the shared rollout token may register extra ids, unless the
    session names its rollout ids (PERMISSION_DENIED) or counts them (RESOURCE_EXHAUSTED);
    and an id that registered after a version was published cannot turn it PARTIAL."""
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps(TOKENS))
    coord = cluster.start_coordinator(args=["--auth-tokens-file", str(tokens)])
    as_trainer, as_rollout = Security(token=TOKENS["trainer"]), Security(token=TOKENS["rollout"])
    rollout_token = ["--token", TOKENS["rollout"]]
    with (
        CoordinatorClient(coord.address, security=as_trainer) as trainer,
        CoordinatorClient(coord.address, security=as_rollout) as rollout,
        CoordinatorClient(coord.address, security=Security(token=TOKENS["admin"])) as admin,
    ):
        # open joining: v1 published with no rollout live requires none; a late id's refusal
        # leaves it READY, a good handshake commits it
        gen = trainer.open_session("open", trainer=True).generation
        _publish(trainer, "open", gen, 1)
        refused = attack(tmp_path, coord.address, "open", *rollout_token, "--only", "register_and_refuse_v1")
        assert refused == {"register_and_refuse_v1": "OK"}  # accepted, as a late rollout's report
        assert snapshot(admin, "open")["versions"] == [(1, "READY")]
        rollout.register_agent("open", "r0", trainer=False, endpoint=Endpoint())
        _report_ok(rollout, "open", "r0", 1)
        assert snapshot(admin, "open")["versions"] == [(1, "COMMITTED")]

        # a set of ids: another id cannot join, so it neither refuses nor holds up a version
        gen = trainer.open_session("ids", trainer=True, rollout_ids=["r0", "r1"]).generation
        assert list(trainer.open_session("ids", trainer=True, incarnation="x").rollout_ids) == ["r0", "r1"]
        gen += 1
        for agent_id in ("r0", "r1"):
            rollout.register_agent("ids", agent_id, trainer=False, endpoint=Endpoint())
        _publish(trainer, "ids", gen, 1)
        before = snapshot(admin, "ids")
        outcomes = attack(tmp_path, coord.address, "ids", *rollout_token, "--only", "register_and_refuse_v1")
        assert outcomes["register_and_refuse_v1"].startswith("PERMISSION_DENIED: agent_id:"), outcomes
        assert snapshot(admin, "ids") == before
        for agent_id in ("r0", "r1"):
            _report_ok(rollout, "ids", agent_id, 1)
        assert snapshot(admin, "ids")["versions"] == [(1, "COMMITTED")]

        # a count: a new id joins only while fewer rollouts are live
        gen = trainer.open_session("count", trainer=True, max_rollouts=1).generation
        rollout.register_agent("count", "r0", trainer=False, endpoint=Endpoint())
        before = snapshot(admin, "count")
        outcomes = attack(tmp_path, coord.address, "count", *rollout_token, "--only", "register_r0")
        assert outcomes["register_r0"].startswith("ALREADY_EXISTS: agent_id:"), outcomes  # r0's live lease
        outcomes = attack(tmp_path, coord.address, "count", *rollout_token, "--only", "register_and_refuse_v1")
        assert outcomes["register_and_refuse_v1"].startswith("RESOURCE_EXHAUSTED: agent_id:"), outcomes
        assert snapshot(admin, "count") == before


@dataclass
class Guarded:
    """The module's coordinator under role tokens (a tokens file of mode 0600) and the
    per-workload credentials made from them, with leases of LEASE_TTL_S."""

    cluster: Cluster
    coordinator: Proc
    tokens: Path
    work: Path

    def credential_file(self, name: str, credential: str) -> str:
        """`credential` in a file of its own (0600), as a pod's Secret holds it."""
        path = self.work / f"{name}.credential"
        path.write_text(credential)
        path.chmod(0o600)
        return str(path)

    def admin(self) -> CoordinatorClient:
        return CoordinatorClient(self.coordinator.address, security=Security(token=TOKENS["admin"]))


@pytest.fixture(scope="module")
def guarded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Guarded]:
    work = tmp_path_factory.mktemp("guarded")
    tokens = work / "tokens.json"
    tokens.write_text(json.dumps(TOKENS))
    tokens.chmod(0o600)
    cluster = Cluster(work / "cluster")
    try:
        coord = cluster.start_coordinator(args=["--auth-tokens-file", str(tokens), "--lease-ttl-s", str(LEASE_TTL_S)])
        yield Guarded(cluster, coord, tokens, work)
    finally:
        cluster.close()


@pytest.fixture
def guarded_logs(guarded: Guarded, request: pytest.FixtureRequest) -> Iterator[Guarded]:
    """`guarded`, its processes' logs printed when the test fails."""
    yield guarded
    rep = getattr(request.node, "rep_call", None)
    if rep is not None and rep.failed:
        for proc in guarded.cluster.procs.values():
            print(f"===== {proc.name} (exit {proc.popen.returncode}) =====\n{proc.log()[-6000:]}")


def test_a_rollout_credential_cannot_join_under_another_id_where_the_role_token_refuses_versions(
    guarded_logs: Guarded, tmp_path: Path
) -> None:
    """A session any rollout may join: the shared rollout token registers an id of its own
    making before a version is published, so the version requires it, and its refusal turns
    the version PARTIAL. A rollout's own credential cannot register that id
    (PERMISSION_DENIED naming agent_id), and the session is unchanged."""
    g = guarded_logs
    address = g.coordinator.address
    trainer_token = agent_credential(TOKENS["trainer"], "trainer", ["trainer-0"])
    r0 = agent_credential(TOKENS["rollout"], "rollout", ["r0"])
    with CoordinatorClient(address, security=Security(token=trainer_token)) as trainer, g.admin() as admin:
        gen = trainer.open_session("extra", trainer=True).generation
        before = snapshot(admin, "extra")
        outcomes = attack(tmp_path, address, "extra", "--token", r0, "--only", "join_then_refuse")
        assert outcomes["join_then_refuse"].startswith("PERMISSION_DENIED: agent_id:"), outcomes
        assert snapshot(admin, "extra") == before
        # the role token: joins as "evil", keeps its lease until v1 is READY, and refuses it
        joined = start_attack(tmp_path, address, "extra", "--token", TOKENS["rollout"], "--only", "join_then_refuse")
        try:
            eventually(
                lambda: any(a.agent_id == "evil" and a.alive for a in admin.status("extra").agents),
                timeout_s=30,
                what="the role token's id to join",
            )
            _publish(trainer, "extra", gen, 1)
        finally:
            outcomes = outcomes_of(joined)
        assert outcomes == {"join_then_refuse": "OK"}
        assert state_name(admin.wait_for_version("extra", 1, timeout_s=30)) == "PARTIAL"


def test_per_workload_credentials_keep_each_rollout_to_its_own_id_and_a_revoked_one_is_refused(
    guarded_logs: Guarded, tmp_path: Path
) -> None:
    """Each workload runs on its own credential (`wsctl credential`, given through the one
    variable): the trainer's, r0's and r1's, and their own servers take the callers the
    verifiers list (`wsctl verifiers`), as deploy/examples/tls runs them: the rollouts read
    chunks from the trainer's server (grpc mode), the trainer's credential may call a
    rollout's Sync, r1's may not. The holder of r1's credential can neither act as the
    trainer nor as r0, not even once r0 is stopped (SIGSTOP) and its lease lapsed, where the
    shared rollout token takes r0's id; without a credential every call is UNAUTHENTICATED;
    the trainer's may not delete the session or act as a rollout. Once r1's credential is
    revoked (`wsctl revoke`), r1's next call is refused and its lease lapses, with no
    process restarted; r0 takes its id back."""
    g = guarded_logs
    address = g.coordinator.address
    coordinator_pid = g.coordinator.pid

    def wsctl(*args: str) -> str:
        out = subprocess.run(
            [sys.executable, "-m", "weightsync.cli", *args], capture_output=True, text=True, timeout=60, check=True
        )
        return out.stdout.strip()

    trainer = wsctl("credential", "--auth-tokens-file", str(g.tokens), "--role", "trainer", "--agent-id", "trainer-0")
    r0, r1 = (agent_credential(TOKENS["rollout"], "rollout", [name], serial=f"{name}s") for name in ("r0", "r1"))
    files = {name: g.credential_file(name, token) for name, token in (("trainer", trainer), ("r0", r0), ("r1", r1))}
    verifiers = g.work / "verifiers.json"
    verifiers.write_text(wsctl("verifiers", *files.values()))
    serve = ["--auth-tokens-file", str(verifiers)]  # the agents' own servers
    for name in ("r0", "r1"):
        g.cluster.start_rollout(name, address, "ids", serve, env={CREDENTIAL_ENV: files[name]}, wait=False)
    g.cluster.start_trainer(
        "trainer",
        address,
        "ids",
        [*TINY, "--steps", "1", "--hold", "--agent-id", "trainer-0", "--rollout-ids", "r0", "--rollout-ids", "r1"]
        + ["--weight-sync-mode", "grpc", *serve],
        env={CREDENTIAL_ENV: files["trainer"]},
    )
    rollouts = [g.cluster.wait_ready(g.cluster.procs[name]) for name in ("r0", "r1")]
    with g.admin() as admin:
        assert state_name(admin.wait_for_version("ids", 1, timeout_s=120)) == "COMMITTED"
        eventually(
            lambda: {(h.agent_id, h.ok) for h in admin.status("ids").handshakes} >= {("r0", True), ("r1", True)},
            timeout_s=60,
            what="both rollouts' handshakes",
        )
        # r0's own server: the trainer's credential may make it sync, r1's may not, nor one unlisted
        r9 = agent_credential(TOKENS["rollout"], "rollout", ["r9"])
        assert [_sync(rollouts[0].address, token) for token in (trainer, r1, r9, "")] == [
            "OK",
            "PERMISSION_DENIED: role 'rollout' may not call Sync",
            "UNAUTHENTICATED: authorization: missing or unknown bearer token",
            "UNAUTHENTICATED: authorization: missing or unknown bearer token",
        ]
        before = snapshot(admin, "ids")
        as_r1 = start_attack(tmp_path, address, "ids", "--token", r1, "--agent-id", "r0")
        anonymous = start_attack(tmp_path, address, "ids")
        as_trainer = start_attack(
            tmp_path,
            address,
            "ids",
            "--token",
            trainer,
            "--only",
            "delete_session_force",
            "--only",
            "register_and_refuse_v1",
        )
        outcomes = outcomes_of(as_r1)
        assert outcomes.pop("status") == "OK"
        for name in ("open_session_as_trainer", "publish_v1000", "force_release_v1", "abort_v1"):
            assert outcomes.pop(name).startswith("PERMISSION_DENIED: role"), name
        assert outcomes.pop("delete_session_force").startswith("PERMISSION_DENIED: role 'rollout'")
        assert all(
            o.startswith("PERMISSION_DENIED: agent_id: this token acts for agent 'r1' only") for o in outcomes.values()
        ), outcomes
        outcomes = outcomes_of(anonymous)
        assert len(outcomes) == 9 and all(o.startswith("UNAUTHENTICATED") for o in outcomes.values()), outcomes
        outcomes = outcomes_of(as_trainer)
        assert outcomes["delete_session_force"].startswith("PERMISSION_DENIED: role 'trainer'"), outcomes
        assert outcomes["register_and_refuse_v1"].startswith("PERMISSION_DENIED: role: a trainer token"), outcomes
        assert snapshot(admin, "ids") == before

        # r0 stopped: its lease lapses, and its id is any rollout role token's to take
        os.kill(rollouts[0].pid, signal.SIGSTOP)
        try:
            eventually(
                lambda: not next(a for a in admin.status("ids").agents if a.agent_id == "r0").alive,
                timeout_s=30,
                what="r0's lease to lapse",
            )
            outcomes = attack(
                tmp_path,
                address,
                "ids",
                "--token",
                r1,
                "--agent-id",
                "r0",
                "--only",
                "register_r0",
                "--only",
                "register_and_refuse_v1",
            )
            assert all(o.startswith("PERMISSION_DENIED: agent_id:") for o in outcomes.values()), outcomes
            assert snapshot(admin, "ids") == before
            outcomes = attack(tmp_path, address, "ids", "--token", TOKENS["rollout"], "--only", "register_r0")
            assert outcomes == {"register_r0": "OK"}  # the role token's holder is r0 while r0 is stopped
            assert next(a for a in admin.status("ids").agents if a.agent_id == "r0").alive
        finally:
            os.kill(rollouts[0].pid, signal.SIGCONT)

        # r1's credential revoked: its process is refused at its next call, the coordinator runs on
        assert wsctl("revoke", "--auth-tokens-file", str(g.tokens), r1) == "revoked r1s"
        assert stat.S_IMODE(g.tokens.stat().st_mode) == 0o600
        eventually(
            lambda: (
                {a.agent_id: a.alive for a in admin.status("ids").agents}
                == {"trainer-0": True, "r0": True, "r1": False}
            ),
            timeout_s=30,
            what="r1 refused and r0 back under its id",
        )
        outcomes = attack(tmp_path, address, "ids", "--token", r1, "--only", "status")
        assert outcomes["status"] == "UNAUTHENTICATED: authorization: this agent credential was revoked"
        assert g.coordinator.alive() and g.coordinator.pid == coordinator_pid
        assert all(p.alive() for p in (*rollouts, g.cluster.procs["trainer"]))
        assert snapshot(admin, "ids")["versions"] == before["versions"]
    for name in ("trainer", "r0", "r1"):
        g.cluster.stop(name)


def _sync(address: str, token: str) -> str:
    """A rollout's Sync of version 1 called with `token`: "OK", or the status answered."""
    with rpc.channel(address, Security(token=token)) as channel:
        try:
            answer = rpc.unary(rpb_grpc.RolloutAgentStub(channel).Sync, rpb.SyncRequest(version=1), timeout_s=60)
        except WeightsyncError as e:
            return f"{status_name_for(e)}: {e}"
    return "OK" if answer.ok else f"not ok: {answer.mismatch}"


def test_an_open_watch_of_a_revoked_credential_ends_at_its_next_event(guarded_logs: Guarded) -> None:
    """A stream opened before the revocation is no way around it: the coordinator checks
    the credential again before each message it sends, so a watch held open by a revoked
    credential ends at its next event with UNAUTHENTICATED, while another's goes on."""
    g = guarded_logs
    address = g.coordinator.address
    trainer_token = agent_credential(TOKENS["trainer"], "trainer", ["trainer-0"])
    revoked, kept = (agent_credential(TOKENS["rollout"], "rollout", [name], serial=f"{name}w") for name in "ab")
    with (
        CoordinatorClient(address, security=Security(token=trainer_token)) as trainer,
        CoordinatorClient(address, timeout_s=30, retries=0, security=Security(token=revoked)) as watcher,
        CoordinatorClient(address, timeout_s=30, retries=0, security=Security(token=kept)) as other,
    ):
        gen = trainer.open_session("watched", trainer=True).generation
        events, cancel = watcher.open_watch("watched")
        others, cancel_other = other.open_watch("watched")
        try:
            _publish(trainer, "watched", gen, 1)
            assert next(events).version.version == 1 and next(others).version.version == 1
            assert wsctl_main(["revoke", "--auth-tokens-file", str(g.tokens), revoked]) == 0
            eventually(lambda: _refused(watcher), timeout_s=10, what="the tokens file read again")
            _publish(trainer, "watched", gen, 2)
            with pytest.raises(Unauthenticated, match="this agent credential was revoked"):
                for event in events:
                    assert event.version.version == 1, event  # v1's events went out before the revocation
            assert any(event.version.version == 2 for event in others)
        finally:
            cancel()
            cancel_other()


def _refused(client: CoordinatorClient) -> bool:
    try:
        client.status("watched")
    except Unauthenticated:
        return True
    return False
