"""Chaos: a real cluster publishing continuously under a seeded random schedule of faults.

Coordinator, trainer and three rollouts (tcp, shm and relay modes) on loopback with a
2 s lease. While the trainer publishes a version every few hundred milliseconds the
schedule kills (-9) and restarts each component, freezes rollouts past their lease,
takes the coordinator away for longer than the lease, flips bytes in the trainer's arena,
races a writer against readers of it, and drops tcp connections mid-reply (a trainer
failpoint armed at every start). Then the invariants of docs/design.md "Invariants under
faults" are checked. The seed is printed (and in every failure message):
`CHAOS_SEED=<seed> make chaos` replays the schedule; `CHAOS_SECONDS` sets its length.
`make test` runs a short one with a fixed seed (CI reproduces exactly); `make chaos` soaks
with a fresh seed each run.
"""

from __future__ import annotations

import mmap
import os
import random
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from devtools.cluster import Cluster, Proc
from tests.integration.support import rollout_status
from weightsync._proto import types_pb2 as tpb
from weightsync.arena_files import owner_pid
from weightsync.client import CoordinatorClient
from weightsync.errors import SessionNotFound, WeightsyncError
from weightsync.version_states import SERVABLE

TTL = 2.0
SESSION = "chaos"
MODES = {"r0": "tcp", "r1": "shm", "r2": "relay"}
TRAINER_ARGS = [
    "--model-size",
    "tiny",
    "--weight-dtype",
    "float32",
    "--steps",
    "100000",
    "--wait-commit",
    "false",
    "--step-interval-s",
    "0.3",
    "--failpoints",
    "tcp_server.drop_mid_reply=2",
]
FAULTS = (
    "kill_coordinator",
    "kill_rollout",
    "pause_rollout",
    "kill_trainer",
    "freeze_trainer",
    "flip_arena_byte",
    "racing_writer",
)
# A process that does not exit on SIGTERM is killed after this (and its exit code says so).
# One that exits takes its grace (the coordinator's 5 s, 1 s elsewhere) at most, plus its
# teardown: seconds more on a loaded machine, nowhere near this.
EXIT_WITHIN_S = 60.0
DEFAULT_SEED = 2
RETAIN_VERSIONS = 20


