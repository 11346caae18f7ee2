"""One pull per host: rollouts relaying on unix sockets (`--relay-host unix:DIR`) read each
version from the host's puller, mapping its buffers (`hostshm`); real processes on unix
sockets only, so these run where no inet socket exists (a TPU host)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from devtools.cluster import Cluster, Proc
from tests.integration.support import eventually, state_name, trainer_bytes_served
from tests.unit.helpers import unshare_missing
from trainer_agent import synthetic
from weightsync._proto import types_pb2 as tpb
from weightsync.client import CoordinatorClient
from weightsync.errors import TransportUnavailable
from weightsync.manifest import Endpoint
from weightsync.transports import FetchRequest
from weightsync.transports.hostshm import HostShmTransport
from weightsync.transports.tcp import REPLY, REQUEST

pytestmark = pytest.mark.unix_only  # no inet socket: runs on a TPU host too
ROOT = Path(__file__).resolve().parents[2]
NO_METRICS = ["--metrics-port", "-1"]
# Small chunks: a tiny version spans enough of them for a reader to be caught mid-version.
TRAINER = ["--model-size", "tiny", "--weight-dtype", "float32", "--weight-sync-mode", "grpc", "--chunk-bytes", "16384"]
STALLED = "failpoint relay.stall_after_chunks: stalling this reply"
FELL_BACK = "pulling the rest from the trainer"


def _rollouts(cluster: Cluster, coord: Proc, sockets: Path, dumps: Path, extra: dict[str, list[str]]) -> list[Proc]:
    """r0, r1, r2 relaying on unix sockets in `sockets`; r0, first in the chain, is the host's puller."""
    return [
        cluster.start_rollout(
            name,
            coord.address,
            "job",
            [
                *("--host", f"unix:{sockets}/{name}.sock", *NO_METRICS),
                *("--weight-sync-mode", "relay", "--relay-host", f"unix:{sockets}"),
                *("--dump-dir", str(dumps / name), *extra.get(name, [])),
            ],
        )
        for name in ("r0", "r1", "r2")
    ]


def _trainer(cluster: Cluster, coord: Proc, sockets: Path, steps: int, *args: str) -> Proc:
    listen = ["--host", f"unix:{sockets}/trainer.sock", *NO_METRICS]
    return cluster.start_trainer("trainer", coord.address, "job", [*listen, *TRAINER, "--steps", str(steps), *args])


def _version_bytes(client: CoordinatorClient, version: int) -> int:
    _, manifest = client.get_manifest("job", version)
    return sum(p.total_bytes for p in manifest.parts)


def _applied_exactly(dump: Path, version: int) -> bool:
    got = load_file(str(dump / f"v{version}.safetensors"))
    expected = synthetic.params_after("tiny", 0, version)
    return set(got) == set(expected) and all(np.array_equal(got[k], np.asarray(v)) for k, v in expected.items())


@pytest.mark.slow
def test_three_rollouts_on_a_host_take_one_pull_per_version_from_the_trainer(
    cluster: Cluster, sockets: Path, tmp_path: Path
) -> None:
    coord = cluster.start_coordinator(host=f"unix:{sockets}/coordinator.sock", args=NO_METRICS)
    rollouts = _rollouts(cluster, coord, sockets, tmp_path, {})
    trainer = _trainer(cluster, coord, sockets, 3, "--min-rollouts", "3", "--hold")
    with CoordinatorClient(coord.address) as client:
        assert state_name(client.wait_for_version("job", 3, timeout_s=120)) == "COMMITTED"
        relays = {a.agent_id: a.endpoint.tcp_address for a in client.status("job").agents if a.role == tpb.ROLLOUT}
        assert relays == {n: f"unix:{sockets}/relay-{n}.sock" for n in ("r0", "r1", "r2")}  # the chain, by id
        sent = 3 * _version_bytes(client, 3)  # (every step has the model's size; 1 and 2 are released)
        handshakes = {(h.version, h.agent_id): h for h in client.status("job").handshakes}
    assert sent <= trainer_bytes_served(trainer.address) < 1.01 * sent  # once for three (grpc frames add a little)
    for v in (1, 2, 3):
        for name in ("r0", "r1", "r2"):
            assert handshakes[(v, name)].ok and _applied_exactly(tmp_path / name, v), (v, name)
    for proc in rollouts:
        assert FELL_BACK not in proc.log()
    for name in ("trainer", "r0", "r1", "r2", "coordinator"):
        assert cluster.stop(name) == 0
    assert sorted(p.name for p in sockets.iterdir()) == []  # every server removed its socket, relays too


