"""A coordinator process on its default flags holds hundreds of watch streams.

Streams are served from the event loop, not each on one of the 64 handler threads (at ~64
watchers nothing else would be answered). Here 300 agents (a
connection each) register, watch and heartbeat; status calls are still answered, and a
version published meanwhile reaches every watcher and commits once all report.
Garbage collections are timed (the streams' objects outlive them: weightsync.gc_freeze).
"""

from __future__ import annotations

import asyncio
import multiprocessing
from typing import Any

import grpc

from devtools.cluster import Cluster
from devtools.scrape import metric_value, scrape
from devtools.synthetic import good_report, synthetic_part
from weightsync._proto import coordinator_pb2 as pb
from weightsync._proto import coordinator_pb2_grpc as pb_grpc
from weightsync._proto import types_pb2 as tpb
from weightsync.client import CoordinatorClient
from weightsync.manifest import Manifest
from weightsync.security import bearer_metadata, with_credential

from .support import eventually

AGENTS = 300


def _fleet_process(address: str, part_manifest: Manifest, published: Any, results: Any) -> None:
    results.put(asyncio.run(_fleet(address, part_manifest, published)))


async def _fleet(address: str, part_manifest: Manifest, published: Any) -> dict[str, int]:
    channels = [
        grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)]) for _ in range(AGENTS)
    ]
    stubs = [pb_grpc.CoordinatorStub(c) for c in channels]
    auth = bearer_metadata(with_credential(None, address, "rollout"))  # the coordinator's default credential
    ids = [f"r{i:04d}" for i in range(AGENTS)]
    keys = {}  # agent id -> the agent key its calls carry
    for stub, agent in zip(stubs, ids):
        request = pb.RegisterAgentRequest(session="job", agent_id=agent, role=tpb.ROLLOUT)
        keys[agent] = (await stub.RegisterAgent(request, timeout=30, metadata=auth)).agent_key
    counts = {"ready": 0, "reported": 0, "committed": 0}
    opened = asyncio.Event()
    streams_open = 0

    async def agent(stub: pb_grpc.CoordinatorStub, agent_id: str) -> None:
        nonlocal streams_open
        call = stub.WatchVersions(pb.WatchVersionsRequest(session="job"), timeout=120, metadata=auth)
        streams_open += 1
        if streams_open == AGENTS:
            opened.set()
        async for ev in call:
            if ev.version.state == tpb.READY:
                counts["ready"] += 1
                beat = pb.HeartbeatRequest(session="job", agent_id=agent_id, agent_key=keys[agent_id])
                await stub.Heartbeat(beat, timeout=30, metadata=auth)
                report = good_report("job", ev.version.version, ev.version.manifest_digest, part_manifest)
                report.agent_id, report.agent_key = agent_id, keys[agent_id]
                await stub.ReportApplied(report, timeout=60, metadata=auth)
                counts["reported"] += 1
            elif ev.version.state == tpb.COMMITTED:
                counts["committed"] += 1
                return

    tasks = [asyncio.create_task(agent(s, a)) for s, a in zip(stubs, ids)]
    await asyncio.wait_for(opened.wait(), 60)
    await asyncio.sleep(1.0)  # the last streams reach the server
    published.set()
    await asyncio.wait_for(asyncio.gather(*tasks), 120)
    for c in channels:
        await c.close()
    return counts


def test_hundreds_of_watch_streams_leave_the_coordinator_answering(tmp_path) -> None:  # noqa: ANN001
    with Cluster(tmp_path / "cluster") as cluster:
        coord = cluster.start_coordinator()  # default flags: 8 handler threads
        with CoordinatorClient(coord.address, timeout_s=10) as client:
            gen = client.open_session("job", trainer=True, trainer_ranks=1, min_rollouts=1).generation
            part = synthetic_part(8)
            manifest = Manifest("job", 1, gen, part.chunk_bytes, (part,))
            # the fleet in a process of its own: grpc.aio stays bound to the first event loop a
            # process used, and later in-process servers of this test run would not answer
            ctx = multiprocessing.get_context("spawn")
            published, results = ctx.Event(), ctx.Queue()
            fleet = ctx.Process(target=_fleet_process, args=(coord.address, manifest, published, results))
            fleet.start()
            try:
                assert published.wait(120), "the fleet's watch streams did not open"
                # 300 streams are open: far more than handler threads; unary calls still answer.
                for _ in range(5):
                    got = client.status("job")
                assert len(got.agents) == AGENTS and all(a.alive for a in got.agents)
                client.publish_part("job", generation=gen, version=1, idempotency_key="v1", part=part)
                counts = results.get(timeout=180)
            finally:
                fleet.join(30)
                if fleet.is_alive():
                    fleet.kill()
                    fleet.join()
            assert counts == {"ready": AGENTS, "reported": AGENTS, "committed": AGENTS}
            assert tpb.VersionState.Name(client.status("job").versions[0].state) == "COMMITTED"
            with open(f"/proc/{coord.pid}/status") as f:
                threads = int(next(line.split()[1] for line in f if line.startswith("Threads:")))
            assert threads < 60, f"{threads} threads for {AGENTS} streams: streams must not hold a thread each"
            # The coordinator runs weightsync.gc_freeze's collector and times every collection
            # (observed every lease_ttl_s / 2).
            eventually(
                lambda: metric_value(scrape(coord.ready["metrics_port"]), "weightsync_gc_pause_seconds_count"),
                timeout_s=15,
                what="garbage collections timed",
            )