@dataclass
class Chaos:
    """The cluster under test and what the schedule did to it."""

    cluster: Cluster
    seed: int
    rng: random.Random
    db: str
    port: int = 0
    trainer_gen: int = 0
    log: list[str] = field(default_factory=list)
    killed: set[str] = field(default_factory=set)  # processes the schedule killed on purpose
    committed: dict[int, str] = field(default_factory=dict)  # version -> digest, ever seen COMMITTED
    ok_handshakes: dict[int, set[str]] = field(default_factory=dict)  # version -> rollouts ever seen reporting OK
    model_bytes: int = 1 << 16  # how much of its slot a version fills (from the coordinator once known)

    @property
    def coordinator(self) -> str:
        return f"127.0.0.1:{self.port}"

    def note(self, what: str) -> None:
        line = f"t={time.monotonic():.1f} {what}"
        self.log.append(line)
        print(line, flush=True)

    # -- processes ---------------------------------------------------------------------
    def start_coordinator(self) -> None:
        # a short retention window: old versions are summarized while faults happen
        args = ["--lease-ttl-s", str(TTL), "--retain-versions", str(RETAIN_VERSIONS)]
        proc = self.cluster.start_coordinator(db_path=self.db, port=self.port, args=args)
        self.port = int(proc.address.rsplit(":", 1)[1])

    def start_rollout(self, name: str) -> None:
        args = ["--weight-sync-mode", MODES[name], "--dump-dir", str(self.cluster.workdir / "dumps" / name)]
        self.cluster.start_rollout(name, self.coordinator, SESSION, args)

    def start_trainer(self) -> Proc:
        """A new trainer incarnation that continues after the session's latest version."""
        latest = self.latest_version()
        self.trainer_gen += 1
        return self.cluster.start_trainer(
            "trainer", self.coordinator, SESSION, [*TRAINER_ARGS, "--start-version", str(latest + 1)]
        )

    def latest_version(self) -> int:
        deadline = time.monotonic() + 60
        while True:
            try:
                with CoordinatorClient(self.coordinator, timeout_s=5) as client:
                    versions = client.status(SESSION, 1).versions
                    return versions[0].version if versions else 0
            except SessionNotFound:  # nothing published yet
                return 0
            except WeightsyncError:  # the coordinator is restarting
                if time.monotonic() > deadline:
                    raise

    def kill(self, name: str) -> None:
        self.killed.add(name)
        self.cluster.kill(name)

    # -- faults ------------------------------------------------------------------------
    def inject(self, fault: str) -> None:
        rollout = self.rng.choice(sorted(MODES))
        if fault == "kill_coordinator":
            outage = self.rng.uniform(0.2, 1.5 * TTL)
            self.note(f"kill -9 coordinator, restart after {outage:.1f}s")
            self.kill("coordinator")
            time.sleep(outage)
            self.start_coordinator()
        elif fault == "kill_rollout":
            self.note(f"kill -9 {rollout}, restart")
            self.kill(rollout)
            self.start_rollout(rollout)
        elif fault == "pause_rollout":
            self.note(f"SIGSTOP {rollout} for {1.5 * TTL:.1f}s (past its lease)")
            proc = self.cluster.procs[rollout]
            proc.popen.send_signal(signal.SIGSTOP)
            time.sleep(1.5 * TTL)
            proc.popen.send_signal(signal.SIGCONT)
        elif fault == "kill_trainer":
            self.note("kill -9 trainer, restart as a new incarnation")
            self.kill("trainer")
            self.start_trainer()
        elif fault == "freeze_trainer":
            # a hung trainer host, mid-transfer as likely as not: resumed, or replaced by a
            # new incarnation while it is still frozen (its readers' connections stay open)
            replace = self.rng.random() < 0.5
            self.note(f"SIGSTOP trainer for {1.5 * TTL:.1f}s, then {'replace it' if replace else 'SIGCONT'}")
            proc = self.cluster.procs["trainer"]
            proc.popen.send_signal(signal.SIGSTOP)
            time.sleep(1.5 * TTL)
            if not replace:
                proc.popen.send_signal(signal.SIGCONT)
                return
            frozen = f"frozen-trainer-{self.trainer_gen}"
            self.cluster.procs[frozen] = self.cluster.procs.pop("trainer")
            self.start_trainer()
            self.kill(frozen)  # (SIGKILL ends a stopped process too)
            del self.cluster.procs[frozen]  # gone on purpose: not one that "exited on its own"
        elif fault == "flip_arena_byte":
            with self.arena() as view:
                if view is not None:
                    offset = self.staged_offset(len(view))
                    self.note(f"flip arena byte {offset}")
                    view[offset] ^= 0xFF
        elif fault == "racing_writer":
            with self.arena() as view:
                if view is not None:
                    offset = self.staged_offset(len(view))
                    self.note(f"racing writer toggles arena byte {offset} for 2s")
                    end = time.monotonic() + 2.0
                    while time.monotonic() < end:
                        view[offset] ^= 0x01
                        time.sleep(0.0005)

    def staged_offset(self, arena_bytes: int) -> int:
        """A byte some version occupies: in either slot, below the model's size."""
        slot_bytes = arena_bytes // 2  # the trainer's two slots
        return self.rng.randrange(2) * slot_bytes + self.rng.randrange(min(slot_bytes, self.model_bytes))

    def arena(self) -> _ArenaView:
        trainer = self.cluster.procs["trainer"]
        paths = [p for p in Path("/dev/shm").glob("weightsync-*") if owner_pid(p.name) == trainer.pid]
        return _ArenaView(paths[0] if paths else None)

    # -- the observer --------------------------------------------------------------------
    def observe(self, stop: threading.Event) -> None:
        """Records every version ever seen COMMITTED and every OK handshake (polls through
        coordinator restarts, and faster than retention summarizes old versions)."""
        while not stop.wait(0.3):
            try:
                with CoordinatorClient(self.coordinator, timeout_s=2, retries=0) as client:
                    self.record(client.status(SESSION, 100))
            except WeightsyncError:
                continue

    def record(self, status: object) -> None:
        for v in status.versions:  # type: ignore[attr-defined]
            self.model_bytes = max(self.model_bytes, v.total_bytes)
            if v.state == tpb.COMMITTED:
                self.committed.setdefault(v.version, v.manifest_digest)
        for h in status.handshakes:  # type: ignore[attr-defined]
            if h.ok:
                self.ok_handshakes.setdefault(h.version, set()).add(h.agent_id)


