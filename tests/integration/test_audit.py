"""Auditing what running rollouts serve, with real processes: a bit flipped in one live
weight and a whole tensor overwritten (failpoints that write into the engine's own arrays
right after an apply) are named by the audit (the rollout's Audit RPC and `wsctl audit`),
the rollout says it serves no version and the coordinator's view shows the mismatch
until the rollout re-applied the version by itself and audited it exact; nothing
committed is lost. NumPy and JAX sidecars (8 CPU devices); vLLM: tests/e2e/test_vllm.py.
And many audits while versions keep coming: no false positive, never a torn state."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from typing import Any

import grpc
import pytest

from devtools.cluster import Cluster, Proc
from devtools.scrape import metric_value, scrape
from tests.integration.support import eventually, rollout_status, state_name
from weightsync._proto import rollout_agent_pb2 as rpb
from weightsync._proto import rollout_agent_pb2_grpc as rpb_grpc
from weightsync._proto import types_pb2 as tpb
from weightsync.client import CoordinatorClient
from weightsync.model_shapes import PRESETS, param_shapes

pytestmark = pytest.mark.slow
TINY_NAMES = sorted(param_shapes(PRESETS["tiny"]))
FAULTS = ["--failpoints", "audit.flip_live_bit=1,audit.overwrite_tensor=1"]
EIGHT_DEVICES = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}


def audit(address: str) -> tpb.AuditResult:
    with grpc.insecure_channel(address) as channel:
        return rpb_grpc.RolloutAgentStub(channel).Audit(rpb.AuditRequest(), timeout=30)


def wsctl_audit(coordinator: str, *args: str) -> tuple[int, dict[str, Any]]:
    """`wsctl audit --json ARGS` as a process: (exit code, its JSON)."""
    out = subprocess.run(
        [sys.executable, "-m", "weightsync.cli", "--coordinator", coordinator, "--session", "job", "audit", "--json",
         *args],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode in (0, 1), out.stderr
    return out.returncode, json.loads(out.stdout)


def row(report: dict[str, Any], agent: str) -> dict[str, Any]:
    (found,) = [r for r in report["rollouts"] if r["agent_id"] == agent]
    return found


def start_trainer(cluster: Cluster, coordinator: str, args: list[str]) -> Proc:
    return cluster.start_trainer("trainer", coordinator, "job", ["--model-size", "tiny", *args])


def test_a_numpy_rollouts_damaged_weights_are_named_shown_unserved_and_healed_by_itself(cluster: Cluster) -> None:
    coord = cluster.start_coordinator(args=["--lease-ttl-s", "4"])
    # --timeout-s 2: the heal's pull from the stopped trainer below fails fast and is retried
    np_rollout = cluster.start_rollout("np", coord.address, "job", [*FAULTS, "--audit-interval-s", "0",
                                                                      "--timeout-s", "2"])  # fmt: skip
    trainer = start_trainer(cluster, coord.address, ["--steps", "1", "--hold", "--wait-commit", "false"])
    with CoordinatorClient(coord.address) as client:
        assert state_name(client.wait_for_version("job", 1, timeout_s=120)) == "COMMITTED"  # damaged after it verified
        os.kill(trainer.pid, signal.SIGSTOP)  # the bytes cannot be fetched again for now
        try:
            code, report = wsctl_audit(coord.address, "--fresh")
            r = row(report, "np")
            assert code == 1 and r["answered"] and not r["audit"]["exact"]
            assert {m["tensor"] for m in r["audit"]["mismatches"]} == {TINY_NAMES[0], TINY_NAMES[-1]}
            assert r["audit"]["unserved_version"] == "1"
            # the rollout says so, and the coordinator's view shows it while it cannot heal
            status = rollout_status(np_rollout.address)
            assert status.current_version == 0 and status.unserved_version == 1 and not status.audit.exact
            eventually(lambda: row(wsctl_audit(coord.address)[1], "np")["current_version"] == "0", timeout_s=10)
            time.sleep(3)
            code, report = wsctl_audit(coord.address)
            assert code == 1 and row(report, "np")["audit"]["mismatch_count"] == 2
        finally:
            os.kill(trainer.pid, signal.SIGCONT)
        healed = eventually(
            lambda: (s := rollout_status(np_rollout.address)).current_version == 1 and s.audit.exact and s, timeout_s=60
        )
        assert healed.unserved_version == 0 and healed.audit.heals == 1
        code, report = wsctl_audit(coord.address, "--fresh")
        r = row(report, "np")
        assert code == 0 and r["answered"] and r["audit"]["exact"] and r["current_version"] == "1"
        assert r["audit"]["tensors"] == len(TINY_NAMES)
        assert state_name(client.status("job").versions[0]) == "COMMITTED"  # nothing committed was lost
    metrics = scrape(np_rollout.ready["metrics_port"])
    for name in (TINY_NAMES[0], TINY_NAMES[-1]):
        assert metric_value(metrics, "weightsync_audit_mismatches_total", session="job", tensor=name) == 1
    assert metric_value(metrics, "weightsync_audits_total", session="job", result="mismatch") >= 1
    assert metric_value(metrics, "weightsync_current_version", session="job") == 1


def test_a_jax_rollout_on_8_devices_names_its_damaged_leaves_and_heals_by_itself(
    cluster: Cluster,
) -> None:
    coord = cluster.start_coordinator()
    jx = cluster.start_rollout(
        "jx", coord.address, "job",
        ["--engine", "jax", "--jax-preset", "tiny", "--jax-mesh", "2x4", *FAULTS, "--audit-interval-s", "0"],
        env=EIGHT_DEVICES,
    )  # fmt: skip
    start_trainer(cluster, coord.address, ["--steps", "1", "--hold", "--wait-commit", "false"])
    with CoordinatorClient(coord.address) as client:
        assert state_name(client.wait_for_version("job", 1, timeout_s=120)) == "COMMITTED"
    found = audit(jx.address)
    assert found.version == 1 and found.method == "view" and found.tensors == len(TINY_NAMES)
    assert {m.tensor for m in found.mismatches} == {TINY_NAMES[0], TINY_NAMES[-1]}
    flipped = next(m for m in found.mismatches if m.tensor == TINY_NAMES[0])
    assert "replicas of the block" in flipped.detail  # one device's copy: its replica on the other row disagrees
    healed = eventually(
        lambda: (s := rollout_status(jx.address)).current_version == 1 and s.audit.exact and s, timeout_s=60
    )
    assert healed.audit.heals == 1 and audit(jx.address).exact


def test_a_thousand_audits_while_versions_keep_coming_find_no_mismatch_and_no_torn_state(cluster: Cluster) -> None:
    coord = cluster.start_coordinator()
    np_rollout = cluster.start_rollout("np", coord.address, "job", ["--audit-interval-s", "0"])
    steps = 40
    start_trainer(cluster, coord.address, ["--steps", str(steps), "--step-interval-s", "0.05", "--hold",
                                           "--wait-commit", "false"])  # fmt: skip
    seen: dict[int, int] = {}  # version -> audits of it
    bad: list[tpb.AuditResult] = []
    with grpc.insecure_channel(np_rollout.address) as channel:
        stub = rpb_grpc.RolloutAgentStub(channel)
        eventually(lambda: rollout_status(np_rollout.address).current_version >= 1, timeout_s=120)
        started = time.monotonic()
        while sum(seen.values()) < 1000 or rollout_status(np_rollout.address).current_version < steps:
            result = stub.Audit(rpb.AuditRequest(), timeout=30)
            seen[result.version] = seen.get(result.version, 0) + 1
            if not result.exact or result.tensors != len(TINY_NAMES):
                bad.append(result)
            assert time.monotonic() - started < 240
    assert not bad, bad[:3]
    applied_during = [v for v in seen if v > min(seen)]
    # the audits interleaved with applies: they saw many versions come, and each one whole
    assert sum(seen.values()) >= 1000 and len(applied_during) >= 10, seen
    status = rollout_status(np_rollout.address)
    assert status.current_version == steps and status.audit.audits >= 1000 and status.audit.heals == 0
