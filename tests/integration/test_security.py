"""TLS, mTLS and per-role bearer tokens on real servers; certificates are made per run."""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import socket
import ssl
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc

from devtools.cluster import Cluster
from devtools.scrape import metric_value, scrape
from devtools.synthetic import good_report
from rollout_agent.engines.dict_applier import DictApplier
from rollout_agent.pull.puller import WeightPuller
from rollout_agent.sync.round import sync_version
from tests.conftest import coordinator_in_process
from tests.integration.support import eventually, state_name
from tests.unit.helpers import make_part, sample_arrays
from trainer_agent.publish.publisher import WeightPublisher
from trainer_agent.settings import PublisherSettings
from weightsync._proto import coordinator_pb2 as pb
from weightsync._proto import coordinator_pb2_grpc as pb_grpc
from weightsync._proto import types_pb2 as tpb
from weightsync.client import CoordinatorClient
from weightsync.errors import AlreadyExists, InvalidArgument, PermissionDenied, TransportUnavailable, Unauthenticated
from weightsync.manifest import Endpoint
from weightsync.rpc import CHANNEL_OPTIONS, MAX_MESSAGE_BYTES
from weightsync.security import Security, agent_token, load_tokens
from weightsync.server import RunningServer, open_to_everyone
from weightsync.unix_sockets import SocketFile

TOKENS = {"trainer": "t" * 24, "rollout": "r" * 24, "admin": "a" * 24}
# The deadline of calls made with no retries: a refusal comes at once, and a loaded machine
# must not turn an answer into DEADLINE_EXCEEDED.
CALL_S = 30.0


def _write(path: Path, key: ec.EllipticCurvePrivateKey, cert: x509.Certificate) -> tuple[str, str]:
    path.with_suffix(".key").write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    path.with_suffix(".crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return str(path.with_suffix(".crt")), str(path.with_suffix(".key"))


def _cert(
    name: str, key: ec.EllipticCurvePrivateKey, issuer: x509.Name, signer: ec.EllipticCurvePrivateKey, ca: bool
) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if not ca:
        san = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
        builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
    return builder.sign(signer, hashes.SHA256())


def _pki(root: Path, name: str) -> tuple[str, str, str]:
    """(ca.crt, node.crt, node.key): a CA and one node identity (server and client) it signed."""
    ca_key, node_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{name} CA")])
    ca_crt, _ = _write(root / f"{name}-ca", ca_key, _cert(f"{name} CA", ca_key, ca_name, ca_key, True))
    node_crt, node_key_path = _write(root / f"{name}-node", node_key, _cert("node", node_key, ca_name, ca_key, False))
    return ca_crt, node_crt, node_key_path


@pytest.fixture
def pki(tmp_path: Path) -> dict[str, str]:
    ca, crt, key = _pki(tmp_path, "good")
    rogue_ca, rogue_crt, rogue_key = _pki(tmp_path, "rogue")
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps(TOKENS))
    return {"ca": ca, "crt": crt, "key": key, "rogue_crt": rogue_crt, "rogue_key": rogue_key, "tokens": str(tokens)}


def _client_side(pki: dict[str, str], role: str | None) -> Security:
    return Security(pki["crt"], pki["key"], pki["ca"], token=TOKENS[role] if role else "")


@pytest.fixture
def secure_coordinator(tmp_path: Path, pki: dict[str, str]) -> Iterator[RunningServer]:
    security = Security(pki["crt"], pki["key"], pki["ca"], require_client_cert=True, tokens_file=pki["tokens"])
    with coordinator_in_process(tmp_path / "c.db", security) as running:
        yield running


