"""Control-plane benchmark: one coordinator process on its default flags under a fleet.

Three rounds, all on loopback against `python -m coordinator` (default flags):

1. fleet: N agents (default 1,000) each register, hold a WatchVersions stream and
   heartbeat at the TTL-derived interval (on a Heartbeats stream, as weightsync's agents
   do; `--heartbeats unary` for unary calls), on a connection of their own. A prober times
   `GetStatus` of the fleet's session and of a quiet one, and Health.Check of the
   coordinator and of a bare grpc.aio server in a process of its own (the machine's floor
   under the same load: what any gRPC server here would show). Midway the trainer publishes a
   version: every agent sees READY on its watch, takes a lease (`GetManifest`) at once
   and reports its handshake uniform(0, --pull-s) later, as a pull would take; we time
   the fan-out and the commit after the last handshake. Both calls travel on the agent's
   Heartbeats stream as weightsync's rollouts carry them (`--calls rpc`: an RPC each, not
   carried; the two modes compare the burst's cost).
2. big manifest: one rank of 100,000 tensors publishes while the prober times another
   session; then `GetManifest` of it streams (pieces counted, largest message size); then
   the coordinator restarts and the first `GetManifest` (which decodes the stored part)
   streams while the prober times the other session again.
3. retention: V versions (default 10,000) published and released; the database size is
   sampled as it goes (it must stay within the retention window, not grow with V).

Prints one JSON line (stdout) with p50/p99/max, coordinator RSS and threads, and each
target as true/false; a table on stderr. The agents are asyncio tasks (grpc.aio, a
connection each) in `--fleet-procs` worker processes, which share the machine's cores
with the coordinator: latencies are an upper bound on what a coordinator alone would
show, and its CPU use is reported beside them (the agents: bench/control_fleet.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import cpu_seconds, peak_rss_bytes, rss_bytes  # noqa: E402
from control_fleet import fleet_worker  # noqa: E402

from devtools.cluster import Cluster  # noqa: E402
from devtools.scrape import metric_value, scrape  # noqa: E402
from devtools.synthetic import synthetic_part  # noqa: E402
from weightsync._proto import coordinator_pb2 as pb  # noqa: E402
from weightsync._proto import coordinator_pb2_grpc as pb_grpc  # noqa: E402
from weightsync._proto import types_pb2 as tpb  # noqa: E402
from weightsync.client import CoordinatorClient  # noqa: E402
from weightsync.config import bounded_number  # noqa: E402
from weightsync.lease import heartbeat_interval_s  # noqa: E402

TARGET_P99_MS = 50.0
TARGET_COMMIT_S = 1.0
TARGET_RSS_MIB = 300.0
TARGET_BIG_PUBLISH_S = 10.0
PROBE_INTERVAL_S = 0.1
err = Console(stderr=True)


def percentiles(samples_s: list[float], over_ms: float | None = None) -> dict[str, float]:
    """p50/p99/max in ms; with `over_ms`, also how many samples took longer (with ~100
    samples the p99 is the slowest call, the count says whether it was the only one)."""
    if not samples_s:
        return {"n": 0}
    ms = sorted(x * 1000 for x in samples_s)
    out = {
        "n": len(ms),
        "p50_ms": round(statistics.median(ms), 2),
        "p99_ms": round(ms[min(len(ms) - 1, int(len(ms) * 0.99))], 2),
        "max_ms": round(ms[-1], 2),
    }
    if over_ms is not None:
        out[f"over_{over_ms:g}ms"] = sum(x > over_ms for x in ms)
    return out


def frozen_objects(metrics_port: int) -> int:
    """The coordinator's `weightsync_gc_frozen_objects` (set every --lease-ttl-s / 2)."""
    return int(metric_value(scrape(metrics_port), "weightsync_gc_frozen_objects"))


