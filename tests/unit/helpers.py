"""Builders for manifests and parts used across unit tests (no sockets), a database damager,
and command prefixes that run a process under a TPU host's conditions (no usable inet
socket, an ordinary user)."""

from __future__ import annotations

import functools
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from trainer_agent.stage.staging import HostShard, plan_layout, stage_shards
from weightsync.addresses import inet_refused
from weightsync.manifest import Endpoint, Part

CHUNK = 4096


class Clock:
    """A clock the test moves: `clock.t += seconds` (a store's or a sweep's `clock`)."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def make_part(
    arrays: dict[str, np.ndarray] | Sequence[HostShard],
    *,
    rank: int = 0,
    chunk_bytes: int = CHUNK,
    address: str = "127.0.0.1:1",
) -> tuple[Part, np.ndarray]:
    """Stages arrays (whole tensors) or HostShards into a buffer; returns (part, bytes)."""
    shards = (
        [HostShard(n, a, a.shape, (0,) * a.ndim) for n, a in arrays.items()]
        if isinstance(arrays, dict)
        else list(arrays)
    )
    layout = plan_layout(shards)
    buf = np.zeros(max(layout.total_bytes, 1), np.uint8)
    specs, chunks = stage_shards(buf, shards, layout, chunk_bytes)
    part = Part(rank, layout.total_bytes, chunk_bytes, layout.tensors, tuple(specs), tuple(chunks), Endpoint(address))
    return part, buf[: layout.total_bytes]


def row_shards(arrays: dict[str, np.ndarray], rank: int, world: int) -> list[HostShard]:
    """Rank's rows [r*n/W, (r+1)*n/W) of every array."""
    out = []
    for name, a in arrays.items():
        n = a.shape[0]
        lo, hi = rank * n // world, (rank + 1) * n // world
        out.append(HostShard(name, a[lo:hi], a.shape, (lo,) + (0,) * (a.ndim - 1)))
    return out


def sample_arrays(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "model.embed_tokens.weight": rng.standard_normal((64, 16)).astype(np.float32),
        "model.layers.0.self_attn.q_proj.weight": rng.standard_normal((32, 16)).astype(np.float16),
        "model.norm.weight": rng.standard_normal((16,)).astype(np.float32),
    }


def damage(db_path: Path) -> None:
    """Overwrites every page but the header's with noise, as a torn write or a bad disk
    would (after moving what the WAL holds into the file)."""
    other = sqlite3.connect(db_path)
    other.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    other.close()
    size = db_path.stat().st_size
    with open(db_path, "r+b") as f:
        for page in range(1, size // 4096):
            f.seek(page * 4096)
            f.write(os.urandom(4096))


def python_path(*first: Path | str) -> str:
    """A child interpreter's PYTHONPATH: `first`, then this process's own. A TPU host's kit
    (devtools/tpu_kit.sh) puts the dependencies, the host's JAX stack among them, on
    PYTHONPATH rather than in a venv: a child given a PYTHONPATH of its own imports none."""
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return os.pathsep.join([*map(str, first), *inherited])


def unshare_missing() -> str:
    """Why a network namespace cannot be made here ("" where `unshare -n` runs)."""
    if shutil.which("unshare") is None:
        return "no unshare(1)"
    probe = subprocess.run(["unshare", "-n", "true"], capture_output=True, text=True)
    return (
        f"unshare -n fails ({probe.stderr.strip() or probe.returncode}): needs CAP_SYS_ADMIN"
        if probe.returncode
        else ""
    )


def without_inet() -> list[str]:
    """A command prefix that runs a process where no inet socket is usable: none on a host
    that has none (a TPU VM), else `unshare -n` (a network namespace whose loopback is
    down); skips the calling test, naming why, where neither is at hand."""
    if inet_refused():
        return []
    if why := unshare_missing():
        pytest.skip(f"needs a process without inet sockets: {why}")
    return ["unshare", "-n"]


NOBODY = 65534


def as_ordinary_user() -> list[str]:
    """A command prefix that runs a process as an ordinary user, as a TPU host runs every
    command: none where this process is one, else `setpriv` to nobody (uid and gid 65534,
    no groups); skips the calling test, naming why, where neither is at hand. What it
    touches must be open to others (a directory made with `shared_directory`)."""
    if os.geteuid() != 0:
        return []
    if why := _nobody_missing():
        pytest.skip(f"needs an ordinary user: this process is root, and {why}")
    return _SETPRIV


_SETPRIV = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
ROOT = Path(__file__).resolve().parents[2]


@functools.cache
def _nobody_missing() -> str:
    """Why nobody cannot run this interpreter on this tree here ("" where it can)."""
    if shutil.which("setpriv") is None:
        return "setpriv(1) is missing"
    try:
        probe = subprocess.run(
            [*_SETPRIV, sys.executable, "-c", "import weightsync"], cwd=ROOT, capture_output=True, text=True, timeout=60
        )
    except OSError as e:
        return f"setpriv fails: {e}"
    lines = probe.stderr.strip().splitlines()
    return (
        f"nobody cannot run {sys.executable} on {ROOT}: {lines[-1] if lines else probe.returncode}"
        if probe.returncode
        else ""
    )


def shared_directory(parent: Path) -> Path:
    """A new directory in `parent` that every user may make files in, each user removing
    only their own (mode 1777, as /dev/shm and /tmp are); the caller removes it."""
    directory = Path(tempfile.mkdtemp(prefix="ws-test-", dir=parent))
    directory.chmod(0o1777)
    return directory
