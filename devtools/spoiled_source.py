"""A trainer's bug as a weight source: vLLM's `WeightSource` protocol (`metadata()` and
iteration) over another source, one tensor replaced by `spoil(tensor)`. The refusal tests
(`tests/e2e/test_vllm_trainer.py`) and the defect rounds of `bench/vllm_defects.py` send it."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any


class Spoiled:
    """`inner` (a `ModuleSource`, or any source) with tensor `name` as `spoil(tensor)`."""

    def __init__(self, inner: Any, name: str, spoil: Callable[[Any], Any]) -> None:
        self.inner, self.name, self.spoil = inner, name, spoil

    def metadata(self) -> list[Any]:
        """The inner source's, the spoiled tensor's shape and dtype as spoiled."""
        out = []
        for m in self.inner.metadata():
            if m.name == self.name:
                t = self.spoil(dict(self.inner)[m.name])
                m = dataclasses.replace(m, shape=tuple(t.shape), dtype=t.dtype)
            out.append(m)
        return out

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        return ((n, self.spoil(t) if n == self.name else t) for n, t in self.inner)
