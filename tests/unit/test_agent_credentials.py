"""Per-workload credentials without a server: what a credential may act as, its revocation,
and the verifiers an agent's own server takes in place of the role tokens."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from weightsync._proto import coordinator_pb2 as pb
from weightsync._proto import types_pb2 as tpb
from weightsync.cli import main as wsctl
from weightsync.errors import InvalidArgument, PermissionDenied, Unauthenticated
from weightsync.security import BearerAuth, agent_credential, credential_verifier, load_auth, load_tokens

TOKENS = {"trainer": "t" * 24, "rollout": "r" * 24, "admin": "a" * 24}
REGISTER = "/weightsync.v1.Coordinator/RegisterAgent"
SYNC = "/weightsync.v1.RolloutAgent/Sync"


def bearer(token: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {token}")]


def register(agent_id: str, role: int = tpb.ROLLOUT) -> pb.RegisterAgentRequest:
    return pb.RegisterAgentRequest(session="job", agent_id=agent_id, role=role)


def test_a_credential_acts_as_its_role_and_ids_only() -> None:
    auth = BearerAuth(TOKENS)
    r0 = agent_credential(TOKENS["rollout"], "rollout", ["r0"])
    assert auth.identity_of(bearer(r0)) == ("rollout", frozenset({"r0"}))
    auth(REGISTER, bearer(r0), register("r0"))
    with pytest.raises(PermissionDenied) as exc:
        auth(REGISTER, bearer(r0), register("r1"))
    assert exc.value.field == "agent_id"
    with pytest.raises(PermissionDenied) as exc:
        auth(REGISTER, bearer(r0), register("r0", tpb.TRAINER))
    assert exc.value.field == "role"
    with pytest.raises(PermissionDenied, match="may not call Sync"):
        auth.before_read(SYNC, bearer(r0))
    ranks = agent_credential(TOKENS["trainer"], "trainer", ["trainer-1", "trainer-0"])
    assert auth.identity_of(bearer(ranks)) == ("trainer", frozenset({"trainer-0", "trainer-1"}))
    # a credential made under another secret, or edited to name another id, is nobody's
    for forged in (
        agent_credential("x" * 24, "rollout", ["r0"]),
        r0.replace(":r0:", ":r1:"),
        r0.replace("wsagent:rollout:", "wsagent:trainer:"),
    ):
        with pytest.raises(Unauthenticated):
            auth.identity_of(bearer(forged))
    with pytest.raises(InvalidArgument):
        agent_credential(TOKENS["admin"], "admin", ["ops"])


def test_a_revoked_credential_is_refused_and_ends_the_streams_it_holds(tmp_path: Path) -> None:
    r0 = agent_credential(TOKENS["rollout"], "rollout", ["r0"], serial="s0")
    r1 = agent_credential(TOKENS["rollout"], "rollout", ["r1"], serial="s1")
    path = tmp_path / "tokens.json"
    path.write_text(json.dumps({**TOKENS, "revoked": ["s0"]}))
    auth = BearerAuth.from_file(str(path))
    with pytest.raises(Unauthenticated, match="revoked"):
        auth.identity_of(bearer(r0))
    with pytest.raises(Unauthenticated, match="revoked"):
        auth.while_streaming("/weightsync.v1.Coordinator/WatchVersions", bearer(r0))
    auth.while_streaming("/weightsync.v1.Coordinator/WatchVersions", bearer(r1))
    assert auth.identity_of(bearer(r1))[1] == {"r1"}
    # a role token rotated away keeps the stream it opened (its next call is refused)
    rotated = BearerAuth({**TOKENS, "rollout": "n" * 24})
    rotated.while_streaming("/weightsync.v1.Coordinator/WatchVersions", bearer(TOKENS["rollout"]))
    with pytest.raises(Unauthenticated):
        rotated.before_read("/weightsync.v1.Coordinator/GetStatus", bearer(TOKENS["rollout"]))


def test_verifiers_let_a_server_check_credentials_it_cannot_make(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    trainer = agent_credential(TOKENS["trainer"], "trainer", ["trainer-0", "trainer-1"], serial="t1")
    r0 = agent_credential(TOKENS["rollout"], "rollout", ["r0"], serial="r0")
    files = []
    for name, credential in (("trainer", trainer), ("r0", r0)):
        files.append(tmp_path / f"{name}.credential")
        files[-1].write_text(credential + "\n")
    assert wsctl(["verifiers", *map(str, files)]) == 0
    verifiers = tmp_path / "verifiers.json"
    verifiers.write_text(capsys.readouterr().out)
    assert json.loads(verifiers.read_text()) == {
        "verifiers": sorted([credential_verifier(trainer), credential_verifier(r0)])
    }
    assert load_tokens(str(verifiers)) == {}  # no role token: nothing to make a credential with
    auth = BearerAuth.from_file(str(verifiers))
    auth.before_read(SYNC, bearer(trainer))  # a rollout's server takes the trainer's Sync
    assert auth.identity_of(bearer(r0)) == ("rollout", frozenset({"r0"}))
    with pytest.raises(PermissionDenied, match="may not call Sync"):
        auth.before_read(SYNC, bearer(r0))
    for stranger in (
        agent_credential(TOKENS["rollout"], "rollout", ["r1"]),  # a valid credential not listed
        TOKENS["trainer"],  # a role token
        trainer.replace("trainer-1", "trainer-2"),
    ):
        with pytest.raises(Unauthenticated):
            auth.identity_of(bearer(stranger))
    # revoked by its serial as on the coordinator
    verifiers.write_text(json.dumps({**json.loads(verifiers.read_text()), "revoked": ["r0"]}))
    with pytest.raises(Unauthenticated, match="revoked"):
        BearerAuth.from_file(str(verifiers)).identity_of(bearer(r0))
    with pytest.raises(InvalidArgument, match="not an agent credential"):
        credential_verifier(TOKENS["trainer"])


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({"verifiers": ["md5:00"]}, "is no verifier"),
        ({"verifiers": "sha256:" + "0" * 64}, "must be a list"),
        ({"revoked": ["s0"]}, "neither a role token nor a verifier"),
        ({"operator": "o" * 24}, "unknown role"),
    ],
)
def test_a_tokens_file_that_is_not_one_is_named(tmp_path: Path, body: dict, says: str) -> None:
    path = tmp_path / "tokens.json"
    path.write_text(json.dumps(body))
    with pytest.raises(InvalidArgument, match=says) as exc:
        load_auth(str(path))
    assert exc.value.field == "auth_tokens_file"
