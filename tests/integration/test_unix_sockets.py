"""Real processes over unix sockets: coordinator, trainer and rollout dial each other at
`unix:` paths (shm and grpc data planes), each socket file mode 0660 and gone after SIGTERM;
a killed server's socket is taken over by its restart, a live one's is refused by name."""

from __future__ import annotations

import json
import os
import re
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from devtools.cluster import Cluster
from tests.integration.support import eventually, reflected_services, serving, state_name
from tests.unit.helpers import unshare_missing
from weightsync.client import CoordinatorClient
from weightsync.unix_sockets import SOCKET_MODE

pytestmark = [pytest.mark.slow, pytest.mark.unix_only]  # no inet socket: runs on a TPU host too
ROOT = Path(__file__).resolve().parents[2]
NO_METRICS = ["--metrics-port", "-1"]


def _is_socket_0660(path: Path) -> bool:
    st = path.lstat()
    return stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == SOCKET_MODE


@pytest.mark.parametrize("mode", ["shm", "grpc"])
def test_a_cluster_over_unix_sockets_commits_and_every_server_lists_its_services(
    cluster: Cluster, sockets: Path, mode: str
) -> None:
    coord = cluster.start_coordinator(host=f"unix:{sockets}/coordinator.sock", args=NO_METRICS)
    assert coord.address == f"unix:{sockets}/coordinator.sock" and coord.ready["metrics_port"] == -1
    rollout = cluster.start_rollout(
        "r0", f"unix://{sockets}/coordinator.sock", "job", ["--host", f"unix:{sockets}/r0.sock", *NO_METRICS]
    )
    trainer = cluster.start_trainer(
        "trainer",
        coord.address,
        "job",
        [
            "--host",
            f"unix:{sockets}/trainer.sock",
            *NO_METRICS,
            "--weight-sync-mode",
            mode,
            "--model-size",
            "tiny",
            "--steps",
            "2",
            "--min-rollouts",
            "1",
            "--hold",
        ],
    )
    with CoordinatorClient(coord.address) as client:
        assert state_name(client.wait_for_version("job", 2, timeout_s=120)) == "COMMITTED"
        _, manifest = client.get_manifest("job", 2)
    endpoint = manifest.parts[0].endpoint
    assert endpoint.address == trainer.address == f"unix:{sockets}/trainer.sock"
    assert "tcp" not in endpoint.transports and not endpoint.tcp_address  # no inet socket to offer
    serving(rollout.address, 2)
    for proc, service in ((coord, "Coordinator"), (rollout, "RolloutAgent"), (trainer, "TrainerAgent")):
        assert f"weightsync.v1.{service}" in reflected_services(proc.address)  # `grpcurl -unix PATH list`
        assert _is_socket_0660(Path(proc.address.removeprefix("unix:")))
    for name in ("trainer", "r0", "coordinator"):
        assert cluster.stop(name) == 0
    assert sorted(p.name for p in sockets.iterdir()) == []  # each server removed its socket


def test_a_killed_servers_socket_is_taken_over_and_a_live_ones_is_refused_by_name(
    cluster: Cluster, sockets: Path
) -> None:
    path = sockets / "coordinator.sock"
    first = cluster.start_coordinator(host=f"unix:{path}", args=NO_METRICS)
    second = cluster.start(
        "second",
        "coordinator",
        ["--db-path", str(cluster.workdir / "second.db"), "--host", f"unix:{path}", *NO_METRICS],
        wait=False,
    )
    assert second.popen.wait(60) == 2
    assert re.search(rf"host: another process serves on unix:{re.escape(str(path))} \(pid {first.pid}\b", second.log())
    assert "weightsync.v1.Coordinator" in reflected_services(first.address)  # the first still serves there

    cluster.kill("coordinator")  # SIGKILL: nothing removes the socket
    assert _is_socket_0660(path)
    restarted = cluster.start_coordinator(name="restarted", host=f"unix:{path}", args=NO_METRICS)
    assert "its previous server is gone; taking it over" in restarted.log()
    assert "weightsync.v1.Coordinator" in reflected_services(restarted.address) and _is_socket_0660(path)
    assert cluster.stop("restarted") == 0
    assert not path.exists()


def _inet_sockets(pid: int) -> list[str] | None:
    """The inet sockets (tcp, udp, v4 and v6) open in `pid`'s network namespace; None until
    it has one of its own (before unshare(2) runs, it is in ours) or once it ended."""
    try:
        if os.readlink(f"/proc/{pid}/ns/net") == os.readlink("/proc/self/ns/net"):
            return None
    except OSError:
        return None
    found = []
    for table in ("tcp", "tcp6", "udp", "udp6"):
        try:
            lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:  # the process ended
            continue
        found += [f"{table}: {line.strip()}" for line in lines]
    return found


@pytest.mark.skipif(bool(unshare_missing()), reason=unshare_missing() or "unshare -n works")
def test_the_demo_over_unix_sockets_commits_every_version_without_a_network(
    tmp_path: Path, no_arena_leak: None
) -> None:
    """In a network namespace (loopback down: no inet socket can reach anything) the demo
    runs all its processes; and none of them opens an inet socket, sampled all along."""
    with subprocess.Popen(
        [
            "unshare",
            "-n",
            sys.executable,
            "-m",
            "devtools.demo",
            "--unix-sockets",
            "--engine",
            "numpy",
            "--model-size",
            "tiny",
            "--steps",
            "3",
            "--workdir",
            str(tmp_path / "demo"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
    ) as proc:
        opened: list[str] = []
        samples = 0
        try:
            deadline = time.monotonic() + 300
            while proc.poll() is None and time.monotonic() < deadline:
                found = _inet_sockets(proc.pid)  # unshare execs the demo: one namespace, this pid
                if found is not None:
                    samples += 1
                    opened += found
                time.sleep(0.2)
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                eventually(lambda: proc.poll() is not None, timeout_s=60, what="the demo to stop")
        out = proc.stdout.read() if proc.stdout else ""
    assert proc.returncode == 0, out[-4000:]
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["ok"] and summary["committed"] == summary["steps"] == 3
    assert summary["unix_sockets"] and summary["weight_sync_mode"] == "shm"
    assert samples > 10 and not opened, (samples, opened)
    assert "metrics off" in out and "127.0.0.1" not in out
    coordinator = next(line.split()[1] for line in out.splitlines() if line.startswith("coordinator "))
    assert coordinator.startswith("unix:/") and not Path(coordinator.removeprefix("unix:")).parent.exists()


@pytest.mark.skipif(bool(unshare_missing()), reason=unshare_missing() or "unshare -n works")
def test_the_overlap_bench_publishes_through_its_coordinator_without_a_network(no_arena_leak: None) -> None:
    """bench/train_overlap.py as it runs on a TPU host (no usable inet socket): its own
    coordinator and the publisher's chunk server on unix sockets, every async version
    published and none lost."""
    run = subprocess.run(
        ["unshare", "-n", sys.executable, "bench/train_overlap.py", "--steps", "3", "--blocking-steps", "1"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    result = json.loads(run.stdout)
    assert result["mode"] == "coordinator" and result["coordinator_address"].startswith("unix:/")
    phase = result["async"]
    assert phase["published"] + phase["skipped"] == 3 and phase["published"] >= 1
