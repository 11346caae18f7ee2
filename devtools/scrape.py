"""Reading a weightsync server's /metrics endpoint (Prometheus text format), for process
tests and benchmarks."""

from __future__ import annotations

import urllib.request


def scrape(metrics_port: int) -> str:
    """The /metrics page of the server whose metrics port is `metrics_port` on loopback."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as r:
        return r.read().decode()


def metric_value(text: str, name: str, **labels: str) -> float:
    """Sum of samples of `name` whose labels include `labels`."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total
