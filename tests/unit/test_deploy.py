"""deploy/ checked without Docker or a cluster: Kubernetes schemas, promtool, the dashboard,
provisioning, compose wiring, and every metric name against what the server exports."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from engine.kv.accounting import KVShape
from engine.outputs import EngineStats, PoolStats, TierStats
from server.metrics import RequestRecord, ServerMetrics

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
PROMETHEUS = DEPLOY / "prometheus"
RULE_FILES = sorted((PROMETHEUS / "rules").glob("*.yml"))
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "kvserve.json"
K8S = DEPLOY / "kubernetes"
METRIC_NAME = re.compile(r"\bkvserve_[a-z0-9_]+")
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")
COMPARISON = re.compile(r"==|!=|>=|<=|>|<")


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def k8s_documents() -> list[tuple[str, dict[str, Any]]]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        if path.name != "kustomization.yaml":
            docs += [(path.name, doc) for doc in yaml.safe_load_all(path.read_text()) if doc]
    return docs


def k8s_kind(kind: str) -> dict[str, Any]:
    (doc,) = [doc for _, doc in k8s_documents() if doc["kind"] == kind]
    return doc


def exported_names() -> set[str]:
    """Every sample name a server exports, from a real ServerMetrics render."""
    stats = EngineStats(
        device_blocks=PoolStats(8, 1, 7, 0),
        host_blocks=PoolStats(4, 0, 4, 0),
        block_size=16,
        num_running=1,
        num_waiting=0,
        num_swapped=0,
        live_tokens=5,
        payload_bytes=5 * 64,
        allocated_bytes=16 * 64,
        shared_bytes=0,
        tiers=(
            TierStats("host", 4, 1, 1024, 4096),
            TierStats("disk", 8, 1, 1536, 8192, rejected_entries_total=(("checksum", 1),)),
        ),
    )
    metrics = ServerMetrics(
        model_name="m",
        stats_fn=lambda: stats,
        cache_info={"block_size": "16"},
        kv_shape=KVShape(1, 1, 8, "float32"),
        weight_bytes=1,
        memory_fn=lambda: {"kv_cache": 1},
        planned_bytes={"copy_staging": 1},
    )
    metrics.observe_request(RequestRecord("stop", 3, 2, 0, 0.1, 0.1, 0.2, (0.1,), 1))
    body, _ = metrics.render()
    families = text_string_to_metric_families(body.decode())
    return {sample.name for family in families for sample in family.samples}


def rule_expressions() -> list[tuple[str, str]]:
    """(record or alert name, expr) of every rule."""
    out = []
    for path in RULE_FILES:
        for group in load_yaml(path)["groups"]:
            for rule in group["rules"]:
                out.append((rule.get("record") or rule["alert"], rule["expr"]))
    return out


def dashboard_expressions() -> list[tuple[str, str]]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [
        (panel["title"], target["expr"])
        for panel in dashboard["panels"]
        for target in panel.get("targets", [])
    ]


def metric_names_in(expr: str) -> set[str]:
    return set(METRIC_NAME.findall(expr))


# --- Kubernetes ------------------------------------------------------------------------


@pytest.mark.parametrize("version", ["1.28.0", "latest"])
def test_kubernetes_manifests_match_the_schemas(version: str) -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    target = kubernetes_validate.latest_version() if version == "latest" else version
    documents = k8s_documents()
    assert {doc["kind"] for _, doc in documents} >= {
        "Deployment",
        "Service",
        "HorizontalPodAutoscaler",
        "ConfigMap",
    }
    for _, doc in documents:
        kubernetes_validate.validate(doc, target, strict=True)


def test_the_schema_check_rejects_a_broken_manifest() -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    deployment = k8s_kind("Deployment")
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGett"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, "1.28.0", strict=True)


# Applied on their own: the adapter's config belongs in the adapter's namespace.
OUTSIDE_KUSTOMIZATION = {"kustomization.yaml", "prometheus-adapter.yaml"}


def test_kustomization_lists_every_manifest() -> None:
    kustomization = load_yaml(K8S / "kustomization.yaml")
    listed = set(kustomization["resources"])
    assert listed == {p.name for p in K8S.glob("*.yaml")} - OUTSIDE_KUSTOMIZATION
    assert "namespace" not in kustomization
    for _, doc in k8s_documents():
        assert "namespace" not in doc["metadata"], doc["metadata"]


def test_deployment_probes_resources_gpu_and_scrape_annotations() -> None:
    deployment = k8s_kind("Deployment")
    pod = deployment["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["path"] == "/health"
    resources = container["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == 1
    assert {"cpu", "memory"} <= set(resources["requests"])
    (port,) = container["ports"]
    annotations = pod["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert int(annotations["prometheus.io/port"]) == port["containerPort"]
    assert annotations["prometheus.io/path"] == "/metrics"
    assert f"--port={port['containerPort']}" in container["args"]
    service = k8s_kind("Service")
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()


def test_hpa_scales_the_deployment_on_the_adapter_metric() -> None:
    hpa, deployment = k8s_kind("HorizontalPodAutoscaler"), k8s_kind("Deployment")
    assert hpa["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    (metric,) = hpa["spec"]["metrics"]
    metric_name = metric["pods"]["metric"]["name"]
    adapter = yaml.safe_load(k8s_kind("ConfigMap")["data"]["config.yaml"])
    (rule,) = adapter["rules"]
    assert rule["name"]["as"] == metric_name
    assert re.fullmatch(rule["name"]["matches"], metric_name)
    assert metric_names_in(rule["seriesQuery"]) <= exported_names()
    assert set(rule["resources"]["overrides"]) == {"namespace", "pod"}
    # The Kubernetes scrape job keeps exactly those labels for the adapter.
    scrape = load_yaml(PROMETHEUS / "kubernetes-scrape.yml")["scrape_configs"][0]
    targets = {c.get("target_label") for c in scrape["relabel_configs"]}
    assert {"namespace", "pod", "instance"} <= targets


# --- Prometheus ------------------------------------------------------------------------


def promtool(*args: str, cwd: Path = PROMETHEUS) -> subprocess.CompletedProcess[str]:
    if shutil.which("promtool") is None:
        pytest.skip("promtool missing: apt-get install -y prometheus (CI installs it)")
    return subprocess.run(
        ["promtool", *args], cwd=cwd, capture_output=True, text=True, timeout=60, check=False
    )


def test_promtool_accepts_rules_and_scrape_config() -> None:
    checked = promtool("check", "rules", *map(str, RULE_FILES))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    config = promtool("check", "config", "prometheus.yml")
    assert config.returncode == 0, config.stdout + config.stderr


def test_promtool_rule_unit_tests_pass() -> None:
    result = promtool("test", "rules", "tests/kvserve-rules.test.yml")
    assert result.returncode == 0, result.stdout + result.stderr


def test_rules_cover_the_required_signals() -> None:
    names = dict(rule_expressions())
    for alert in ("KVServeKVCacheNearlyFull", "KVServePreemptionStorm", "KVServeEngineDown"):
        assert alert in names
    recorded = " ".join(names)
    for signal in ("usage_ratio", "prefix_cache_hit_ratio", "generation_tokens"):
        assert signal in recorded


def test_rule_comparisons_are_spaced_for_bool_evaluation() -> None:
    """The live test turns `a > b` into `a > bool b`; an unspaced operator would hide."""
    for name, expr in rule_expressions():
        bare = re.sub(r"\{[^}]*\}", "{}", expr)  # label matchers (=, !=, =~) are not comparisons
        for match in COMPARISON.finditer(bare):
            spaced = bare[match.start() - 1] == " " and bare[match.end()] == " "
            assert spaced, (name, expr)


def test_compose_prometheus_config_matches_the_mounts() -> None:
    config = load_yaml(PROMETHEUS / "prometheus.yml")
    (job,) = config["scrape_configs"]
    assert job["metrics_path"] == "/metrics"
    assert job["static_configs"][0]["targets"] == ["kvserve:8000"]
    assert config["rule_files"] == ["/etc/prometheus/rules/*.yml"]


# --- names used anywhere exist ------------------------------------------------------------


def test_every_metric_name_in_rules_and_dashboard_is_exported() -> None:
    exported = exported_names()
    for source, expr in rule_expressions() + dashboard_expressions():
        missing = metric_names_in(expr) - exported
        assert not missing, (source, missing)


def test_metrics_doc_lists_every_exported_name() -> None:
    documented = set(METRIC_NAME.findall((ROOT / "docs" / "reference" / "metrics.md").read_text()))
    families = set()
    for name in exported_names():
        if name.endswith("_created") or name.startswith("process_"):
            continue  # process_*: the standard exporter's names, documented as a group
        for suffix in HISTOGRAM_SUFFIXES:
            if name.endswith(suffix) and name.removesuffix(suffix) in documented:
                name = name.removesuffix(suffix)
        families.add(name)
    assert families <= documented, families - documented
    recorded = {name for name, _ in rule_expressions() if ":" in name}
    assert recorded <= set(
        re.findall(r"`([a-z_]+:[a-z0-9_:]+)`", (ROOT / "docs/reference/metrics.md").read_text())
    )


# --- Grafana ---------------------------------------------------------------------------


def test_dashboard_is_valid_and_covers_the_required_panels() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    panels = dashboard["panels"]
    ids = [panel["id"] for panel in panels]
    assert len(ids) == len(set(ids))
    assert all(panel.get("targets") for panel in panels)
    titles = " | ".join(panel["title"] for panel in panels).lower()
    required = ["device kv", "host kv", "payload vs allocated", "blocks by state"]
    required += ["running, waiting, swapped", "preemptions and swaps", "prefix-cache hit"]
    required += ["time to first token", "inter-token", "end-to-end", "token throughput"]
    for words in required:
        assert words in titles, words
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    for _, expr in dashboard_expressions():
        used = set(re.findall(r"\$(\w+)", expr)) - {"__rate_interval"}
        assert used <= variables, expr
        assert 'model_name=~"$model"' in expr, expr
        assert 'instance=~"$instance"' in expr, expr
    instance = next(v for v in dashboard["templating"]["list"] if v["name"] == "instance")
    assert "instance" in instance["definition"]
    for panel in panels:
        for target in panel["targets"]:
            # A series per pod is labelled by the pod (instance is its name in Kubernetes).
            if re.search(r"by \((le, )?instance", target["expr"]) or "sum" not in target["expr"]:
                assert "{{instance}}" in target["legendFormat"], (panel["title"], target)
        units = {panel["fieldConfig"]["defaults"].get("unit")}
        units |= {
            prop["value"]
            for override in panel["fieldConfig"].get("overrides", [])
            for prop in override["properties"]
            if prop["id"] == "unit"
        }
        axes = {
            prop["value"]
            for override in panel["fieldConfig"].get("overrides", [])
            for prop in override["properties"]
            if prop["id"] == "custom.axisPlacement"
        }
        # A second unit in one panel gets an axis of its own.
        assert len(units) == 1 or axes, panel["title"]
    (throughput,) = [p for p in panels if "token throughput" in p["title"].lower()]
    assert throughput["fieldConfig"]["defaults"]["unit"] == "suffix: tokens/s"


def test_grafana_provisioning_matches_compose_mounts() -> None:
    compose = load_yaml(DEPLOY / "docker-compose.yml")
    grafana_volumes = compose["services"]["grafana"]["volumes"]
    mounts = {v.split(":")[1]: v.split(":")[0] for v in grafana_volumes}
    provisioning = DEPLOY / "grafana" / "provisioning"
    dashboards = load_yaml(provisioning / "dashboards" / "kvserve.yml")["providers"][0]
    dashboard_dir = dashboards["options"]["path"]
    assert (DEPLOY / mounts[dashboard_dir]).resolve() == DASHBOARD.parent
    assert (DEPLOY / mounts["/etc/grafana/provisioning"]).resolve() == provisioning
    (datasource,) = load_yaml(provisioning / "datasources" / "prometheus.yml")["datasources"]
    assert datasource["type"] == "prometheus"
    assert datasource["url"] == "http://prometheus:9090"
    dashboard = json.loads(DASHBOARD.read_text())
    (ds_variable,) = [v for v in dashboard["templating"]["list"] if v["type"] == "datasource"]
    assert ds_variable["current"]["value"] == datasource["uid"]


# --- docker-compose ----------------------------------------------------------------------


def test_compose_wires_kvserve_prometheus_and_grafana() -> None:
    compose = load_yaml(DEPLOY / "docker-compose.yml")
    services = compose["services"]
    assert set(services) == {"kvserve", "prometheus", "grafana"}
    for service in services.values():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (DEPLOY / source).exists(), volume
    build = services["kvserve"]["build"]
    assert (DEPLOY / build["context"] / build["dockerfile"]).is_file()
    assert "8000:8000" in services["kvserve"]["ports"]
    prometheus_mounts = {v.split(":")[1] for v in services["prometheus"]["volumes"]}
    assert {"/etc/prometheus/prometheus.yml", "/etc/prometheus/rules"} <= prometheus_mounts
    assert services["grafana"]["depends_on"] == ["prometheus"]
    assert set(compose["volumes"]) == {"prometheus-data", "grafana-data"}
