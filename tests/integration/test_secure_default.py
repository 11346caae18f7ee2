"""Attacks on a session from another process on the coordinator's host, with real processes:
under the default (the coordinator's own credential), under role tokens with the session's
rollout ids or count, and with per-agent tokens. Each is refused, the session unchanged."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from devtools.cluster import Cluster
from devtools.scrape import metric_value, scrape
from devtools.synthetic import good_report
from tests.integration.support import eventually, state_name
from tests.unit.helpers import make_part, sample_arrays
from weightsync.client import CoordinatorClient
from weightsync.credentials import CREDENTIAL_ENV
from weightsync.manifest import Endpoint
from weightsync.security import Security, agent_token

pytestmark = pytest.mark.slow
TOKENS = {"trainer": "t" * 24, "rollout": "r" * 24, "admin": "a" * 24}
TINY = ["--model-size", "tiny"]


def attack(tmp_path: Path, address: str, session: str, *args: str) -> dict[str, str]:
    """Runs the attacker (tests/integration/attacker.py) as another process with a HOME of
    its own and no credential variable: what another user of the host has."""
    home = tmp_path / "attacker-home"
    home.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != CREDENTIAL_ENV}
    out = subprocess.run(
        [sys.executable, "-m", "tests.integration.attacker", address, session, *args],
        env={**env, "HOME": str(home)},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


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
            assert len(outcomes) == 9 and all(o.startswith("Unauthenticated") for o in outcomes.values()), outcomes
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
        assert outcomes["register_and_refuse_v1"].startswith("PermissionDenied: agent_id:"), outcomes
        assert snapshot(admin, "ids") == before
        for agent_id in ("r0", "r1"):
            _report_ok(rollout, "ids", agent_id, 1)
        assert snapshot(admin, "ids")["versions"] == [(1, "COMMITTED")]

        # a count: a new id joins only while fewer rollouts are live
        gen = trainer.open_session("count", trainer=True, max_rollouts=1).generation
        rollout.register_agent("count", "r0", trainer=False, endpoint=Endpoint())
        before = snapshot(admin, "count")
        outcomes = attack(tmp_path, coord.address, "count", *rollout_token, "--only", "register_r0")
        assert outcomes["register_r0"].startswith("AlreadyExists"), outcomes  # r0's live lease
        outcomes = attack(tmp_path, coord.address, "count", *rollout_token, "--only", "register_and_refuse_v1")
        assert outcomes["register_and_refuse_v1"].startswith("ResourceExhausted: agent_id:"), outcomes
        assert snapshot(admin, "count") == before


def test_an_agent_token_cannot_take_a_lapsed_rollouts_id(cluster: Cluster, tmp_path: Path) -> None:
    """With per-agent tokens, a rollout whose lease lapsed (stopped, SIGSTOP) keeps its id:
    another rollout's token cannot register it (PERMISSION_DENIED naming agent_id)."""
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps(TOKENS))
    coord = cluster.start_coordinator(args=["--auth-tokens-file", str(tokens), "--lease-ttl-s", "1"])
    r0 = Security(token=agent_token(TOKENS["rollout"], "rollout", "r0"))
    with CoordinatorClient(coord.address, security=Security(token=TOKENS["trainer"])) as trainer:
        trainer.open_session("job", trainer=True)
    with CoordinatorClient(coord.address, security=r0) as rollout:
        rollout.register_agent("job", "r0", trainer=False, endpoint=Endpoint())
    with CoordinatorClient(coord.address, security=Security(token=TOKENS["admin"])) as admin:
        eventually(lambda: not any(a.alive for a in admin.status("job").agents), what="r0's lease lapsed")
        before = snapshot(admin, "job")
        r1_token = agent_token(TOKENS["rollout"], "rollout", "r1")
        outcomes = attack(tmp_path, coord.address, "job", "--token", r1_token, "--only", "register_r0")
        assert outcomes["register_r0"].startswith("PermissionDenied: agent_id:"), outcomes
        assert snapshot(admin, "job") == before


def test_each_workload_runs_on_its_own_credential_and_a_revoked_one_is_refused_at_once(
    cluster: Cluster, tmp_path: Path
) -> None:
    """Per-workload credentials (`wsctl credential`), each given to its process through the
    one variable: the trainer and a rollout sync under theirs; the rollout's acts for its own
    id only, and once revoked (`wsctl revoke`) its next call is refused, without a restart."""
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps(TOKENS))
    tokens.chmod(0o600)
    coord = cluster.start_coordinator(args=["--auth-tokens-file", str(tokens)])

    def wsctl(*args: str) -> str:
        out = subprocess.run(
            [sys.executable, "-m", "weightsync.cli", *args], capture_output=True, text=True, timeout=60, check=True
        )
        return out.stdout.strip()

    credentials = {}
    for name, role, agent_id in (("trainer", "trainer", "trainer-0"), ("r0", "rollout", "r0")):
        credentials[name] = wsctl(
            "credential", "--auth-tokens-file", str(tokens), "--role", role, "--agent-id", agent_id
        )
        path = tmp_path / f"{name}.credential"
        path.write_text(credentials[name])
        path.chmod(0o600)
        credentials[f"{name}_file"] = str(path)
    cluster.start_rollout("r0", coord.address, "job", env={CREDENTIAL_ENV: credentials["r0_file"]})
    cluster.start_trainer(
        "trainer",
        coord.address,
        "job",
        [*TINY, "--steps", "1", "--hold", "--agent-id", "trainer-0", "--rollout-ids", "r0"],
        env={CREDENTIAL_ENV: credentials["trainer_file"]},
    )
    with CoordinatorClient(coord.address, security=Security(token=TOKENS["admin"])) as admin:
        assert state_name(admin.wait_for_version("job", 1, timeout_s=120)) == "COMMITTED"
        before = snapshot(admin, "job")
        outcomes = attack(tmp_path, coord.address, "job", "--token", credentials["r0"], "--agent-id", "r1")
        assert outcomes["register_and_refuse_v1"].startswith("PermissionDenied: agent_id:"), outcomes
        assert outcomes["open_session_as_trainer"].startswith("PermissionDenied"), outcomes
        assert snapshot(admin, "job") == before
        assert wsctl("revoke", "--auth-tokens-file", str(tokens), credentials["r0"]).startswith("revoked ")
        assert stat.S_IMODE(tokens.stat().st_mode) == 0o600
        eventually(
            lambda: attack(tmp_path, coord.address, "job", "--token", credentials["r0"], "--only", "status")[
                "status"
            ].startswith("Unauthenticated: authorization: this agent credential was revoked"),
            timeout_s=30,
            what="the revoked credential refused",
        )
        assert snapshot(admin, "job")["versions"] == before["versions"]
