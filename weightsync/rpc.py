"""The one bridge between weightsync errors and gRPC status codes, both directions.

Servers install `StatusInterceptor`, so servicers raise `errors.*` and never call
`context.abort`. Clients call through `unary()` / `stream()`, so callers catch
`DigestMismatch`, not `grpc.RpcError`.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import random
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import grpc
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from weightsync import errors
from weightsync.event_loop import URGENT
from weightsync.security import PLAINTEXT, Security
from weightsync.validation import INT64_MAX

log = logging.getLogger(__name__)

# Room for the largest allowed chunk (validation caps chunk_bytes at 64 MiB) plus its header;
# gRPC's 4 MiB default would refuse a 4 MiB chunk (the limit includes the header).
MAX_MESSAGE_BYTES = 80 << 20
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.keepalive_permit_without_calls", 1),
]
# The server must accept what CHANNEL_OPTIONS send: pings every 20 s, also without calls.
# Otherwise it counts them as abuse and answers GOAWAY too_many_pings. Each server sets its
# own largest request (`weightsync.server.start_server`).
SERVER_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ("grpc.http2.max_ping_strikes", 0),
    ("grpc.so_reuseport", 0),
]

T = TypeVar("T")
# Messages and details travel in trailing metadata (8 KiB by default): an error that
# quoted a 1 MiB name whole would come back as RESOURCE_EXHAUSTED about metadata instead.
MAX_ERROR_CHARS = 1024
ERROR_DOMAIN = "weightsync"  # google.rpc.ErrorInfo.domain of our errors; reason is the class name


class RpcObserver(Protocol):
    """Receives one call per finished RPC (metrics hook, so this module needs no prometheus)."""

    def __call__(self, method: str, code: str, seconds: float | None) -> None: ...


def _clip(text: str) -> str:
    return text if len(text) <= MAX_ERROR_CHARS else f"{text[:MAX_ERROR_CHARS]}… ({len(text)} characters)"


def check_int64_range(message: Any, prefix: str = "") -> None:
    """Refuses uint64 fields above 2^63-1 (naming the field) in a request and its singular
    sub-messages: they could not be stored, and would otherwise surface as INTERNAL."""
    for fd, value in message.ListFields():
        if fd.is_repeated:
            continue
        if fd.type == fd.TYPE_UINT64 and value > INT64_MAX:
            raise errors.InvalidArgument(f"{value} exceeds 2^63-1", field=prefix + fd.name)
        if fd.type == fd.TYPE_MESSAGE:
            check_int64_range(value, f"{prefix}{fd.name}.")


def to_status(error: Exception) -> status_pb2.Status:
    """The google.rpc.Status for an error; INVALID_ARGUMENT carries a BadRequest detail.
    Messages are clipped to MAX_ERROR_CHARS (they may quote what the caller sent)."""
    if isinstance(error, errors.WeightsyncError):
        name = errors.status_name_for(error)
        message = _clip(error.message)
    elif isinstance(error, NotImplementedError):  # e.g. grpc's Health.List in some versions
        name, message = "UNIMPLEMENTED", _clip(f"not implemented: {error}")
    else:
        name, message = "INTERNAL", _clip(f"internal error: {type(error).__name__}: {error}")
    status = status_pb2.Status(code=getattr(code_pb2, name), message=message)
    if isinstance(error, errors.WeightsyncError):  # the class travels, so clients raise the same one
        info = any_pb2.Any()
        info.Pack(error_details_pb2.ErrorInfo(reason=type(error).__name__, domain=ERROR_DOMAIN))
        status.details.append(info)
    field = getattr(error, "field", None)
    if field:
        detail = any_pb2.Any()
        detail.Pack(
            error_details_pb2.BadRequest(
                field_violations=[error_details_pb2.BadRequest.FieldViolation(field=_clip(field), description=message)]
            )
        )
        status.details.append(detail)
    return status


def status_for(error: Exception, method: str) -> status_pb2.Status:
    """`to_status(error)` for a call of `method` that failed with it; what none of our
    errors describes is logged with its traceback (it answers INTERNAL)."""
    if not isinstance(error, (errors.WeightsyncError, NotImplementedError)):
        log.exception("unhandled error in %s", method, exc_info=error)
    return to_status(error)


def code_name(status: status_pb2.Status) -> str:
    """The grpc.StatusCode member name of a google.rpc.Status ("DATA_LOSS")."""
    return grpc.StatusCode(_code_tuple(status.code)).name


# Calls answered in the event loop's urgent lane (weightsync.event_loop): an operator's or
# a probe's, each cheap and rare, that must not queue behind a fleet's burst of messages.
URGENT_METHOD_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


def is_urgent(method: str) -> bool:
    """True for the methods served in the urgent lane: every service's GetStatus, health, reflection."""
    return method.endswith("/GetStatus") or method.startswith(URGENT_METHOD_PREFIXES)