@pytest.mark.slow
def test_when_the_hosts_puller_is_killed_mid_version_the_others_finish_from_the_trainer(
    cluster: Cluster, sockets: Path, tmp_path: Path
) -> None:
    """r0 hands out two chunks, then stalls every reply; killed -9 there, r1 and r2 leave it
    for the trainer and version 1 commits. By version 2 (5 s later: r0 is out of the chain)
    r1 is the host's puller and the trainer again sends the version once."""
    coord = cluster.start_coordinator(host=f"unix:{sockets}/coordinator.sock", args=[*NO_METRICS, "--lease-ttl-s", "3"])
    rollouts = _rollouts(cluster, coord, sockets, tmp_path, {"r0": ["--failpoints", "relay.stall_after_chunks=2"]})
    trainer = _trainer(cluster, coord, sockets, 2, "--min-rollouts", "2", "--step-interval-s", "5", "--hold")
    eventually(lambda: STALLED in rollouts[0].log(), timeout_s=60, what="r0 to stall its readers mid-version")
    cluster.kill("r0")
    with CoordinatorClient(coord.address) as client:
        assert state_name(client.wait_for_version("job", 1, timeout_s=60)) == "COMMITTED"
        after_first = trainer_bytes_served(trainer.address)
        assert state_name(client.wait_for_version("job", 2, timeout_s=60)) == "COMMITTED"
        second = _version_bytes(client, 2)
        ok = {(h.version, h.agent_id) for h in client.status("job").handshakes if h.ok}
    for proc in rollouts[1:]:
        assert FELL_BACK in proc.log(), proc.name
    assert second <= trainer_bytes_served(trainer.address) - after_first < 1.01 * second
    for v in (1, 2):
        for name in ("r1", "r2"):
            assert (v, name) in ok and _applied_exactly(tmp_path / name, v), (v, name)
    assert cluster.stop("r1") == 0 and cluster.stop("r2") == 0
    assert [p.name for p in sockets.glob("relay-*")] == ["relay-r0.sock"]  # the killed one's, taken over at its restart


@pytest.mark.slow
@pytest.mark.skipif(bool(unshare_missing()), reason=unshare_missing() or "unshare -n works")
def test_the_host_pull_bench_runs_without_a_network(no_arena_leak: None) -> None:
    """bench/host_pull.py inside `unshare -n` (no inet socket reaches anything, as on a TPU
    host): three rollouts take three pulls per version from the trainer, then one."""
    run = subprocess.run(
        ["unshare", "-n", sys.executable, "bench/host_pull.py", "--size", "tiny", "--rollouts", "3", "--rounds", "2"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    rows = {r["phase"]: r for r in json.loads(run.stdout)["rows"]}
    assert rows["separate"]["egress_ratio"] == [3.0, 3.0] and rows["host"]["egress_ratio"] == [1.0, 1.0]
    assert len(rows["host"]["reader_ratio_to_memcpy"]) == 2


def _open_memfds(name: str) -> int:
    """Descriptors of this process open on memfd files named `name`."""
    links = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            links.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:  # closed meanwhile (the listing's own descriptor, another thread's)
            pass
    return sum(link.startswith(f"/memfd:{name} ") for link in links)


def test_a_reader_maps_no_buffer_that_could_shrink_under_it(sockets: Path) -> None:
    """A relay answering with memory not sealed to its size (it could be truncated while
    mapped: SIGBUS in the reader) is refused as unavailable, and its descriptor closed."""
    path = sockets / "relay.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(1)
    unsealed = os.memfd_create("not-sealed")
    os.ftruncate(unsealed, 4096)

    def answer() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.recv(REQUEST.size + 64)
            socket.send_fds(conn, [REPLY.pack(b"WSR1", 0, 0, 1)], [unsealed])

    server = threading.Thread(target=answer)
    server.start()
    reader = HostShmTransport()
    try:
        reader.open(Endpoint(tcp_address=f"unix:{path}"))
        request = FetchRequest("job", 1, 0, [0], 5.0, [(0, 4096)], "token")
        with pytest.raises(TransportUnavailable, match="not sealed"):
            reader.fetch_into(request, np.empty(4096, np.uint8), 0, [0])
        server.join(10)
        assert _open_memfds("not-sealed") == 1  # ours: the descriptor the reader was handed is closed
    finally:
        server.join(10)
        reader.close()
        listener.close()
        os.close(unsealed)
