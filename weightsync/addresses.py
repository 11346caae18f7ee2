"""host:port strings, IPv6 literals included ([::1]:50051, as gRPC and URLs write them)."""

from __future__ import annotations

import socket


def join_host_port(host: str, port: int | str) -> str:
    """`host:port`; an IPv6 literal goes in brackets (`::1` alone would read as a host)."""
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


def listening_socket(host: str, port: int, backlog: int = 128) -> socket.socket:
    """A TCP listener on host:port, IPv6 literals included; `::` also takes IPv4 where the
    system allows both on one socket (as `0.0.0.0` takes every IPv4 address)."""
    host = bare_host(host)
    if ":" not in host:
        return socket.create_server((host, port), backlog=backlog)
    dual = host == "::" and socket.has_dualstack_ipv6()
    return socket.create_server((host, port), family=socket.AF_INET6, backlog=backlog, dualstack_ipv6=dual)
