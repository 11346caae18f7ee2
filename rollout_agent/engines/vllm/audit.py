"""The audit of a vLLM model's loaded weights: this worker's tensor-parallel shard of each
checkpoint tensor, where vLLM keeps it.

Each checkpoint tensor maps to regions of live tensors (`VllmLayout`), by vLLM's own
loader rules: q/k/v rows of `qkv_proj` (this rank's heads; a KV head repeated over ranks
where there are fewer than ranks), gate/up rows of `gate_up_proj`, a column-parallel
layer's rows, a row-parallel layer's columns, an embedding's (or LM head's) vocabulary
rows, and replicated parameters (norms) whole. A region is read two ways:

- a parameter vLLM keeps in checkpoint layout (every parameter on GPU builds; on CPU the
  embeddings and norms): its bytes, where they are;
- a layer whose weights vLLM-CPU repacked into its GEMM kernel's own layout (oneDNN or
  sgl-kernel: `.weight` left empty, the bytes held by the kernel, not readable): through
  the kernel itself, `cpu_linear(I)` = W^T, an identity block at a time. The kernel is
  what serves, so this reads exactly what the engine computes with. Exact for finite
  weights but for two kinds of bits the GEMM does not carry: the sign of a zero (-0 + 0
  is +0) and subnormals (a CPU that flushes them reads 0); both sides of the comparison
  are made canonical (+0 for |w| below the smallest normal), so a fault that only
  changes a zero's sign or a subnormal's value is not seen there. A tensor holding NaN
  or infinity cannot be read through a GEMM at all (0 * inf is NaN everywhere it goes):
  it is not audited (`AuditReading.unaudited`, named with why).

A probe costs K^2 * N multiply-adds per layer (K inputs, N outputs): trivial for tiny
models, seconds for billion-parameter ones on CPU (the auditor's 1% bound stretches the
period to match). Not mapped, so not audited and named: quantized layers (their packed
form is not the checkpoint's bytes) and parameters sharded by layouts not listed above
(fused MoE experts).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from rollout_agent.engines.audit_reading import AuditReading, Expected, compare, damage, fingerprint
from rollout_agent.engines.fingerprint import MASK, Fingerprint, add, canonical_fingerprint, shifted
from rollout_agent.engines.vllm.tensors import to_torch

PROBE_ROWS = 1024  # identity rows per kernel probe: bounds the probe's memory at PROBE_ROWS x N
_ALL = slice(None)
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def _exponent_mask(dtype: Any) -> int:
    """The exponent bits of a torch float dtype the native shim reads canonically (0: another dtype)."""
    import torch

    return {torch.bfloat16: 0x7F80, torch.float16: 0x7C00, torch.float32: 0x7F800000}.get(dtype, 0)


@dataclass(frozen=True)
class Region:
    """Where one checkpoint tensor's slice lives in one live tensor."""

    key: str  # the audit entry: "<live tensor>[<checkpoint tensor>]", or the tensor's name alone
    tensor: str  # checkpoint name
    live: str  # a parameter's name, or (kernel) a module's
    kernel: bool  # read through the module's GEMM
    live_box: tuple[slice, ...]  # in the live parameter (kernel: in its (N, K) weight)
    source_box: tuple[slice, ...]  # in the checkpoint tensor
    dtype: Any  # the live tensor's torch dtype


def _rows(start: int, size: int) -> tuple[slice, ...]:
    return (slice(start, start + size),)


