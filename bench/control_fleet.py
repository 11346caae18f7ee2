"""The control-plane benchmark's fleet (bench/control.py, `--worker FIRST:COUNT`): agents as
asyncio tasks of one worker process, each registered on a connection of its own, holding a
WatchVersions stream, beating on a Heartbeats stream (or unary calls), and taking a lease
and reporting its handshake for each READY version, carried on that stream or an RPC each."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from devtools.synthetic import good_report, synthetic_part  # noqa: E402
from weightsync._proto import coordinator_pb2 as pb  # noqa: E402
from weightsync._proto import coordinator_pb2_grpc as pb_grpc  # noqa: E402
from weightsync._proto import types_pb2 as tpb  # noqa: E402
from weightsync.lease import heartbeat_interval_s  # noqa: E402
from weightsync.manifest import Manifest  # noqa: E402
from weightsync.rpc import CHANNEL_OPTIONS, code_name  # noqa: E402
from weightsync.security import bearer_metadata, with_credential  # noqa: E402


@dataclass
class Fleet:
    """Agents `first`..`first+count-1` as asyncio tasks of one worker process: register,
    watch, heartbeat, and handshake each READY version. Times are wall clock (time.time),
    comparable across the bench's processes."""

    address: str
    session: str
    first: int
    count: int
    ttl_s: float
    pull_s: float
    report: pb.ReportAppliedRequest
    unary_heartbeats: bool = False
    carried_calls: bool = True
    seen_ready: list[float] = field(default_factory=list)
    handshakes: list[float] = field(default_factory=list)
    heartbeats: list[float] = field(default_factory=list)
    leases: list[float] = field(default_factory=list)  # GetManifest (with a lease) latencies
    reports: list[float] = field(default_factory=list)  # ReportApplied latencies
    errors: dict[str, int] = field(default_factory=dict)
    keys: dict[str, str] = field(default_factory=dict)  # agent id -> the agent key its registration answered
    auth: tuple[tuple[str, str], ...] = ()  # what every call carries: the coordinator's bearer token

    def _error(self, what: str) -> None:
        self.errors[what] = self.errors.get(what, 0) + 1

    async def run(self) -> None:
        """Registers every agent, prints "ready", runs until stdin closes."""
        self.auth = bearer_metadata(with_credential(None, self.address, "rollout"))  # the default credential
        ids = [f"r{i:05d}" for i in range(self.first, self.first + self.count)]
        channels = [
            grpc.aio.insecure_channel(self.address, options=[*CHANNEL_OPTIONS, ("grpc.use_local_subchannel_pool", 1)])
            for _ in ids
        ]  # a connection per agent, as a fleet of pods has
        stubs = [pb_grpc.CoordinatorStub(c) for c in channels]
        sem = asyncio.Semaphore(32)

        async def register(stub: pb_grpc.CoordinatorStub, agent_id: str) -> None:
            async with sem:
                registered = await stub.RegisterAgent(
                    pb.RegisterAgentRequest(session=self.session, agent_id=agent_id, role=tpb.ROLLOUT),
                    timeout=60,
                    metadata=self.auth,
                )
                self.keys[agent_id] = registered.agent_key  # every later call for the agent carries it

        await asyncio.gather(*(register(st, a) for st, a in zip(stubs, ids)))
        stop = asyncio.Event()
        tasks = [asyncio.create_task(self._agent(st, a, stop)) for st, a in zip(stubs, ids)]
        await asyncio.sleep(0.5)  # the watch streams are open
        print("ready", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
        stop.set()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for c in channels:
            await c.close()

    async def _agent(self, stub: pb_grpc.CoordinatorStub, agent_id: str, stop: asyncio.Event) -> None:
        line: list[_Line] = []  # the agent's open Heartbeats stream, once there is one
        beat = asyncio.create_task(self._heartbeat(stub, agent_id, line))
        try:
            async for ev in stub.WatchVersions(pb.WatchVersionsRequest(session=self.session), metadata=self.auth):
                if ev.version.state == tpb.READY:
                    self.seen_ready.append(time.time())
                    await self._handshake(stub, line, agent_id, ev.version.version, ev.version.manifest_digest)
        except asyncio.CancelledError:
            pass
        except grpc.aio.AioRpcError as e:
            if not stop.is_set():
                self._error(f"watch {e.code().name}")
        finally:
            beat.cancel()

    async def _heartbeat(self, stub: pb_grpc.CoordinatorStub, agent_id: str, line: list[_Line]) -> None:
        """Beats as weightsync.heartbeat does: on one Heartbeats stream (or unary calls)."""
        interval = heartbeat_interval_s(self.ttl_s)
        request = pb.HeartbeatRequest(session=self.session, agent_id=agent_id, agent_key=self.keys[agent_id])
        await asyncio.sleep(random.random() * interval)  # agents beat at random phases
        while True:
            t0 = time.perf_counter()
            try:
                if self.unary_heartbeats:
                    await stub.Heartbeat(request, timeout=self.ttl_s, metadata=self.auth)
                else:
                    if not line:
                        line.append(_Line(stub.Heartbeats(metadata=self.auth)))
                    await asyncio.wait_for(line[0].ask(request), self.ttl_s)
                self.heartbeats.append(time.perf_counter() - t0)
            except (grpc.aio.AioRpcError, TimeoutError) as e:
                self._error(f"heartbeat {e.code().name if isinstance(e, grpc.aio.AioRpcError) else 'TIMEOUT'}")
                if line:
                    line.pop().call.cancel()
            await asyncio.sleep(max(0.0, interval - (time.perf_counter() - t0)))

    async def _handshake(
        self, stub: pb_grpc.CoordinatorStub, line: list[_Line], agent_id: str, version: int, digest: str
    ) -> None:
        carried = self.carried_calls and not self.unary_heartbeats
        try:
            t0 = time.perf_counter()
            lease = pb.GetManifestRequest(
                session=self.session, version=version, agent_id=agent_id, agent_key=self.keys[agent_id]
            )
            if carried and line:
                _answered(await line[0].ask(pb.HeartbeatRequest(call_id=1, get_manifest=lease)))
            else:
                async for _piece in stub.GetManifest(lease, timeout=60, metadata=self.auth):
                    pass
            self.leases.append(time.perf_counter() - t0)
            await asyncio.sleep(random.random() * self.pull_s)  # the pull and apply a rollout does here
            report = pb.ReportAppliedRequest()
            report.CopyFrom(self.report)
            report.version, report.agent_id, report.manifest_digest = version, agent_id, digest
            report.agent_key = self.keys[agent_id]
            t0 = time.perf_counter()
            if carried and line:
                _answered(await line[0].ask(pb.HeartbeatRequest(call_id=2, report_applied=report)))
            else:
                await stub.ReportApplied(report, timeout=60, metadata=self.auth)
            self.reports.append(time.perf_counter() - t0)
            self.handshakes.append(time.time())
        except grpc.aio.AioRpcError as e:
            self._error(f"handshake {e.code().name}")
        except _CarriedError as e:
            self._error(f"handshake {e}")


class _CarriedError(Exception):
    """A carried call answered with an error status (its code name)."""


def _answered(answers: list[pb.HeartbeatResponse]) -> None:
    if answers[-1].HasField("error"):
        raise _CarriedError(code_name(answers[-1].error))


class _Line:
    """One agent's Heartbeats stream, shared by its beats and its carried calls. The
    coordinator answers a stream's requests in order, so answers are matched first in,
    first out: a beat takes one answer, a call those up to its `last`."""

    def __init__(self, call: Any) -> None:
        self.call = call
        self._lock = asyncio.Lock()
        self._waiting: deque[tuple[asyncio.Future[list[pb.HeartbeatResponse]], list[pb.HeartbeatResponse]]] = deque()
        self._reader = asyncio.create_task(self._read())

    async def ask(self, request: pb.HeartbeatRequest) -> list[pb.HeartbeatResponse]:
        done: asyncio.Future[list[pb.HeartbeatResponse]] = asyncio.get_running_loop().create_future()
        async with self._lock:
            self._waiting.append((done, []))
            await self.call.write(request)
        return await done

    async def _read(self) -> None:
        try:
            while (resp := await self.call.read()) is not grpc.aio.EOF:
                done, answers = self._waiting[0]
                answers.append(resp)
                if not resp.call_id or resp.last:
                    self._waiting.popleft()
                    done.set_result(answers)
            raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata())
        except (grpc.aio.AioRpcError, asyncio.CancelledError) as e:
            for done, _ in self._waiting:
                if not done.done():
                    done.set_exception(e if isinstance(e, grpc.aio.AioRpcError) else TimeoutError())
            self._waiting.clear()


def fleet_worker(args: argparse.Namespace) -> int:
    """`--worker FIRST:COUNT`: one process of the fleet; results as JSON on stdout."""
    first, count = map(int, args.worker.split(":"))
    if args.fleet_nice:
        os.nice(args.fleet_nice)
    part = synthetic_part(8)
    report = good_report("fleet", 1, "", Manifest("fleet", 1, 1, part.chunk_bytes, (part,)))
    fleet = Fleet(
        args.address,
        "fleet",
        first,
        count,
        args.lease_ttl_s,
        args.pull_s,
        report,
        args.heartbeats == "unary",
        args.calls == "carried",
    )
    asyncio.run(fleet.run())
    print(
        json.dumps(
            {
                "seen_ready": fleet.seen_ready,
                "handshakes": fleet.handshakes,
                "heartbeats": fleet.heartbeats,
                "leases": fleet.leases,
                "reports": fleet.reports,
                "errors": fleet.errors,
            }
        ),
        flush=True,
    )
    return 0
