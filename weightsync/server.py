"""Builds a weightsync gRPC server: health, reflection, status mapping, /metrics, ready file."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import stat
import threading
from collections.abc import Callable, Coroutine, Sequence
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

from weightsync._proto import coordinator_pb2 as _coordinator_pb2
from weightsync.addresses import is_unix, join_host_port, unix_path
from weightsync.config import is_loopback
from weightsync.errors import cannot_listen
from weightsync.event_loop import URGENT, LaneLoop
from weightsync.metrics import Metrics
from weightsync.metrics_http import MetricsServer
from weightsync.rpc import MAX_MESSAGE_BYTES, SERVER_OPTIONS, OpenCalls, RequestCheck, StatusInterceptor
from weightsync.security import PLAINTEXT, Security
from weightsync.signal_wait import StopEvent
from weightsync.unix_sockets import SocketFile, bind_unix

log = logging.getLogger(__name__)
T = TypeVar("T")
# The service through which whoever may call it may attach as the trainer.
COORDINATOR = _coordinator_pb2.DESCRIPTOR.services_by_name["Coordinator"].full_name


@dataclass(frozen=True)
class Service:
    """One servicer to mount: the generated add_*_to_server, the servicer, its full name."""

    add: Callable[[Any, grpc.aio.Server], None]
    servicer: Any
    full_name: str
    # Its streams that end only when their client leaves or the servicer ends them (the
    # coordinator's watch and heartbeat streams): shutdown does not wait on them.
    endless: tuple[str, ...] = ()
    # What every call to the server must pass besides the bearer-token check (which runs
    # first): the coordinator's agent keys.
    checks: tuple[RequestCheck, ...] = ()

    def endless_methods(self) -> set[str]:
        return {f"/{self.full_name}/{name}" for name in self.endless}


# One event loop per process runs every grpc.aio server in it (grpc.aio objects belong to
# the loop that made them; tests run coordinator, trainer and rollout servers in one process).
# A LaneLoop: status calls and probes answer promptly under a fleet's burst (event_loop).
_loop_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
# Concurrent calls a server admits; watches and streams cost no thread, so this bounds
# only memory (a fleet of 1,000 rollouts holds ~2,000: a watch and a heartbeat each).
MAX_CONCURRENT_RPCS = 16_384
# The trainer's and rollouts' servers take only small requests (a chunk read names at most
# 4,096 indices, ~20 KB): a dozen 70 MiB requests at once, from anyone who reaches it,
# took a trainer's peak memory from 0.5 to 1.9 GB beside its arena.
SMALL_REQUEST_BYTES = 1 << 20
# Streams every server has that end only when their client leaves: a client of
# grpc's health-checking service config (or `grpcurl ... Health/Watch`) keeps a Watch open,
# and it held every shutdown for the whole grace (5 s).
REFLECTION_V1 = "grpc.reflection.v1.ServerReflection"
ENDLESS_METHODS = frozenset(
    {
        f"/{health.SERVICE_NAME}/Watch",
        f"/{reflection.SERVICE_NAME}/ServerReflectionInfo",
        f"/{REFLECTION_V1}/ServerReflectionInfo",
    }
)
# At shutdown, once only such streams are left: the time they get to end by themselves
# (the coordinator's, which its hub ends as returns) before the server cancels them.
ENDLESS_GRACE_S = 0.25
DRAIN_POLL_S = 0.02
# How long past the grace grpc waits before it cancels calls by itself, should the drain
# below not end them first.
BACKSTOP_S = 1.0


def _server_loop() -> asyncio.AbstractEventLoop:
    global _loop
    with _loop_lock:
        if _loop is None:
            _loop = LaneLoop()
            threading.Thread(target=_loop.run_forever, name="grpc-aio", daemon=True).start()
        return _loop


def run_on_server_loop(coro: Coroutine[Any, Any, T]) -> T:
    """Runs `coro` on the servers' event loop and waits for its result (from any other thread)."""
    return asyncio.run_coroutine_threadsafe(coro, _server_loop()).result()


