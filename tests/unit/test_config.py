"""Config dataclasses: flags win over WEIGHTSYNC_* variables; unknown variables warn."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from coordinator.config import CoordinatorConfig
from rollout_agent.config import RolloutConfig
from weightsync.config import load_config
from weightsync.errors import InvalidArgument


def test_flag_beats_env_beats_default(capsys: pytest.CaptureFixture[str]) -> None:
    env = {
        "WEIGHTSYNC_COORDINATOR_DB_PATH": "/env.db",
        "WEIGHTSYNC_COORDINATOR_LEASE_TTL_S": "3",
        "WEIGHTSYNC_COORDINATOR_BOGUS": "1",
    }
    cfg = load_config(CoordinatorConfig, "coordinator", ["--db-path", "/flag.db"], env)
    assert cfg.db_path == "/flag.db" and cfg.lease_ttl_s == 3.0 and cfg.port == 0
    assert "unknown variable WEIGHTSYNC_COORDINATOR_BOGUS" in capsys.readouterr().err


def test_bool_and_validation() -> None:
    cfg = load_config(RolloutConfig, "rollout", ["--follow", "false"], {"WEIGHTSYNC_ROLLOUT_STREAMS": "4"})
    assert cfg.follow is False and cfg.streams == 4
    with pytest.raises(SystemExit):
        load_config(RolloutConfig, "rollout", ["--agent-id", "Not_Valid!"], {})
    with pytest.raises(SystemExit):
        load_config(CoordinatorConfig, "coordinator", ["--lease-ttl-s", "0"], {})


def test_weight_sync_mode_flags_and_aliases() -> None:
    from trainer_agent.config import TrainerConfig

    cfg = load_config(RolloutConfig, "rollout", ["--weight-sync-mode", "filesystem", "--fs-root", "/tmp/x"], {})
    assert cfg.weight_sync_mode == "fs"
    assert (
        load_config(RolloutConfig, "rollout", [], {"WEIGHTSYNC_ROLLOUT_WEIGHT_SYNC_MODE": "shm"}).weight_sync_mode
        == "shm"
    )
    assert load_config(RolloutConfig, "rollout", [], {}).weight_sync_mode == ""  # the session's
    for mode in ("tcp", "relay"):
        assert load_config(RolloutConfig, "rollout", ["--weight-sync-mode", mode], {}).weight_sync_mode == mode
    with pytest.raises(SystemExit):
        load_config(RolloutConfig, "rollout", ["--weight-sync-mode", "fs"], {})  # needs --fs-root
    with pytest.raises(SystemExit):  # a usage error naming the mode, not a traceback
        load_config(RolloutConfig, "rollout", ["--weight-sync-mode", "udp"], {})
    with pytest.raises(SystemExit):
        load_config(TrainerConfig, "trainer", ["--weight-sync-mode", "gcs"], {})  # needs --fs-root


def test_advertised_addresses_keep_the_bound_port() -> None:
    from trainer_agent.config import TrainerConfig
    from weightsync.config import advertised

    assert advertised("0.0.0.0:5123", "10.1.2.3") == "10.1.2.3:5123"
    assert advertised("127.0.0.1:5123", "") == "127.0.0.1:5123"
    cfg = load_config(
        TrainerConfig, "trainer", ["--tcp-port", "50060"], {"WEIGHTSYNC_TRAINER_ADVERTISE_HOST": "10.1.2.3"}
    )
    assert (cfg.tcp_port, cfg.advertise_host) == (50060, "10.1.2.3")
    assert load_config(RolloutConfig, "rollout", ["--relay-port", "50053"], {}).relay_port == 50053


def test_security_flags_are_checked_at_start(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:  # noqa: ANN001
    tokens = tmp_path / "tokens.json"
    tokens.write_text('{"rollout": "' + "r" * 20 + '"}')
    cfg = load_config(CoordinatorConfig, "coordinator", ["--auth-tokens-file", str(tokens)], {})
    assert cfg.security().tokens_file == str(tokens)
    env = {"WEIGHTSYNC_ROLLOUT_AUTH_TOKEN": "r" * 20}
    assert (
        load_config(RolloutConfig, "rollout", ["--coordinator", "c:1", "--session", "s"], env).security().token
        == "r" * 20
    )
    for argv, why in (
        (["--auth-tokens-file", str(tmp_path / "missing.json")], "cannot read"),
        (["--tls-cert-file", str(tokens)], "set both or neither"),
        (["--tls-require-client-cert"], "tls_require_client_cert"),
    ):
        with pytest.raises(SystemExit):
            load_config(CoordinatorConfig, "coordinator", argv, {})
        assert why in capsys.readouterr().err


def test_a_network_facing_server_needs_tls_tokens_or_insecure(tmp_path) -> None:  # noqa: ANN001
    """docs/design.md "Security": off loopback, plaintext without tokens needs --insecure."""
    from weightsync.config import is_loopback

    assert is_loopback("127.0.0.1") and is_loopback("127.8.0.1") and is_loopback("::1") and is_loopback("[::1]")
    assert is_loopback("localhost") and not is_loopback("0.0.0.0") and not is_loopback("10.0.0.4")
    assert not is_loopback("coordinator.svc")
    with pytest.raises(SystemExit):
        load_config(CoordinatorConfig, "coordinator", ["--host", "0.0.0.0"], {})
    assert load_config(CoordinatorConfig, "coordinator", ["--host", "0.0.0.0", "--insecure"], {}).insecure
    tokens = tmp_path / "tokens.json"
    tokens.write_text('{"trainer": "t' + "x" * 30 + '", "rollout": "r' + "x" * 30 + '", "admin": "a' + "x" * 30 + '"}')
    assert load_config(CoordinatorConfig, "coordinator", ["--host", "0.0.0.0", "--auth-tokens-file", str(tokens)], {})
    assert load_config(CoordinatorConfig, "coordinator", ["--host", "127.0.0.1"], {}).host == "127.0.0.1"


def test_one_settings_class_feeds_every_rollout_entry_point() -> None:
    # The sidecar's flags and vLLM's init_info are the same SyncSettings; errors of the
    # init_info form name the field as init_info.<name>.
    from rollout_agent.settings import InitInfo, SyncSettings

    cfg = load_config(
        RolloutConfig,
        "rollout",
        ["--session", "job", "--weight-sync-mode", "relay", "--advertise-host", "10.0.0.7"],
        {},
    )
    info = InitInfo(**cfg.init_info(agent_id="eng-1"))
    assert (info.session, info.weight_sync_mode, info.advertise_host, info.agent_id) == (
        "job",
        "relay",
        "10.0.0.7",
        "eng-1",
    )
    assert set(cfg.init_info()) == {f.name for f in dataclasses.fields(SyncSettings)}
    for bad, field in (
        ({"apply_mode": "lazy"}, "init_info.apply_mode"),
        ({"weight_sync_mode": "udp"}, "init_info.weight_sync_mode"),
        ({"weight_sync_mode": "fs"}, "init_info.fs_root"),
        ({"weight_sync_mode": "fs", "fs_root": "bogus://bucket"}, "init_info.fs_root"),
        ({"streams": 0}, "init_info.streams"),
        ({"prefetch_nice": -1}, "init_info.prefetch_nice"),
        ({"prefetch_nice": 20}, "init_info.prefetch_nice"),
        ({"session": "Bad!"}, "init_info.session"),
        ({"tls_cert_file": "/x.pem"}, "init_info.tls_key_file"),
        ({"session": ""}, "init_info.session"),
        ({"coordinator": ""}, "init_info.coordinator"),
    ):
        with pytest.raises(InvalidArgument) as exc:
            InitInfo(**{"coordinator": "c:1", "session": "job", **bad})
        assert exc.value.field == field and exc.value.message.startswith(f"{field}: "), exc.value.message


@pytest.mark.parametrize(
    ("mode", "apply_mode", "relays"),
    [
        pytest.param("", "atomic", True, marks=pytest.mark.needs_inet),  # a relay listens on tcp
        # tcp and relay rollouts are refused at start where inet sockets are not (test_addresses)
        pytest.param("relay", "atomic", True, marks=pytest.mark.needs_inet),
        pytest.param("tcp", "atomic", False, marks=pytest.mark.needs_inet),
        pytest.param("relay", "streaming", False, marks=pytest.mark.needs_inet),
        ("", "streaming", False),
    ],
)
def test_every_entry_point_relays_by_the_same_rule(mode: str, apply_mode: str, relays: bool) -> None:
    from rollout_agent.settings import InitInfo
    from rollout_agent.wiring import wire_rollout

    settings = InitInfo(coordinator="127.0.0.1:1", session="job", weight_sync_mode=mode, apply_mode=apply_mode)
    wiring = wire_rollout(settings, "r0", on_verdict=lambda *_: None)
    try:
        assert (wiring.relay is not None) is relays
        assert ("relay" in wiring.endpoint().transports) is relays
    finally:
        wiring.close_data_plane()
        wiring.outbox.close()
        wiring.client.close()


@pytest.mark.needs_inet
def test_a_relay_in_a_vllm_worker_binds_and_advertises_the_advertised_host() -> None:
    # Inside a vLLM worker there is no server --host: a relay bound to 127.0.0.1 and
    # advertising it would be unreachable from every other host.
    from rollout_agent.settings import InitInfo
    from rollout_agent.wiring import wire_rollout

    settings = InitInfo(coordinator="127.0.0.1:1", session="job", weight_sync_mode="relay", advertise_host="127.0.0.3")
    wiring = wire_rollout(settings, "r0", on_verdict=lambda *_: None)
    try:
        assert wiring.relay is not None and wiring.relay.address.startswith("127.0.0.3:")
        assert wiring.endpoint().tcp_address == wiring.relay.address
        assert wiring.endpoint().address == ""  # no gRPC server of its own
        wiring.server_address = "0.0.0.0:4242"  # a sidecar's: advertised with the pod's host
        assert wiring.endpoint().address == "127.0.0.3:4242"
    finally:
        wiring.close_data_plane()
        wiring.outbox.close()
        wiring.client.close()


def test_vllm_init_info_requires_the_coordinator_and_the_session() -> None:
    from rollout_agent.settings import InitInfo

    with pytest.raises(InvalidArgument, match="init_info.coordinator"):
        InitInfo()
    with pytest.raises(InvalidArgument, match="init_info.session"):
        InitInfo(coordinator="c:1")
    with pytest.raises(InvalidArgument, match="init_info.coordinator.*port 65536"):
        InitInfo(coordinator="c:65536", session="s")
    with pytest.raises(InvalidArgument, match="init_info.advertise_host"):
        InitInfo(coordinator="c:1", session="s", advertise_host="-1")


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(session="Bad Name"), "session"),
        (dict(coordinator=""), "coordinator"),
        (dict(coordinator="127.0.0.1:99999"), "coordinator"),  # gRPC would dial port 34463
        (dict(coordinator="coordinator"), "coordinator"),  # gRPC would dial port 443
        (dict(rank=2, world_size=2), "rank"),
        (dict(world_size=0), "world_size"),
        (dict(weight_dtype="float8"), "weight_dtype"),
        (dict(weight_sync_mode="fs"), "fs_root"),
        (dict(weight_sync_mode="udp"), "weight_sync_mode"),
        (dict(slots=0), "slots"),
        (dict(d2h_window_bytes=0), "d2h_window_bytes"),
        (dict(d2h_block_bytes=-1), "d2h_block_bytes"),
        (dict(chunk_bytes=0), "chunk_bytes"),
        (dict(chunk_bytes=1024), "chunk_bytes"),  # below what the coordinator takes: refused before staging
        (dict(chunk_bytes=128 << 20), "chunk_bytes"),
        (dict(min_rollouts=-1), "min_rollouts"),
        (dict(timeout_s=0.0), "timeout_s"),
        (dict(slot_wait_s=-1.0), "slot_wait_s"),
        (dict(tcp_port=70000), "tcp_port"),
        (dict(agent_id="Trainer 0"), "agent_id"),
        # past what the request or the coordinator takes: tracebacks at the first publish before
        (dict(world_size=5000), "world_size"),
        (dict(slots=65), "slots"),
        (dict(min_rollouts=1 << 32), "min_rollouts"),
        (dict(timeout_s=1e20), "timeout_s"),
        (dict(failpoints="x"), "failpoints"),  # refused only after the session was attached
    ],
)
def test_publisher_settings_name_the_bad_field_for_library_and_entry_point(kwargs: dict, field: str) -> None:
    from trainer_agent.config import TrainerConfig
    from trainer_agent.settings import PublisherSettings

    with pytest.raises(InvalidArgument) as e:
        PublisherSettings(**kwargs)
    assert e.value.field == field
    # the entry point runs the same check (one owner): a usage error, not a traceback
    argv = [arg for k, v in kwargs.items() for arg in ("--" + k.replace("_", "-"), str(v))]
    with pytest.raises(SystemExit):
        load_config(TrainerConfig, "trainer", argv, {})


def test_trainer_config_is_the_publisher_settings_with_entry_point_defaults() -> None:
    from trainer_agent.config import TrainerConfig
    from trainer_agent.settings import PublisherSettings

    cfg = load_config(TrainerConfig, "trainer", ["--use-ffi", "false", "--slot-wait-s", "5"], {})
    assert isinstance(cfg, PublisherSettings) and cfg.use_ffi is False and cfg.slot_wait_s == 5.0
    assert (cfg.weight_dtype, cfg.weight_sync_mode, cfg.metrics_port) == ("bfloat16", "tcp", 0)
    library = PublisherSettings()
    assert (library.weight_dtype, library.weight_sync_mode, library.metrics_port, library.use_ffi) == ("", "", -1, None)
    assert load_config(TrainerConfig, "trainer", [], {}).use_ffi is None  # not given: the best path


def test_a_publisher_does_no_io_until_started_and_refuses_to_publish_before() -> None:
    import numpy as np

    from trainer_agent.publish.publisher import WeightPublisher
    from trainer_agent.settings import PublisherSettings
    from weightsync.errors import FailedPrecondition

    pub = WeightPublisher(PublisherSettings(coordinator="127.0.0.1:1", session="job"))  # nothing listens there
    with pytest.raises(FailedPrecondition, match="start"):
        pub.publish({"w": np.zeros(4, np.float32)}, 1)
    pub.close()  # closing what never started is fine
    with pytest.raises(FailedPrecondition, match="closed"):
        pub.publish({"w": np.zeros(4, np.float32)}, 1)


@pytest.mark.parametrize("module", ["coordinator", "trainer_agent", "rollout_agent", "weightsync.cli"])
def test_every_entry_point_prints_its_help(module: str) -> None:
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]  # a bare % in help text ("~90% of RAM") crashes argparse
    assert "usage:" in out.stdout


def test_wsctl_takes_json_before_or_after_the_subcommand() -> None:
    from weightsync.cli import build_parser

    parser = build_parser()
    for argv, expected in (
        (["versions", "--json"], True),
        (["--json", "versions"], True),
        (["watch", "--json", "--count", "1"], True),
        (["status"], False),
    ):
        assert parser.parse_args(argv).json is expected, argv


def test_json_logs_name_session_agent_and_version(capsys: pytest.CaptureFixture[str]) -> None:
    import json
    import logging

    from weightsync import logs

    logs.setup_logging("INFO", "json")
    try:
        logs.bind(session="job", agent_id="r0")
        log = logging.getLogger("weightsync.test")
        log.info("outside")
        with logs.version_context(7):
            log.warning("inside %d", 1)
        log.error("explicit", extra={"version": 9})
        lines = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    finally:
        logs._bound.clear()  # noqa: SLF001 - process state of this test only
        logging.getLogger().handlers.clear()
    assert [(x["message"], x.get("version")) for x in lines] == [("outside", None), ("inside 1", 7), ("explicit", 9)]
    assert all(x["session"] == "job" and x["agent_id"] == "r0" and x["time"].endswith("Z") for x in lines)
    assert lines[1]["level"] == "WARNING" and lines[1]["logger"] == "weightsync.test"
    with pytest.raises(ValueError, match="log format"):
        logs.setup_logging("INFO", "xml")


def test_a_bearer_token_can_come_from_a_mounted_file(tmp_path) -> None:  # noqa: ANN001
    token = tmp_path / "token"
    token.write_text("t" * 24 + "\n")
    argv = ["--coordinator", "c:1", "--session", "s", "--auth-token-file", str(token)]
    assert load_config(RolloutConfig, "rollout", argv, {}).security().token == "t" * 24
    for bad in (
        [*argv, "--auth-token", "x" * 20],  # both
        ["--coordinator", "c:1", "--session", "s", "--auth-token-file", str(tmp_path / "missing")],
    ):
        with pytest.raises(SystemExit):
            load_config(RolloutConfig, "rollout", bad, {})
    (tmp_path / "empty").write_text("\n")
    from rollout_agent.settings import InitInfo

    with pytest.raises(InvalidArgument, match="init_info.auth_token_file"):
        InitInfo(coordinator="c:1", session="s", auth_token_file=str(tmp_path / "empty"))


@pytest.mark.parametrize(
    ("component", "argv", "why"),
    [
        ("coordinator", ["--retain-versions", str(1 << 64)], "retain_versions"),  # OverflowError at each prune
        ("coordinator", ["--max-sessions", str(1 << 64)], "max_sessions"),
        ("coordinator", ["--lease-ttl-s", "1e20"], "lease_ttl_s"),  # OverflowError at the first lease
        ("coordinator", ["--forget-agents-after-s", "1e300"], "forget_agents_after_s"),
        ("coordinator", ["--max-workers", "100000000"], "max_workers"),
        ("coordinator", ["--log-level", "verbose"], "log_level"),  # taken as INFO, silently
        ("trainer", ["--seed", str(1 << 64)], "seed"),
        ("trainer", ["--seed", "-1"], "seed"),
        ("trainer", ["--start-version", str(1 << 63)], "start_version"),
        ("rollout", ["--kv-cache-bytes", "-1"], "kv_cache_bytes"),
        # registered as the address other agents dial: they failed to, version after version
        ("rollout", ["--advertise-host=-1"], "advertise_host"),
        ("trainer", ["--advertise-host", "pod ip"], "advertise_host"),
        # a store scheme fsspec does not know, or whose package is missing: every round failed
        ("rollout", ["--weight-sync-mode", "fs", "--fs-root", "bogus://bucket"], "fs_root"),
        ("rollout", ["--fs-root", "abfs://container/ws"], "adlfs"),  # a scheme fsspec knows, its package not installed
        ("trainer", ["--weight-sync-mode", "fs", "--fs-root", "bogus://bucket"], "fs_root"),
    ],
)
def test_settings_past_what_a_process_can_use_are_refused_at_start(
    component: str, argv: list[str], why: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from trainer_agent.config import TrainerConfig

    cls = {"coordinator": CoordinatorConfig, "trainer": TrainerConfig, "rollout": RolloutConfig}[component]
    with pytest.raises(SystemExit):
        load_config(cls, component, argv, {})  # type: ignore[type-var]
    assert why in capsys.readouterr().err


def test_a_float_flag_that_is_no_number_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    for argv, environ in ((["--lease-ttl-s=abc"], {}), ([], {"WEIGHTSYNC_COORDINATOR_LEASE_TTL_S": "abc"})):
        with pytest.raises(SystemExit):
            load_config(CoordinatorConfig, "coordinator", argv, environ)
        assert "expected a number, got 'abc'" in capsys.readouterr().err


@pytest.mark.parametrize("text", ["nan", "inf", "-inf", "1e400"])
def test_float_settings_are_finite_from_flags_env_and_code(text: str, capsys: pytest.CaptureFixture[str]) -> None:
    """ "nan" and "inf" parse as floats: a coordinator started with a NaN lease compared no
    lease as expired, an infinite one died of an OverflowError at its first lease."""
    from rollout_agent.settings import SyncSettings
    from trainer_agent.settings import PublisherSettings

    with pytest.raises(SystemExit):
        load_config(CoordinatorConfig, "coordinator", [f"--lease-ttl-s={text}"], {})
    assert "--lease-ttl-s: expected a finite number" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        load_config(CoordinatorConfig, "coordinator", [], {"WEIGHTSYNC_COORDINATOR_LEASE_TTL_S": text})
    assert "expected a finite number" in capsys.readouterr().err
    for cls, name in (
        (PublisherSettings, "slot_wait_s"),
        (PublisherSettings, "timeout_s"),
        (SyncSettings, "timeout_s"),
    ):
        with pytest.raises(InvalidArgument) as e:
            cls(coordinator="127.0.0.1:1", session="job", **{name: float(text)})
        assert e.value.field == name


@pytest.mark.parametrize(
    "argv",
    [
        ["--timeout-s", "nan", "status"],
        ["--timeout-s", "0", "status"],
        ["status", "--limit", "-5"],
        ["versions", "--limit", str(1 << 32)],  # GetStatusRequest.version_limit is a uint32
        ["manifest", "-3"],
        ["manifest", str(1 << 64)],
        ["watch", "--since", "-1"],
        ["watch", "--timeout", "inf"],
    ],
)
def test_wsctl_refuses_numbers_its_requests_cannot_carry_as_usage_errors(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """A negative limit or version is a usage error, not a traceback from protobuf's "Value
    out of range" building the request; a NaN deadline is one too, not DEADLINE_EXCEEDED."""
    from weightsync.cli import build_parser

    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(argv)
    assert e.value.code == 2 and "expected a number in" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--rollouts", "0"], "--rollouts"),
        (["--rollouts", "100000"], "--rollouts"),
        (["--steps", "0"], "--steps"),
        (["--model-size", "huge"], "--model-size"),
        (["--session", "Demo/1"], "--session"),
        (["--lr", "nan"], "--lr"),
        (["--timeout-s", "-1"], "--timeout-s"),
        (["--group", "1"], "--group"),  # a group of one has no baseline to compare with
        (["--max-tokens", "0"], "--max-tokens"),
    ],
)
def test_the_demo_refuses_what_it_cannot_run_before_starting_anything(
    argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--rollouts 0` (it would wait out --timeout-s, 900 s, for a handshake nobody sends),
    a bad model size or session are refused before anything starts, not in the trainer
    after the engines started."""
    from devtools.demo import build_parser

    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(argv)
    assert e.value.code == 2 and f"argument {flag}:" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--async", "--noise"], ["--async", "--engine", "numpy"], ["--async", "--delta"]])
def test_the_demos_async_mode_needs_the_learning_trainer(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    from devtools.demo import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and "--async belongs to the learning trainer" in capsys.readouterr().err


def test_the_demo_learns_by_default_and_takes_noise_where_it_cannot() -> None:
    import importlib.util

    from devtools.demo import LEARN_STEPS, build_parser, check_args

    if importlib.util.find_spec("vllm") is None:
        pytest.skip("learning needs vLLM engines")

    def resolved(*argv: str):
        parser = build_parser()
        args = parser.parse_args(list(argv))
        check_args(parser, args)
        return args

    learn = resolved()
    assert learn.learn and learn.engine == "vllm" and learn.model_size == "tiny" and learn.steps == LEARN_STEPS
    for argv in (["--noise"], ["--engine", "numpy"], ["--delta"], ["--unix-sockets"], ["--model-size", "medium"]):
        args = resolved(*argv)
        assert not args.learn and args.steps == 5, argv
    assert resolved("--noise").model_size == "small"  # the transport demo's size, as before


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--fs-emulator", "s3"], "is the store of --weight-sync-mode fs"),
        (["--weight-sync-mode", "fs", "--fs-emulator", "gs", "--unix-sockets"], "opens no inet socket"),
    ],
)
def test_the_demo_refuses_an_emulated_store_it_cannot_use(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from devtools.demo import build_parser, check_args

    parser = build_parser()
    with pytest.raises(SystemExit) as e:
        check_args(parser, parser.parse_args(argv))
    assert e.value.code == 2 and says in capsys.readouterr().err


@pytest.mark.parametrize(
    ("address", "why"), [("127.0.0.1:99999", "port 99999 is not in [1, 65535]"), ("coordinator", "is not host:port")]
)
def test_wsctl_refuses_a_coordinator_address_grpc_would_read_as_another(
    address: str, why: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """gRPC dials 127.0.0.1:99999 as port 34463 (the port modulo 2^16), and a host without a
    port as port 443: wsctl talked to whatever listened there."""
    from weightsync.cli import main

    assert main(["--coordinator", address, "status"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("wsctl: coordinator: ") and why in err


@pytest.mark.parametrize("flag", ["--tls-ca-file", "--tls-cert-file"])
def test_wsctl_names_a_tls_file_it_cannot_read(flag: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A TLS file wsctl cannot read is named in its error, not a traceback from building
    its channel."""
    from weightsync.cli import main

    extra = ["--tls-key-file", str(tmp_path / "k")] if flag == "--tls-cert-file" else []
    assert main([flag, str(tmp_path / "missing.pem"), *extra, "status"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("wsctl: tls_") and "missing.pem" in err and "No such file" in err
