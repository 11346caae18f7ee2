"""What the transfer benchmark compares against, measured in the same run: the seconds and
CPU seconds of the physical work a round cannot avoid (a copy, a hash pass, a loopback
socket moving the model), and each role's minimum CPU built from them."""

from __future__ import annotations

import socket
import statistics
import threading
import time
from dataclasses import dataclass

import numpy as np
import xxhash

SOCKET_BUFFER = 4 << 20


@dataclass
class Bounds:
    """Per model: seconds and CPU seconds of each piece of physical work (one thread each)."""

    nbytes: int
    copy_s: float = 0.0  # a warm copy of the model's bytes (np.copyto): also "one apply copy"
    hash_s: float = 0.0  # one xxh3-64 pass over them
    send_cpu_s: float = 0.0  # the sending side of a loopback socket moving them (sendall)
    recv_cpu_s: float = 0.0  # the receiving side (recv_into a warm buffer)
    socket_s: float = 0.0  # the socket transfer's wall seconds

    @property
    def memcpy_gbps(self) -> float:
        return self.nbytes / self.copy_s / 1e9

    @property
    def socket_gbps(self) -> float:
        return self.nbytes / self.socket_s / 1e9

    @property
    def socket_cpu_s(self) -> float:
        return self.send_cpu_s + self.recv_cpu_s

    def cpu_min(self, mode: str, rollouts: int) -> dict[str, float]:
        """The least CPU seconds each role's work takes, whatever the code: the trainer
        stages (one copy + one hash pass) and sends; a rollout receives, checks (one hash
        pass) and applies (one copy). Over a socket (grpc, tcp, relay) every rollout
        receives the model once and someone sends it once per rollout: the trainer (tcp,
        grpc) or the trainer once and the relays the rest. shm: a rollout copies out of
        the mapped arena instead of receiving; fs: the trainer writes the files (a copy)
        and each rollout reads them (a copy). A delta ("tcp+delta", "relay+delta"): the
        trainer also reads the previous version while staging (a copy's worth of memory
        traffic), every rollout still checks and applies the whole model; the few bytes
        on the wire are left out."""
        stage = self.copy_s + self.hash_s
        check_apply = self.hash_s + self.copy_s
        if mode.endswith("+delta"):  # (fs: the trainer also writes the part's files, a copy)
            write = self.copy_s if mode.startswith("fs") else 0.0
            return {"trainer": stage + self.copy_s + write, "rollouts": rollouts * check_apply}
        if mode == "shm":
            return {"trainer": stage, "rollouts": rollouts * (self.copy_s + check_apply)}
        if mode == "fs":
            return {"trainer": stage + self.copy_s, "rollouts": rollouts * (self.copy_s + check_apply)}
        trainer_sends = 1 if mode == "relay" else rollouts
        return {
            "trainer": stage + trainer_sends * self.send_cpu_s,
            "rollouts": rollouts * (self.recv_cpu_s + check_apply) + (rollouts - trainer_sends) * self.send_cpu_s,
        }


def measure(
    nbytes: int, reps: int = 5, buffers: tuple[np.ndarray, np.ndarray] | None = None, socket: bool = True
) -> Bounds:
    """Medians of `reps` repetitions of each piece of work over warm buffers (`buffers`:
    a source and a destination of `nbytes` uint8 each, kept by a caller that measures
    again and again; their first use faults their pages in). Without `socket`, the
    socket's figures stay 0 (for shm, whose least work has none)."""
    src, dst = buffers if buffers is not None else (np.ones(nbytes, np.uint8), np.zeros(nbytes, np.uint8))
    b = Bounds(nbytes)
    b.copy_s = _median_cpu(lambda: np.copyto(dst, src), reps)
    b.hash_s = _median_cpu(lambda: xxhash.xxh3_64_intdigest(src), reps)
    if socket:
        b.send_cpu_s, b.recv_cpu_s, b.socket_s = _socket(src, dst, reps)
    return b


def concurrent_copy_s(nbytes: int, n: int, reps: int = 3) -> float:
    """Median wall seconds of n warm copies of nbytes running at once (n threads; NumPy
    releases the GIL): what n rollouts applying together on this one machine cannot beat,
    beside `copy_s`, one apply alone."""
    pairs = [(np.ones(nbytes, np.uint8), np.zeros(nbytes, np.uint8)) for _ in range(n)]
    times = []
    for _ in range(reps + 1):  # the first pass populates the destinations
        threads = [threading.Thread(target=np.copyto, args=(dst, src)) for src, dst in pairs]
        t = time.perf_counter()
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        times.append(time.perf_counter() - t)
    return statistics.median(times[1:])


def _median_cpu(work, reps: int) -> float:  # noqa: ANN001
    """Median CPU seconds of one call (single-threaded work: CPU = wall when not preempted)."""
    times = []
    for _ in range(reps):
        t = time.thread_time()
        work()
        times.append(time.thread_time() - t)
    return statistics.median(times)


def _socket(src: np.ndarray, dst: np.ndarray, reps: int) -> tuple[float, float, float]:
    """(send CPU, receive CPU, wall) medians of moving src into dst over loopback TCP."""
    nbytes = src.nbytes
    listener = socket.create_server(("127.0.0.1", 0))
    out = socket.create_connection(listener.getsockname())
    inc, _ = listener.accept()
    for s in (out, inc):
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER)
    view = memoryview(dst)
    sends, recvs, walls = [], [], []
    try:
        for _ in range(reps):
            sent = [0.0]

            def send(sent: list[float] = sent) -> None:
                t = time.thread_time()
                out.sendall(memoryview(src))
                sent[0] = time.thread_time() - t

            sender = threading.Thread(target=send)
            t0 = time.perf_counter()
            sender.start()
            c0 = time.thread_time()
            got = 0
            while got < nbytes:
                got += inc.recv_into(view[got:], min(nbytes - got, SOCKET_BUFFER))
            recvs.append(time.thread_time() - c0)
            sender.join()
            walls.append(time.perf_counter() - t0)
            sends.append(sent[0])
    finally:
        for s in (out, inc, listener):
            s.close()
    return statistics.median(sends), statistics.median(recvs), statistics.median(walls)
