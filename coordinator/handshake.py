"""Handshake comparison: what a rollout applied versus the source manifest."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from weightsync.digests import hex64
from weightsync.manifest import Aggregates, Manifest
from weightsync.validation import values_close


@dataclass(frozen=True)
class AppliedReport:
    """A rollout's account of one version (ReportApplied, as a dataclass)."""

    manifest_digest: str
    tensor_digests: dict[str, tuple[int, float]]  # name -> (xxh3, float64 sum)
    aggregates: Aggregates
    consumed_names: tuple[str, ...]
    timings: dict[str, float] = field(default_factory=dict)
    bytes_pulled: int = 0
    local_error: str = ""
    prepared: bool = False  # ATOMIC: held ready, not applied (no engine consumed names)
    flipped_at: float = 0.0  # the rollout's clock when the weights took effect (0: not said)

    def stored(self) -> dict[str, Any]:
        """What the store keeps of a report once compared: the verdict has columns of its
        own, and the per-tensor digests (300+ for a real model, x1,000 rollouts x every
        retained version) are never read back; status shows timings and bytes."""
        return {"timings": self.timings, "bytes_pulled": self.bytes_pulled, "local_error": self.local_error}


def compare_report(manifest: Manifest, manifest_digest: str, report: AppliedReport) -> str | None:
    """The first difference between a report and the source, or None when they agree.

    Order: local error, manifest digest, consumed names (missing, then unknown; not for a
    PREPARED report, which no engine consumed yet), per-tensor digests and sums in manifest
    order, then aggregates.
    """
    if report.local_error:
        return f"rollout reported a local failure: {report.local_error}"
    if report.manifest_digest != manifest_digest:
        return f"manifest digest {report.manifest_digest[:16]}… differs from the source {manifest_digest[:16]}…"
    tensors = manifest.tensors
    if not report.prepared:
        consumed = set(report.consumed_names)
        for name in tensors:
            if name not in consumed:
                return f"tensor {name!r} was not consumed by the engine"
        for name in report.consumed_names:
            if name not in tensors:
                return f"the engine consumed {name!r}, which is not in the manifest"
    for name, (digest, total, elements) in manifest.tensor_checks().items():
        got = report.tensor_digests.get(name)
        if got is None:
            return f"tensor {name!r}: no digest reported"
        if got[0] != digest:
            return f"tensor {name!r}: xxh3 {hex64(got[0])} != source {hex64(digest)}"
        if got[1] != total and not values_close(got[1], total, elements):  # equal: the common case
            return f"tensor {name!r}: sum {got[1]!r} != source {total!r}"
    for name in report.tensor_digests:
        if name not in tensors:
            return f"digest reported for {name!r}, which is not in the manifest"
    src = manifest.aggregates()
    got_agg = report.aggregates
    if got_agg.tensor_count != src.tensor_count:
        return f"tensor_count {got_agg.tensor_count} != source {src.tensor_count}"
    if got_agg.element_count != src.element_count:
        return f"element_count {got_agg.element_count} != source {src.element_count}"
    if not values_close(got_agg.grand_total, src.grand_total, src.element_count):
        return f"grand_total {got_agg.grand_total!r} != source {src.grand_total!r}"
    return None
