"""The `weightsync-no-inet` vLLM plugin (rollout_agent/vllm_worker/no_inet.py): it decides by
whether an AF_INET socket can be made (EAFNOSUPPORT, errno 97, on a TPU VM under gVisor),
changes nothing where it can, and where it cannot hands out ports without binding and
makes torch.distributed's gloo groups of one rank with the `fake` backend."""

from __future__ import annotations

import errno
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest

from rollout_agent.vllm_worker import no_inet


def _refusing(family: int, kind: int) -> Any:
    raise OSError(errno.EAFNOSUPPORT, "Address family not supported by protocol")


def _other_error(family: int, kind: int) -> Any:
    raise OSError(errno.EMFILE, "Too many open files")


class _Socket:
    closed = False

    def close(self) -> None:
        self.closed = True


def test_inet_is_refused_only_on_eafnosupport() -> None:
    assert no_inet.inet_refused(_refusing)
    assert not no_inet.inet_refused(_other_error)  # a full fd table is no proof of a host without inet
    made = _Socket()
    assert not no_inet.inet_refused(lambda family, kind: made) and made.closed


def test_where_inet_is_allowed_nothing_changes() -> None:
    assert not no_inet.install(refused=False)
    assert not no_inet.installed()


@pytest.fixture
def refused() -> Iterator[None]:
    pytest.importorskip("vllm.utils.network_utils", reason="vLLM is not installed")
    try:
        assert no_inet.install(refused=True)
        yield
    finally:
        no_inet.uninstall()


def test_ports_are_handed_out_without_binding(refused: None) -> None:
    from vllm.utils import network_utils

    first = network_utils.get_open_port()
    assert first == no_inet.PORT_BASE
    assert network_utils.get_open_port() == first + 1  # distinct: a list of ports fills
    assert len(set(network_utils.get_open_ports_list(3))) == 3
    assert no_inet.install(refused=True) and no_inet.installed()  # again: idempotent


def test_gloo_groups_of_one_rank_are_fake(refused: None) -> None:
    import torch
    import torch.distributed as dist

    with tempfile.NamedTemporaryFile() as f:
        dist.init_process_group(backend="gloo", init_method=f"file://{f.name}", world_size=1, rank=0)
        try:
            assert dist.get_backend() == "fake"
            group = dist.new_group([0], backend="gloo")
            assert dist.get_backend(group) == "fake"
            t = torch.ones(3)
            dist.all_reduce(t, group=group)  # one rank: the identity
            assert t.tolist() == [1.0, 1.0, 1.0]
        finally:
            dist.destroy_process_group()


def test_uninstall_puts_everything_back() -> None:
    pytest.importorskip("vllm.utils.network_utils", reason="vLLM is not installed")
    import torch.distributed as dist
    from vllm.utils import network_utils

    before = (network_utils._get_open_port, dist.init_process_group, dist.new_group)
    no_inet.install(refused=True)
    assert network_utils._get_open_port is not before[0]
    no_inet.uninstall()
    assert (network_utils._get_open_port, dist.init_process_group, dist.new_group) == before
