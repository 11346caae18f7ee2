"""Reflection-driven fuzzing of all three servers: no request may come back INTERNAL or UNKNOWN.

The fuzzer knows nothing of our protos: it asks each server for its services through
server reflection (as grpcurl does), builds request classes from the descriptors it gets,
and fills random fields with extremes (2^64-1, -2^63, NaN, +-inf, 10^4-character and
path-like strings, long repeats, unknown enum values, nested messages), and mangles one
request in six at the byte level (cut short, a bit flipped, invalid UTF-8 or a malformed
tag spliced in), as a byte-level fuzzer would. Every answer must
carry a deliberate status; afterwards every server still answers and the session that was
not named by any request is unchanged.
"""

from __future__ import annotations

import math
import os
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest
from google.protobuf.descriptor import FieldDescriptor as F

from devtools.cluster import Cluster, Proc
from tests.integration.support import reflected_methods, state_name
from weightsync.client import CoordinatorClient
from weightsync.security import with_credential

pytestmark = pytest.mark.slow
CALLS = int(os.environ.get("WS_FUZZ_CALLS", "600"))  # per server (watches wait out a 0.2 s deadline each)
SEED = int(os.environ.get("WS_FUZZ_SEED", "11"))
FORBIDDEN = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}
INTS = {
    F.TYPE_UINT64: [0, 1, 2, (1 << 63) - 1, 1 << 63, (1 << 64) - 1],
    F.TYPE_INT64: [0, 1, -1, (1 << 63) - 1, -(1 << 63)],
    F.TYPE_UINT32: [0, 1, 7, (1 << 31), (1 << 32) - 1],
    F.TYPE_INT32: [0, 1, -1, (1 << 31) - 1, -(1 << 31)],
}
FLOATS = [0.0, -0.0, 1.0, math.nan, math.inf, -math.inf, 1e308, 5e-324, -1e-3]
STRINGS = [
    "",
    "fuzz",
    "r0",
    "a",
    "model.layers.0.w",
    "../../etc",
    "/etc/passwd",
    "file:///etc",
    "memory://x",
    "fuzz/v1/r0",
    "127.0.0.1:1",
    "[::1]:0",
    "grpc,tcp",
    "\x00",
    "é\u2028\U0001f600",
    "x" * 10_000,
    "A" * 300,
]


def _fill(msg: Any, rng: random.Random, depth: int = 0) -> Any:
    for field in msg.DESCRIPTOR.fields:
        if rng.random() < 0.35:
            continue
        if field.is_repeated:
            n = rng.choice([0, 1, 2, 3, 40, 1000 if field.type != F.TYPE_MESSAGE else 20])
            target = getattr(msg, field.name)
            for _ in range(n):
                if field.type == F.TYPE_MESSAGE:
                    if field.message_type.GetOptions().map_entry or depth > 3:
                        break
                    _fill(target.add(), rng, depth + 1)
                else:
                    _append(target, field, rng)
            continue
        if field.type == F.TYPE_MESSAGE:
            if depth <= 3:
                _fill(getattr(msg, field.name), rng, depth + 1)
            continue
        try:
            setattr(msg, field.name, _scalar(field, rng))
        except (ValueError, TypeError):
            pass  # a value this field's type cannot hold (the wire could not carry it either)
    return msg


def _append(target: Any, field: F, rng: random.Random) -> None:
    try:
        target.append(_scalar(field, rng))
    except (ValueError, TypeError):
        pass


def _scalar(field: F, rng: random.Random) -> Any:
    t = field.type
    if t in INTS:
        return rng.choice(INTS[t])
    if t in (F.TYPE_DOUBLE, F.TYPE_FLOAT):
        return rng.choice(FLOATS)
    if t == F.TYPE_BOOL:
        return rng.random() < 0.5
    if t == F.TYPE_STRING:
        return rng.choice(STRINGS) if rng.random() < 0.8 else "".join(chr(rng.randrange(32, 0x3000)) for _ in range(12))
    if t == F.TYPE_BYTES:
        return rng.randbytes(rng.choice([0, 8, 32, 4096]))
    if t == F.TYPE_ENUM:
        return rng.choice([v.number for v in field.enum_type.values] + [99, -1])
    return 0


