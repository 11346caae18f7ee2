"""One pull per host, the parts that need no socket: shared receive buffers, which relay a
rollout reads from, and the unix relay host's settings."""

from __future__ import annotations

import fcntl
import mmap
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from rollout_agent.pull.puller import WeightPuller
from rollout_agent.pull.relay import RelaySource
from rollout_agent.settings import InitInfo, SyncSettings
from tests.unit.helpers import without_inet
from weightsync.errors import FailedPrecondition, InvalidArgument
from weightsync.manifest import Endpoint
from weightsync.transports.hostshm import SEALS, readonly_fd, shared_array

ROOT = Path(__file__).resolve().parents[2]


def test_a_shared_buffer_is_handed_out_read_only_and_sealed_to_its_size() -> None:
    buf = shared_array(1 << 16)
    view = buf[4096:8192]  # a receive buffer is a view of the grown one
    fd = readonly_fd(view)
    try:
        assert fcntl.fcntl(fd, fcntl.F_GET_SEALS) & SEALS == SEALS and os.fstat(fd).st_size == 1 << 16
        with pytest.raises(PermissionError):  # a reader cannot write the puller's bytes
            mmap.mmap(fd, 0, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        with pytest.raises(OSError):  # nor shrink the file under another reader's mapping
            os.ftruncate(fd, 0)
        seen = np.frombuffer(mmap.mmap(fd, 0, mmap.MAP_SHARED, mmap.PROT_READ), np.uint8)
        view[:] = 7
        assert seen[4096:8192].tolist() == [7] * 4096 and not seen[:4096].any()
    finally:
        os.close(fd)
    os.close(readonly_fd(RelaySource("job", shares_memory=True).allocate(64)))
    with pytest.raises(FailedPrecondition):  # a relay on inet sockets keeps plain buffers
        readonly_fd(RelaySource("job").allocate(64))


def _here(name: str, host: str = "h1") -> Endpoint:
    return Endpoint(transports=("grpc", "relay"), host_id=host, tcp_address=f"unix:/run/ws/relay-{name}.sock")


def _inet(port: int) -> Endpoint:
    return Endpoint(transports=("grpc", "relay"), host_id="h9", tcp_address=f"10.0.0.9:{port}")


def test_a_rollout_reads_from_the_first_unix_relay_of_its_host() -> None:
    puller = WeightPuller(None, "job", "r3", host_id="h1")  # type: ignore[arg-type]
    assert puller.upstream_of([]) is None  # first in the chain: the trainer
    assert puller.upstream_of([_here("r0"), _here("r1"), _here("r2")]) == _here("r0")  # a star, not a chain
    assert puller.upstream_of([_inet(1), _here("a", "h2"), _here("r1"), _inet(2)]) == _here("r1")
    assert puller.upstream_of([_here("a", "h2")]) is None  # another host's unix socket is out of reach


_UPSTREAM = """
from rollout_agent.pull.puller import WeightPuller
from tests.unit.test_host_pull import _here, _inet
chain = [_inet(1), _here("a", "h2"), _inet(2)]
print(WeightPuller(None, "job", "r3", host_id="h1").upstream_of(chain))
"""


@pytest.mark.needs_inet
def test_else_a_rollout_reads_from_the_last_inet_relay() -> None:
    puller = WeightPuller(None, "job", "r3", host_id="h1")  # type: ignore[arg-type]
    assert puller.upstream_of([_inet(1), _here("a", "h2"), _inet(2)]) == _inet(2)  # the inet chain as before


def test_without_inet_sockets_a_rollout_past_inet_relays_reads_from_the_trainer() -> None:
    done = subprocess.run([*without_inet(), sys.executable, "-c", _UPSTREAM], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == "None", done.stderr


def test_a_unix_relay_host_names_a_directory_and_each_rollout_a_socket_in_it(tmp_path: Path) -> None:
    settings = SyncSettings(relay_host=f"unix:{tmp_path}/", weight_sync_mode="relay")
    assert settings.relay_unusable() == "" and settings.wants_relay()
    assert settings.relay_bind("r7") == f"unix:{tmp_path}/relay-r7.sock"
    assert SyncSettings(relay_host="10.0.0.1").relay_bind("r7", "unix:/x/r.sock") == "10.0.0.1"
    for kwargs, field, words in (
        ({"relay_host": "unix:run/ws"}, "relay_host", "absolute directory"),
        ({"relay_host": f"unix:{tmp_path}/missing"}, "relay_host", "is not a directory"),
        ({"relay_host": f"unix:{tmp_path}", "relay_port": 7000}, "relay_port", "no port"),
    ):
        with pytest.raises(InvalidArgument, match=words) as e:
            SyncSettings(**kwargs)  # type: ignore[arg-type]
        assert e.value.field == field
    with pytest.raises(InvalidArgument) as e:
        InitInfo(coordinator="unix:/x/c.sock", session="job", relay_host="unix:run/ws")
    assert e.value.field == "init_info.relay_host"
    deep = tmp_path / ("d" * 40)
    deep.mkdir()
    with pytest.raises(InvalidArgument, match="107") as e:  # the socket's path past sun_path: refused at start
        SyncSettings(relay_host=f"unix:{deep}").relay_bind("r" * 63)
    assert e.value.field == "relay_host"
    with pytest.raises(InvalidArgument) as e:
        InitInfo(coordinator="unix:/x/c.sock", session="job", relay_host=f"unix:{deep}").relay_bind("r" * 63)
    assert e.value.field == "init_info.relay_host"