@dataclass
class RunningServer:
    """A started server; `stop()` flips health to NOT_SERVING, drains and stops."""

    server: grpc.aio.Server
    address: str
    metrics_port: int
    health: health.aio.HealthServicer
    service_names: list[str]
    metrics: Metrics | None = None
    _httpd: MetricsServer | None = None
    _pool: futures.ThreadPoolExecutor | None = None
    calls: OpenCalls = field(default_factory=OpenCalls)
    endless: frozenset[str] = ENDLESS_METHODS
    socket_file: SocketFile | None = None  # where it serves on a unix socket
    _stopped: bool = field(default=False)

    @property
    def metrics_http(self) -> MetricsServer | None:
        """The /metrics server (None where /metrics is off)."""
        return self._httpd

    def set_serving(self, name: str, serving: bool) -> None:
        """Health's answer for service `name` (after a graceful shutdown began, NOT_SERVING stays)."""
        run_on_server_loop(self.health.set(name, health_pb2.HealthCheckResponse.SERVING if serving else NOT_SERVING))

    def enter_graceful_shutdown(self) -> None:
        """Health answers NOT_SERVING from now on (load balancers stop sending calls)."""
        run_on_server_loop(self.health.enter_graceful_shutdown())

    def stop(self, grace_s: float = 5.0) -> None:
        if self._stopped:
            return
        self._stopped = True
        self.enter_graceful_shutdown()
        run_on_server_loop(self._drain(grace_s))
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        if self._httpd is not None:
            self._httpd.stop()
        if self.socket_file is not None:
            self.socket_file.remove()

    async def _drain(self, grace_s: float) -> None:
        """Stops taking calls; gives calls in flight up to `grace_s` to end, but streams that
        end only when their client leaves (`endless`) just ENDLESS_GRACE_S once nothing
        else is left, then cancels what is still open and logs which of the two it was."""
        # grpc's own grace is only a backstop: were it `grace_s`, its timer would fire with
        # this loop's deadline and cancel the calls first, unlogged.
        stopping = asyncio.ensure_future(self.server.stop(grace_s + BACKSTOP_S))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        while not stopping.done() and loop.time() < deadline and self._finite_calls_open():
            await asyncio.sleep(DRAIN_POLL_S)
        if stopping.done():
            await stopping
            return
        if self._finite_calls_open():
            log.warning("the %gs grace is over; ending calls still open: %s", grace_s, self._describe_open())
        else:
            await asyncio.wait({stopping}, timeout=min(ENDLESS_GRACE_S, max(0.0, deadline - loop.time())))
            if not stopping.done():
                log.info("ending streams that end only when their client leaves: %s", self._describe_open())
        if not stopping.done():
            await self.server.stop(0)
        await stopping

    def _describe_open(self) -> str:
        return ", ".join(f"{m} x{n}" for m, n in sorted(self.calls.by_method().items())) or "none"

    def _finite_calls_open(self) -> bool:
        return any(method not in self.endless for method in self.calls.by_method())


def start_server(
    services: Sequence[Service],
    *,
    host: str,
    port: int,
    metrics: Metrics,
    metrics_port: int,
    metrics_host: str = "",
    max_workers: int = 32,
    security: Security | None = None,
    max_request_bytes: int = MAX_MESSAGE_BYTES,
    not_serving: Sequence[str] = (),
) -> RunningServer:
    """Starts a grpc.aio server with health + reflection and a /metrics endpoint.

    Args:
        services: the servicers to mount. Plain methods and generators run on a pool of
            `max_workers` threads (they may block); `async` ones run on the event loop
            and hold no thread (the coordinator's watch streams).
        host, port: gRPC bind address; port 0 picks a free port. A `unix:/path` host
            serves on that unix socket (`weightsync.unix_sockets`; the port is unused).
        metrics: this process's metrics (the registry served on /metrics).
        metrics_port: 0 picks a free port; -1 disables /metrics.
        metrics_host: the address /metrics binds: default `host`, or 127.0.0.1 where
            `host` is a unix socket.
        max_workers: handler threads for the plain methods.
        security: TLS / mTLS and bearer-token checks (`weightsync.security`); plaintext
            and open without.
        max_request_bytes: the largest request message accepted (grpc refuses larger ones
            with RESOURCE_EXHAUSTED before buffering them). grpc holds each whole, so the
            server's memory under concurrent large requests is this times their number:
            servers whose requests are all small (`SMALL_REQUEST_BYTES`) say so.
        not_serving: service names whose health starts NOT_SERVING (a rollout's, until it
            is ready: `RunningServer.set_serving`); the others, and "", start SERVING.
    """
    security = security or PLAINTEXT
    credentials = security.server_credentials()
    checks = [*security.request_checks(), *(check for svc in services for check in svc.checks)]
    pool = futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grpc")
    names = [svc.full_name for svc in services]
    calls = OpenCalls()
    endless = ENDLESS_METHODS.union(*(svc.endless_methods() for svc in services))
    socket_files: list[SocketFile] = []  # the unix socket start() binds, where it does

    async def start() -> tuple[grpc.aio.Server, health.aio.HealthServicer, int]:
        server = grpc.aio.server(
            migration_thread_pool=pool,
            interceptors=[StatusInterceptor(metrics.observe_rpc, checks, calls)],
            options=[*SERVER_OPTIONS, ("grpc.max_receive_message_length", max_request_bytes)],
            maximum_concurrent_rpcs=MAX_CONCURRENT_RPCS,
        )
        health_servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        for svc in services:
            svc.add(svc.servicer, server)
        _enable_reflection([*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)

        def add_port(listen: str, flag: str, shown: str) -> int:
            try:
                if credentials is None:
                    bound = server.add_insecure_port(listen)
                else:
                    bound = server.add_secure_port(listen, credentials)
            except RuntimeError as e:  # grpc's "Failed to bind to address"
                raise cannot_listen(flag, shown, "the bind failed") from e
            if bound == 0:
                raise cannot_listen(flag, shown, "the bind failed")
            return bound

        listen = join_host_port(host, port)
        if is_unix(host):
            bound, socket_file = bind_unix(unix_path(host), lambda p: add_port(f"unix:{p}", "host", listen), "host")
            socket_files.append(socket_file)
        else:
            bound = add_port(listen, "port", listen)
        # The server's accept loop is a task made here: in the urgent lane, so a new call
        # is taken on at once; the interceptor then puts each call in its method's lane.
        URGENT.set(True)
        await server.start()
        for name in ["", *names]:
            serving = name not in not_serving
            await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING if serving else NOT_SERVING)
        return server, health_servicer, bound

    try:
        server, health_servicer, bound = run_on_server_loop(start())
    except BaseException:
        pool.shutdown(wait=False)
        for made in socket_files:
            made.remove()
        raise
    socket_file = socket_files[0] if socket_files else None
    httpd = None
    mport = -1
    if metrics_port >= 0:
        mhost = metrics_host or ("127.0.0.1" if is_unix(host) else host)
        try:
            httpd = MetricsServer(mhost, metrics_port, metrics.registry)
        except OSError as e:
            run_on_server_loop(server.stop(0))
            pool.shutdown(wait=False)
            if socket_file is not None:
                socket_file.remove()
            reason = f"{e.strerror}; --metrics-port -1 turns /metrics off"
            raise cannot_listen("metrics_port", join_host_port(mhost, metrics_port), reason) from None
        mport = httpd.server_port
    address = join_host_port(host, bound)
    if open_to_everyone(security, socket_file):
        metrics.auth_open.set(1)
        if not is_loopback(host):
            log.warning(
                "INSECURE: %s serves %s without bearer tokens or client certificates on %s; any client that reaches "
                "it may fence the trainer or publish versions (see --auth-tokens-file / --tls-require-client-cert)",
                ", ".join(names),
                "plaintext" if credentials is None else "TLS",
                address,
            )
        else:
            log.warning(
                "OPEN: %s on %s takes calls without a credential from every user of this machine%s. Fine alone on "
                "a workstation, in a pod or on a VM of one user; on a shared host require bearer tokens "
                "(--auth-tokens-file) or serve a unix socket (--host unix:/path, mode 0660: its owner and group "
                "decide)",
                ", ".join(names),
                address,
                ": any of them may attach as the trainer, fence it and publish versions"
                if COORDINATOR in names
                else "",
            )
    log.info(
        "serving %s on %s (metrics on %s; %s%s)",
        ", ".join(names),
        address,
        mport,
        "plaintext" if credentials is None else "mTLS" if security.require_client_cert else "TLS",
        ", bearer tokens" if security.tokens_file else "",
    )
    return RunningServer(
        server, address, mport, health_servicer, names, metrics, httpd, pool, calls, endless, socket_file
    )