def test_mtls_and_role_tokens_guard_the_coordinator(secure_coordinator: RunningServer, pki: dict[str, str]) -> None:
    addr = secure_coordinator.address
    with CoordinatorClient(addr, security=_client_side(pki, "trainer")) as trainer:
        assert trainer.open_session("job", trainer=True).generation == 1

    def refused(security: Security, error: type[Exception], call=lambda c: c.status("job")) -> str:  # noqa: ANN001
        with CoordinatorClient(addr, timeout_s=CALL_S, retries=0, security=security) as c, pytest.raises(error) as exc:
            call(c)
        return str(exc.value)

    refused(Security(), TransportUnavailable)  # plaintext to a TLS port
    refused(Security(ca_file=pki["ca"], token=TOKENS["trainer"]), TransportUnavailable)  # TLS without a client cert
    refused(Security(pki["rogue_crt"], pki["rogue_key"], pki["ca"], token=TOKENS["trainer"]), TransportUnavailable)
    assert "bearer token" in refused(_client_side(pki, None), Unauthenticated)
    assert "bearer token" in refused(Security(pki["crt"], pki["key"], pki["ca"], token="x" * 24), Unauthenticated)
    # a rollout token neither attaches as the trainer nor touches versions; it may read and register
    assert refused(
        _client_side(pki, "rollout"), PermissionDenied, lambda c: c.open_session("job", trainer=True)
    ).startswith("role")
    assert "ReleaseVersion" in refused(
        _client_side(pki, "rollout"), PermissionDenied, lambda c: c.release_version("job", 1, generation=1)
    )
    # nor does a trainer token report a handshake by carrying it on a heartbeat stream
    report = pb.HeartbeatRequest(call_id=1, report_applied=pb.ReportAppliedRequest(session="job", version=1))
    assert "ReportApplied" in refused(
        _client_side(pki, "trainer"), PermissionDenied, lambda c: list(c.heartbeats(iter([report]))[0])
    )
    with CoordinatorClient(addr, security=_client_side(pki, "rollout")) as rollout:
        rollout.open_session("job", trainer=False)
        rollout.register_agent("job", "r0", trainer=False, endpoint=Endpoint())
        assert rollout.status("job").generation == 1  # the trainer was not fenced
    # deleting a session is an admin's call
    for role in ("trainer", "rollout"):
        assert "DeleteSession" in refused(
            _client_side(pki, role), PermissionDenied, lambda c: c.delete_session("job", force=True)
        )
    with CoordinatorClient(addr, security=_client_side(pki, "admin")) as admin:
        admin.open_session("finished", trainer=False)
        assert admin.delete_session("finished").agents == 0
    # health answers without a token (probes), over TLS
    channel = _client_side(pki, None).channel(addr, CHANNEL_OPTIONS)
    reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    channel.close()


def test_a_refused_caller_s_request_is_never_read(secure_coordinator: RunningServer, pki: dict[str, str]) -> None:
    """A call without a valid token, or whose role may not call the method, is refused from
    its metadata before grpc reads the request (read first, a dozen concurrent 70 MiB
    requests without a token take a coordinator from 68 MiB to 1 GiB). A request past the
    server's limit tells which: read, it is RESOURCE_EXHAUSTED; unread, the refusal."""
    too_big = "x" * (MAX_MESSAGE_BYTES + (1 << 20))

    def code(role: str | None, call: Callable[[pb_grpc.CoordinatorStub], object]) -> grpc.StatusCode:
        channel = _client_side(pki, role).channel(secure_coordinator.address, [("grpc.max_send_message_length", -1)])
        try:
            with pytest.raises(grpc.RpcError) as exc:
                call(pb_grpc.CoordinatorStub(channel))
            return exc.value.code()
        finally:
            channel.close()

    def status(stub: pb_grpc.CoordinatorStub) -> object:
        return stub.GetStatus(pb.GetStatusRequest(session=too_big), timeout=30)

    assert code(None, status) == grpc.StatusCode.UNAUTHENTICATED
    assert code(None, lambda s: list(s.WatchVersions(pb.WatchVersionsRequest(session=too_big), timeout=30))) == (
        grpc.StatusCode.UNAUTHENTICATED
    )
    release = pb.ReleaseVersionRequest(session=too_big, version=1, generation=1)
    assert code("rollout", lambda s: s.ReleaseVersion(release, timeout=30)) == grpc.StatusCode.PERMISSION_DENIED
    assert code("trainer", status) == grpc.StatusCode.RESOURCE_EXHAUSTED  # admitted: read, and over the limit


def _served_serial(address: str, pki: dict[str, str]) -> int:
    """The serial number of the certificate a TLS handshake with `address` is given."""
    ctx = ssl.create_default_context(cafile=pki["ca"])
    ctx.load_cert_chain(pki["crt"], pki["key"])
    ctx.set_alpn_protocols(["h2"])
    host, _, port = address.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=5) as raw:
        with ctx.wrap_socket(raw, server_hostname="localhost") as tls:
            der = tls.getpeercert(binary_form=True)
    assert der is not None
    return x509.load_der_x509_certificate(der).serial_number


def _kept(tmp_path: Path, pem: bytes) -> str:
    path = tmp_path / "kept.key"
    path.write_bytes(pem)
    return str(path)


def test_a_renewed_certificate_is_served_without_a_restart(
    secure_coordinator: RunningServer, pki: dict[str, str], tmp_path: Path
) -> None:
    """cert-manager renews the mounted Secret in place: servers present the renewed
    certificate to new connections without a restart (the one read at start would fail
    every new connection once it expired)."""
    before = _served_serial(secure_coordinator.address, pki)
    ca_key = serialization.load_pem_private_key(Path(pki["ca"]).with_suffix(".key").read_bytes(), None)
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    issuer = x509.load_pem_x509_certificate(Path(pki["ca"]).read_bytes()).subject
    key = ec.generate_private_key(ec.SECP256R1())
    renewed = _cert("node", key, issuer, ca_key, False)
    crt_path, key_path = _write(tmp_path / "renewed", key, renewed)
    old_key = Path(pki["key"]).read_bytes()
    os.replace(key_path, pki["key"])  # the new key beside the old certificate: no pair yet
    time.sleep(0.1)
    # the last pair is served meanwhile (a handshake with the mismatched pair would fail)
    assert _served_serial(secure_coordinator.address, {**pki, "key": _kept(tmp_path, old_key)}) == before
    os.replace(crt_path, pki["crt"])  # swapped in place, as a Secret volume's files are
    assert _served_serial(secure_coordinator.address, pki) == renewed.serial_number != before
    with CoordinatorClient(secure_coordinator.address, security=_client_side(pki, "trainer")) as trainer:
        assert trainer.open_session("job", trainer=True).generation == 1


