"""The monitoring sees the failures that matter, on real processes: a rollout whose sync
fails and a version that ends PARTIAL move the series the alerts read (rules.test.yaml
fires each alert on such series), JSON logs name session, agent and version, and every
metric the alerting rules and the dashboard query is exported by some live server."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

from devtools.cluster import Cluster
from devtools.scrape import metric_value, scrape
from tests.integration.support import state_name
from weightsync.client import CoordinatorClient

ROOT = Path(__file__).resolve().parents[2]
COMPONENTS = ROOT / "deploy" / "components"
TINY = ["--model-size", "tiny"]
HISTOGRAM_SUFFIXES = ("_bucket", "_count", "_sum")


def _queried_metrics() -> dict[str, set[str]]:
    """Metric names each of the rules and the dashboard query."""
    rules = yaml.safe_load((COMPONENTS / "prometheus-rules" / "rules.yaml").read_text())
    exprs = {"rules.yaml": [r["expr"] for g in rules["groups"] for r in g["rules"]]}
    dashboard = json.loads((COMPONENTS / "grafana" / "weightsync.json").read_text())
    exprs["weightsync.json"] = [t["expr"] for p in dashboard["panels"] for t in p["targets"]] + [
        v["definition"] for v in dashboard["templating"]["list"] if v.get("definition")
    ]
    return {where: {m for e in es for m in re.findall(r"\bweightsync_[a-z0-9_]+", e)} for where, es in exprs.items()}


def _exported(texts: list[str]) -> set[str]:
    names = set()
    for text in texts:
        names |= set(re.findall(r"^# TYPE (\S+) ", text, re.M))
        names |= set(re.findall(r"^(weightsync_[a-z0-9_]+)[{ ]", text, re.M))
    return names | {n + s for n in names for s in HISTOGRAM_SUFFIXES}


def test_a_failing_rollout_and_a_partial_version_move_the_metrics_alerts_read(cluster: Cluster) -> None:
    json_logs = ["--log-format", "json"]
    coord = cluster.start_coordinator(args=json_logs)
    good = cluster.start_rollout("good", coord.address, "job", json_logs)
    bad = cluster.start_rollout("bad", coord.address, "job", [*json_logs, "--failpoints", "puller.corrupt_assembled=2"])
    trainer = cluster.start_trainer(
        "trainer",
        coord.address,
        "job",
        [*TINY, *json_logs, "--steps", "1", "--min-rollouts", "2", "--wait-commit", "false", "--hold"],
    )
    with CoordinatorClient(coord.address) as client:
        assert state_name(client.wait_for_version("job", 1, timeout_s=120)) == "PARTIAL"

    c = scrape(coord.ready["metrics_port"])
    for state, n in (("STAGING", 1), ("READY", 1), ("PARTIAL", 1), ("COMMITTED", 0)):
        assert metric_value(c, "weightsync_version_transitions_total", session="job", state=state) == n, state
    assert metric_value(c, "weightsync_handshakes_total", session="job", outcome="ok") == 1
    # the bad rollout's apply failed and it said so: a local failure, not a coordinator digest mismatch
    assert metric_value(c, "weightsync_handshakes_total", session="job", outcome="local_error") == 1
    assert metric_value(c, "weightsync_digest_failures_total", role="coordinator") == 0
    assert metric_value(c, "weightsync_ready_to_commit_seconds_count", session="job") == 1
    # the OK handshake carried the engine's pause and READY -> serving
    assert metric_value(c, "weightsync_pause_seconds_count", session="job") == 1
    assert metric_value(c, "weightsync_ready_to_serving_seconds_count", session="job") == 1
    assert 0 < metric_value(c, "weightsync_ready_to_serving_seconds_sum", session="job") < 60
    assert metric_value(c, "weightsync_session_version", session="job", kind="published") == 1
    assert metric_value(c, "weightsync_session_version", session="job", kind="committed") == 0
    assert metric_value(c, "weightsync_agents", session="job", role="rollout", state="alive") == 2
    assert metric_value(c, "weightsync_agents", session="job", role="trainer", state="alive") == 1

    b = scrape(bad.ready["metrics_port"])
    assert metric_value(b, "weightsync_sync_failures_total", session="job", reason="data_loss") == 1
    # the chunk under the first flip (re-fetched), then the tensor that failed again
    assert metric_value(b, "weightsync_digest_failures_total", role="rollout", session="job") == 2
    assert 'weightsync_current_version{role="rollout",session="job"} 0.0' in b  # present, so min() sees it
    g = scrape(good.ready["metrics_port"])
    assert metric_value(g, "weightsync_current_version", role="rollout", session="job") == 1
    assert metric_value(g, "weightsync_sync_failures_total") == 0
    t = scrape(trainer.ready["metrics_port"])
    assert metric_value(t, "weightsync_current_version", role="trainer", session="job") == 1
    assert 'weightsync_fenced{session="job"} 0.0' in t

    lines = [json.loads(line) for line in bad.log().splitlines() if line.startswith("{")]
    failed = [x for x in lines if x["level"] == "ERROR" and x.get("version") == 1]
    assert failed and all(x["session"] == "job" and x["agent_id"] == "bad" for x in failed), lines[-5:]
    assert any(line.startswith("{") and '"logger": "coordinator"' in line for line in coord.log().splitlines())

    exported = _exported([c, b, g, t])
    for where, names in _queried_metrics().items():
        assert names, where
        assert names <= exported, f"{where} queries metrics no server exports: {sorted(names - exported)}"