def _request(cls: Any, rng: random.Random) -> bytes:
    """A filled request's bytes, one in six mangled as a byte-level fuzzer would: cut
    short, a byte flipped, invalid UTF-8 or a malformed tag spliced in (most then do not
    parse as the method's message, which must be INVALID_ARGUMENT, not grpc's UNKNOWN)."""
    data = _fill(cls(), rng).SerializeToString()
    if rng.random() >= 1 / 6:
        return data
    at = rng.randrange(len(data) + 1)
    how = rng.randrange(4)
    if how == 0:
        return data[:at]
    if how == 1 and data:
        at = min(at, len(data) - 1)
        return data[:at] + bytes([data[at] ^ (1 << rng.randrange(8))]) + data[at + 1 :]
    splice = rng.choice([b"\x0a\x02\xff\xfe", b"\x12\x03\xed\xa0\x80", b"\xff", b"\x07", b"\x0b", b"\x0a\x7fab"])
    return data[:at] + splice + data[at:]


def _call(
    channel: grpc.Channel, path: str, cls: Any, cstream: bool, sstream: bool, rng: random.Random
) -> grpc.StatusCode:
    ser = de = lambda b: b  # noqa: E731 - requests are serialized (and some mangled) beforehand
    try:
        if cstream and not sstream:
            reqs = [_request(cls, rng) for _ in range(rng.choice([0, 1, 2, 4]))]
            channel.stream_unary(path, request_serializer=ser, response_deserializer=de)(iter(reqs), timeout=10)
        elif sstream:
            if cstream:  # a bidi stream (Heartbeats): a few requests, a few answers
                reqs = [_request(cls, rng) for _ in range(rng.choice([0, 1, 2, 4]))]
                call = channel.stream_stream(path, request_serializer=ser, response_deserializer=de)(
                    iter(reqs), timeout=2
                )
            else:
                call = channel.unary_stream(path, request_serializer=ser, response_deserializer=de)(
                    _request(cls, rng), timeout=0.2
                )
            # Belt and braces: a watch that outlives its deadline on the client side would
            # hang the test rather than fail it (seen once with a health Watch).
            timer = threading.Timer(3, call.cancel)
            timer.start()
            try:
                for i, _ in enumerate(call):
                    if i >= 2:
                        call.cancel()
                        break
            finally:
                timer.cancel()
        else:
            channel.unary_unary(path, request_serializer=ser, response_deserializer=de)(_request(cls, rng), timeout=10)
    except grpc.RpcError as e:
        return e.code()
    return grpc.StatusCode.OK


def test_reflection_fuzzer_finds_no_internal_error_on_any_server(cluster: Cluster) -> None:
    coord = cluster.start_coordinator()
    rollout = cluster.start_rollout("r0", coord.address, "job")
    trainer = cluster.start_trainer("trainer", coord.address, "job", ["--model-size", "tiny", "--steps", "1", "--hold"])
    with CoordinatorClient(coord.address) as client:
        client.wait_for_version("job", 1, timeout_s=120)
        client.open_session("fuzz", trainer=True, trainer_ranks=1)  # a session the fuzzer may name
        before = [(v.version, state_name(v), v.manifest_digest, v.generation) for v in client.status("job").versions]
    # the three servers at once, each with its own stream of requests (a watch's wait
    # overlaps the other servers' calls); the first failure is raised here
    servers = (coord, trainer, rollout)
    with ThreadPoolExecutor(len(servers)) as pool:
        list(pool.map(lambda proc: _fuzz_server(proc, random.Random(f"{SEED}/{proc.name}")), servers))
    for proc in servers:
        assert proc.alive(), f"{proc.name} died under fuzzing"
    with CoordinatorClient(coord.address) as client:
        after = [(v.version, state_name(v), v.manifest_digest, v.generation) for v in client.status("job").versions]
    assert after == before


def _fuzz_server(proc: Proc, rng: random.Random) -> None:
    """`CALLS` requests to every method `proc` lists through reflection, in turn; raises
    at the first forbidden status or a call past its deadline."""
    codes: dict[str, dict[str, int]] = {}
    # the coordinator's calls carry its default credential (found as a client finds it), so
    # the fuzzer reaches its handlers, not only the bearer-token check
    security = with_credential(None, proc.address, "admin")
    with security.channel(proc.address, [("grpc.max_send_message_length", 64 << 20)]) as channel:
        methods = list(reflected_methods(channel))
        assert methods, f"{proc.name}: reflection lists no methods"
        for i in range(CALLS):
            path, cls, cstream, sstream = methods[i % len(methods)]
            t0 = time.monotonic()
            code = _call(channel, path, cls, cstream, sstream, rng)
            assert time.monotonic() - t0 < 30, f"{proc.name} {path}: no answer within its deadline (call {i})"
            codes.setdefault(path, {}).setdefault(code.name, 0)
            codes[path][code.name] += 1
            assert code not in FORBIDDEN, f"{proc.name} {path}: {code.name} (seed {SEED}, call {i}); so far {codes}"
