"""The transfer benchmark's methods as runners that stay up between rounds, so the driver can
interleave one method's rounds with another's (ABAB...): weightsync (a publisher in this
process, N rollout processes of one mode) and the peers (worker processes of
peer_worker.py). Each `round()` returns what one round measured."""

from __future__ import annotations

import ctypes
import json
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from common import cpu_seconds, peak_rss_bytes, reset_peak_rss, rss_bytes

from devtools.cluster import Cluster, Proc
from trainer_agent.publish.publisher import WeightPublisher
from trainer_agent.settings import PublisherSettings
from trainer_agent.update_model import AdamSteps
from weightsync._proto import types_pb2 as tpb

HERE = Path(__file__).resolve().parent
# Between runners: this VM hands freed memory back to its host within 1-2 s, and pages
# touched while that runs cost several times more (docs/machine.md); let it finish.
SETTLE_S = 3.0


@dataclass
class Round:
    """One round of one method: publish (or write / broadcast) until every rollout holds it."""

    seconds: float
    cpu: dict[str, float]  # CPU seconds per role: trainer (or sender / writer), coordinator, rollouts
    pause: float  # how long the engine could not serve
    egress_bytes: int  # what the trainer (sender) sent
    stage: float = 0.0  # weightsync: the trainer's staging
    pull: float = 0.0  # weightsync: the slowest rollout's pull
    wire_bytes: float = 0.0  # weightsync: bytes on the wire per rollout (mean of their pulls)
    delta_bytes: int = 0  # weightsync: the published delta's bytes (0: published whole)
    changed: float = 0.0  # weightsync with a delta: fraction of 16-bit elements that changed

    @property
    def cpu_total(self) -> float:
        return sum(self.cpu.values())


def model_bytes_of(params: dict) -> int:
    return sum(v.nbytes for v in params.values())


