"""Launches weightsync processes on loopback or unix sockets (the demo and the process tests use it).

Each process gets `--ready-file`; `start()` waits for it and for grpc.health SERVING,
and `close()` stops everything (SIGTERM, then SIGKILL) and removes arenas that killed
trainers left in /dev/shm.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

import coordinator as coordinator_pkg
import rollout_agent as rollout_pkg
import trainer_agent as trainer_pkg
from weightsync import rpc
from weightsync.addresses import is_unix
from weightsync.arena_files import ARENA_GLOB, owner_pid
from weightsync.security import Security


@dataclass
class Proc:
    """A started process and what its ready file said."""

    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path
    ready: dict[str, Any] = field(default_factory=dict)

    @property
    def address(self) -> str:
        return str(self.ready["address"])

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


def wait_serving(address: str, timeout_s: float = 30.0, security: Security | None = None) -> None:
    """Polls grpc.health.v1 until the server answers SERVING (over TLS when `security`
    has a CA; health needs no token)."""
    deadline = time.monotonic() + timeout_s
    with rpc.channel(address, security) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            try:
                if (
                    stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status
                    == health_pb2.HealthCheckResponse.SERVING
                ):
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{address} not SERVING after {timeout_s}s")
            time.sleep(0.1)


def _exit_on_sigterm(signum: int, frame: object) -> None:
    sys.exit(128 + signum)


class Cluster:
    """A set of weightsync subprocesses sharing one work directory."""

    def __init__(
        self,
        workdir: str | Path,
        *,
        python: str = sys.executable,
        env: dict[str, str] | None = None,
        security: Security | None = None,
    ) -> None:
        """`security`: how to reach the processes' health services when they serve TLS."""
        self.workdir = Path(workdir)
        self.security = security
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.python = python
        self.env = {
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            "PYTHONFAULTHANDLER": "1",
            "JAX_PLATFORMS": "cpu",
            **(env or {}),
        }
        self.procs: dict[str, Proc] = {}
        self._pids: set[int] = set()
        self._sigterm_set = False

    def __enter__(self) -> Cluster:
        """Also makes a SIGTERM to this process unwind the `with` (SystemExit 143), where
        SIGTERM has its default action and this is the main thread: the processes run in
        sessions of their own, so a holder ended on the spot would leave them running."""
        if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
            signal.signal(signal.SIGTERM, _exit_on_sigterm)
            self._sigterm_set = True
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        try:
            self.close()
        finally:
            if self._sigterm_set and signal.getsignal(signal.SIGTERM) is _exit_on_sigterm:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
            self._sigterm_set = False

    def start(
        self,
        name: str,
        module: str,
        args: Sequence[str],
        *,
        wait: bool = True,
        timeout_s: float = 90.0,
        wrapper: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
    ) -> Proc:
        """Starts `python -m module args --ready-file ...`; waits until it serves.

        `wrapper` is a command the process runs under (e.g. a private mount namespace);
        `env` is laid over the cluster's environment for this process alone.
        """
        ready = self.workdir / f"{name}.ready"
        ready.unlink(missing_ok=True)
        log_path = self.workdir / f"{name}.log"
        with open(log_path, "ab") as log:
            popen = subprocess.Popen(
                [*wrapper, self.python, "-m", module, *args, "--ready-file", str(ready)],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**self.env, **(env or {})},
                cwd=self.workdir,
                start_new_session=True,  # Ctrl-C in a terminal reaches the demo only; it stops the rest
            )
        proc = Proc(name, popen, log_path)
        self.procs[name] = proc
        self._pids.add(popen.pid)
        if wait:
            self.wait_ready(proc, timeout_s)
        return proc

    def wait_ready(self, proc: Proc, timeout_s: float = 90.0) -> Proc:
        ready = self.workdir / f"{proc.name}.ready"
        deadline = time.monotonic() + timeout_s
        while not ready.exists():
            if not proc.alive():
                raise RuntimeError(f"{proc.name} exited with {proc.popen.returncode}:\n{proc.log()[-4000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{proc.name} not ready after {timeout_s}s:\n{proc.log()[-4000:]}")
            time.sleep(0.05)
        proc.ready = json.loads(ready.read_text())
        wait_serving(proc.address, max(1.0, deadline - time.monotonic()), self.security)
        return proc

    def start_coordinator(
        self,
        *,
        name: str = "coordinator",
        db_path: str | None = None,
        port: int = 0,
        host: str = "",
        args: Sequence[str] = (),
    ) -> Proc:
        """A coordinator on `host` (default its own: loopback), `port`; a unix: host takes no port."""
        db = db_path or str(self.workdir / "coordinator.db")
        listen = ["--host", host] if host else []
        if not is_unix(host):
            listen += ["--port", str(port)]
        return self.start(name, coordinator_pkg.__name__, ["--db-path", db, *listen, *args])

    def start_rollout(
        self, name: str, coordinator: str, session: str, args: Sequence[str] = (), **options: Any
    ) -> Proc:
        """A rollout sidecar named `name` (its agent id); `options` as `start` takes them."""
        args = ["--coordinator", coordinator, "--session", session, "--agent-id", name, *args]
        return self.start(name, rollout_pkg.__name__, args, **options)

    def start_trainer(
        self, name: str, coordinator: str, session: str, args: Sequence[str] = (), **options: Any
    ) -> Proc:
        """A trainer sidecar; `options` as `start` takes them."""
        return self.start(
            name, trainer_pkg.__name__, ["--coordinator", coordinator, "--session", session, *args], **options
        )

    def kill(self, name: str, sig: int = signal.SIGKILL, timeout_s: float = 10.0) -> int:
        """Sends `sig` and waits for the exit; returns the exit code."""
        proc = self.procs[name]
        if proc.alive():
            proc.popen.send_signal(sig)
        try:
            return proc.popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.popen.kill()
            return proc.popen.wait(timeout_s)

    def stop(self, name: str, timeout_s: float = 10.0) -> int:
        """SIGTERM, then SIGKILL after timeout_s."""
        return self.kill(name, signal.SIGTERM, timeout_s)

    def wait_exit(self, name: str, timeout_s: float) -> int:
        return self.procs[name].popen.wait(timeout_s)

    def close(self) -> None:
        """Stops every process and removes arenas left by processes that were killed."""
        for proc in self.procs.values():
            if proc.alive():
                proc.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        for proc in self.procs.values():
            try:
                proc.popen.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.popen.kill()
                proc.popen.wait(5)
        remove_arenas(self._pids)


def remove_arenas(pids: set[int], directory: str = "/dev/shm") -> list[Path]:
    """Deletes arena files created by the given (dead) pids; returns what was removed."""
    removed = []
    for path in Path(directory).glob(ARENA_GLOB):
        if owner_pid(path.name) in pids:
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed
