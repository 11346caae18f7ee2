"""unix: addresses: parsing, validation naming the field, and the socket file's life (real sockets)."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest

from tests.unit.helpers import as_ordinary_user, shared_directory, without_inet
from weightsync.addresses import inet_unusable, is_unix, join_host_port, unix_address, unix_path
from weightsync.config import advertised, is_loopback, load_config
from weightsync.errors import FailedPrecondition, InvalidArgument
from weightsync.unix_sockets import SOCKET_MODE, bind_unix, process_named
from weightsync.validation import SUN_PATH_MAX, UNIX_BIND_DIR_BYTES, check_address, check_unix_address

ROOT = Path(__file__).resolve().parents[2]


def test_both_spellings_name_one_path() -> None:
    for address in ("unix:/run/ws/c.sock", "unix:///run/ws/c.sock"):
        assert is_unix(address) and unix_path(address) == "/run/ws/c.sock"
        check_address(address, "coordinator")
        assert join_host_port(address, 0) == "unix:/run/ws/c.sock"  # a server's address: no port
    assert unix_address("/a/b") == "unix:/a/b"
    assert not is_unix("127.0.0.1:50051") and not is_unix("unixhost:80")
    assert is_loopback("unix:/run/ws/c.sock")  # only this machine reaches it
    assert advertised("unix:/run/ws/t.sock", "10.0.0.7") == "unix:/run/ws/t.sock"


@pytest.mark.parametrize(
    ("address", "why"),
    [
        ("unix:", "names no socket path"),
        ("unix:///", "names a directory"),
        ("unix:relative/c.sock", "must be absolute"),
        ("unix:/run/ws/", "names a directory"),
        ("unix:/run/\0c.sock", "NUL"),
        ("unix:/" + "a" * SUN_PATH_MAX, f"at most {SUN_PATH_MAX}"),
        ("unix:/" + "d" * (SUN_PATH_MAX - UNIX_BIND_DIR_BYTES) + "/s", "its directory's path"),
    ],
)
def test_bad_unix_paths_are_invalid_arguments_naming_the_field(address: str, why: str) -> None:
    with pytest.raises(InvalidArgument, match=why) as e:
        check_address(address, "endpoint.address")
    assert e.value.field == "endpoint.address"


def test_the_longest_path_whose_private_bind_directory_fits_is_taken(tmp_path: Path) -> None:
    directory = "/" + "d" * (SUN_PATH_MAX - UNIX_BIND_DIR_BYTES - 1)
    check_unix_address(f"unix:{directory}/s", "host")
    temporary = f"{directory}/.abcdefgh/s"  # what bind_unix binds first (mkdtemp's 8 characters)
    assert len(temporary) == SUN_PATH_MAX


def test_a_data_plane_address_must_be_host_port() -> None:
    with pytest.raises(InvalidArgument, match="not a unix socket") as e:
        check_address("unix:/run/t.sock", "endpoint.tcp_address", unix=False)
    assert e.value.field == "endpoint.tcp_address"


# Where no inet socket is usable: the probe's verdict, then each of tcp and relay for the
# trainer (its publisher's start) and a rollout (its wiring): loaded from flags, then started.
_WITHOUT_INET = """
import json
from rollout_agent.config import RolloutConfig
from rollout_agent.wiring import wire_rollout
from trainer_agent.config import TrainerConfig
from trainer_agent.publish.publisher import WeightPublisher
from weightsync.addresses import inet_refused
from weightsync.config import load_config
from weightsync.errors import FailedPrecondition

seen = {"probe": inet_refused()}
for mode in ("tcp", "relay"):
    trainer = load_config(TrainerConfig, "trainer", ["--weight-sync-mode", mode], {})
    rollout = load_config(RolloutConfig, "rollout", ["--weight-sync-mode", mode], {})
    starts = {
        "trainer": lambda: WeightPublisher(trainer).start(),
        "rollout": lambda: wire_rollout(rollout, "r0", on_verdict=print, server_host=rollout.host),
    }
    for name, start in starts.items():
        try:
            start()
            seen[f"{name} {mode}"] = "started"
        except FailedPrecondition as e:
            seen[f"{name} {mode}"] = [e.field, e.message]