def release_heap() -> None:
    """Hands freed heap memory back to the OS: a model's many small tensors (under glibc's
    mmap threshold) otherwise stay in this process after a runner closes (seen: 7 GB,
    which the next row's processes then miss)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


@dataclass
class Peaks:
    """RSS high-water marks over a runner's life, above each process's baseline."""

    largest: int = 0  # the largest over the method's reading processes (and a writer)
    trainer: int = 0
    rollout_overhead: int = 0  # weightsync: beyond the applied weights an engine holds anyway
    extra: dict = field(default_factory=dict)


class WeightsyncRun:
    """weightsync end to end in one mode: publish -> every rollout pulled, checked, applied,
    handshakes COMMITTED. A mode "<mode>+delta" publishes with delta="auto" a new version
    of an RL update (`steps`: an AdamSteps) each round, so rollouts holding the previous
    version rebuild it from its delta."""

    def __init__(
        self,
        cluster: Cluster,
        coord: Proc,
        mode: str,
        n: int,
        params: dict,
        chunk_bytes: int,
        apply_mode: str = "atomic",
        steps: AdamSteps | None = None,
    ) -> None:
        self.cluster, self.coord, self.mode, self.n, self.params = cluster, coord, mode, n, params
        self.sync_mode, _, variant = mode.partition("+")
        self.steps = steps if variant == "delta" else None
        if variant and self.steps is None:
            raise ValueError(f"mode {mode!r} needs an update model (steps)")
        self.session = f"{self.sync_mode}-{variant or 'full'}-n{n}-{uuid.uuid4().hex[:6]}"
        self.fs_root = tempfile.mkdtemp(prefix="wsbench-fs-", dir="/dev/shm") if self.sync_mode == "fs" else ""
        self.chunk_bytes = chunk_bytes
        self.apply_mode = apply_mode
        self.names = [f"{self.session}-r{i}" for i in range(n)]
        self.procs: list[Proc] = []
        self.pub: WeightPublisher | None = None
        self.version = 0

    def start(self) -> WeightsyncRun:
        args = ["--weight-sync-mode", self.sync_mode, "--apply-mode", self.apply_mode]
        if self.fs_root:
            args += ["--fs-root", self.fs_root]
        self.procs = [self.cluster.start_rollout(name, self.coord.address, self.session, args) for name in self.names]
        self.baselines = {p.pid: rss_bytes(p.pid) for p in self.procs}
        reset_peak_rss()
        self.trainer_base = rss_bytes()
        self.pub = WeightPublisher(
            PublisherSettings(
                coordinator=self.coord.address,
                session=self.session,
                weight_sync_mode=self.sync_mode,
                fs_root=self.fs_root,
                min_rollouts=self.n,
                chunk_bytes=self.chunk_bytes,
                slot_wait_s=300,
                delta="auto" if self.steps is not None else "off",
            )
        ).start()
        return self

    def _cpu(self) -> dict[str, float]:
        return {
            "trainer": cpu_seconds(["self"]),
            "coordinator": cpu_seconds([self.coord.pid]),
            "rollouts": cpu_seconds([p.pid for p in self.procs]),
        }

    def round(self) -> Round:
        pub = self.pub
        assert pub is not None
        self.version += 1
        v = self.version
        changed = 0.0
        if self.steps is not None:  # the next RL step's weights, made before the clock starts
            self.params = {}  # (the step releases the previous ones tensor by tensor)
            self.params = self.steps.step()
            changed = self.steps.changed
        served0 = pub._servicer.bytes_served
        cpu0 = self._cpu()
        t = time.perf_counter()
        result = pub.publish(self.params, v)
        # decided, PARTIAL included: a bench round that did not verify fails, it is not retried
        state = tpb.VersionState.Name(pub.client.wait_for_version(self.session, v, timeout_s=600).state)
        seconds = time.perf_counter() - t
        cpu1 = self._cpu()
        handshakes = [h for h in pub.client.status(self.session, 4).handshakes if h.version == v]
        if state != "COMMITTED":
            why = [f"{h.agent_id}: {h.mismatch}" for h in handshakes]
            logs = "\n".join(p.log()[-1500:] for p in self.procs)
            raise RuntimeError(f"{self.mode} n={self.n}: version {v} ended {state} {why}\n{logs}")
        total = model_bytes_of(self.params)
        egress = {"shm": 0, "fs": total}.get(self.sync_mode, pub._servicer.bytes_served - served0)
        return Round(
            seconds,
            {k: cpu1[k] - cpu0[k] for k in cpu0},
            pause=max(h.timings.pause_seconds for h in handshakes),
            egress_bytes=egress,
            stage=result.stage_seconds,
            pull=max(h.timings.pull_seconds for h in handshakes),
            wire_bytes=sum(h.bytes_pulled for h in handshakes) / len(handshakes),
            delta_bytes=result.delta_bytes,
            changed=changed,
        )

    def close(self) -> Peaks:
        peaks = Peaks()
        try:
            peaks.trainer = peak_rss_bytes() - self.trainer_base
            if self.procs:
                peaks.largest = max(peak_rss_bytes(p.pid) - self.baselines[p.pid] for p in self.procs)
                peaks.rollout_overhead = max(0, peaks.largest - model_bytes_of(self.params))
        finally:
            if self.pub is not None:
                self.pub.close()
            for name in self.names:
                if name in self.cluster.procs:
                    self.cluster.stop(name)
            if self.fs_root:
                shutil.rmtree(self.fs_root, ignore_errors=True)
            self.steps = None
            self.params = {}
            release_heap()
            time.sleep(SETTLE_S)
        return peaks


class Worker:
    """A peer_worker.py process: JSON lines on stdout, commands on stdin."""

    def __init__(self, *argv: object) -> None:
        self.popen = subprocess.Popen(
            [sys.executable, str(HERE / "peer_worker.py"), *map(str, argv)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
        )
        self.ready = self.read()

    def read(self) -> dict:
        line = self.popen.stdout.readline()  # type: ignore[union-attr]
        if not line:
            raise RuntimeError(f"peer worker {self.popen.args} exited with {self.popen.wait()}")
        return json.loads(line)

    def send(self, text: str) -> None:
        self.popen.stdin.write(text + "\n")  # type: ignore[union-attr]
        self.popen.stdin.flush()  # type: ignore[union-attr]

    def wchar(self) -> int:
        with open(f"/proc/{self.popen.pid}/io") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("wchar"))

    def quit(self) -> dict:
        self.send("quit")
        out = self.read()
        self.popen.wait(60)
        return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PeerRun:
    """A peer method: safetensors or orbax (this process writes a checkpoint to tmpfs,
    reader processes load it), gloo (a sender process broadcasts to N receivers),
    jax_transfer (readers pull from a sender). A peer's engine waits for the whole round."""

    def __init__(self, method: str, n: int, size: str, params: dict) -> None:
        self.method, self.n, self.size, self.params = method, n, size, params
        self.workdir = Path(tempfile.mkdtemp(prefix=f"wsbench-{method}-", dir="/dev/shm"))
        self.sender: Worker | None = None
        self.readers: list[Worker] = []
        self.writer = None
        self.it = 0

    def start(self) -> PeerRun:
        method, n, size, port = self.method, self.n, self.size, _free_port()
        reset_peak_rss()
        self.trainer_base = rss_bytes()
        try:
            if method == "gloo":  # every rank must join the group before any of them is ready
                workers = _start_all(
                    lambda r: Worker(method, "send" if r == 0 else "recv", r, n, size, port, self.workdir), n + 1
                )
                self.sender, self.readers = workers[0], workers[1:]
            elif method == "jax_transfer":
                self.sender = Worker(method, "send", 0, n, size, port, self.workdir)
                self.readers = [
                    Worker(method, "recv", r, n, size, port, self.sender.ready["address"]) for r in range(1, n + 1)
                ]
            else:
                self.readers = _start_all(lambda r: Worker(method, "recv", r + 1, n, size, port, self.workdir), n)
                self.writer = _checkpoint_writer(method, self.params)
        except BaseException:
            self.close()
            raise
        return self

    def _workers(self) -> list[Worker]:
        return ([self.sender] if self.sender else []) + self.readers

    def _sent_bytes(self) -> int:
        """Bytes the sender has written: its write/send syscalls (/proc/PID/io wchar); for
        jax_transfer, whose sends bypass that counter, the loopback interface's tx bytes
        (only its transfers run meanwhile)."""
        if self.sender is None:
            return 0
        if self.method == "jax_transfer":
            with open("/proc/net/dev") as f:
                return next(int(line.split(":")[1].split()[8]) for line in f if line.strip().startswith("lo:"))
        return self.sender.wchar()

    def _cpu(self) -> dict[str, float]:
        sender = [self.sender.popen.pid] if self.sender else ["self"]  # a checkpoint's writer is this process
        return {"trainer": cpu_seconds(sender), "rollouts": cpu_seconds([w.popen.pid for w in self.readers])}

    def round(self) -> Round:
        it, self.it = self.it, self.it + 1
        w0 = self._sent_bytes()
        cpu0 = self._cpu()
        t0 = time.time()
        if self.writer is not None:
            self.writer(self.workdir, it)
        if self.sender is not None and self.method == "jax_transfer":
            self.sender.send(f"go {it}")
            self.sender.read()
        everyone = self.readers + ([self.sender] if self.method == "gloo" and self.sender else [])
        for w in everyone:
            w.send(f"go {it}")
        t_end = max(w.read()["t_end"] for w in everyone)
        cpu1 = self._cpu()
        for old in self.workdir.glob(f"v{it}*"):
            shutil.rmtree(old, ignore_errors=True) if old.is_dir() else old.unlink()
        seconds = t_end - t0
        egress = self._sent_bytes() - w0 if self.sender else model_bytes_of(self.params)  # checkpoints: written once
        return Round(seconds, {k: cpu1[k] - cpu0[k] for k in cpu0}, pause=seconds, egress_bytes=egress)

    def close(self) -> Peaks:
        peaks = Peaks()
        try:
            stats = [w.quit() for w in self._workers() if w.popen.poll() is None]
            peaks.largest = max((s["peak_rss"] - s["baseline_rss"] for s in stats), default=0)
            if self.writer is not None:
                peaks.largest = max(peaks.largest, peak_rss_bytes() - self.trainer_base)
        finally:
            for w in self._workers():
                if w.popen.poll() is None:
                    w.popen.kill()
            shutil.rmtree(self.workdir, ignore_errors=True)
            time.sleep(SETTLE_S)
        return peaks


def _start_all(make, n: int) -> list[Worker]:  # noqa: ANN001
    """Starts workers 0..n-1 concurrently (gloo ranks are ready only once all joined)."""
    out: list[Worker | None] = [None] * n
    errors: list[BaseException] = []

    def start(r: int) -> None:
        try:
            out[r] = make(r)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=start, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    if errors or any(w is None for w in out):
        for w in out:
            if w is not None:
                w.popen.kill()
        raise RuntimeError(f"a peer worker did not start: {errors[0] if errors else 'timed out'}")
    return out  # type: ignore[return-value]


def _checkpoint_writer(method: str, params: dict):  # noqa: ANN202
    if method == "safetensors":
        from safetensors.numpy import save_file

        as_u16 = {k: v.view(np.uint16) for k, v in params.items()}  # same bytes; numpy has no bf16
        return lambda workdir, it: save_file(as_u16, str(workdir / f"v{it}.safetensors"))
    import jax
    import orbax.checkpoint as ocp

    tree = {k: jax.device_put(v) for k, v in params.items()}
    ckpt = ocp.StandardCheckpointer()

    def write(workdir: Path, it: int) -> None:
        ckpt.save(workdir / f"v{it}", tree)
        ckpt.wait_until_finished()

    return write
