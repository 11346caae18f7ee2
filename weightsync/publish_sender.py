"""PublishVersion's requests sent from an asyncio loop on a thread that lives as long as
its client.

gRPC's sync API reads a call's request stream on a thread it starts for that call, so every
publish ends with a fresh thread sending its descriptors. Here one thread, started with the
sender, runs an event loop and a `grpc.aio` channel (TLS and bearer token as the client's
`Security` says, `AioCalls`), and each publish hands it the requests already serialized.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

import grpc

from weightsync import rpc
from weightsync._proto import coordinator_pb2 as pb
from weightsync.security import PLAINTEXT, AioCalls, Security
from weightsync.signal_wait import future_done

T = TypeVar("T")
PUBLISH_METHOD = "/weightsync.v1.Coordinator/PublishVersion"


class LoopSender:
    """Sends PublishVersion calls to `address` from a loop of its own (see the module doc)."""

    def __init__(self, address: str, security: Security | None = None) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="weightsync-publish-send", daemon=True)
        self._thread.start()
        self._calls = self._run(self._open(address, security or PLAINTEXT))

    @staticmethod
    async def _open(address: str, security: Security) -> AioCalls:
        return AioCalls(security, address, rpc.CHANNEL_OPTIONS)  # made in the loop that uses it

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        done = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            future_done(done, None)  # in slices: a trainer's SIGTERM is not held for the call
        except BaseException:
            done.cancel()  # the handler's KeyboardInterrupt: the call is not left running
            raise
        return done.result()

    def publish(self, serialized: Sequence[bytes], *, timeout_s: float) -> pb.PublishResponse:
        """One PublishVersion call of these serialized requests; weightsync's typed errors
        as `rpc.unary` maps them."""

        async def call() -> pb.PublishResponse:
            send = self._calls.channel().stream_unary(
                PUBLISH_METHOD, request_serializer=None, response_deserializer=pb.PublishResponse.FromString
            )
            return await send(iter(serialized), timeout=timeout_s, metadata=self._calls.metadata())

        try:
            return self._run(call())
        except grpc.RpcError as e:
            raise rpc.error_from_rpc(e) from None

    def close(self) -> None:
        """Closes the channel, stops the loop and its thread."""
        if self._loop.is_closed():
            return
        try:
            self._run(self._calls.close())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop.close()