print(json.dumps(seen))
"""


def test_without_inet_sockets_tcp_and_relay_settings_load_and_are_refused_at_start() -> None:
    """A network namespace whose loopback is down (AF_INET allowed, 127.0.0.1 binds, nothing
    connects) or a host refusing AF_INET: the probe says so and names the errno. Settings
    naming tcp or relay read as on any host; the trainer's publisher and a rollout's wiring
    refuse them when they start, naming weight_sync_mode."""
    done = subprocess.run(
        [*without_inet(), sys.executable, "-c", _WITHOUT_INET], capture_output=True, text=True, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert re.fullmatch(r"this host has no usable inet sockets \(E[A-Z]+: .+\)", seen.pop("probe"))
    assert sorted(seen) == ["rollout relay", "rollout tcp", "trainer relay", "trainer tcp"]
    for name, (field, message) in seen.items():
        mode = name.split()[1]
        assert field == "weight_sync_mode" and message.startswith(
            f"weight_sync_mode: {mode!r} needs inet sockets, and this host"
        )


def test_inet_modes_are_refused_where_the_addresses_are_unix(tmp_path: Path) -> None:
    from rollout_agent.config import RolloutConfig
    from trainer_agent.config import TrainerConfig

    assert inet_unusable(host="unix:/x/t.sock") == "--host is a unix socket (unix:/x/t.sock)"
    for mode in ("tcp", "relay"):
        with pytest.raises(SystemExit):
            load_config(TrainerConfig, "trainer", ["--host", "unix:/x/t.sock", "--weight-sync-mode", mode], {})
    cfg = load_config(TrainerConfig, "trainer", ["--host", "unix:/x/t.sock", "--weight-sync-mode", "shm"], {})
    assert cfg.weight_sync_mode == "shm"
    with pytest.raises(SystemExit):  # a relay would serve on the unix --host
        load_config(RolloutConfig, "rollout", ["--host", "unix:/x/r.sock", "--weight-sync-mode", "relay"], {})
    relaying = ["--host", "unix:/x/r.sock", "--relay-host", f"unix:{tmp_path}", "--weight-sync-mode", "relay"]
    assert load_config(RolloutConfig, "rollout", relaying, {}).wants_relay()  # serving its host on a unix socket
    follower = load_config(RolloutConfig, "rollout", ["--host", "unix:/x/r.sock", "--coordinator", "unix:/x/c"], {})
    assert not follower.wants_relay()  # the session's mode may be relay: no relay where it cannot serve


def test_every_client_takes_a_unix_coordinator(capsys: pytest.CaptureFixture[str]) -> None:
    from rollout_agent.settings import InitInfo
    from weightsync.cli import main as wsctl

    assert InitInfo(coordinator="unix:///run/ws/c.sock", session="job").coordinator == "unix:///run/ws/c.sock"
    with pytest.raises(InvalidArgument) as e:
        InitInfo(coordinator="unix:run/c.sock", session="job")
    assert e.value.field == "init_info.coordinator"
    assert wsctl(["--coordinator", "unix:run/c.sock", "status"]) == 2
    assert "coordinator: 'unix:run/c.sock': the socket path must be absolute" in capsys.readouterr().err


def test_settings_name_the_field_in_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    from coordinator.config import CoordinatorConfig

    for argv, expected in (
        (["--host", "unix:c.sock"], "host: 'unix:c.sock': the socket path must be absolute"),
        (["--host", "unix:/x/c.sock", "--port", "5"], "port: a unix socket has no port"),
        (["--host", "unix:/x/c.sock", "--advertise-host", "10.0.0.1"], "advertise_host:"),
        (["--metrics-host", "unix:/x/m.sock"], "metrics_host: /metrics binds an IP address"),
    ):
        with pytest.raises(SystemExit):
            load_config(CoordinatorConfig, "coordinator", argv, {})
        assert expected in capsys.readouterr().err
    cfg = load_config(CoordinatorConfig, "coordinator", ["--host", "unix:///x/c.sock", "--metrics-port", "-1"], {})
    assert cfg.host == "unix:///x/c.sock" and cfg.metrics_port == -1


def _listen(path: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(path)
    s.listen()
    return s


def test_the_socket_is_bound_privately_then_moved_into_place_with_mode_0660(tmp_path: Path) -> None:
    path = str(tmp_path / "s.sock")
    seen: list[tuple[str, int]] = []

    def bind(temporary: str) -> socket.socket:
        parent = os.path.dirname(temporary)
        seen.append((temporary, stat.S_IMODE(os.stat(parent).st_mode)))
        return _listen(temporary)

    old = os.umask(0)  # the widest umask: the socket must still be owner+group only
    try:
        listener, made = bind_unix(path, bind, "host")
    finally:
        os.umask(old)
    with listener:
        ((temporary, parent_mode),) = seen
        assert parent_mode == 0o700 and os.path.dirname(temporary) != str(tmp_path)
        assert not os.path.exists(os.path.dirname(temporary))  # the private directory is gone
        st = os.stat(path)
        assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == SOCKET_MODE
        with socket.socket(socket.AF_UNIX) as client:
            client.connect(path)  # the listener serves at the final path
        made.remove()
    assert not os.path.exists(path)


# A server as gRPC runs one: it listens from a thread of its own, which stays.
_LISTENER = """
import socket, sys, threading
from weightsync.unix_sockets import bind_unix
def listen(path):
    s = socket.socket(socket.AF_UNIX); s.bind(path); s.listen(); return s
