"""deploy/ is consistent with itself: generated files are fresh, every alert has a runbook
section and a promtool test, the examples define every variable they use."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from devtools import check_deploy, prometheus_rule

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
RULES = DEPLOY / "components" / "prometheus-rules"


def _alerts() -> list[dict]:
    groups = yaml.safe_load((RULES / "rules.yaml").read_text())["groups"]
    return [r for g in groups for r in g["rules"] if "alert" in r]


def test_the_prometheus_rule_is_generated_from_the_rules_file() -> None:
    committed = (DEPLOY / "components" / "prometheus-operator" / "prometheusrule.yaml").read_text()
    assert committed == prometheus_rule.render((RULES / "rules.yaml").read_text()), "run `make deploy-rules`"
    spec = yaml.safe_load(committed)["spec"]
    assert spec == yaml.safe_load((RULES / "rules.yaml").read_text())


def test_every_alert_has_a_runbook_section_and_a_promtool_test() -> None:
    anchors = {
        re.sub(r"[^a-z0-9-]", "", line[3:].strip().lower().replace(" ", "-"))
        for line in (ROOT / "docs" / "runbooks.md").read_text().splitlines()
        if line.startswith("## ")
    }
    tests = yaml.safe_load((RULES / "rules.test.yaml").read_text())["tests"]
    tested = {case["alertname"] for t in tests for case in t.get("alert_rule_test", []) if case.get("exp_alerts")}
    for alert in _alerts():
        name = alert["alert"]
        url = alert["annotations"]["runbook_url"]
        assert url == f"docs/runbooks.md#{name.lower()}", name
        assert name.lower() in anchors, f"docs/runbooks.md has no section for {name}"
        assert name in tested, f"rules.test.yaml never fires {name}"
        assert alert["labels"]["severity"] in ("critical", "warning", "info"), name


def _env_and_refs(container: dict) -> tuple[set[str], set[str]]:
    defined = {e["name"] for e in container.get("env", [])}
    text = json.dumps([container.get("args", []), container.get("command", []), container.get("env", [])])
    return defined, set(re.findall(r"\$\(([A-Z0-9_]+)\)", text))


@pytest.mark.parametrize(
    "path",
    [
        DEPLOY / "examples" / "trainer" / "trainer.yaml",
        DEPLOY / "examples" / "rollout" / "rollout.yaml",
        DEPLOY / "base" / "coordinator.yaml",
    ],
)
def test_workloads_define_what_they_use_and_run_restricted(path: Path) -> None:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d and d.get("kind") in ("Deployment", "StatefulSet")]
    for doc in docs:
        pod = doc["spec"]["template"]["spec"]
        assert pod["automountServiceAccountToken"] is False
        assert pod["securityContext"]["runAsNonRoot"] is True
        mounts_by_volume = {v["name"] for v in pod.get("volumes", [])} | {
            t["metadata"]["name"] for t in doc["spec"].get("volumeClaimTemplates", [])
        }
        for container in pod.get("initContainers", []) + pod["containers"]:
            defined, used = _env_and_refs(container)
            assert used <= defined, f"{path.name}: {container['name']} uses undefined {sorted(used - defined)}"
            sc = container["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
            assert sc["capabilities"]["drop"] == ["ALL"]
            assert {"cpu", "memory"} <= set(container["resources"]["limits"]), container["name"]
            for mount in container.get("volumeMounts", []):
                assert mount["name"] in mounts_by_volume, f"{container['name']} mounts undefined {mount['name']}"
        for container in pod["containers"]:
            assert "livenessProbe" in container and "readinessProbe" in container, container["name"]
            shm = [m for m in container.get("volumeMounts", []) if m["mountPath"] == "/dev/shm"]
            if doc["metadata"]["name"] != "weightsync-coordinator":  # trainers and rollouts share /dev/shm
                assert shm, f"{container['name']} has no /dev/shm volume"


def test_the_image_builds_its_wheel_with_the_script_the_test_runs() -> None:
    containerfile = (DEPLOY / "Containerfile").read_text()
    assert 'RUN sh deploy/build-wheel.sh /wheels "$VARIANT"' in containerfile
    ignored = (ROOT / ".dockerignore").read_text().splitlines()
    assert "weightsync/_native/*.so" in ignored  # a local build never stands in for the image's own


def _render(root: str) -> list[dict]:
    rendered = subprocess.run(
        ["kubectl", "kustomize", str(DEPLOY / root)], capture_output=True, text=True, check=True
    ).stdout
    return [d for d in yaml.safe_load_all(rendered) if d]


def _workloads(docs: list[dict]) -> list[dict]:
    return [d for d in docs if d["kind"] in ("Deployment", "StatefulSet")]


def _volumes(pod: dict, kind: str) -> dict[str, str]:
    """volume name -> the Secret (kind "secret") or ConfigMap ("configMap") it mounts."""
    key = "secretName" if kind == "secret" else "name"
    return {v["name"]: v[kind][key] for v in pod.get("volumes", []) if kind in v}


needs_kubectl = pytest.mark.skipif(
    shutil.which("kubectl") is None, reason="kubectl renders kustomize trees (make check-deploy)"
)


@needs_kubectl
@pytest.mark.parametrize("root", ["overlays/tls", "examples/tls"])
def test_tls_trees_drop_insecure_and_mount_what_they_name(root: str) -> None:
    workloads = _workloads(_render(root))
    assert workloads
    for doc in workloads:
        pod = doc["spec"]["template"]["spec"]
        main = pod["containers"][0]
        assert "--insecure" not in main["args"], doc["metadata"]["name"]
        env = {e["name"].split("_", 2)[2]: e.get("value") for e in main["env"] if e["name"].startswith("WEIGHTSYNC_")}
        mounted = {m["mountPath"] for m in main["volumeMounts"]}
        for key in ("TLS_CERT_FILE", "TLS_KEY_FILE", "TLS_CA_FILE", "AUTH_TOKENS_FILE"):
            assert env[key].rsplit("/", 1)[0] in mounted, (doc["metadata"]["name"], key)
        if doc["metadata"]["name"] != "weightsync-coordinator":  # agents dial with their own credential
            assert env["AUTH_TOKEN_FILE"].rsplit("/", 1)[0] in mounted
        assert "grpc" not in main["readinessProbe"]  # kubelet's gRPC probe cannot speak TLS


@needs_kubectl
def test_each_agent_pod_holds_its_own_credential_and_no_role_token() -> None:
    """examples/tls: the trainer's pods mount the trainer's credential, each rollout's pod its
    own (a Deployment of one pod per rollout id, acting as the id its credential names); no
    agent pod mounts the role tokens, and their own servers check callers against the
    verifiers (a ConfigMap). Only the coordinator (overlays/tls) holds the role tokens."""
    rollouts: dict[str, str] = {}
    for doc in _workloads(_render("examples/tls")):
        name, pod = doc["metadata"]["name"], doc["spec"]["template"]["spec"]
        secrets = set(_volumes(pod, "secret").values())
        assert "weightsync-tokens" not in secrets, name
        main = pod["containers"][0]
        env = {e["name"].split("_", 2)[2]: e for e in main["env"] if e["name"].startswith("WEIGHTSYNC_")}
        mounts = {m["mountPath"]: m["name"] for m in main["volumeMounts"]}
        assert _volumes(pod, "configMap")[mounts[env["AUTH_TOKENS_FILE"]["value"].rsplit("/", 1)[0]]] == (
            "weightsync-verifiers"
        )
        credential = _volumes(pod, "secret")[mounts[env["AUTH_TOKEN_FILE"]["value"].rsplit("/", 1)[0]]]
        if doc["kind"] == "StatefulSet":
            assert name == "trainer" and secrets == {"weightsync-tls", "weightsync-trainer"}
            assert credential == "weightsync-trainer"
            continue
        assert doc["spec"]["replicas"] == 1 and doc["spec"]["strategy"]["type"] == "Recreate", name
        agent_id = doc["spec"]["template"]["metadata"]["labels"]["weightsync.io/agent-id"]
        field = env["AGENT_ID"]["valueFrom"]["fieldRef"]["fieldPath"]
        assert field == "metadata.labels['weightsync.io/agent-id']", name
        assert name == agent_id and credential == f"weightsync-{agent_id}", name
        assert secrets == {"weightsync-tls", credential}, name
        rollouts[agent_id] = credential
    assert sorted(rollouts) == ["rollout-0", "rollout-1"] and len(set(rollouts.values())) == 2
    holders = [
        d["metadata"]["name"]
        for d in _workloads(_render("overlays/tls"))
        if "weightsync-tokens" in _volumes(d["spec"]["template"]["spec"], "secret").values()
    ]
    assert holders == ["weightsync-coordinator"]


@needs_kubectl
@pytest.mark.parametrize("root", check_deploy.ROOTS)
def test_every_pod_carries_the_label_the_network_policies_admit(root: str) -> None:
    for doc in _workloads(_render(root)):
        labels = doc["spec"]["template"]["metadata"]["labels"]
        assert labels.get("app.kubernetes.io/part-of") == "weightsync", (root, doc["metadata"]["name"])