def _parts(module: Any, attr: str, names: list[str]) -> list[tuple[str, tuple[slice, ...], tuple[slice, ...]]] | str:
    """(checkpoint name, live box, source box) of each tensor loading into `module.attr`,
    by vLLM's loaders; a str says why the layout is not mapped."""
    from vllm.model_executor.layers.linear import (
        ColumnParallelLinear,
        MergedColumnParallelLinear,
        QKVParallelLinear,
        ReplicatedLinear,
        RowParallelLinear,
    )
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    quant = type(getattr(module, "quant_method", None)).__name__
    if quant not in ("NoneType", "UnquantizedLinearMethod", "UnquantizedEmbeddingMethod"):
        return f"quantized ({quant}): its packed form is not the checkpoint's bytes"
    if isinstance(module, QKVParallelLinear):
        if attr not in ("weight", "bias"):
            return f"{type(module).__name__}.{attr} is not mapped"
        hs, vhs = module.head_size, module.v_head_size
        kv_rank = module.tp_rank // module.num_kv_head_replicas
        q, k = module.num_heads * hs, module.num_kv_heads * hs
        v = module.num_kv_heads * vhs
        return [
            (names[0], _rows(0, q), _rows(module.tp_rank * q, q)),
            (names[1], _rows(q, k), _rows(kv_rank * k, k)),
            (names[2], _rows(q + k, v), _rows(kv_rank * v, v)),
        ]
    if isinstance(module, MergedColumnParallelLinear):
        if attr not in ("weight", "bias"):
            return f"{type(module).__name__}.{attr} is not mapped"
        out, at = [], 0
        for name, size in zip(names, module.output_sizes):
            local = size // module.tp_size
            out.append((name, _rows(at, local), _rows(module.tp_rank * local, local)))
            at += local
        return out
    (name,) = names
    if isinstance(module, RowParallelLinear):
        if attr == "bias":
            return [(name, (_ALL,), (_ALL,))]
        k = module.input_size_per_partition
        return [(name, (_ALL, _ALL), (_ALL, slice(module.tp_rank * k, (module.tp_rank + 1) * k)))]
    if isinstance(module, ColumnParallelLinear):
        n = module.output_size_per_partition
        return [(name, _rows(0, n), _rows(module.tp_rank * n, n))]
    if isinstance(module, VocabParallelEmbedding):
        s = module.shard_indices
        return [(name, _rows(0, s.num_org_elements), _rows(s.org_vocab_start_index, s.num_org_elements))]
    if isinstance(module, ReplicatedLinear):
        return [(name, (_ALL,), (_ALL,))]
    param = getattr(module, attr)
    if hasattr(param, "output_dim") or hasattr(param, "input_dim"):
        return f"{type(module).__name__}.{attr} is sharded by a layout the audit does not map"
    return [(name, (_ALL,), (_ALL,))]


class VllmLayout:
    """Every checkpoint tensor's regions in one vLLM model (this worker's shard), read
    from its modules once (parameters are looked up by name at each read: a reload
    replaces them)."""

    def __init__(self, model: Any, tied: Iterable[tuple[str, str]] = ()) -> None:
        from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

        self.model = model
        self.regions: dict[str, list[Region]] = {}  # checkpoint name -> its regions
        self.unaudited: dict[str, str] = {}
        packed: Mapping[str, list[str]] = getattr(model, "packed_modules_mapping", {}) or {}
        aliases = dict(tied)  # alias parameter -> the parameter it is (its name loads it)
        for path, module in model.named_modules():
            last = path.rpartition(".")[2]
            for attr, param in module.named_parameters(recurse=False):
                pname = f"{path}.{attr}" if path else attr
                source = aliases.get(pname, pname)
                if last in packed:
                    prefix = path.rpartition(".")[0]
                    names = [f"{prefix}.{sub}.{attr}" if prefix else f"{sub}.{attr}" for sub in packed[last]]
                else:
                    names = [source]
                parts = _parts(module, attr, names)
                if isinstance(parts, str):
                    for name in names:
                        self.unaudited[name] = parts
                    continue
                # a kept parameter's bytes (an alias is its source's: read once); a
                # layer with a CPU GEMM kernel also through the kernel, which is what
                # serves (an input embedding looks its rows up in the parameter)
                reads = [] if pname in aliases else [(pname, False)]
                if (
                    attr == "weight"
                    and hasattr(module, "cpu_linear")
                    and (isinstance(module, ParallelLMHead) or not _is_embedding(module))
                ):
                    reads.append((path, True))
                for live, kernel in reads:
                    shown = f"{live} (kernel)" if kernel else live
                    for name, live_box, source_box in parts:
                        key = name if shown == name else f"{shown}[{name}]"
                        region = Region(key, name, live, kernel, live_box, source_box, param.dtype)
                        self.regions.setdefault(name, []).append(region)

    def expected(self, name: str, arr: np.ndarray) -> tuple[dict[str, Expected], str]:
        """The fingerprints `name`'s regions must have, from its verified bytes `arr`, cast
        as vLLM casts them into the live dtype; and why its kernel regions are not
        audited, if they are not ("": they are)."""
        import torch

        out, why = {}, ""
        own = to_torch(np.empty(0, arr.dtype)).dtype
        for r in self.regions.get(name, ()):
            source = np.ascontiguousarray(arr[r.source_box])
            # the bits as they are where vLLM keeps the dtype; else cast as its loader casts
            box = source if own == r.dtype else to_torch(source).to(r.dtype)
            bits = box.view(_UINT[box.dtype.itemsize]) if own == r.dtype else None
            if r.kernel and (mask := _exponent_mask(r.dtype)):
                fp, nonfinite = canonical_fingerprint(bits if bits is not None else _bits(box.contiguous()), mask)
            elif r.kernel and box.is_floating_point():  # another float width: torch's elementwise passes
                t = to_torch(box) if bits is not None else box
                fp, nonfinite = _fingerprint(t, True), int(not bool(torch.isfinite(t).all()))
            else:
                fp, nonfinite = fingerprint(bits if bits is not None else _bits(box.contiguous())), 0
            if nonfinite:
                why = "holds NaN or infinity, which its GEMM cannot carry back exactly"
                continue
            out[r.key] = Expected(fp, (name,))
        return out, why

    def read(self, keys: set[str]) -> dict[str, Fingerprint]:
        """The live fingerprints of the regions in `keys`: kept parameters' bytes, and
        kernels through their GEMM. A parameter vLLM emptied (its kernel holds the
        bytes) is skipped: its kernel region covers it."""
        params = dict(self.model.named_parameters())
        by_live: dict[tuple[str, bool], list[Region]] = {}
        for regions in self.regions.values():
            for r in regions:
                if r.key in keys:
                    by_live.setdefault((r.live, r.kernel), []).append(r)
        out: dict[str, Fingerprint] = {}
        for (live, kernel), regions in by_live.items():
            if kernel:
                out.update(_probe(self.model.get_submodule(live), regions))
                continue
            param = params.get(live)
            if param is None or param.numel() == 0:
                continue
            data = param.detach()
            for r in regions:
                out[r.key] = _fingerprint(data[r.live_box], False)
        return out

    def param_view(self, name: str) -> Any:
        """Testing only: a writable NumPy view of the bytes of the kept parameter holding
        checkpoint tensor `name` (its region), or None."""
        params = dict(self.model.named_parameters())
        for r in self.regions.get(name, ()):
            param = params.get(r.live)
            if not r.kernel and param is not None and param.numel():
                return _bits(param.data[r.live_box])
        return None