def serve():
    listener, _ = bind_unix(sys.argv[1], listen, "host")
    print("up", flush=True)
    sys.stdin.read()
threading.Thread(target=serve).start()
"""
# Another server starting on the same path: "taken over", or the error it got.
_SECOND = """
import socket, sys
from weightsync.unix_sockets import bind_unix
from weightsync.errors import FailedPrecondition
def listen(path):
    s = socket.socket(socket.AF_UNIX); s.bind(path); s.listen(); return s
try:
    bind_unix(sys.argv[1], listen, "host")
    print("taken over")
except FailedPrecondition as e:
    print(e.field, e.message)
"""


def test_a_live_socket_is_refused_naming_its_process_and_a_killed_ones_taken_over() -> None:
    """Both servers run as an ordinary user, as on the TPU host."""
    directory = shared_directory(Path(tempfile.gettempdir()))
    path = str(directory / "s.sock")
    user = as_ordinary_user()

    def second() -> str:
        done = subprocess.run([*user, sys.executable, "-c", _SECOND, path], cwd=ROOT, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    try:
        with subprocess.Popen(
            [*user, sys.executable, "-c", _LISTENER, path],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        ) as child:
            try:
                assert child.stdout is not None and child.stdout.readline().strip() == "up"
                inode = os.stat(path).st_ino
                refused = f"host host: another process serves on unix:{path} (pid {child.pid}: {sys.executable} -c "
                assert second().startswith(refused)
                assert os.stat(path).st_ino == inode  # left as it was
            finally:
                child.kill()
                child.wait(timeout=30)
        assert second() == "taken over"
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def test_a_thread_is_named_by_its_process() -> None:
    """gVisor's SO_PEERCRED gives the thread that listened: its process is what is named."""
    started, done = threading.Event(), threading.Event()
    ids: list[int] = []

    def thread() -> None:
        ids.append(threading.get_native_id())
        started.set()
        done.wait(30)

    t = threading.Thread(target=thread)
    t.start()
    try:
        assert started.wait(30) and ids[0] != os.getpid()
        named = process_named(ids[0])
        assert named == process_named(os.getpid()) == f"pid {os.getpid()}: {' '.join(sys.orig_argv)}"
    finally:
        done.set()
        t.join()


def test_a_dead_owners_socket_is_taken_over_and_other_files_are_not_replaced(tmp_path: Path) -> None:
    path = str(tmp_path / "s.sock")
    _listen(path).close()  # its process gone: the file stays, nothing listens
    listener, made = bind_unix(path, _listen, "host")
    with listener:
        with socket.socket(socket.AF_UNIX) as client:
            client.connect(path)
    made.remove()
    regular = tmp_path / "not-a-socket"
    regular.write_text("data")
    with pytest.raises(FailedPrecondition, match="is not a socket"):
        bind_unix(str(regular), _listen, "host")
    assert regular.read_text() == "data"
    with pytest.raises(FailedPrecondition, match="No such file or directory") as e:
        bind_unix(str(tmp_path / "missing" / "s.sock"), _listen, "host")
    assert e.value.field == "host"


def test_remove_leaves_a_socket_another_server_put_there(tmp_path: Path) -> None:
    path = str(tmp_path / "s.sock")
    listener, made = bind_unix(path, _listen, "host")
    listener.close()
    os.unlink(path)
    with _listen(path):  # someone else's now
        made.remove()
        assert os.path.exists(path)


def test_two_servers_starting_on_one_path_at_once_get_one_socket(tmp_path: Path) -> None:
    path = str(tmp_path / "s.sock")
    results: list[object] = []
    start = threading.Barrier(4)

    def claim() -> None:
        start.wait()
        try:
            results.append(bind_unix(path, _listen, "host"))
        except FailedPrecondition as e:
            results.append(e)

    threads = [threading.Thread(target=claim) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    won = [r for r in results if isinstance(r, tuple)]
    assert len(won) == 1 and sum(isinstance(r, FailedPrecondition) for r in results) == 3
    listener, made = won[0]
    listener.close()
    made.remove()
