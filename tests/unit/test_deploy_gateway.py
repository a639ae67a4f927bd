"""deploy/gateway/ checked offline: every custom resource against the released CRDs
vendored in deploy/gateway/crds/ (InferencePool v1 of the inference extension v1.6.0,
Gateway and HTTPRoute of Gateway API v1.6.1; see its README), the core objects against
Kubernetes' schemas, and the wiring between pool, picker, route and the kvserve Deployment."""

from __future__ import annotations

import copy
import hashlib
from pathlib import Path
from typing import Any

import pytest
import yaml

from server.gateway_protocol import ENGINE_LABEL_KEYS, ENGINE_NAME, epp_engine_config

ROOT = Path(__file__).resolve().parents[2]
GATEWAY = ROOT / "deploy" / "gateway"
CRDS = GATEWAY / "crds"
DEPLOYMENT = ROOT / "deploy" / "kubernetes" / "deployment.yaml"
CORE_GROUPS = ("v1", "apps/v1", "rbac.authorization.k8s.io/v1", "networking.k8s.io/v1")
# The upstream blobs' sha256 (shared/vendor/gateway-api-inference-extension/SOURCE.md).
RELEASED_SHA256 = {
    "inference.networking.k8s.io_inferencepools.yaml": (
        "55e0dbf39c50c4bbdd60106493a4573df4bb44479f9ce46762f1af718883e5cd"
    ),
    "gateway.networking.k8s.io_gateways.yaml": (
        "25b885f5870b8fff1ae82efa2628b2761cef3745900c2aecf8fb76629a01255a"
    ),
    "gateway.networking.k8s.io_httproutes.yaml": (
        "a424a0d6c953b162e71d1d97bb7e75012d8f1ac264e7274f2763d1b96ab39852"
    ),
    "LICENSE.gateway-api-inference-extension": (
        "b40930bbcf80744c86c46a12bc9da056641d722716c378f5659b9e555ef833e1"
    ),
    "LICENSE.gateway-api": "20b6dde626f521dbb384f75e6d96c3d16789df3bf878b58bc2810614fb4db07c",
}
# jsonschema's words for minLength/minItems/minProperties, before and since 4.21.
NON_EMPTY = "should be non-empty|is too short|does not have enough properties"


