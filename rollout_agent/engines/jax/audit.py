"""The audit of a JAX engine's live leaves, on their devices.

Every leaf the last whole version wrote is fingerprinted where its shards live, as the
apply's device check does, but a layer at a time: one jitted program over the mesh for a
layer's leaves (`engines.jax.fingerprint.mesh_fingerprints`; alike layers share its
compiled code), NumPy over a CPU device's memory; replicas compared, and the sums
compared with the leaf's fingerprint from the verified host bytes that the apply kept
(`JaxApply.verified`). Only the sums leave the devices: a few integers per device and
leaf.
"""

from __future__ import annotations

import ctypes
from typing import Any

import jax
import numpy as np

from rollout_agent.engines.audit_reading import AuditReading, Expected, compare, damage
from rollout_agent.engines.fingerprint import Fingerprint
from rollout_agent.engines.jax.apply import JaxApply, _layer
from rollout_agent.engines.jax.fingerprint import ShardCheck, device_fingerprint, mesh_fingerprints, on_one_mesh


class JaxAudit(JaxApply):
    """`audit()` and the fault tests' `inject()` for `JaxApply` (mixed into `JaxApplier`)."""

    def audit(self, *, engine_held: bool = False) -> AuditReading:
        """The leaves as they are now against the version last applied whole. Reading
        them beside the engine is safe (JAX arrays are immutable; XLA runs programs from
        any thread): `engine_held` changes nothing."""
        if self.verified is None:
            return AuditReading(0, 0, method="device")
        version, fps, names = self.verified
        leaves = self.target.leaves()
        live: dict[str, Fingerprint | str] = {}
        checks: dict[str, ShardCheck] = {}
        methods: set[str] = set()
        layers: dict[str, list[tuple[str, jax.Array]]] = {}  # leaves on a mesh, by layer
        for path in fps:  # every program dispatched before the first result is read
            leaf = leaves.get(path)
            if not isinstance(leaf, jax.Array) or leaf.is_deleted():
                live[path] = "the leaf is gone from the engine"
                continue
            method = self._fingerprint_method(leaf)
            methods.add(method)
            if method == "jit" and on_one_mesh(leaf.sharding):
                layers.setdefault(_layer(path), []).append((path, leaf))  # a program a layer, below
            else:
                checks[path] = device_fingerprint(path, leaf, method, self._pool_())
        checks |= mesh_fingerprints(list(layers.values()))
        for path, check in checks.items():
            got, problem = check.result()
            live[path] = problem or got
        expected = {path: Expected(fp, names[path]) for path, fp in fps.items()}
        return compare(version, expected, live, method="+".join(sorted(methods)) or "device")

    def inject(self, kind: str) -> str:
        """Testing only: damages the live leaf holding the first (flip: one bit of one
        device's shard) or last (overwrite: every shard) tensor in name order, through the
        engine's own buffers on CPU devices, else as a leaf rebuilt on the devices and put
        in its place; returns the tensor's name."""
        assert self.verified is not None, "nothing applied to damage"
        _, _, names = self.verified
        tensor = (
            min(n for ns in names.values() for n in ns)
            if kind == "flip"
            else max(n for ns in names.values() for n in ns)
        )
        path = next(p for p, ns in names.items() if tensor in ns)
        leaf = self.target.leaves()[path]
        if all(d.platform == "cpu" for d in leaf.sharding.device_set):
            shards = leaf.addressable_shards[:1] if kind == "flip" else leaf.addressable_shards
            for shard in shards:
                damage(host_buffer(shard.data), kind)
        else:
            self.target.replace({path: damaged_on_device(leaf, kind)})
        return tensor


def host_buffer(arr: Any) -> np.ndarray:
    """A writable uint8 view of a CPU device array's own buffer (its memory is host memory)."""
    nbytes = arr.size * arr.dtype.itemsize
    return np.frombuffer((ctypes.c_uint8 * nbytes).from_address(arr.unsafe_buffer_pointer()), np.uint8)


def damaged_on_device(leaf: Any, kind: str) -> Any:
    """`leaf` with one bit of its middle element flipped ("flip") or every byte set
    ("overwrite"), built on its devices in its sharding (nothing comes to the host)."""
    import jax.numpy as jnp
    from jax import lax

    uint = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[leaf.dtype.itemsize]

    def f(x: Any) -> Any:
        b = lax.bitcast_convert_type(x, uint)
        if kind == "flip":
            flat = b.reshape(-1)
            b = flat.at[flat.size // 2].set(flat[flat.size // 2] ^ uint(0x10)).reshape(b.shape)
        else:
            b = jnp.full_like(b, int.from_bytes(b"\x3c" * leaf.dtype.itemsize, "little"))
        return lax.bitcast_convert_type(b, x.dtype)

    return jax.jit(f, out_shardings=leaf.sharding)(leaf)