def test_a_client_keeps_its_channel_while_its_renewed_files_are_no_pem_pair(
    secure_coordinator: RunningServer, pki: dict[str, str], tmp_path: Path
) -> None:
    """A client's TLS files half-renewed (the next certificate's key beside this one, a CA
    file cut short) are not taken as they are: the client keeps the channel it has until the
    files are whole again, and its calls are answered meanwhile."""
    mine = {k: str(tmp_path / f"client-{k}.pem") for k in ("crt", "key", "ca")}
    for k, path in mine.items():
        Path(path).write_bytes(Path(pki[k]).read_bytes())
    security = Security(mine["crt"], mine["key"], mine["ca"], token=TOKENS["trainer"])
    with CoordinatorClient(secure_coordinator.address, security=security, retries=1, timeout_s=5) as client:
        assert client.open_session("job", trainer=True).generation == 1
        cut = tmp_path / "cut.pem"
        cut.write_bytes(Path(pki["ca"]).read_bytes()[:100])
        os.replace(cut, mine["ca"])
        os.replace(pki["rogue_key"], mine["key"])
        time.sleep(1.2)  # past the client's look at its files (once a second)
        assert client.status("job").generation == 1
        for k in ("key", "ca"):  # whole again
            Path(mine[k]).write_bytes(Path(pki[k]).read_bytes())
        time.sleep(1.2)
        assert client.status("job").generation == 1


def test_rotated_bearer_tokens_are_read_again_without_a_restart(
    secure_coordinator: RunningServer, pki: dict[str, str], tmp_path: Path
) -> None:
    """A rotated tokens Secret is swapped in place: servers read the tokens again, so
    agents given the new ones are let in without a restart, and an agent sends the token
    its file holds now, not the one its channel was made with."""
    token_file = tmp_path / "rollout.token"
    token_file.write_text(TOKENS["rollout"])
    security = Security(pki["crt"], pki["key"], pki["ca"], token=TOKENS["rollout"], token_file=str(token_file))
    with CoordinatorClient(secure_coordinator.address, timeout_s=CALL_S, retries=0, security=security) as agent:
        agent.open_session("job", trainer=False)
        rotated = {role: token.upper() for role, token in TOKENS.items()}
        for path, text in ((Path(pki["tokens"]), json.dumps(rotated)), (token_file, rotated["rollout"])):
            path.with_suffix(".new").write_text(text)
            os.replace(path.with_suffix(".new"), path)  # swapped in place, as a Secret volume's files are
        old = Security(pki["crt"], pki["key"], pki["ca"], token=TOKENS["rollout"])
        with CoordinatorClient(secure_coordinator.address, timeout_s=CALL_S, retries=0, security=old) as stale:

            def refused() -> bool:
                try:
                    stale.status("job")
                except Unauthenticated:
                    return True
                return False

            eventually(refused, what="the old token refused")
        eventually(lambda: agent.status("job"), what="the same channel, with the rotated token")


