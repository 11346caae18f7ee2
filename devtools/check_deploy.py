"""`make check-deploy`: renders every kustomize root under deploy/ and checks the output.

kubectl kustomize (every overlay and the examples) -> kubernetes-validate --strict (the
Prometheus Operator's kinds have no bundled schema: they are listed, not validated) ->
checkov with deploy/checkov.yaml -> promtool check rules and promtool test rules. The
metrics the rules and dashboard query are checked against live servers by tests/deploy.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
ROOTS = ("overlays/plain", "overlays/prometheus-operator", "overlays/tls", "examples/base", "examples/tls")
RULES = DEPLOY / "components" / "prometheus-rules"
# Custom resources kubernetes-validate has no schema for (the rules inside are promtool's).
UNVALIDATED_KINDS = ("PodMonitor", "PrometheusRule", "ServiceMonitor")


def _tool(name: str, tools: Path | None) -> str:
    path = shutil.which(name, path=str(tools)) if tools else None
    path = path or shutil.which(name)
    if path is None:
        raise SystemExit(
            f"check-deploy: {name} not found (make check-deploy installs checkov, "
            "kubernetes-validate and promtool; kubectl >= 1.27 must be on PATH)"
        )
    return path


def _run(cmd: list[str], **kw: object) -> subprocess.CompletedProcess[str]:
    print("+", " ".join(str(c) for c in cmd), flush=True)
    return subprocess.run(cmd, text=True, check=True, **kw)  # type: ignore[call-overload]


def render(kubectl: str, out: Path) -> list[Path]:
    """Each kustomize root rendered to out/<name>.yaml."""
    files = []
    for root in ROOTS:
        target = out / (root.replace("/", "-") + ".yaml")
        target.write_text(_run([kubectl, "kustomize", str(DEPLOY / root)], capture_output=True).stdout)
        files.append(target)
    return files


def validate(validator: str, files: list[Path]) -> None:
    proc = subprocess.run([validator, "--strict", "--quiet", *map(str, files)], text=True, capture_output=True)
    warnings = [line for line in proc.stdout.splitlines() + proc.stderr.splitlines() if line.strip()]
    unexpected = [w for w in warnings if not any(f"kind {k} " in w for k in UNVALIDATED_KINDS)]
    for line in warnings:
        print(line)
    if proc.returncode != 0 or unexpected:
        raise SystemExit(f"kubernetes-validate failed ({proc.returncode}): {unexpected or 'see above'}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tools", type=Path, help="directory holding checkov and kubernetes-validate")
    args = parser.parse_args(argv)
    kubectl = _tool("kubectl", None)
    with tempfile.TemporaryDirectory(prefix="weightsync-deploy-") as tmp:
        files = render(kubectl, Path(tmp))
        validate(_tool("kubernetes-validate", args.tools), files)
        _run([_tool("checkov", args.tools), "--config-file", str(DEPLOY / "checkov.yaml"), "-d", tmp])
    promtool = _tool("promtool", None)
    _run([promtool, "check", "rules", "rules.yaml"], cwd=RULES)
    _run([promtool, "test", "rules", "rules.test.yaml"], cwd=RULES)
    print("check-deploy: every overlay renders, validates and passes checkov; rules check and test")
    return 0


if __name__ == "__main__":
    sys.exit(main())