def open_to_everyone(security: Security, socket_file: SocketFile | None) -> bool:
    """True when a server takes calls without a credential from anyone who reaches it:
    neither bearer tokens nor client certificates, on TCP (loopback: every local user) or
    on a unix socket whose file mode lets every local user connect. A unix socket made
    here is mode 0660: its owner and group decide."""
    if security.tokens_file or security.require_client_cert:
        return False
    if socket_file is None:
        return True
    try:
        return bool(os.stat(socket_file.path).st_mode & stat.S_IWOTH)  # connect() needs write permission
    except OSError:
        return True  # cannot tell: said so rather than not


def _enable_reflection(service_names: Sequence[str], server: grpc.aio.Server) -> None:
    """Server reflection as `grpc.reflection.v1alpha` and `grpc.reflection.v1` (what
    current grpcurl asks for first). grpcio-reflection ships only v1alpha; v1's messages
    are the same messages under a new package name, so one servicer answers both."""
    servicer = reflection.aio.ReflectionServicer(service_names)
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                REFLECTION_V1,
                {
                    "ServerReflectionInfo": grpc.stream_stream_rpc_method_handler(
                        servicer.ServerReflectionInfo,
                        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
                        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
                    ),
                },
            ),
        )
    )


def write_ready_file(path: str, **info: Any) -> None:
    """Atomically writes the ready file (tests and the demo wait for it)."""
    if not path:
        return
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump({"pid": os.getpid(), **info}, f)
    os.replace(tmp, path)


def wait_for_signal(*, interrupt: bool = False) -> StopEvent:
    """Installs SIGTERM/SIGINT handlers that set and return an Event, whose `wait` on the
    main thread lets the handlers run whichever thread took the signal (`signal_wait`).

    With `interrupt`, the handler also raises KeyboardInterrupt in the main thread, so a
    blocking call (a trainer waiting for a commit) unwinds through its `with` blocks.
    """
    stop = StopEvent()

    def handler(signum: int, _frame: Any) -> None:
        log.info("received %s, shutting down", signal.Signals(signum).name)
        stop.set()
        if interrupt:
            raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    return stop