def gateway_documents() -> list[dict[str, Any]]:
    docs = []
    for path in sorted(GATEWAY.glob("*.yaml")):
        if path.name != "kustomization.yaml":
            docs += [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    return docs


def one(kind: str) -> dict[str, Any]:
    (doc,) = [doc for doc in gateway_documents() if doc["kind"] == kind]
    return doc


def strict(schema: Any) -> Any:
    """The CRD's structural schema as JSON Schema, rejecting unknown fields the way
    `kubectl apply --validate=strict` does (objects with properties admit no others)."""
    if isinstance(schema, list):
        return [strict(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) for k, v in schema.items() if not k.startswith("x-kubernetes-")}
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def crd_schemas() -> dict[tuple[str, str], dict[str, Any]]:
    """(apiVersion, kind) -> JSON schema, for every version of every vendored CRD."""
    schemas = {}
    for path in sorted(CRDS.glob("*.yaml")):
        crd = yaml.safe_load(path.read_text())
        group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
        for version in crd["spec"]["versions"]:
            schema = strict(version["schema"]["openAPIV3Schema"])
            schemas[(f"{group}/{version['name']}", kind)] = schema
    return schemas


def validate_custom(doc: dict[str, Any]) -> None:
    import jsonschema

    schema = crd_schemas()[(doc["apiVersion"], doc["kind"])]
    jsonschema.validate(doc, schema, cls=jsonschema.Draft7Validator)


def test_every_custom_resource_validates_against_its_vendored_crd() -> None:
    schemas = crd_schemas()
    custom = [doc for doc in gateway_documents() if doc["apiVersion"] not in CORE_GROUPS]
    assert {doc["kind"] for doc in custom} == {"InferencePool", "Gateway", "HTTPRoute"}
    for doc in custom:
        # The manifests use exactly the API versions of the vendored schemas.
        assert (doc["apiVersion"], doc["kind"]) in schemas, (doc["apiVersion"], doc["kind"])
        validate_custom(doc)


@pytest.mark.parametrize(
    ("kind", "path", "value", "why"),
    [
        ("InferencePool", ("spec", "targetPorts"), [{"number": 0}], "less than the minimum"),
        (
            "InferencePool",
            ("spec", "endpointPickerRef", "failureMode"),
            "FailSometimes",
            "not one of",
        ),
        (
            "InferencePool",
            ("spec", "selectr"),
            {"matchLabels": {"a": "b"}},
            "'selectr' was unexpected",
        ),
        ("InferencePool", ("spec", "selector", "matchLabels"), {}, NON_EMPTY),
        (
            "InferencePool",
            ("spec", "endpointPickerRef", "port", "number"),
            70000,
            "greater than the max",
        ),
        ("HTTPRoute", ("spec", "rules", 0, "matches", 0, "path", "type"), "Prefix", "not one of"),
        ("HTTPRoute", ("spec", "rules", 0, "timeouts", "request"), "10 minutes", "does not match"),
        ("HTTPRoute", ("spec", "rules", 0, "timeouts", "request"), 600, "is not of type 'string'"),
        (
            "HTTPRoute",
            ("spec", "rules", 0, "backendRefs", 0, "kind"),
            "Inference Pool",
            "does not match",
        ),
        (
            "HTTPRoute",
            ("spec", "rules", 0, "timeout"),
            {"request": "600s"},
            "'timeout' was unexpected",
        ),
        (
            "HTTPRoute",
            ("spec", "parentRefs"),
            [{"kind": "Gateway"}],
            "'name' is a required property",
        ),
        ("Gateway", ("spec", "listeners", 0, "port"), 0, "less than the minimum"),
        ("Gateway", ("spec", "listeners", 0, "port"), "80", "is not of type 'integer'"),
        ("Gateway", ("spec", "listeners", 0, "name"), "HTTP_1", "does not match"),
        ("Gateway", ("spec", "gatewayClassName"), "", NON_EMPTY),
        ("Gateway", ("spec", "listener"), [], "'listener' was unexpected"),
    ],
)
def test_the_crd_check_rejects_broken_resources(
    kind: str, path: tuple, value: Any, why: str
) -> None:
    import jsonschema

    doc = copy.deepcopy(one(kind))
    node = doc
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    with pytest.raises(jsonschema.ValidationError, match=why):
        validate_custom(doc)


@pytest.mark.parametrize(
    ("kind", "path"),
    [
        # endpointPickerRef itself is optional since v1.6.0 (#2898); its name is not.
        ("InferencePool", ("spec", "endpointPickerRef", "name")),
        ("InferencePool", ("spec", "selector")),
        ("InferencePool", ("spec", "targetPorts")),
        ("Gateway", ("spec", "listeners")),
        ("Gateway", ("spec", "gatewayClassName")),
        ("Gateway", ("spec", "listeners", 0, "protocol")),
        ("HTTPRoute", ("spec", "rules", 0, "backendRefs", 0, "name")),
        ("HTTPRoute", ("spec", "parentRefs", 0, "name")),
        ("HTTPRoute", ("spec",)),
    ],
)
def test_missing_required_fields_are_rejected(kind: str, path: tuple) -> None:
    import jsonschema

    doc = copy.deepcopy(one(kind))
    node = doc
    for key in path[:-1]:
        node = node[key]
    del node[path[-1]]
    with pytest.raises(jsonschema.ValidationError, match=f"'{path[-1]}' is a required property"):
        validate_custom(doc)


@pytest.mark.parametrize("version", ["1.28.0", "latest"])
def test_core_objects_match_the_kubernetes_schemas(version: str) -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    target = kubernetes_validate.latest_version() if version == "latest" else version
    core = [doc for doc in gateway_documents() if doc["apiVersion"] in CORE_GROUPS]
    assert {doc["kind"] for doc in core} >= {"Deployment", "Service", "ConfigMap", "Role"}
    for doc in core:
        kubernetes_validate.validate(doc, target, strict=True)


def test_the_pool_selects_the_kvserve_pods_on_their_port() -> None:
    pool = one("InferencePool")["spec"]
    deployment = yaml.safe_load(DEPLOYMENT.read_text())
    pod = deployment["spec"]["template"]
    assert pool["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    (container,) = pod["spec"]["containers"]
    ports = [port["containerPort"] for port in container["ports"]]
    assert [port["number"] for port in pool["targetPorts"]] == ports
    for key in ENGINE_LABEL_KEYS:
        assert pod["metadata"]["labels"][key] == ENGINE_NAME, key


def test_the_pool_and_the_picker_point_at_each_other() -> None:
    pool = one("InferencePool")
    ref = pool["spec"]["endpointPickerRef"]
    service = one("Service")
    assert ref["name"] == service["metadata"]["name"]
    service_ports = {port["port"]: port for port in service["spec"]["ports"]}
    assert ref["port"]["number"] in service_ports
    epp = one("Deployment")
    assert (
        service["spec"]["selector"].items() <= epp["spec"]["template"]["metadata"]["labels"].items()
    )
    (container,) = epp["spec"]["template"]["spec"]["containers"]
    args = dict(arg.removeprefix("--").split("=", 1) for arg in container["args"])
    assert args["pool-name"] == pool["metadata"]["name"]
    assert int(args["grpc-port"]) == ref["port"]["number"]
    named = {port["name"]: port["containerPort"] for port in container["ports"]}
    assert named[service_ports[ref["port"]["number"]]["targetPort"]] == ref["port"]["number"]
    assert epp["spec"]["template"]["spec"]["serviceAccountName"] == "kvserve-epp"


def epp_config() -> dict[str, Any]:
    config_map = one("ConfigMap")
    epp = one("Deployment")
    (container,) = epp["spec"]["template"]["spec"]["containers"]
    args = dict(arg.removeprefix("--").split("=", 1) for arg in container["args"])
    (mount,) = container["volumeMounts"]
    file_name = Path(args["config-file"]).relative_to(mount["mountPath"]).as_posix()
    (volume,) = epp["spec"]["template"]["spec"]["volumes"]
    assert volume["configMap"]["name"] == config_map["metadata"]["name"]
    return dict(yaml.safe_load(config_map["data"][file_name]))


def test_the_picker_reads_kvserve_metric_names() -> None:
    config = epp_config()
    assert config["kind"] == "EndpointPickerConfig"
    plugins = {plugin.get("name", plugin["type"]): plugin for plugin in config["plugins"]}
    extractor = plugins["core-metrics-extractor"]["parameters"]
    (engine,) = extractor["engineConfigs"]
    assert engine == epp_engine_config()
    assert extractor["defaultEngine"] == ENGINE_NAME
    (source,) = config["data"]["sources"]
    assert source["pluginRef"] == "metrics-data-source"
    assert source["extractors"] == [{"pluginRef": "core-metrics-extractor"}]
    assert plugins["metrics-data-source"]["parameters"]["path"] == "/metrics"
    (profile,) = config["schedulingProfiles"]
    used = {ref["pluginRef"] for ref in profile["plugins"]}
    assert used <= set(plugins)
    assert {"queue-scorer", "kv-cache-utilization-scorer", "prefix-cache-scorer"} <= used
    # The LoRA gauge's reader (loraSpec is set: kvserve exports it with LoRA off too).
    assert "lora-affinity-scorer" in used


def test_the_route_sends_the_openai_api_to_the_pool_through_the_gateway() -> None:
    route, gateway, pool = one("HTTPRoute"), one("Gateway"), one("InferencePool")
    (parent,) = route["spec"]["parentRefs"]
    assert parent["name"] == gateway["metadata"]["name"]
    (rule,) = route["spec"]["rules"]
    (backend,) = rule["backendRefs"]
    assert backend["kind"] == "InferencePool"
    assert backend["group"] == pool["apiVersion"].split("/")[0]
    assert backend["name"] == pool["metadata"]["name"]
    assert rule["matches"][0]["path"] == {"type": "PathPrefix", "value": "/v1/"}


def test_the_picker_runs_restricted() -> None:
    epp = one("Deployment")["spec"]["template"]["spec"]
    assert epp["securityContext"]["runAsNonRoot"] is True
    assert epp["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
    (container,) = epp["containers"]
    context = container["securityContext"]
    assert context["allowPrivilegeEscalation"] is False
    assert context["capabilities"]["drop"] == ["ALL"]
    assert context["readOnlyRootFilesystem"] is True


def test_crds_readme_names_every_vendored_file_with_its_sha256() -> None:
    """The CRDs are the released files, unchanged: each one's sha256 is the upstream blob's
    as the vendor notes record it, and the README lists it."""
    readme = (CRDS / "README.md").read_text()
    vendored = sorted(path for path in CRDS.iterdir() if path.name != "README.md")
    assert {path.name for path in vendored} == {*RELEASED_SHA256}
    for path in vendored:
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        assert digest == RELEASED_SHA256[path.name], path.name
        assert path.name in readme and digest in readme, path.name