class _ArenaView:
    """A writable mapping of the trainer's arena file for the duration of a fault."""

    def __init__(self, path: Path | None) -> None:
        self._path = path
        self._mm: mmap.mmap | None = None
        self._view: memoryview | None = None

    def __enter__(self) -> memoryview | None:
        if self._path is None:
            return None
        try:
            fd = os.open(self._path, os.O_RDWR)
        except FileNotFoundError:
            return None
        try:
            self._mm = mmap.mmap(fd, 0)
        finally:
            os.close(fd)
        self._view = memoryview(self._mm)
        return self._view

    def __exit__(self, *exc: object) -> None:
        if self._view is not None:
            self._view.release()
        if self._mm is not None:
            self._mm.close()


def expected_weights(versions: set[int]) -> dict[int, dict[str, np.ndarray]]:
    """What the synthetic trainer published as each version (seed 0, fp32)."""
    from trainer_agent import synthetic

    out: dict[int, dict[str, np.ndarray]] = {}
    params = synthetic.initial_params("tiny", 0)
    for step in range(1, max(versions, default=0) + 1):
        params = synthetic.train_step(params, step, 0)
        if step in versions:
            out[step] = {k: np.asarray(v) for k, v in params.items()}
    return out


SECONDS = float(os.environ.get("CHAOS_SECONDS", "30"))