def _is_embedding(module: Any) -> bool:
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    return isinstance(module, VocabParallelEmbedding)


def _bits(t: Any) -> np.ndarray:
    """A NumPy view of a torch tensor's elements as unsigned integers of their width."""
    import torch

    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.view(ints).numpy().view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[t.element_size()])


def _canonical(t: Any) -> Any:
    """+0 for every |x| below the smallest normal (-0 and subnormals): what an identity
    GEMM carries back whatever its CPU's flush mode."""
    import torch

    return torch.where(t.abs() < torch.finfo(t.dtype).tiny, torch.zeros_like(t), t)


def _fingerprint(t: Any, kernel: bool) -> Fingerprint:
    """A region's fingerprint where it lives: NumPy (the native shim's one pass, canonical
    for a kernel's floats) over host memory, torch's integer sums on an accelerator (only
    the sums come back)."""
    if t.device.type == "cpu" and kernel and (mask := _exponent_mask(t.dtype)):
        return canonical_fingerprint(_bits(t.contiguous()), mask)[0]
    t = _canonical(t) if kernel else t
    if t.device.type != "cpu":
        return torch_fingerprint(t)
    return fingerprint(_bits(t.contiguous()))


def torch_fingerprint(t: Any, rows_per_step: int = 0) -> Fingerprint:
    """`audit_reading.fingerprint` of a torch tensor, computed by torch where it lives:
    the bits as int64 (8-byte elements as their two 32-bit halves on a new last axis), summed
    plain and weighted by each axis' index, `rows_per_step` leading rows at a time (0:
    about 16 Mi elements), each step's sums shifted to its rows. int64 sums wrap modulo
    2^64, a multiple of 2^32."""
    import torch

    t = t.reshape(1) if t.ndim == 0 else t  # as NumPy's, whose contiguous copy of a scalar is 1-d
    size = t.element_size()
    b = t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[size])
    mask = 0xFFFFFFFF if size == 8 else (1 << (8 * size)) - 1
    per_row = max(1, b[0].numel()) if b.shape[0] else 1
    step = rows_per_step or max(1, (16 << 20) // per_row)
    total: list[int] = [0] * (b.ndim + 1 + (size == 8))
    for r0 in range(0, b.shape[0], step):
        x = b[r0 : r0 + step].to(torch.int64)
        x = torch.stack([x & mask, (x >> 32) & mask], -1) if size == 8 else x & mask  # little-endian halves
        sums = [int(x.sum())]
        for k in range(x.ndim):
            shape = [1] * x.ndim
            shape[k] = x.shape[k]
            index = torch.arange(x.shape[k], device=x.device, dtype=torch.int64).reshape(shape)
            sums.append(int((x * index).sum()))
        sums[1] += r0 * sums[0]  # this step's rows start at r0
        total = [a + c for a, c in zip(total, sums)]
    return tuple(v & MASK for v in total)


def _probe(module: Any, regions: list[Region]) -> dict[str, Fingerprint]:
    """The regions' fingerprints of the weight `module`'s GEMM computes with: its output
    for identity rows, PROBE_ROWS inputs at a time (W^T's rows: W's columns), each block's
    fingerprint shifted to its columns and summed."""
    import torch

    k = module.input_size_per_partition if hasattr(module, "input_size_per_partition") else module.embedding_dim
    dtype = regions[0].dtype
    blocks: dict[str, list[Fingerprint]] = {r.key: [] for r in regions}
    with torch.no_grad():
        for k0 in range(0, k, PROBE_ROWS):
            kb = min(PROBE_ROWS, k - k0)
            x = torch.zeros(kb, k, dtype=dtype)
            x[torch.arange(kb), torch.arange(k0, k0 + kb)] = 1
            w = module.cpu_linear(x, module.weight, None).t()  # (N, kb): the weight's columns k0..k0+kb
            for r in regions:
                blocks[r.key].append(shifted(_fingerprint(w[r.live_box[0]], True), (0, k0)))
    return {key: add(fps) for key, fps in blocks.items()}


class VllmAudit:
    """The audit state of one `VllmApplier`: the reference taken while a version applies,
    swapped in at its commit."""

    def __init__(self, model: Any, tied: Iterable[tuple[str, str]]) -> None:
        self.layout = VllmLayout(model, tied)
        self.version = 0
        self.verified: dict[str, Expected] = {}
        self.unaudited: dict[str, str] = dict(self.layout.unaudited)
        self._taking: dict[str, Expected] = {}
        self._taking_unaudited: dict[str, str] = {}
        self._prepared: tuple[int, dict[str, tuple[dict[str, Expected], str]]] = (0, {})

    def prepare(self, version: int, tensors: Mapping[str, np.ndarray]) -> None:
        """Takes the reference from the verified bytes while the engine serves (the apply
        then only looks it up)."""
        self._prepared = (version, {name: self.layout.expected(name, arr) for name, arr in tensors.items()})

    def begin(self, version: int) -> None:
        self._taking, self._taking_unaudited = {}, dict(self.layout.unaudited)
        if self._prepared[0] != version:
            self._prepared = (0, {})

    def take(self, name: str, arr: np.ndarray) -> None:
        """`name`'s verified bytes, as they are applied."""
        prepared = self._prepared[1].get(name)
        expected, why = prepared if prepared is not None else self.layout.expected(name, arr)
        self._taking.update(expected)
        if why:
            self._taking_unaudited[name] = why
        elif name not in self.layout.regions and name not in self._taking_unaudited:
            self._taking_unaudited[name] = "not found among the model's parameters"

    def commit(self, version: int) -> None:
        self.version, self.verified, self.unaudited = version, self._taking, self._taking_unaudited
        self._prepared = (0, {})

    def audit(self, kernels: bool) -> AuditReading:
        """The kept parameters, and with `kernels` the repacked layers through their GEMM
        (only while the engine runs nothing: vLLM-CPU's kernels are not safe to call from
        two threads at once); without, the tensors only a kernel holds are unaudited."""
        regions = [r for rs in self.layout.regions.values() for r in rs if r.key in self.verified]
        live = self.layout.read({r.key for r in regions if kernels or not r.kernel})
        expected = {k: e for k, e in self.verified.items() if k in live}
        unaudited = dict(self.unaudited)
        held = {r.tensor for r in regions if r.key in live}
        for r in regions:
            if r.tensor not in held and r.tensor not in unaudited:
                unaudited[r.tensor] = (
                    "held only by its layer's CPU GEMM kernel, read through it only while the engine is held "
                    "(the sidecar's audits, or weightsync_audit on the worker's thread)"
                )
        method = "host+kernel" if any(r.kernel for r in regions if r.key in live) else "host"
        return compare(self.version, expected, live, method=method, unaudited=unaudited)

    def inject(self, kind: str) -> str:
        """Testing only: damages the kept parameter bytes of the first (flip) or last
        (overwrite) checkpoint tensor in name order that has them; returns its name."""
        names = sorted({e.tensors[0] for e in self.verified.values()})
        for name in names if kind == "flip" else reversed(names):
            view = self.layout.param_view(name)
            if view is not None:
                damage(view, kind)
                return name
        raise RuntimeError("no parameter kept in checkpoint layout to damage")
