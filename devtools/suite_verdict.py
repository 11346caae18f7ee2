"""One line for a set of pytest runs, from their logs: `suite: 7 failed, 655 passed, 34
skipped` (errors count as failed), naming each log that ends without pytest's summary (a
run cut short or crashed). `devtools/tpu_checks.sh suite` and `devtools/host_lane.sh` end
with it.

    python devtools/suite_verdict.py --name suite unit.log tpu-marked.log
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Iterable
from pathlib import Path

KINDS = ("failed", "passed", "skipped")
_COUNT = re.compile(r"(\d+) (failed|passed|skipped|errors?|xfailed|xpassed|deselected|warnings?)\b")
_SUMMARY = re.compile(r"(?:\d+ \w+|no tests ran).* in \d+(?:\.\d+)?s")


def counts(log: str) -> dict[str, int] | None:
    """failed (errors included), passed and skipped of pytest's last summary line in
    `log`; None where it has none."""
    lines = [line for line in log.splitlines() if _SUMMARY.search(line)]
    if not lines:
        return None
    out = dict.fromkeys(KINDS, 0)
    for n, kind in _COUNT.findall(lines[-1]):
        kind = "failed" if kind.startswith("error") else kind
        if kind in out:
            out[kind] += int(n)
    return out


def verdict(name: str, logs: Iterable[Path]) -> tuple[str, bool]:
    """(`name: N failed, M passed, K skipped`, with `; X: no summary` for each log that has
    none, whether every run passed)."""
    total = dict.fromkeys(KINDS, 0)
    missing = []
    for path in logs:
        found = counts(path.read_text(errors="replace")) if path.exists() else None
        if found is None:
            missing.append(path.stem)
            continue
        for kind in KINDS:
            total[kind] += found[kind]
    line = f"{name}: " + ", ".join(f"{total[k]} {k}" for k in KINDS)
    line += "".join(f"; {m}: no summary (cut short or crashed)" for m in missing)
    return line, total["failed"] == 0 and not missing


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--name", default="suite")
    p.add_argument("logs", nargs="+", type=Path)
    args = p.parse_args()
    line, passed = verdict(args.name, args.logs)
    print(line)
    sys.exit(0 if passed else 1)


if __name__ == "__main__":
    main()