class RequestCheck(Protocol):
    """Runs before a servicer method (the bearer-token check); raises `errors.*` to refuse."""

    def before_read(self, method: str, metadata: Any) -> None:
        """What needs no request (who calls, may they call `method`): checked before grpc
        reads the request, so a refused caller's bytes are never buffered."""

    def __call__(self, method: str, metadata: Any, request: Any) -> None:
        """`request` is the request message, or the request iterator of a client stream."""

    def while_streaming(self, method: str, metadata: Any) -> None:
        """Before each message of a response stream: what ends a call already let in (a
        credential revoked while a watch is open)."""


@dataclass(frozen=True)
class Undecodable:
    """What a request message became when its bytes do not parse as the method's type.

    grpc answers a request it cannot deserialize with UNKNOWN (unary) or hands the
    exception to the handler (streams, where it surfaced as INTERNAL); the interceptor's
    lenient deserializer returns this instead, and the call is refused as INVALID_ARGUMENT.
    """

    type_name: str
    reason: str

    def error(self) -> errors.InvalidArgument:
        return errors.InvalidArgument(f"request: not a valid {self.type_name} message ({self.reason})", field="request")


def lenient(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    """`deserializer`, returning an `Undecodable` where it would raise."""
    if deserializer is None:
        return None
    message_class = getattr(deserializer, "__self__", None)  # pb.X.FromString is bound to X
    type_name = getattr(getattr(message_class, "DESCRIPTOR", None), "full_name", "request")

    def parse(data: bytes) -> Any:
        try:
            return deserializer(data)
        except Exception as e:  # noqa: BLE001 - any failure to parse is the caller's bytes
            return Undecodable(type_name, _clip(f"{type(e).__name__}: {e}"))

    return parse


class OpenCalls:
    """The calls a server is running now, by method (any thread): what its shutdown waits for."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: Counter[str] = Counter()

    def enter(self, method: str) -> None:
        with self._lock:
            self._open[method] += 1

    def leave(self, method: str) -> None:
        with self._lock:
            self._open[method] -= 1
            if not self._open[method]:
                del self._open[method]

    def by_method(self) -> dict[str, int]:
        with self._lock:
            return dict(self._open)


class StatusInterceptor(grpc.aio.ServerInterceptor):
    """Maps raised exceptions to statuses with the table in `errors`; observes every RPC;
    runs `checks` (authorization) before each servicer method.

    Servers are `grpc.aio` servers: a handler may be a plain function or generator (run
    on the server's thread pool, so it may block) or a coroutine / async generator (run
    on the event loop: the watch streams, which must not hold a thread each).
    """

    def __init__(
        self,
        observer: RpcObserver | None = None,
        checks: Sequence[RequestCheck] = (),
        calls: OpenCalls | None = None,
    ) -> None:
        self._observer = observer
        self._checks = tuple(checks)
        self._calls = calls or OpenCalls()

    async def intercept_service(self, continuation: Callable[[Any], Any], details: grpc.HandlerCallDetails) -> Any:
        # Runs in the call's own task: the lane set here is the one its handler runs in.
        URGENT.set(is_urgent(details.method))
        handler = await continuation(details)
        if handler is None:
            return None
        try:
            for check in self._checks:
                check.before_read(details.method, details.invocation_metadata)
        except errors.WeightsyncError as e:
            return self._refusal(handler, details.method, e)
        for kind in ("unary_unary", "unary_stream", "stream_unary", "stream_stream"):
            fn = getattr(handler, kind)
            if fn is not None:
                return handler._replace(
                    request_deserializer=lenient(handler.request_deserializer),
                    **{kind: self._wrap(fn, details.method, details.invocation_metadata, kind)},
                )
        return handler

    def _refusal(self, handler: grpc.RpcMethodHandler, method: str, error: Exception) -> grpc.RpcMethodHandler:
        """A handler answering `error` that never reads the request. grpc reads a unary
        request whole (up to the 80 MiB limit) before any handler runs, and a dozen
        concurrent 70 MiB requests without a token took a coordinator from 68 MiB to 1 GiB;
        a request stream is read only when asked for, so the refusal takes one (unread),
        and the peer's bytes stop at the stream's flow-control window."""
        status = self._status(error, method, None, None)

        async def refuse(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> None:
            await context.abort(status.code, status.details, status.trailing_metadata)

        async def refuse_stream(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            await context.abort(status.code, status.details, status.trailing_metadata)
            yield  # never reached: makes this an async generator, as a response stream's handler is

        if handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(refuse_stream)
        return grpc.stream_unary_rpc_method_handler(refuse)

    def _before(self, method: str, metadata: Any, request: Any) -> None:
        if isinstance(request, Undecodable):
            raise request.error()
        if hasattr(request, "ListFields"):  # messages (a client stream's iterator comes first)
            check_int64_range(request)
        for check in self._checks:
            check(method, metadata, request)

    def _still_allowed(self, method: str, metadata: Any) -> None:
        for check in self._checks:
            check.while_streaming(method, metadata)

    async def _each_checked(self, method: str, metadata: Any, requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
        async for request in requests:
            self._before(method, metadata, request)
            yield request

    def _each_checked_sync(self, method: str, metadata: Any, requests: Iterator[Any]) -> Iterator[Any]:
        for request in requests:
            self._before(method, metadata, request)
            yield request

    def _status(self, error: Exception, method: str, started: float | None, context: Any) -> grpc.Status:
        if isinstance(error, grpc.aio.AbortError):
            # The handler aborted with a status of its own (grpc's health servicer does):
            # count the code it set, and let that status stand.
            code = context.code() if hasattr(context, "code") else None
            self._observe(method, code.name if isinstance(code, grpc.StatusCode) else "UNKNOWN", started)
            raise error
        if isinstance(error, grpc.RpcError):
            # The client went away while we read its request stream: nothing to answer.
            self._observe(method, "CANCELLED", started)
            raise error
        status = status_for(error, method)
        self._observe(method, code_name(status), started)
        return rpc_status.to_status(status)

    def _observe(self, method: str, code: str, started: float | None) -> None:
        """`started` None: a response stream, counted without a duration (a watch lives
        for hours; its length would swamp the latency histogram)."""
        if self._observer is not None:
            self._observer(method, code, None if started is None else time.perf_counter() - started)

    def _wrap(self, fn: Callable[..., Any], method: str, metadata: Any, kind: str) -> Callable[..., Any]:
        """A wrapper of the same flavour as `fn` (the server picks thread or loop by it)."""
        timed = kind in ("unary_unary", "stream_unary")

        if inspect.isasyncgenfunction(fn):

            async def agen(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                self._calls.enter(method)
                try:
                    self._before(method, metadata, request)
                    if kind == "stream_stream":  # every message, as a unary request is
                        request = self._each_checked(method, metadata, request)
                    async for item in fn(request, context):
                        self._still_allowed(method, metadata)
                        yield item
                except asyncio.CancelledError:
                    self._observe(method, "CANCELLED", None)
                    raise
                except Exception as e:  # noqa: BLE001 - the single mapping point
                    s = self._status(e, method, None, context)
                    await context.abort(s.code, s.details, s.trailing_metadata)
                finally:
                    self._calls.leave(method)
                self._observe(method, "OK", None)

            return agen

        if inspect.iscoroutinefunction(fn):

            async def coro(request: Any, context: grpc.aio.ServicerContext) -> Any:
                started = time.perf_counter() if timed else None
                self._calls.enter(method)
                try:
                    self._before(method, metadata, request)
                    if kind == "stream_unary":
                        request = self._each_checked(method, metadata, request)
                    response = await fn(request, context)
                except Exception as e:  # noqa: BLE001 - the single mapping point
                    s = self._status(e, method, started, context)
                    await context.abort(s.code, s.details, s.trailing_metadata)
                finally:
                    self._calls.leave(method)
                self._observe(method, "OK", started)
                return response

            return coro

        if timed:

            def call(request: Any, context: grpc.ServicerContext) -> Any:
                started = time.perf_counter()
                self._calls.enter(method)
                try:
                    self._before(method, metadata, request)
                    if kind == "stream_unary":
                        request = self._each_checked_sync(method, metadata, request)
                    response = fn(request, context)
                except Exception as e:  # noqa: BLE001 - the single mapping point
                    _abort_sync(context, self._status(e, method, started, context))
                finally:
                    self._calls.leave(method)
                self._observe(method, "OK", started)
                return response

            return call

        def gen(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            self._calls.enter(method)
            try:
                self._before(method, metadata, request)
                if kind == "stream_stream":
                    request = self._each_checked_sync(method, metadata, request)
                for item in fn(request, context):
                    self._still_allowed(method, metadata)
                    yield item
            except Exception as e:  # noqa: BLE001 - the single mapping point
                _abort_sync(context, self._status(e, method, None, context))
            finally:
                self._calls.leave(method)
            self._observe(method, "OK", None)

        return gen


def _abort_sync(context: grpc.ServicerContext, status: grpc.Status) -> None:
    """Ends a call run on the thread pool with `status` (its details in trailing metadata)."""
    context.set_trailing_metadata(status.trailing_metadata)
    context.abort(status.code, status.details)


def _code_tuple(code: int) -> tuple[int, str]:
    for member in grpc.StatusCode:
        if member.value[0] == code:
            return member.value
    return grpc.StatusCode.UNKNOWN.value


def error_from_rpc(exc: grpc.RpcError) -> errors.WeightsyncError:
    """The weightsync error for a failed call (the table applied in reverse)."""
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    message = (exc.details() if hasattr(exc, "details") else None) or str(exc)
    try:
        status = rpc_status.from_call(exc)  # type: ignore[arg-type]
    except Exception:  # noqa: BLE001 - a status without details is fine
        status = None
    return _error(code.name, message, status.details if status is not None else ())


def error_from_status(status: status_pb2.Status) -> errors.WeightsyncError:
    """The weightsync error for a status answered in a message (a carried call's `error`)."""
    return _error(code_name(status), status.message, status.details)


def _error(code: str, message: str, details: Sequence[any_pb2.Any]) -> errors.WeightsyncError:
    field = None
    reason = ""
    for detail in details:
        if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            br = error_details_pb2.BadRequest()
            detail.Unpack(br)
            if br.field_violations:
                field = br.field_violations[0].field
        elif detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            if info.domain == ERROR_DOMAIN:
                reason = info.reason
    if code == "UNIMPLEMENTED":  # grpc says only "Method not found!"
        message = f"the server at this address does not serve this call ({message}): is it the weightsync server meant?"
    # A call cancelled under its caller (its channel closed for a renewed one, a server
    # stopping) is tried again like a server out of reach, not taken for a server's bug.
    err = errors.error_for_status("UNAVAILABLE" if code == "CANCELLED" else code, message, field, reason)
    err.grpc_code = code  # type: ignore[attr-defined]
    return err


def unary(
    fn: Callable[..., T],
    request: Any,
    *,
    timeout_s: float,
    retries: int = 0,
    metadata: Any = None,
) -> T:
    """Calls a unary (or stream-unary) stub method with a deadline; maps errors.

    UNAVAILABLE is retried `retries` times with jittered exponential backoff; pass
    retries only for idempotent calls.
    """
    attempt = 0
    while True:
        try:
            return fn(request, timeout=timeout_s, metadata=metadata)
        except grpc.RpcError as e:
            err = error_from_rpc(e)
            if isinstance(err, errors.TransportUnavailable) and attempt < retries:
                attempt += 1
                time.sleep(min(2.0, 0.05 * 2**attempt) * (0.5 + random.random()))
                continue
            raise err from None


def stream(
    fn: Callable[..., Iterator[T]], request: Any, *, timeout_s: float | None, metadata: Any = None
) -> Iterator[T]:
    """Iterates a server-streaming call with a deadline, mapping errors as they arrive."""
    yield from answers(fn(request, timeout=timeout_s, metadata=metadata))


def answers(call: Iterator[T]) -> Iterator[T]:
    """A streaming call's responses, errors mapped as they arrive; cancelled when left."""
    try:
        yield from call
    except grpc.RpcError as e:
        raise error_from_rpc(e) from None
    finally:
        cancel = getattr(call, "cancel", None)
        if cancel is not None:
            cancel()


def channel(address: str, security: Security | None = None) -> grpc.Channel:
    """A channel with weightsync's message-size and keepalive options; TLS and a bearer
    token as `security` says (plaintext without)."""
    return (security or PLAINTEXT).channel(address, CHANNEL_OPTIONS)


def wait_reachable(address: str, timeout_s: float, security: Security | None = None, *, what: str = "peer") -> None:
    """Returns once a channel to `address` connects (TLS handshake included); raises
    TransportUnavailable naming the address after `timeout_s` (a bounded wait where the
    clients' own retries would take their full backoff)."""
    ch = channel(address, security)
    try:
        grpc.channel_ready_future(ch).result(timeout=timeout_s)
    except grpc.FutureTimeoutError:
        raise errors.TransportUnavailable(
            f"the {what} at {address} is not reachable (no connection within {timeout_s:g} s): "
            "is it running, and is the address right?"
        ) from None
    finally:
        ch.close()
