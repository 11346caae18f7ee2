"""Refused versions in vLLM's trainer flow (`bench/vllm_trainer.py --end-to-end`): each
defect a trainer's bug makes, sent through `/pause`, `send_weights()`, `/resume` to a real
server, must be refused with the served weights unchanged, and the next good version must
apply.

A defect replaces one tensor of the module's version: a row short of a fused projection
(q of q/k/v), a transposed row-parallel weight, the vocabulary a row short, integers for a
float weight (the bf16 bits as int16), and a tensor swapped for another of the same size
(gate_proj's place holding down_proj's transposed shape). After each refusal the bench
reads the engine's version (`/weight_info`), audits every worker (`AuditSession`, fresh:
the weights the engine serves against the last version it was given whole) and sends the
module's good version.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

from devtools.spoiled_source import Spoiled


def defects(names: set[str]) -> list[tuple[str, Callable[[Any], Any], str]]:
    """(tensor, spoil, what) for the defect classes above, on tensors the model has."""
    import torch

    layer = "model.layers.1"
    return [
        d
        for d in (
            (f"{layer}.self_attn.q_proj.weight", lambda t: t[:-1], "q_proj a row short"),
            (f"{layer}.mlp.down_proj.weight", lambda t: t.t().contiguous(), "down_proj transposed"),
            ("model.embed_tokens.weight", lambda t: t[:-1], "the vocabulary a row short"),
            (f"{layer}.self_attn.o_proj.weight", lambda t: t.view(torch.int16), "int16 for bf16"),
            (f"{layer}.mlp.gate_proj.weight", lambda t: t.reshape(t.shape[1], t.shape[0]), "gate_proj in down's shape"),
        )
        if d[0] in names
    ]


def run_defects(engine: Any, source: Any, base: str, post: Callable[[str], None], client: Any, session: str) -> dict:
    """Each defect's round and the good round after it; what each showed (see the module
    docstring). `post(route)` posts to the server; `client` is a CoordinatorClient."""
    import requests

    def served_version() -> str:
        return str(requests.get(f"{base}/weight_info", timeout=10).json()["weight_version"])

    rows = []
    for name, spoil, what in defects({n for n, _ in source}):
        last = engine.version
        before = served_version()
        engine.source = Spoiled(source, name, spoil)
        post("pause")
        t0 = time.perf_counter()
        try:
            engine.send_weights()
            refusal = ""
        except Exception as e:  # noqa: BLE001 - the refusal is the measurement
            refusal = f"{type(e).__name__}: {e}"
        refused_s = time.perf_counter() - t0
        post("resume")
        audits = client.audit_session(session, fresh=True, wait_s=60)
        exact = bool(audits.rollouts) and all(
            r.audit.exact and r.audit.version == last and not r.audit.unserved_version for r in audits.rollouts
        )
        unchanged = served_version() == before == str(last)
        engine.source = source
        post("pause")
        try:
            engine.send_weights()
            next_applied = served_version() == str(engine.version) and engine.version > last
        except Exception:  # noqa: BLE001 - the next good version must apply; a failure is what is reported
            next_applied = False
        finally:
            post("resume")
        rows.append(
            {
                "defect": what,
                "tensor": name,
                "refused": bool(refusal) and name in refusal,
                "refusal": refusal[:300],
                "refused_s": refused_s,
                "served_unchanged": unchanged,
                "audit_exact": exact,
                "next_applied": next_applied,
            }
        )
    held = [r for r in rows if r["refused"] and r["served_unchanged"] and r["audit_exact"] and r["next_applied"]]
    return {
        "rounds": rows,
        "held": len(held),
        "of": len(rows),
        "refused_median_s": statistics.median(r["refused_s"] for r in rows) if rows else None,
    }