def proc_threads(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Threads:"))


class Prober:
    """Times a call every PROBE_INTERVAL_S from a process of its own: in the bench's process
    the prober would share a GIL with the load it generates (building a 100,000-tensor
    publish held it for 0.4 s at a time) and time that instead of the coordinator. `call`
    is `status` (GetStatus of `session`) or `health` (Health.Check, no handler work: the
    server's and the machine's own hops). Samples are those started between construction
    and `close()`."""

    def __init__(self, address: str, session: str, call: str = "status") -> None:
        self._proc = subprocess.Popen(
            [sys.executable, __file__, "--probe", session, "--probe-call", call, "--address", address],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        if self._proc.stdout.readline().strip() != "ready":
            raise RuntimeError("the prober failed to start")
        self._from = time.time()
        self.samples: list[tuple[float, float]] = []  # (wall clock at start, seconds)
        self.errors = 0

    def split(self, at: float) -> tuple[list[float], list[float]]:
        """Latencies of the calls started before and after wall clock `at`."""
        return [s for t, s in self.samples if t < at], [s for t, s in self.samples if t >= at]

    def close(self) -> None:
        until = time.time()
        out, _ = self._proc.communicate("", timeout=60)
        result = json.loads(out.strip().splitlines()[-1])
        self.samples = [(t, s) for t, s in result["samples"] if self._from <= t <= until]
        self.errors = result["errors"]


def probe_worker(args: argparse.Namespace) -> int:
    """`--probe SESSION`: a call every PROBE_INTERVAL_S until stdin closes; samples as JSON."""
    samples: list[tuple[float, float]] = []
    errors = 0
    done = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
    with CoordinatorClient(args.address, timeout_s=30.0) as client:
        if args.probe_call == "health":
            check = health_pb2_grpc.HealthStub(client._channel).Check
            call = lambda: check(health_pb2.HealthCheckRequest(), timeout=30.0)  # noqa: E731
        else:
            call = lambda: client.status(args.probe)  # noqa: E731
        call()  # connected before the first timed call
        print("ready", flush=True)
        while not done.wait(PROBE_INTERVAL_S):
            at, t0 = time.time(), time.perf_counter()
            try:
                call()
            except Exception:  # noqa: BLE001 - counted; the bench reports them
                errors += 1
                continue
            samples.append((at, time.perf_counter() - t0))
    print(json.dumps({"samples": samples, "errors": errors}), flush=True)
    return 0


class FloorServer:
    """A bare grpc.aio server (stock event loop, the standard health service, nothing else)
    in a process of its own: probed beside the coordinator, its latency is what a gRPC call
    costs on this machine under the same load, the floor any server here could reach."""

    def __init__(self) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, __file__, "--floor-server"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        line = self._proc.stdout.readline().split()
        if line[:1] != ["ready"]:
            raise RuntimeError("the floor server failed to start")
        self.address = f"127.0.0.1:{line[1]}"

    def close(self) -> None:
        self._proc.communicate("", timeout=30)


def floor_server_worker() -> int:
    """`--floor-server`: serves Health on a free loopback port until stdin closes."""

    async def serve() -> None:
        server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        print("ready", port, flush=True)
        await asyncio.to_thread(sys.stdin.read)
        await server.stop(None)

    asyncio.run(serve())
    return 0


def fleet_round(
    address: str,
    pid: int,
    metrics_port: int,
    agents: int,
    seconds: float,
    ttl_s: float,
    procs: int,
    pull_s: float,
    heartbeats: str,
    calls: str,
    nice: int,
) -> dict[str, Any]:
    trainer = CoordinatorClient(address, timeout_s=60.0)
    opened = trainer.open_session("fleet", trainer=True, trainer_ranks=1, min_rollouts=1)
    trainer.open_session("quiet", trainer=True, trainer_ranks=1)
    floor_server = FloorServer()  # exits when its stdin closes, with this process at the latest
    t0 = time.perf_counter()
    workers = []
    for w in range(procs):
        first, last = agents * w // procs, agents * (w + 1) // procs
        workers.append(
            subprocess.Popen(
                [
                    sys.executable,
                    __file__,
                    "--worker",
                    f"{first}:{last - first}",
                    "--address",
                    address,
                    "--lease-ttl-s",
                    str(ttl_s),
                    "--pull-s",
                    str(pull_s),
                    "--heartbeats",
                    heartbeats,
                    "--calls",
                    calls,
                    "--fleet-nice",
                    str(nice),
                ],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
        )
    for w in workers:
        if w.stdout.readline().strip() != "ready":
            raise RuntimeError("a fleet worker failed to start")
    setup_s = time.perf_counter() - t0
    committed: list[float] = []

    def observe() -> None:
        with CoordinatorClient(address) as watcher:
            for ev in watcher.watch("fleet"):
                if ev.version.state == tpb.COMMITTED:
                    committed.append(time.time())
                    return

    threading.Thread(target=observe, daemon=True).start()
    time.sleep(heartbeat_interval_s(ttl_s))  # every agent has beaten once
    c0, f0 = cpu_seconds([pid]), cpu_seconds([w.pid for w in workers])
    frozen0 = frozen_objects(metrics_port)
    busy, quiet = Prober(address, "fleet"), Prober(address, "quiet")
    # Beside GetStatus, over the same window: the coordinator's Health.Check (its hops without
    # a handler's work) and a bare gRPC server's (the machine's floor under this load).
    hops, floor = Prober(address, "-", "health"), Prober(floor_server.address, "-", "health")
    time.sleep(seconds / 2)
    part = synthetic_part(8)
    published = time.time()
    trainer.publish_part("fleet", generation=opened.generation, version=1, idempotency_key="v1", part=part)
    deadline = time.monotonic() + max(60.0, seconds)
    while not committed and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(max(0.0, seconds / 2 - (time.time() - published)))
    for prober in (busy, quiet, hops, floor):
        prober.close()
    floor_server.close()
    window_s = seconds + max(0.0, time.time() - published - seconds / 2)
    coordinator_cores = (cpu_seconds([pid]) - c0) / window_s
    fleet_cores = (cpu_seconds([w.pid for w in workers]) - f0) / window_s
    rss, hwm, threads = rss_bytes(pid), peak_rss_bytes(pid), proc_threads(pid)
    frozen = (frozen0, frozen_objects(metrics_port))
    results = []
    for w in workers:
        out, _ = w.communicate("", timeout=120)
        results.append(json.loads(out.strip().splitlines()[-1]))
    state = trainer.status("fleet").versions[0]
    trainer.close()
    seen = [t for r in results for t in r["seen_ready"]]
    handshakes = [t for r in results for t in r["handshakes"]]
    errors: dict[str, int] = {}
    for r in results:
        for k, n in r["errors"].items():
            errors[k] = errors.get(k, 0) + n
    if probe_errors := sum(p.errors for p in (busy, quiet, hops, floor)):
        errors["probe"] = probe_errors
    return {
        "agents": agents,
        "worker_processes": procs,
        "fleet_nice": nice,
        "simulated_pull_s": pull_s,
        "register_all_s": round(setup_s, 2),
        "heartbeat_interval_s": heartbeat_interval_s(ttl_s),
        "heartbeats": heartbeats,
        "calls": calls if heartbeats == "stream" else "rpc",
        "getstatus_fleet": percentiles([s for _, s in busy.samples], TARGET_P99_MS),
        "getstatus_quiet": percentiles([s for _, s in quiet.samples], TARGET_P99_MS),
        # steady: heartbeats and watches only; burst: from the publish on (leases, handshakes)
        "getstatus_fleet_steady": percentiles(busy.split(published)[0], TARGET_P99_MS),
        "getstatus_fleet_burst": percentiles(busy.split(published)[1], TARGET_P99_MS),
        "getstatus_quiet_steady": percentiles(quiet.split(published)[0], TARGET_P99_MS),
        "getstatus_quiet_burst": percentiles(quiet.split(published)[1], TARGET_P99_MS),
        "health_coordinator_steady": percentiles(hops.split(published)[0], TARGET_P99_MS),
        "health_coordinator_burst": percentiles(hops.split(published)[1], TARGET_P99_MS),
        "health_floor_server_steady": percentiles(floor.split(published)[0], TARGET_P99_MS),
        "health_floor_server_burst": percentiles(floor.split(published)[1], TARGET_P99_MS),
        "heartbeat": percentiles([x for r in results for x in r["heartbeats"]]),
        "get_manifest_leased": percentiles([x for r in results for x in r["leases"]]),
        "report_applied": percentiles([x for r in results for x in r["reports"]]),
        "watchers_saw_ready": len(seen),
        "ready_fanout_max_s": round(max(seen) - published, 3) if seen else None,
        "handshakes": len(handshakes),
        "last_handshake_after_publish_s": round(max(handshakes) - published, 3) if handshakes else None,
        "commit_after_last_handshake_s": round(committed[0] - max(handshakes), 3) if committed and handshakes else None,
        "state": tpb.VersionState.Name(state.state),
        "errors": errors,
        "coordinator_cpu_cores": round(coordinator_cores, 2),
        # the simulated agents' own share of the machine's cores, over the same window
        "fleet_cpu_cores": round(fleet_cores, 2),
        "coordinator_rss_mib": round(rss / 2**20, 1),
        "coordinator_peak_rss_mib": round(hwm / 2**20, 1),
        "coordinator_threads": threads,
        # objects out of the collector's walk at the window's start and end (weightsync.gc_freeze)
        "coordinator_gc_frozen_objects": frozen,
    }


def big_manifest_round(address: str, pid: int, tensors: int) -> dict[str, Any]:
    client = CoordinatorClient(address, timeout_s=120.0)
    opened = client.open_session("big", trainer=True, trainer_ranks=1)
    client.open_session("other", trainer=True, trainer_ranks=1)
    t0 = time.perf_counter()
    part = synthetic_part(tensors, seed=1)
    build_s = time.perf_counter() - t0
    other = Prober(address, "other")
    t0 = time.perf_counter()
    client.publish_part("big", generation=opened.generation, version=1, idempotency_key="big", part=part)
    publish_s = time.perf_counter() - t0
    other.close()
    manifest_s, pieces, largest = read_manifest(client, "big", 1)
    client.close()
    return {
        "tensors": tensors,
        "build_descriptors_s": round(build_s, 2),
        "publish_s": round(publish_s, 2),
        "getstatus_other_session": percentiles([s for _, s in other.samples], TARGET_P99_MS),
        "get_manifest_s": round(manifest_s, 2),
        "get_manifest_pieces": pieces,
        "largest_piece_bytes": largest,
        "coordinator_peak_rss_mib": round(peak_rss_bytes(pid) / 2**20, 1),
    }


def read_manifest(client: CoordinatorClient, session: str, version: int) -> tuple[float, int, int]:
    """Streams a version's `GetManifest`: (seconds, pieces, largest piece's bytes)."""
    stub = pb_grpc.CoordinatorStub(client._channel)
    t0 = time.perf_counter()
    pieces, largest = 0, 0
    for piece in stub.GetManifest(pb.GetManifestRequest(session=session, version=version), timeout=120):
        pieces += 1
        largest = max(largest, piece.ByteSize())
    return time.perf_counter() - t0, pieces, largest


def cold_manifest_round(address: str) -> dict[str, Any]:
    """After a restart, the first `GetManifest` of the big version decodes its stored part
    (no decoded manifest is kept yet) while the prober times another session."""
    client = CoordinatorClient(address, timeout_s=120.0)
    client.status("other")  # connected before the timed read
    other = Prober(address, "other")
    time.sleep(0.5)
    started = time.time()
    read_s, _pieces, _largest = read_manifest(client, "big", 1)
    ended = time.time()
    other.close()
    client.close()
    return {
        "cold_get_manifest_s": round(read_s, 2),
        "getstatus_other_session_cold_read": percentiles(
            [s for t, s in other.samples if started <= t <= ended], TARGET_P99_MS
        ),
    }


def database_bytes(db: Path) -> int:
    return sum(p.stat().st_size for p in (db, Path(f"{db}-wal")) if p.exists())


def retention_round(address: str, db: Path, versions: int) -> dict[str, Any]:
    client = CoordinatorClient(address, timeout_s=30.0)
    opened = client.open_session("churn", trainer=True, trainer_ranks=1)
    part = synthetic_part(64, seed=2)
    samples: list[tuple[int, int]] = []
    t0 = time.perf_counter()
    for v in range(1, versions + 1):
        client.publish_part("churn", generation=opened.generation, version=v, idempotency_key=f"v{v}", part=part)
        client.release_version("churn", v, generation=opened.generation)
        if v % max(1, versions // 10) == 0:
            samples.append((v, database_bytes(db)))
    elapsed = time.perf_counter() - t0
    client.close()
    first_v, first_b = samples[0] if samples else (0, 0)
    last_v, last_b = samples[-1] if samples else (0, 0)
    return {
        "versions": versions,
        "seconds": round(elapsed, 1),
        "db_bytes": [[v, b] for v, b in samples],
        "growth_bytes_per_version_after_first_tenth": round((last_b - first_b) / max(1, last_v - first_v), 1),
    }


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--agents", type=bounded_number(1), default=1000)
    ap.add_argument("--seconds", type=bounded_number(0.001, float), default=20.0, help="fleet measuring window")
    ap.add_argument("--tensors", type=bounded_number(1), default=100_000)
    ap.add_argument("--versions", type=bounded_number(1), default=10_000)
    ap.add_argument("--lease-ttl-s", type=bounded_number(0.001, float), default=10.0, help="the coordinator's default")
    ap.add_argument("--rounds", default="fleet,big,retention")
    ap.add_argument("--fleet-procs", type=bounded_number(1), default=2, help="processes the fleet's agents run in")
    ap.add_argument(
        "--pull-s",
        type=float,
        default=2.0,
        help="each agent reports uniform(0, pull_s) after its GetManifest, as a pull takes; 0: all at once",
    )
    ap.add_argument(
        "--heartbeats",
        choices=("stream", "unary"),
        default="stream",
        help="how agents beat: on a Heartbeats stream each (as weightsync's agents do) or unary calls",
    )
    ap.add_argument(
        "--calls",
        choices=("carried", "rpc"),
        default="carried",
        help="how agents lease and report: on their Heartbeats stream (as weightsync's rollouts) or an RPC each",
    )
    ap.add_argument(
        "--fleet-nice",
        type=int,
        default=0,
        help="niceness of the fleet's processes: >0 gives the coordinator and probers the cores first, "
        "as a coordinator whose rollouts run on other machines has them",
    )
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--probe", help=argparse.SUPPRESS)
    ap.add_argument("--probe-call", choices=("status", "health"), default="status", help=argparse.SUPPRESS)
    ap.add_argument("--floor-server", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--address", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return fleet_worker(args)
    if args.probe:
        return probe_worker(args)
    if args.floor_server:
        return floor_server_worker()
    rounds = set(args.rounds.split(","))
    out: dict[str, Any] = {"bench": "control", "cpus": os.cpu_count()}
    with tempfile.TemporaryDirectory(prefix="ws-bench-control-") as tmp, Cluster(tmp) as cluster:
        db = Path(tmp) / "coordinator.db"
        coord = cluster.start_coordinator(db_path=str(db))
        peak = 0  # the coordinators' peak RSS, over every round
        if "fleet" in rounds:
            err.print(f"fleet: {args.agents} agents for {args.seconds:.0f} s …")
            out["fleet"] = fleet_round(
                coord.address,
                coord.pid,
                coord.ready["metrics_port"],
                args.agents,
                args.seconds,
                args.lease_ttl_s,
                args.fleet_procs,
                args.pull_s,
                args.heartbeats,
                args.calls,
                args.fleet_nice,
            )
        if "big" in rounds:
            err.print(f"big manifest: {args.tensors} tensors …")
            out["big_manifest"] = big_manifest_round(coord.address, coord.pid, args.tensors)
            peak = max(peak, peak_rss_bytes(coord.pid))  # the restart starts a new process
            cluster.stop("coordinator")  # restarted on the same port and database: nothing decoded is kept
            coord = cluster.start_coordinator(db_path=str(db), port=int(coord.address.rsplit(":", 1)[1]))
            out["big_manifest"] |= cold_manifest_round(coord.address)
        if "retention" in rounds:
            err.print(f"retention: {args.versions} versions …")
            out["retention"] = retention_round(coord.address, db, args.versions)
        out["coordinator_peak_rss_mib"] = round(max(peak, peak_rss_bytes(coord.pid)) / 2**20, 1)
    out["targets"] = targets(out)
    report(out)
    print(json.dumps(out, separators=(",", ":")))
    return 0


def targets(out: dict[str, Any]) -> dict[str, bool]:
    t: dict[str, bool] = {}
    if f := out.get("fleet"):
        t["fleet_getstatus_p99_lt_50ms"] = f["getstatus_fleet"].get("p99_ms", 1e9) < TARGET_P99_MS
        t["quiet_getstatus_p99_lt_50ms"] = f["getstatus_quiet"].get("p99_ms", 1e9) < TARGET_P99_MS
        t["every_watcher_saw_ready"] = f["watchers_saw_ready"] == f["agents"]
        t["committed_within_1s_of_last_handshake"] = (
            f["state"] == "COMMITTED" and (f["commit_after_last_handshake_s"] or 1e9) < TARGET_COMMIT_S
        )
        t["rss_lt_300mib"] = f["coordinator_peak_rss_mib"] < TARGET_RSS_MIB
    if b := out.get("big_manifest"):
        t["big_publish_lt_10s"] = b["publish_s"] < TARGET_BIG_PUBLISH_S
        t["other_session_p99_lt_50ms_during_big_publish"] = (
            b["getstatus_other_session"].get("p99_ms", 1e9) < TARGET_P99_MS
        )
    if r := out.get("retention"):
        sizes = [b for _, b in r["db_bytes"]]
        # Bounded: the last tenth is no larger than 1.5x the first (summary rows are ~100 B/version).
        t["database_bounded_by_retention"] = bool(sizes) and sizes[-1] <= 1.5 * sizes[0] + (1 << 20)
    return t


def report(out: dict[str, Any]) -> None:
    table = Table(title="control plane (one coordinator, default flags)")
    table.add_column("measure")
    table.add_column("value", justify="right")
    for section in ("fleet", "big_manifest", "retention"):
        for k, v in (out.get(section) or {}).items():
            table.add_row(f"{section}.{k}", json.dumps(v) if isinstance(v, (dict, list)) else str(v))
    for k, v in out["targets"].items():
        table.add_row(f"target {k}", "[green]yes" if v else "[red]NO")
    err.print(table)


if __name__ == "__main__":
    sys.exit(main())
