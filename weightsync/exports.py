"""Lazy package exports (PEP 562): a package lists its public names and the modules that
define them, and each module is imported on first use, so `python -m package --help`
does not pay for (or need) what it does not use."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(package: str, exports: Mapping[str, str]) -> Callable[[str], Any]:
    """A module-level `__getattr__` for `package` resolving `exports` (name -> module)."""

    def __getattr__(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(exports[name]), name)

    return __getattr__
