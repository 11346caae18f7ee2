"""Transport registry: names map to "module:Class" strings, imported on first use."""

from __future__ import annotations

import importlib

from weightsync.transports.base import ChunkPayload, ChunkSource, FetchRequest, Transport

__all__ = [
    "ChunkPayload",
    "ChunkSource",
    "FetchRequest",
    "Transport",
    "available_transports",
    "create_transport",
    "register_transport",
]

_REGISTRY: dict[str, str] = {
    "grpc": "weightsync.transports.grpc:GrpcTransport",
    "memory": "weightsync.transports.memory:InMemoryTransport",
    "shm": "weightsync.transports.shm:ShmTransport",
    "fs": "weightsync.transports.fs:FsTransport",
    "tcp": "weightsync.transports.tcp:TcpTransport",
    "hostshm": "weightsync.transports.hostshm:HostShmTransport",
}


def register_transport(name: str, target: str) -> None:
    """Registers "module:Class" under name; registering a name twice is an error."""
    if name in _REGISTRY:
        raise ValueError(f"transport {name!r} is already registered as {_REGISTRY[name]}")
    if ":" not in target:
        raise ValueError(f"target {target!r} must be 'module:Class'")
    _REGISTRY[name] = target


def available_transports() -> list[str]:
    return sorted(_REGISTRY)


def create_transport(name: str, **kwargs: object) -> Transport:
    """Instantiates a registered transport; unknown names list the available ones."""
    try:
        target = _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown transport {name!r}; available: {', '.join(available_transports())}") from None
    module, _, cls = target.partition(":")
    return getattr(importlib.import_module(module), cls)(**kwargs)
