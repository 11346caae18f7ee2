"""vLLM's start-up where the host refuses inet sockets (gVisor without a network: a TPU VM
whose `socket(AF_INET, ...)` fails with EAFNOSUPPORT, errno 97). Unix sockets work there.

Two steps of a single-worker engine's start open inet sockets, neither for anything the
worker then uses:

- `UniProcExecutor._distributed_args` asks `get_open_port()` for a port, which binds a
  socket; the port only goes into a `tcp://` init string that a TPU worker never dials.
  Here vLLM's `_get_open_port` returns ports counted up from `PORT_BASE`, never bound.
- tpu-inference's `TPUWorker.init_device` sets up torch.distributed at world size 1 with
  the `gloo` backend, and vLLM's group coordinator adds a `gloo` CPU group; gloo binds a
  TCP address even alone ("Cannot resolve 127.0.0.1 to a (local) address"). Here a gloo
  process group of one rank is made with torch's built-in `fake` backend instead: at one
  rank every collective is the identity, which `fake` is. Groups of more ranks are left
  to gloo (and fail there as before: they need the network).

`install()` does both only where inet sockets are refused (`inet_refused`), so everywhere
else it changes nothing; loaded by the `vllm.general_plugins` entry point
`weightsync-no-inet` (rollout_agent.vllm_plugin.no_inet) in every vLLM process.
"""

from __future__ import annotations

import errno
import inspect
import itertools
import logging
import socket
from collections.abc import Callable
from typing import Any

log = logging.getLogger("vllm.plugins.weightsync")

PORT_BASE = 29_500  # the first port handed out (never bound): torch.distributed's usual one
_ORIGINALS: dict[tuple[Any, str], Any] = {}  # (owner, name) -> what install() replaced


def inet_refused(make_socket: Callable[[int, int], Any] = socket.socket) -> bool:
    """Whether this host refuses inet sockets: creating an AF_INET one fails with
    EAFNOSUPPORT. Any other outcome (a socket, another error) counts as allowed."""
    try:
        s = make_socket(socket.AF_INET, socket.SOCK_STREAM)
    except OSError as e:
        return e.errno == errno.EAFNOSUPPORT
    s.close()
    return False


def installed() -> bool:
    """Whether install() replaced vLLM's port picker and torch's group makers here."""
    return bool(_ORIGINALS)


def install(refused: bool | None = None) -> bool:
    """Applies both work-arounds where inet sockets are refused (`refused`, default: the
    probe `inet_refused`); True when it applied them. Idempotent."""
    if refused is None:
        refused = inet_refused()
    if not refused:
        return False
    if installed():
        return True
    import torch.distributed as dist
    from vllm.utils import network_utils

    ports = itertools.count(PORT_BASE)

    def _get_open_port(start_port: int | None = None, max_attempts: int | None = None) -> int:
        """A port for a `tcp://` string nothing dials (no inet socket to bind)."""
        return start_port if start_port is not None else next(ports)

    init_process_group, new_group = dist.init_process_group, dist.new_group

    init_signature, group_signature = inspect.signature(init_process_group), inspect.signature(new_group)

    def _init_process_group(*args: Any, **kwargs: Any) -> Any:
        bound = init_signature.bind(*args, **kwargs)
        if _is_gloo(bound.arguments.get("backend")) and bound.arguments.get("world_size") == 1:
            bound.arguments["backend"] = "fake"
        return init_process_group(*bound.args, **bound.kwargs)

    def _new_group(*args: Any, **kwargs: Any) -> Any:
        bound = group_signature.bind(*args, **kwargs)
        ranks = bound.arguments.get("ranks")
        one = len(ranks) == 1 if ranks is not None else dist.get_world_size() == 1
        if one and _is_gloo(bound.arguments.get("backend")):
            bound.arguments["backend"] = "fake"
        return new_group(*bound.args, **bound.kwargs)

    _replace(network_utils, "_get_open_port", _get_open_port)
    _replace(dist, "init_process_group", _init_process_group)
    _replace(dist, "new_group", _new_group)
    log.info("weightsync: inet sockets are refused here: vLLM's ports are not bound, gloo groups of one rank are fake")
    return True


def uninstall() -> None:
    """Puts back what install() replaced (tests)."""
    for (owner, name), original in _ORIGINALS.items():
        setattr(owner, name, original)
    _ORIGINALS.clear()


def _replace(owner: Any, name: str, new: Any) -> None:
    _ORIGINALS[(owner, name)] = getattr(owner, name)
    setattr(owner, name, new)


def _is_gloo(backend: Any) -> bool:
    return backend is not None and str(backend).lower() == "gloo"