def test_an_agent_token_acts_for_its_own_agent_only(secure_coordinator: RunningServer, pki: dict[str, str]) -> None:
    addr = secure_coordinator.address
    with CoordinatorClient(addr, security=_client_side(pki, "trainer")) as trainer:
        trainer.open_session("job", trainer=True)
    r0 = Security(pki["crt"], pki["key"], pki["ca"], token=agent_token(TOKENS["rollout"], "rollout", "r0"))
    with CoordinatorClient(addr, timeout_s=CALL_S, retries=0, security=r0) as c:
        c.register_agent("job", "r0", trainer=False, endpoint=Endpoint())
        c.heartbeat("job", "r0")
        assert c.status("job").agents[0].agent_id == "r0"
        for call in (
            lambda: c.register_agent("job", "r1", trainer=False, endpoint=Endpoint()),
            lambda: c.heartbeat("job", "r1"),
            lambda: c.deregister_agent("job", "r0x"),
        ):
            with pytest.raises(PermissionDenied) as exc:
                call()
            assert exc.value.field == "agent_id"
        # on the Heartbeats stream every message is checked: r0's beats answered, r1's ends it
        beats = [c.keyed(pb.HeartbeatRequest(session="job", agent_id=a)) for a in ("r0", "r0", "r1", "r0")]
        answers, _ = c.heartbeats(iter(beats))
        got = []
        with pytest.raises(PermissionDenied) as exc:
            got.extend(answers)
        assert len(got) == 2 and exc.value.field == "agent_id"
        # a call carried on the stream is authorized as its own RPC: r0 may not lease for r1
        carried = pb.HeartbeatRequest(call_id=1, get_manifest=pb.GetManifestRequest(session="job", agent_id="r1"))
        answers, _ = c.heartbeats(iter([beats[0], carried]))
        got = []
        with pytest.raises(PermissionDenied) as exc:
            got.extend(answers)
        assert len(got) == 1 and got[0].carries_calls and exc.value.field == "agent_id"
        with pytest.raises(PermissionDenied):  # the role still binds: a rollout's token cannot attach as trainer
            c.open_session("job", trainer=True)
    forged = Security(pki["crt"], pki["key"], pki["ca"], token=agent_token("x" * 24, "rollout", "r1"))
    with CoordinatorClient(addr, timeout_s=CALL_S, retries=0, security=forged) as c, pytest.raises(Unauthenticated):
        c.heartbeat("job", "r1")
    with pytest.raises(InvalidArgument):
        agent_token(TOKENS["admin"], "admin", "r0")
    # the tokens file holds role tokens only; what the operator hands each pod is derived
    cli = subprocess.run(
        [
            sys.executable,
            "-m",
            "weightsync.cli",
            "agent-token",
            "--auth-tokens-file",
            pki["tokens"],
            "--role",
            "rollout",
            "--agent-id",
            "r0",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert cli.returncode == 0, cli.stderr
    assert cli.stdout.strip() == agent_token(TOKENS["rollout"], "rollout", "r0")


@pytest.mark.parametrize("mode", ["grpc", "tcp"])
def test_a_version_syncs_over_mtls_with_role_tokens(
    secure_coordinator: RunningServer, pki: dict[str, str], no_arena_leak: None, mode: str
) -> None:
    params = {
        f"model.layers.{i}.mlp.up_proj.weight": np.random.default_rng(i).standard_normal((64, 96)).astype(np.float32)
        for i in range(3)
    }
    with WeightPublisher(
        PublisherSettings(
            coordinator=secure_coordinator.address,
            session="job",
            chunk_bytes=8192,
            tls_cert_file=pki["crt"],
            tls_key_file=pki["key"],
            tls_ca_file=pki["ca"],
            tls_require_client_cert=True,
            auth_token=TOKENS["trainer"],
            auth_tokens_file=pki["tokens"],
        )
    ) as pub:
        client = CoordinatorClient(secure_coordinator.address, security=_client_side(pki, "rollout"))
        client.register_agent("job", "r0", trainer=False, endpoint=Endpoint())
        puller = WeightPuller(client, "job", "r0", mode=mode, security=_client_side(pki, "rollout"))
        pub.publish(params, 1)
        applier = DictApplier()
        outcome = sync_version(puller, applier, 1)
        assert outcome.ok, outcome.mismatch
        assert all(np.array_equal(applier.weights[k], v) for k, v in params.items())
        assert pub.wait_committed(1, 10) == "COMMITTED"
        if mode == "grpc":  # the trainer agent's ReadChunks wants the rollout role
            intruder = WeightPuller(
                client, "job", "r0", mode="grpc", security=_client_side(pki, "trainer"), max_attempts=1
            )
            assert "ReadChunks" in sync_version(intruder, DictApplier(), 1).mismatch
            intruder.close()
        puller.close()
        client.close()


def test_security_settings_are_checked(tmp_path: Path, pki: dict[str, str]) -> None:
    with pytest.raises(InvalidArgument, match="tls_key_file"):
        Security(cert_file=pki["crt"])
    with pytest.raises(InvalidArgument, match="tls_require_client_cert"):
        Security(require_client_cert=True)
    bad = tmp_path / "bad.json"
    for content, why in (
        ('{"root": "' + "x" * 20 + '"}', "unknown role"),
        ('{"trainer": "short"}', "16 characters"),
        ('{"trainer": "' + "x" * 20 + '", "rollout": "' + "x" * 20 + '"}', "share"),
        ("[1", "not JSON"),
    ):
        bad.write_text(content)
        with pytest.raises(InvalidArgument, match=why):
            load_tokens(str(bad))
    assert load_tokens(pki["tokens"]) == TOKENS


def test_tls_files_that_are_no_pem_pair_are_named_at_start(tmp_path: Path, pki: dict[str, str]) -> None:
    """TLS files that make no PEM pair (a key that is not its certificate's, a certificate
    that is not PEM, a CA file without a certificate) are refused at start, naming the
    flag: grpc takes any bytes as a certificate, and then says only that a server could not
    bind its port or a client could not connect."""
    Security(cert_file=pki["crt"], key_file=pki["key"], ca_file=pki["ca"]).check_files()
    for files, field, why in (
        ({"cert_file": pki["crt"], "key_file": pki["rogue_key"]}, "tls_cert_file", "KEY_VALUES_MISMATCH"),
        ({"cert_file": pki["key"], "key_file": pki["key"]}, "tls_cert_file", "not PEM"),
        ({"ca_file": pki["tokens"]}, "tls_ca_file", "no PEM certificate"),
    ):
        with pytest.raises(InvalidArgument, match=why) as e:
            Security(**files).check_files()
        assert e.value.field == field
    db = tmp_path / "c.db"
    flags = ["--tls-cert-file", pki["crt"], "--tls-key-file", pki["rogue_key"], "--db-path", str(db), "--port", "0"]
    run = subprocess.run(
        [sys.executable, "-m", "coordinator", *flags],
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    assert run.returncode == 2
    assert "tls_cert_file:" in run.stderr and "KEY_VALUES_MISMATCH" in run.stderr and "bind" not in run.stderr
    wsctl = subprocess.run(
        [sys.executable, "-m", "weightsync.cli", "--tls-ca-file", pki["tokens"], "status"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert wsctl.returncode == 2 and wsctl.stderr.startswith("wsctl: tls_ca_file:")


def test_processes_started_with_tls_flags_sync_over_mtls_with_tokens(
    tmp_path: Path, pki: dict[str, str], no_arena_leak: None
) -> None:
    """The entry points' flags: coordinator, trainer and rollout agents as real processes,
    every gRPC server on mTLS with role tokens; wsctl reads with flags, not without."""
    tls = [
        "--tls-cert-file",
        pki["crt"],
        "--tls-key-file",
        pki["key"],
        "--tls-ca-file",
        pki["ca"],
        "--tls-require-client-cert",
        "--auth-tokens-file",
        pki["tokens"],
    ]
    with Cluster(tmp_path / "procs", security=Security(pki["crt"], pki["key"], pki["ca"])) as cluster:
        try:
            coord = cluster.start_coordinator(args=tls)
            cluster.start_rollout(
                "r0", coord.address, "job", [*tls, "--auth-token", TOKENS["rollout"], "--weight-sync-mode", "grpc"]
            )
            cluster.start_trainer(
                "trainer",
                coord.address,
                "job",
                [
                    "--model-size",
                    "tiny",
                    "--steps",
                    "2",
                    "--min-rollouts",
                    "1",
                    "--hold",
                    *tls,
                    "--auth-token",
                    TOKENS["trainer"],
                ],
            )
            with CoordinatorClient(coord.address, security=_client_side(pki, "admin")) as admin:
                assert state_name(admin.wait_for_version("job", 2, timeout_s=120)) == "COMMITTED"
                assert sorted((h.version, h.agent_id, h.ok) for h in admin.status("job").handshakes) == [
                    (1, "r0", True),
                    (2, "r0", True),
                ]
            wsctl = [
                sys.executable,
                "-m",
                "weightsync.cli",
                "--coordinator",
                coord.address,
                "--session",
                "job",
                "--json",
            ]
            ok = subprocess.run(
                [
                    *wsctl,
                    "--tls-ca-file",
                    pki["ca"],
                    "--tls-cert-file",
                    pki["crt"],
                    "--tls-key-file",
                    pki["key"],
                    "--auth-token",
                    TOKENS["rollout"],
                    "versions",
                ],
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert ok.returncode == 0, ok.stderr
            assert [v["state"] for v in json.loads(ok.stdout)] == ["COMMITTED", "COMMITTED"]
            plain = subprocess.run([*wsctl, "--timeout-s", "3", "versions"], capture_output=True, text=True, timeout=60)
            assert plain.returncode == 2 and "UNAVAILABLE" in plain.stderr.upper()
        finally:
            failed = [p for p in cluster.procs.values() if not p.alive()]
            for proc in failed:
                print(f"===== {proc.name} =====\n{proc.log()[-4000:]}")


def test_an_agent_presents_its_renewed_client_certificate_without_a_restart(
    tmp_path: Path, no_arena_leak: None
) -> None:
    """A CA rotated under mTLS: the rollout's certificate is renewed by the next CA in place
    (cert-manager, SPIFFE), then the coordinator, restarted, trusts the next CA alone. The
    rollout's new connections present the renewed certificate (a channel that kept the one
    it was made with would fail every one), and it registers again without a restart."""
    ca, crt, key = _pki(tmp_path, "first")
    next_ca, next_crt, next_key = _pki(tmp_path, "next")
    trusted = tmp_path / "trusted-clients.crt"  # the coordinator's client CAs: both while rotating
    trusted.write_bytes(Path(ca).read_bytes() + Path(next_ca).read_bytes())
    mine = {"crt": str(tmp_path / "rollout.crt"), "key": str(tmp_path / "rollout.key")}
    for src, dst in ((crt, mine["crt"]), (key, mine["key"])):
        Path(dst).write_bytes(Path(src).read_bytes())
    server = ["--tls-cert-file", crt, "--tls-key-file", key, "--tls-ca-file", str(trusted), "--tls-require-client-cert"]
    admin = Security(
        next_crt, next_key, ca
    )  # trusted before and after; verifies the coordinator's (first CA) certificate
    with Cluster(tmp_path / "procs", security=admin) as cluster:
        coord = cluster.start_coordinator(args=[*server, "--lease-ttl-s", "2"])
        port = int(coord.address.rpartition(":")[2])
        with CoordinatorClient(coord.address, security=admin) as client:
            client.open_session("job", trainer=True, incarnation="x")
        rollout_tls = ["--tls-cert-file", mine["crt"], "--tls-key-file", mine["key"], "--tls-ca-file", ca]
        cluster.start_rollout("r0", coord.address, "job", rollout_tls)

        def alive() -> bool:
            with CoordinatorClient(coord.address, security=admin, timeout_s=CALL_S, retries=0) as client:
                return any(a.agent_id == "r0" and a.alive for a in client.status("job").agents)

        eventually(alive, what="r0 registered")
        for src, dst in ((next_key, mine["key"]), (next_crt, mine["crt"])):
            Path(dst + ".new").write_bytes(Path(src).read_bytes())
            os.replace(dst + ".new", dst)  # swapped in place, as a Secret volume's files are
        trusted.with_suffix(".new").write_bytes(Path(next_ca).read_bytes())
        os.replace(trusted.with_suffix(".new"), trusted)
        cluster.kill("coordinator")
        time.sleep(3)  # past r0's lease: it must register again, on a new connection
        coord = cluster.start_coordinator(
            port=port, db_path=coord.ready["db_path"], args=[*server, "--lease-ttl-s", "2"]
        )
        eventually(alive, what="r0 registered again with its renewed certificate")
        assert cluster.procs["r0"].alive()


def _stored(admin: CoordinatorClient, *, leases: bool = True) -> tuple:
    """What a refused call must leave as it was: the session, its versions and handshakes,
    and each agent's row (its lease too, where no agent beats meanwhile)."""
    st = admin.status("job")
    agents = sorted(
        (a.agent_id, a.role, a.endpoint.SerializeToString(), a.rank, a.generation, a.current_version)
        + ((a.lease_expires_at.ToNanoseconds(),) if leases else (a.alive,))
        for a in st.agents
    )
    return (
        st.generation,
        [v.SerializeToString() for v in st.versions],
        [h.SerializeToString() for h in st.handshakes],
        agents,
    )


def test_a_rollout_credential_acts_for_its_own_agent_id_only(
    secure_coordinator: RunningServer, pki: dict[str, str]
) -> None:
    """A rollout's role token (which may mint any rollout's agent token) may not heartbeat
    for the trainer's agent id (keeping a dead trainer's lease alive) nor register as
    another rollout's id with a foreign endpoint (taking its place in relays and
    handshakes): calls naming an agent need the key its registration answered, whatever
    the token."""
    addr = secure_coordinator.address
    rollout = _client_side(pki, "rollout")
    with (
        CoordinatorClient(addr, security=_client_side(pki, "trainer")) as trainer,
        CoordinatorClient(addr, security=rollout) as r0,
        CoordinatorClient(addr, timeout_s=CALL_S, retries=0, security=rollout) as intruder,
        CoordinatorClient(addr, security=_client_side(pki, "admin")) as admin,
    ):
        gen = trainer.open_session("job", trainer=True, incarnation="run-1").generation
        trainer.register_agent("job", "trainer-0", trainer=True, endpoint=Endpoint("127.0.0.1:7000"), generation=gen)
        r0.register_agent("job", "r0", trainer=False, endpoint=Endpoint("127.0.0.1:7100", host_id="a"), instance="p0")
        part, _ = make_part(sample_arrays())
        trainer.publish_part("job", generation=gen, version=1, idempotency_key="k", part=part)
        header, manifest = r0.get_manifest("job", 1, agent_id="r0")
        before = _stored(admin)

        def refused(
            call: Callable[[], object], error: type[Exception] = PermissionDenied, field: str = "agent_id"
        ) -> str:
            with pytest.raises(error) as exc:
                call()
            assert getattr(exc.value, "field", None) == field, exc.value
            assert _stored(admin) == before, "a refused call changed what the coordinator stores"
            return str(exc.value)

        def beats(*requests: pb.HeartbeatRequest) -> list[pb.HeartbeatResponse]:
            answers, _ = intruder.heartbeats(iter(requests))
            return list(answers)

        def report(agent_id: str) -> pb.ReportAppliedRequest:
            made = good_report("job", 1, header.version.manifest_digest, manifest)
            made.agent_id = agent_id
            return made

        foreign = Endpoint("10.6.6.6:7100", host_id="elsewhere")
        # as the trainer: keep its lease, take its id, detach it, attach in its place
        assert "'trainer-0' is registered by another trainer process" in refused(
            lambda: intruder.heartbeat("job", "trainer-0")
        )
        refused(lambda: beats(pb.HeartbeatRequest(session="job", agent_id="trainer-0")))
        refused(lambda: intruder.deregister_agent("job", "trainer-0"))
        assert "registered as a trainer" in refused(
            lambda: intruder.register_agent("job", "trainer-0", trainer=False, endpoint=foreign, instance="evil")
        )
        refused(lambda: intruder.open_session("job", trainer=True, incarnation="evil"), field="role")
        refused(lambda: intruder.register_agent("job", "trainer-0", trainer=True, endpoint=foreign), field="role")
        # as another rollout: take its place, beat, lease, report, leave for it
        for instance in ("", "evil"):
            refused(
                lambda i=instance: intruder.register_agent("job", "r0", trainer=False, endpoint=foreign, instance=i),
                AlreadyExists,
            )
        refused(lambda: intruder.heartbeat("job", "r0"))
        lease = pb.GetManifestRequest(session="job", version=1, agent_id="r0")
        refused(lambda: beats(pb.HeartbeatRequest(call_id=1, get_manifest=lease)))
        refused(lambda: intruder.get_manifest("job", 1, agent_id="r0"))
        refused(lambda: intruder.report_applied(report("r0"), retries=0))
        refused(lambda: beats(pb.HeartbeatRequest(call_id=2, report_applied=report("r0"))))
        refused(lambda: intruder.deregister_agent("job", "r0"))
        # the same calls for its own id are answered, and its key is no key for another
        own = intruder.register_agent("job", "r1", trainer=False, endpoint=Endpoint("127.0.0.1:7200")).agent_key
        assert len(own) == 64
        before = _stored(admin)
        wrong = pb.HeartbeatRequest(session="job", agent_id="trainer-0", agent_key=own)
        assert "carries another agent key" in refused(lambda: beats(wrong))
        intruder.heartbeat("job", "r1")
        assert beats(intruder.keyed(pb.HeartbeatRequest(session="job", agent_id="r1")))[0].generation == gen
        assert intruder.get_manifest("job", 1, agent_id="r1")[0].access_token
        assert intruder.report_applied(report("r1")).ok
        assert intruder.deregister_agent("job", "r1")
        # and the agents whose ids were tried go on as before
        r0.heartbeat("job", "r0")
        assert r0.report_applied(report("r0")).ok
        # a process that shares r0's instance (the vLLM engine its sidecar drives) shares its key
        with CoordinatorClient(addr, security=rollout) as engine:
            engine.register_agent("job", "r0", trainer=False, endpoint=Endpoint("127.0.0.1:7100"), instance="p0")
            engine.heartbeat("job", "r0")
        r0.heartbeat("job", "r0")
        trainer.heartbeat("job", "trainer-0")
        assert trainer.register_agent("job", "trainer-0", trainer=True, endpoint=Endpoint("127.0.0.1:7000")).agent_key


def test_a_rollout_token_neither_keeps_a_dead_trainer_alive_nor_takes_a_rollout_s_place(
    tmp_path: Path, no_arena_leak: None
) -> None:
    """The issue's sequence with real processes and role tokens: the rollout token's holder
    tries to register as r0 with its own endpoint and to beat for the SIGKILLed trainer."""
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps(TOKENS))
    auth = ["--auth-tokens-file", str(tokens)]
    with Cluster(tmp_path / "procs") as cluster:
        try:
            coord = cluster.start_coordinator(args=[*auth, "--lease-ttl-s", "2"])
            cluster.start_rollout("r0", coord.address, "job", [*auth, "--auth-token", TOKENS["rollout"]])
            trainer_args = ["--model-size", "tiny", "--steps", "1", "--min-rollouts", "1", "--hold"]
            cluster.start_trainer(
                "trainer", coord.address, "job", [*trainer_args, *auth, "--auth-token", TOKENS["trainer"]]
            )
            with (
                CoordinatorClient(coord.address, security=Security(token=TOKENS["admin"])) as admin,
                CoordinatorClient(
                    coord.address, timeout_s=CALL_S, retries=0, security=Security(token=TOKENS["rollout"])
                ) as intruder,
            ):
                assert state_name(admin.wait_for_version("job", 1, timeout_s=120)) == "COMMITTED"
                trainer_id = next(a.agent_id for a in admin.status("job").agents if a.role == tpb.TRAINER)
                # r0's heartbeat carries the version it serves after the commit: the row settles then
                eventually(
                    lambda: {a.agent_id: a.current_version for a in admin.status("job").agents}["r0"] == 1,
                    timeout_s=30,
                    what="r0's heartbeat to report version 1",
                )
                before = _stored(admin, leases=False)
                with pytest.raises(AlreadyExists) as exc:
                    intruder.register_agent("job", "r0", trainer=False, endpoint=Endpoint("127.0.0.1:9", host_id="x"))
                assert exc.value.field == "agent_id"
                with pytest.raises(PermissionDenied):
                    intruder.open_session("job", trainer=True, incarnation="evil")
                assert _stored(admin, leases=False) == before
                cluster.kill("trainer")  # SIGKILL: its lease ends within 2 s unless someone beats for it
                until = time.monotonic() + 4.0
                while time.monotonic() < until:
                    with pytest.raises(PermissionDenied) as exc:
                        intruder.heartbeat("job", trainer_id)
                    assert exc.value.field == "agent_id" and trainer_id in str(exc.value)
                    time.sleep(0.25)
                agents = {a.agent_id: a for a in admin.status("job").agents}
                assert not agents[trainer_id].alive, "the dead trainer's lease was kept alive"
                assert agents["r0"].alive and agents["r0"].endpoint.host_id != "x"
                assert admin.status("job").generation == before[0]
                assert cluster.procs["r0"].alive()
        finally:
            for proc in cluster.procs.values():
                if proc.name != "trainer" and not proc.alive():
                    print(f"===== {proc.name} =====\n{proc.log()[-4000:]}")


def test_a_server_every_local_user_may_call_says_so(tmp_path: Path, sockets: Path) -> None:
    """Without bearer tokens or client certificates (`--auth none`), a server on loopback TCP
    takes every local user's calls (any of them may attach as the trainer): it logs OPEN at
    start and exports weightsync_auth_open 1. By default (its credential), with tokens, or
    on a unix socket (mode 0660, its owner and group decide), it does neither."""
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps(TOKENS))
    socket_path = sockets / "c.sock"
    with Cluster(tmp_path / "procs") as cluster:
        plain = cluster.start_coordinator(name="plain", args=["--auth", "none"])
        default = cluster.start_coordinator(name="default", db_path=str(tmp_path / "d.db"))
        guarded = cluster.start_coordinator(
            name="guarded", db_path=str(tmp_path / "g.db"), args=["--auth-tokens-file", str(tokens)]
        )
        on_socket = cluster.start_coordinator(name="socket", db_path=str(tmp_path / "s.db"), host=f"unix:{socket_path}")
        for proc, open_ in ((plain, 1.0), (default, 0.0), (guarded, 0.0), (on_socket, 0.0)):
            assert metric_value(scrape(proc.ready["metrics_port"]), "weightsync_auth_open") == open_, proc.name
            assert ("OPEN: weightsync.v1.Coordinator" in proc.log()) == bool(open_), proc.log()[-2000:]
        assert stat.S_IMODE(os.stat(socket_path).st_mode) == 0o660
    # a socket file others may write is open to them
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(sockets / "w.sock"))
        made = os.stat(sockets / "w.sock")
        bound = SocketFile(str(sockets / "w.sock"), made.st_dev, made.st_ino)
        os.chmod(bound.path, 0o660)
        assert not open_to_everyone(Security(), bound)
        os.chmod(bound.path, 0o666)
        assert open_to_everyone(Security(), bound)
        assert not open_to_everyone(Security(tokens_file=str(tokens)), bound)
    assert open_to_everyone(Security(), None)


def test_the_loop_sender_publishes_over_mtls_with_the_token_its_file_holds_now(
    secure_coordinator: RunningServer, pki: dict[str, str], tmp_path: Path
) -> None:
    """`publish_requests = "loop"` sends from an asyncio channel of its own: the same TLS
    and bearer token as the client's other calls, a rotated token read again, and a
    caller with a token no longer valid refused with the same error."""
    part, _ = make_part(sample_arrays())
    token_file = tmp_path / "trainer.token"
    token_file.write_text(TOKENS["trainer"])
    security = Security(pki["crt"], pki["key"], pki["ca"], token=TOKENS["trainer"], token_file=str(token_file))
    stale = Security(pki["crt"], pki["key"], pki["ca"], token=TOKENS["trainer"])
    with (
        CoordinatorClient(secure_coordinator.address, timeout_s=CALL_S, retries=0, security=security) as trainer,
        CoordinatorClient(secure_coordinator.address, timeout_s=CALL_S, retries=0, security=stale) as old,
    ):
        trainer.publish_requests = old.publish_requests = "loop"
        gen = trainer.open_session("job", trainer=True).generation

        def publish(client: CoordinatorClient, v: int) -> bool:
            try:
                answer = client.publish_part("job", generation=gen, version=v, idempotency_key=f"k{v}", part=part)
            except Unauthenticated as e:
                assert "bearer token" in str(e)
                return False
            return answer.version.version == v

        assert publish(trainer, 1)
        rotated = {role: token.upper() for role, token in TOKENS.items()}
        for path, text in ((Path(pki["tokens"]), json.dumps(rotated)), (token_file, rotated["trainer"])):
            path.with_suffix(".new").write_text(text)
            os.replace(path.with_suffix(".new"), path)
        eventually(lambda: not publish(old, 2), what="the old token refused")
        eventually(lambda: publish(trainer, 2), what="the same sender, with the rotated token")