# The schedule, then up to ~2 minutes of checks (the run's own pytest timeout, 300 s, ended
# every `make chaos` at its default length before it could check anything).
@pytest.mark.timeout(SECONDS + 300)
def test_faults_heal_and_nothing_unverified_is_applied(cluster: Cluster) -> None:
    seed = int(os.environ.get("CHAOS_SEED") or DEFAULT_SEED)
    seconds = SECONDS
    print(f"chaos seed={seed} seconds={seconds}", flush=True)
    chaos = Chaos(cluster, seed, random.Random(seed), str(cluster.workdir / "coordinator.db"))
    chaos.start_coordinator()
    for name in MODES:
        chaos.start_rollout(name)
    chaos.start_trainer()
    stop_observing = threading.Event()
    observer = threading.Thread(target=chaos.observe, args=(stop_observing,), daemon=True)
    observer.start()
    where = f"(CHAOS_SEED={seed})"

    # -- the schedule ------------------------------------------------------------------
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(chaos.rng.uniform(0.5, 2.5))
        chaos.inject(chaos.rng.choice(FAULTS))
        for name, proc in cluster.procs.items():  # nothing dies unless the schedule killed it
            assert proc.alive(), f"{name} exited on its own with {proc.popen.returncode} {where}:\n{proc.log()[-3000:]}"
    chaos.note("schedule over")

    # -- healing: the last version must reach every rollout within 3 x TTL --------------
    assert cluster.stop("trainer", timeout_s=EXIT_WITHIN_S) == 0, f"trainer did not exit on SIGTERM {where}"
    final = chaos.latest_version() + 1
    cluster.start_trainer(
        "final",
        chaos.coordinator,
        SESSION,
        [
            "--model-size",
            "tiny",
            "--weight-dtype",
            "float32",
            "--steps",
            "1",
            "--start-version",
            str(final),
            "--wait-commit",
            "false",
            "--hold",
        ],
    )
    with CoordinatorClient(chaos.coordinator) as client:
        ready = client.wait_for_version(SESSION, final, states=("READY", "COMMITTED"), timeout_s=60)
        assert ready
        t_ready = time.monotonic()
        while True:
            at = {name: rollout_status(cluster.procs[name].address).current_version for name in MODES}
            if all(v == final for v in at.values()):
                break
            assert time.monotonic() - t_ready < 3 * TTL, f"not healed within 3 x TTL: {at}, want {final} {where}"
            time.sleep(0.1)
        healed_s = time.monotonic() - t_ready
        assert client.wait_for_version(SESSION, final, timeout_s=30).state == tpb.COMMITTED, where
        stop_observing.set()
        observer.join()

        # -- nothing the replaced trainers left stays servable (no one else releases it)
        def servable_before_final() -> list[int]:
            versions = client.status(SESSION, 1000).versions
            return [v.version for v in versions if v.version < final and tpb.VersionState.Name(v.state) in SERVABLE]

        # A lease the sweep has yet to drop (gone within about 1.5 x TTL); nothing else
        # would release these versions: a generous deadline tells the two apart.
        deadline = time.monotonic() + 60
        while (left := servable_before_final()) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not left, f"versions of replaced trainers still servable: {left} {where}"
        status = client.status(SESSION, 1000)
        chaos.record(status)
    chaos.note(f"healed: every rollout serves version {final} {healed_s:.2f}s after it was READY")

    # -- no COMMITTED version lost across coordinator restarts ------------------------
    final_state = {v.version: v.state for v in status.versions}
    lost = {v: final_state.get(v) for v in chaos.committed if final_state.get(v) not in (tpb.COMMITTED, tpb.RELEASED)}
    assert not lost, f"versions once COMMITTED are now {lost} {where}"
    ok_by_version = chaos.ok_handshakes
    pruned = sum(1 for v in status.versions if v.version < final - RETAIN_VERSIONS)
    for v in chaos.committed:
        assert ok_by_version.get(v), f"version {v} COMMITTED without an OK handshake {where}"

    # -- no rollout applied bytes that differ from a version it reported OK for --------
    from safetensors.numpy import load_file

    expected = expected_weights(set(ok_by_version))
    checked = 0
    for version, agents in ok_by_version.items():
        for agent in agents:
            dump = cluster.workdir / "dumps" / agent / f"v{version}.safetensors"
            assert dump.exists(), f"{agent} reported version {version} OK but never committed it locally {where}"
            applied = load_file(str(dump))
            assert applied.keys() == expected[version].keys()
            for name, arr in expected[version].items():
                assert applied[name].tobytes() == arr.tobytes(), f"{agent} v{version} {name} differs {where}"
            checked += 1
    assert checked >= len(MODES), f"only {checked} OK rounds to check {where}"
    chaos.note(
        f"{checked} OK rounds checked byte for byte; {len(chaos.committed)} versions committed, "
        f"{pruned} outside the retention window; faults: {len(chaos.log)}"
    )

    # -- every process exits on SIGTERM, cleanly; nothing is left behind ---------------
    pids = {p.pid for p in cluster.procs.values()}
    for name, proc in list(cluster.procs.items()):
        if proc.alive():
            code = cluster.stop(name, timeout_s=EXIT_WITHIN_S)
            assert code == 0, f"{name} exited with {code} on SIGTERM (-9: killed, it did not exit) {where}"
    # arenas of trainers killed with -9 were reclaimed by the next trainer; the rest exited cleanly
    left = [p for p in Path("/dev/shm").glob("weightsync-*") if owner_pid(p.name) in pids]
    assert not left, f"arenas left behind: {left} {where}"
    assert not list(Path("/dev/shm").glob(".weightsync-*")), f"half-created arenas left {where}"
    assert not list((cluster.workdir / "dumps").rglob(".*.tmp")), f"temp files left {where}"
    for name, proc in cluster.procs.items():  # keepalive settings agree on both ends
        assert "too_many_pings" not in proc.log(), f"{name} was sent GOAWAY too_many_pings {where}"


pytestmark = pytest.mark.chaos
