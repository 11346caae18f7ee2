"""Lazy package exports (PEP 562): a package lists its public names and the modules that
define them, and each module is imported on first use, so `python -m package --help`
does not pay for (or need) what it does not use. A module that needs an optional part
(vLLM, which a JAX-only rollout host lacks) names it: its exports are public where that
part is installed, and elsewhere resolve to an ImportError naming the extra to install."""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Extra:
    """An optional part a module needs: the top-level module it imports, and the extra of
    the weightsync distribution that installs it."""

    module: str
    extra: str


def available(exports: Mapping[str, str], needs: Mapping[str, Extra] | None = None) -> list[str]:
    """The names of `exports` (name -> module) this interpreter can import, sorted: a
    module's names only where what it `needs` (module -> Extra) is installed (found, not
    imported)."""
    needs = needs or {}
    return sorted(
        name
        for name, module in exports.items()
        if module not in needs or importlib.util.find_spec(needs[module].module) is not None
    )


def lazy_exports(
    package: str, exports: Mapping[str, str], needs: Mapping[str, Extra] | None = None
) -> Callable[[str], Any]:
    """A module-level `__getattr__` for `package` resolving `exports` (name -> module); a
    name whose module's optional part (`needs`, module -> Extra) is missing raises an
    ImportError naming the extra."""
    needs = needs or {}

    def __getattr__(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module = exports[name]
        try:
            return getattr(importlib.import_module(module), name)
        except ModuleNotFoundError as e:
            extra = needs.get(module)
            if extra is None or (e.name or "").partition(".")[0] != extra.module:
                raise
            raise ImportError(
                f"{package}.{name} needs {extra.module}, which is not installed here:"
                f" pip install 'weightsync[{extra.extra}]'",
                name=package,
            ) from e

    return __getattr__
