"""In-process coordinator server against SQLite in tmp_path: watch fan-out, wsctl, client errors."""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import pytest

from tests.unit.helpers import make_part, sample_arrays
from weightsync._proto import types_pb2 as tpb
from weightsync.client import CoordinatorClient
from weightsync.errors import FailedPrecondition, InvalidArgument, NotFound
from weightsync.server import RunningServer


def test_watch_fans_out_to_many_watchers(inprocess_coordinator: RunningServer) -> None:
    n = 64
    with CoordinatorClient(inprocess_coordinator.address) as client:
        gen = client.open_session("job", trainer=True, incarnation="a").generation
        ready = threading.Barrier(n + 1)
        seen: list[list[str]] = [[] for _ in range(n)]

        def watch(i: int) -> None:
            with CoordinatorClient(inprocess_coordinator.address) as c:
                stream = c.watch("job", 0, timeout_s=30)
                ready.wait()
                for ev in stream:
                    seen[i].append(tpb.VersionState.Name(ev.version.state))
                    if seen[i][-1] == "READY":
                        return

        threads = [threading.Thread(target=watch, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        ready.wait()
        part, _ = make_part(sample_arrays())
        client.publish_part("job", generation=gen, version=1, idempotency_key="k", part=part)
        for t in threads:
            t.join(30)
        assert all(s == ["STAGING", "READY"] for s in seen), seen


def test_client_raises_typed_errors_with_fields(inprocess_coordinator: RunningServer) -> None:
    with CoordinatorClient(inprocess_coordinator.address) as client:
        with pytest.raises(NotFound):
            client.status("missing")
        with pytest.raises(InvalidArgument) as exc:
            client.open_session("Bad Name", trainer=False)
        assert exc.value.field == "session"
        old = client.open_session("job", trainer=True, incarnation="a").generation
        client.open_session("job", trainer=True, incarnation="b")
        part, _ = make_part(sample_arrays())
        with pytest.raises(FailedPrecondition, match="generation"):
            client.publish_part("job", generation=old, version=1, idempotency_key="k", part=part)


def test_wsctl_watch_json_and_errors(inprocess_coordinator: RunningServer) -> None:
    with CoordinatorClient(inprocess_coordinator.address) as client:
        gen = client.open_session("job", trainer=True, incarnation="a").generation
        part, _ = make_part(sample_arrays())
        client.publish_part("job", generation=gen, version=1, idempotency_key="k", part=part)
    base = [sys.executable, "-m", "weightsync.cli", "--coordinator", inprocess_coordinator.address, "--session", "job"]
    out = subprocess.run([*base, "--json", "watch", "--count", "2"], capture_output=True, text=True, timeout=60, check=True)
    events = [json.loads(line) for line in out.stdout.splitlines()]
    assert [e["version"]["state"] for e in events] == ["STAGING", "READY"]
    bad = subprocess.run([*base, "manifest", "7"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "NOT_FOUND" in bad.stderr
    human = subprocess.run([*base, "status"], capture_output=True, text=True, timeout=60, check=True)
    assert "READY" in human.stdout and "generation 1" in human.stdout
