"""Addresses: host:port strings, IPv6 literals included ([::1]:50051, as gRPC and URLs write
them), and unix-domain sockets (`unix:/path`, also written `unix:///path`, as gRPC takes them)."""

from __future__ import annotations

import errno
import functools
import socket

UNIX_PREFIX = "unix:"
# sun_path holds 108 bytes on Linux, the terminating NUL included.
SUN_PATH_MAX = 107


def join_host_port(host: str, port: int | str) -> str:
    """`host:port`; an IPv6 literal goes in brackets (`::1` alone would read as a host).
    A unix socket's address is itself: it has no port."""
    if is_unix(host):
        return unix_address(unix_path(host))
    if ":" in host and not host.startswith("["):
        return f"[{host}]:{port}"
    return f"{host}:{port}"


def bare_host(host: str) -> str:
    """`host` without the brackets an IPv6 literal is written in (`[::1]` -> `::1`)."""
    return host.removeprefix("[").removesuffix("]")


def split_host_port(address: str) -> tuple[str, str]:
    """(host without brackets, port) of `host:port` or `[v6]:port`."""
    host, _, port = address.rpartition(":")
    return bare_host(host), port


def is_unix(address: str) -> bool:
    """True for a unix-domain socket address (`unix:/path` or `unix:///path`)."""
    return address.startswith(UNIX_PREFIX)


def unix_path(address: str) -> str:
    """The file path of `unix:/path` or `unix:///path` (gRPC's two spellings)."""
    rest = address.removeprefix(UNIX_PREFIX)
    return rest.removeprefix("//") if rest.startswith("///") else rest


def unix_address(path: str) -> str:
    """The canonical address of a socket file: `unix:/path`."""
    return UNIX_PREFIX + path


@functools.cache
def inet_refused() -> str:
    """Why this process cannot use inet sockets ("" when it can): some hosts (TPU VMs,
    sandboxes) refuse AF_INET outright, and a network namespace whose loopback is down
    binds 127.0.0.1 but cannot connect to it. Probed once: bind, listen, connect."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
            server.bind(("127.0.0.1", 0))
            server.listen(1)
            with socket.create_connection(server.getsockname(), timeout=5):
                pass
    except OSError as e:
        name = errno.errorcode.get(e.errno or 0, "timeout" if isinstance(e, TimeoutError) else str(e.errno))
        return f"this host has no usable inet sockets ({name}: {e.strerror or e})"
    return ""


def unix_among(**addresses: str) -> str:
    """Why settings whose data plane needs inet sockets (tcp, relay) contradict themselves:
    the first of `addresses` (field name -> address or host) that is a unix socket; "" when
    none is. The same on every host (what the host offers is `inet_refused`)."""
    for name, address in addresses.items():
        if address and is_unix(address):
            return f"--{name.replace('_', '-')} is a unix socket ({address})"
    return ""


def inet_unusable(**addresses: str) -> str:
    """Why a data plane that needs inet sockets (tcp, relay) cannot run here: the first of
    `addresses` that is a unix socket (`unix_among`), or the host refusing AF_INET; "" when
    neither."""
    return unix_among(**addresses) or inet_refused()


def connect(address: str, timeout_s: float) -> socket.socket:
    """A connected stream socket to `host:port` or `unix:/path`, connecting within `timeout_s`."""
    if not is_unix(address):
        host, port = split_host_port(address)
        return socket.create_connection((host, int(port)), timeout=timeout_s)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout_s)
        sock.connect(unix_path(address))
    except BaseException:
        sock.close()
        raise
    return sock


def listening_socket(host: str, port: int, backlog: int = 128) -> socket.socket:
    """A TCP listener on host:port, IPv6 literals included; `::` also takes IPv4 where the
    system allows both on one socket (as `0.0.0.0` takes every IPv4 address)."""
    host = bare_host(host)
    if ":" not in host:
        return socket.create_server((host, port), backlog=backlog)
    dual = host == "::" and socket.has_dualstack_ipv6()
    return socket.create_server((host, port), family=socket.AF_INET6, backlog=backlog, dualstack_ipv6=dual)
