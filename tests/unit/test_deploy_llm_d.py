"""deploy/llm-d/ checked offline: kvserve behind llm-d's router (llm-d-router v0.10.0).

The InferencePool, Gateway and HTTPRoute against the released CRDs vendored in
deploy/gateway/crds/ (the helpers of test_deploy_gateway.py); the kustomize overlay rendered
here (the kvserve base plus two RFC 6902 patches) and its core objects against Kubernetes'
schemas; the picker's EndpointPickerConfig against the parameter names the v0.10.0 picker
decodes strictly; and the wiring: pool -> kvserve pods, pool -> picker Service, the KV-event
sockets kvserve binds = the ones the picker dials, topic and model names, render endpoints.
The Go picker itself and a cluster are not run here (deploy/README.md says what is not).
"""

from __future__ import annotations

import copy
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from engine.config import KVEventsConfig
from server.cli import build_parser
from server.gateway_protocol import ENGINE_LABEL_KEYS, ENGINE_NAME, epp_engine_config
from tests.unit.test_deploy_gateway import CORE_GROUPS, NON_EMPTY, crd_schemas, validate_custom

ROOT = Path(__file__).resolve().parents[2]
LLM_D = ROOT / "deploy" / "llm-d"
RELEASE = "v0.10.0"
RELEASE_COMMIT = "71f4f0999f95b96c49a9d0c4afbd18dfdb943c26"
PICKER_IMAGE = f"ghcr.io/llm-d/llm-d-router-endpoint-picker:{RELEASE}"
CONFIG_API_VERSION = "llm-d.ai/v1alpha1"
SAMPLE_POD_IP = "10.1.2.3"

# --- what llm-d-router v0.10.0 accepts --------------------------------------------------------
# The picker decodes its config and every plugin's parameters strictly (serializer.EnableStrict,
# json DisallowUnknownFields): a misspelt key stops it at startup. These are the JSON names of
# the config structs at the tag: apix/config/v1alpha1/endpointpickerconfig_types.go, and per
# plugin the parameter struct under pkg/epp/framework/plugins/ (pkg/kvcache/, pkg/kvevents/ for
# the precise producer's nested configs). A dict is an object's known keys (value: the shape of
# that key's value, None for a scalar or free-form value), a one-item list a list of such.
Shape = dict[str, Any] | list[Any] | None

ENGINE_CONFIG: Shape = [
    dict.fromkeys(
        (
            "name",
            "queuedRequestsSpec",
            "runningRequestsSpec",
            "kvUsageSpec",
            "loraSpec",
            "cacheInfoSpec",
            "cacheBlockSizeLabelName",
            "cacheNumBlocksLabelName",
            "cacheBlockSizeSpec",
            "cacheNumBlocksSpec",
            "customMetrics",
        )
    )
]
PLUGIN_PARAMETERS: dict[str, Shape] = {
    "metrics-data-source": dict.fromkeys(
        (
            "scheme",
            "path",
            "port",
            "insecureSkipVerify",
            "caCertPath",
            "clientCertPath",
            "clientKeyPath",
            "interval",
        )
    ),
    "core-metrics-extractor": {
        "engineLabelKey": None,
        "defaultEngine": None,
        "engineConfigs": ENGINE_CONFIG,
    },
    "endpoint-notification-source": {},
    "token-producer": {
        "modelName": None,
        "vllm": dict.fromkeys(("url", "timeout", "mmTimeout")),
        "udsTokenizerConfig": None,
        "estimate": None,
    },
    "precise-prefix-cache-producer": {
        "tokenProcessorConfig": dict.fromkeys(("blockSize", "blockSizeTokens", "hashSeed")),
        # tokenizersPoolConfig is refused by this producer (a token-producer tokenizes).
        "indexerConfig": {
            "kvBlockIndexConfig": dict.fromkeys(
                (
                    "inMemoryConfig",
                    "redisConfig",
                    "costAwareMemoryConfig",
                    "enableMetrics",
                    "metricsLoggingInterval",
                )
            ),
            "kvCacheBackendConfigs": [dict.fromkeys(("name", "weight"))],
        },
        "kvEventsConfig": {
            "zmqEndpoint": None,
            "topicFilter": None,
            "concurrency": None,
            "engineType": None,
            "discoverPods": None,
            "podDiscoveryConfig": dict.fromkeys(
                ("podLabelSelector", "podNamespace", "socketPort", "replaySocketPort")
            ),
        },
        "speculativeIndexing": None,
        "speculativeTTL": None,
    },
    "approx-prefix-cache-producer": dict.fromkeys(
        (
            "autoTune",
            "blockSizeTokens",
            "blockSize",
            "maxPrefixBlocksToMatch",
            "maxPrefixTokensToMatch",
            "lruCapacityPerServer",
        )
    ),
    "prefix-cache-scorer": dict.fromkeys(
        ("prefixMatchInfoProducerName", "matchLengthWeight", "matchLengthScaleTokens")
    ),
    "kv-cache-utilization-scorer": {},
    "queue-scorer": {},
    "load-aware-scorer": {"threshold": None},
    "max-score-picker": {"maxNumOfEndpoints": None},
    "single-profile-handler": {},
}
SCORERS = {
    "prefix-cache-scorer",
    "kv-cache-utilization-scorer",
    "queue-scorer",
    "load-aware-scorer",
}
PICKERS = {"max-score-picker"}
PROFILE_HANDLERS = {"single-profile-handler"}
PREFIX_PRODUCERS = {"precise-prefix-cache-producer", "approx-prefix-cache-producer"}
PRODUCERS = {"token-producer", *PREFIX_PRODUCERS}
DATA_SOURCES = {"metrics-data-source", "endpoint-notification-source"}
CONFIG_SHAPE: Shape = {
    "apiVersion": None,
    "kind": None,
    "featureGates": None,
    "plugins": [dict.fromkeys(("name", "type", "parameters"))],
    "schedulingProfiles": [{"name": None, "plugins": [dict.fromkeys(("pluginRef", "weight"))]}],
    "dataLayer": {
        "injectDefaults": None,
        "sources": [{"pluginRef": None, "extractors": [{"pluginRef": None}]}],
        "discovery": None,
        "crossReplicaSyncerPluginRef": None,
        "crossReplicaSyncInterval": None,
    },
    "flowControl": None,
    "requestHandler": None,
    "saturationDetector": None,
    "parser": None,
}


def unknown_keys(value: Any, shape: Shape, where: str = "") -> list[str]:
    """Paths of the keys in ``value`` that ``shape`` does not know."""
    if isinstance(shape, list):
        return [
            found
            for i, item in enumerate(value or [])
            for found in unknown_keys(item, shape[0], f"{where}[{i}]")
        ]
    if isinstance(shape, dict):
        if not isinstance(value, dict):
            return [f"{where}: not an object"]
        found = [f"{where}.{key}" for key in value if key not in shape]
        for key, sub in shape.items():
            if key in value and sub is not None:
                found += unknown_keys(value[key], sub, f"{where}.{key}")
        return found
    return []


def config_problems(config: dict[str, Any]) -> list[str]:
    """What would stop the v0.10.0 picker loading ``config``, or leave a reference dangling."""
    problems = unknown_keys(config, CONFIG_SHAPE)
    if config.get("apiVersion") != CONFIG_API_VERSION or config.get("kind") != (
        "EndpointPickerConfig"
    ):
        problems.append(f"apiVersion/kind {config.get('apiVersion')}/{config.get('kind')}")
    plugins: dict[str, dict[str, Any]] = {}
    for spec in config.get("plugins", []):
        name = spec.get("name", spec.get("type"))
        if name in plugins:
            problems.append(f"duplicate plugin name {name}")
        plugins[name] = spec
        if spec.get("type") not in PLUGIN_PARAMETERS:
            problems.append(f"plugin {name}: type {spec.get('type')!r} unknown here")
            continue
        shape = PLUGIN_PARAMETERS[spec["type"]]
        problems += [
            f"plugin {name}: parameter {path}"
            for path in unknown_keys(spec.get("parameters") or {}, shape)
        ]
    types = {name: spec.get("type") for name, spec in plugins.items()}
    handlers = [name for name, kind in types.items() if kind in PROFILE_HANDLERS]
    if len(handlers) != 1:
        problems.append(f"profile handlers: {handlers}")
    for source in (config.get("dataLayer") or {}).get("sources", []):
        refs = [source["pluginRef"], *(e["pluginRef"] for e in source.get("extractors", []))]
        problems += [f"dataLayer references undeclared {ref}" for ref in refs if ref not in types]
        if types.get(source["pluginRef"]) not in DATA_SOURCES:
            problems.append(f"dataLayer source {source['pluginRef']} is not a data source")
    profiles = config.get("schedulingProfiles", [])
    if not profiles:
        problems.append("no scheduling profile")
    for profile in profiles:
        refs = [entry["pluginRef"] for entry in profile.get("plugins", [])]
        problems += [
            f"profile {profile.get('name')} references undeclared {ref}"
            for ref in refs
            if ref not in types
        ]
        pickers = [ref for ref in refs if types.get(ref) in PICKERS]
        if len(pickers) != 1:
            problems.append(f"profile {profile.get('name')}: pickers {pickers}")
        for entry in profile.get("plugins", []):
            kind = types.get(entry["pluginRef"])
            if kind in SCORERS and not isinstance(entry.get("weight"), (int, float)):
                problems.append(f"profile {profile.get('name')}: {entry['pluginRef']} no weight")
            if kind in PRODUCERS | DATA_SOURCES | PROFILE_HANDLERS:
                problems.append(
                    f"profile {profile.get('name')}: {entry['pluginRef']} is no "
                    "filter, scorer or picker"
                )
    for name, spec in plugins.items():
        producer = (spec.get("parameters") or {}).get("prefixMatchInfoProducerName")
        if (
            spec.get("type") == "prefix-cache-scorer"
            and producer is not None
            and types.get(producer) not in PREFIX_PRODUCERS
        ):
            problems.append(f"{name} reads prefix matches from {producer!r}, no producer")
    return problems


# --- the manifests, and the overlay rendered here -----------------------------------------------


def load_documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def apply_json_patch(doc: dict[str, Any], operations: list[dict[str, Any]]) -> None:
    """RFC 6902 ``add`` (what kustomization.yaml uses), in place; anything else is refused."""
    for operation in operations:
        assert operation["op"] == "add", operation
        *parents, last = [
            part.replace("~1", "/").replace("~0", "~")
            for part in operation["path"].lstrip("/").split("/")
        ]
        node: Any = doc
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        value = copy.deepcopy(operation["value"])
        if isinstance(node, list):
            node.insert(len(node) if last == "-" else int(last), value)
        else:
            node[last] = value


def render(directory: Path) -> list[dict[str, Any]]:
    """``kustomize build`` for what deploy/ uses: resources (files and bases) and RFC 6902
    patches with a kind/name target."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    assert set(kustomization) <= {"apiVersion", "kind", "resources", "patches"}, kustomization
    docs: list[dict[str, Any]] = []
    for resource in kustomization["resources"]:
        path = (directory / resource).resolve()
        docs += render(path) if path.is_dir() else load_documents(path)
    for patch in kustomization.get("patches", []):
        target = patch["target"]
        (doc,) = [
            doc
            for doc in docs
            if doc["kind"] == target["kind"] and doc["metadata"]["name"] == target["name"]
        ]
        assert doc["apiVersion"] == "/".join(
            part for part in (target.get("group"), target["version"]) if part
        )
        apply_json_patch(doc, yaml.safe_load(patch["patch"]))
    return docs


def rendered() -> list[dict[str, Any]]:
    return render(LLM_D)


def one(kind: str, name: str, docs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    (doc,) = [
        doc
        for doc in (rendered() if docs is None else docs)
        if doc["kind"] == kind and doc["metadata"]["name"] == name
    ]
    return doc


def custom_documents() -> list[dict[str, Any]]:
    docs = load_documents(LLM_D / "inferencepool.yaml") + load_documents(LLM_D / "httproute.yaml")
    return [doc for doc in docs if doc["apiVersion"] not in CORE_GROUPS]


def custom(kind: str) -> dict[str, Any]:
    (doc,) = [doc for doc in custom_documents() if doc["kind"] == kind]
    return doc


def flags(container: dict[str, Any]) -> dict[str, str]:
    return dict(arg.removeprefix("--").split("=", 1) for arg in container["args"])


def picker() -> tuple[dict[str, Any], dict[str, Any]]:
    epp = one("Deployment", "kvserve-llm-d-epp")
    (container,) = epp["spec"]["template"]["spec"]["containers"]
    return epp, container


def picker_configs() -> dict[str, dict[str, Any]]:
    config_map = one("ConfigMap", "kvserve-llm-d-epp")
    return {key: yaml.safe_load(text) for key, text in config_map["data"].items()}


def loaded_config() -> dict[str, Any]:
    """The config the picker's --config-file names, through its volume and mount."""
    epp, container = picker()
    path = Path(flags(container)["config-file"])
    mounts = {mount["name"]: mount for mount in container["volumeMounts"]}
    volumes = {volume["name"]: volume for volume in epp["spec"]["template"]["spec"]["volumes"]}
    (name,) = [name for name, mount in mounts.items() if path.parent == Path(mount["mountPath"])]
    assert volumes[name]["configMap"]["name"] == "kvserve-llm-d-epp"
    return picker_configs()[path.name]


def plugin(config: dict[str, Any], kind: str) -> dict[str, Any]:
    (spec,) = [spec for spec in config["plugins"] if spec["type"] == kind]
    return dict(spec.get("parameters") or {})


def kvserve() -> tuple[dict[str, Any], dict[str, Any]]:
    pod = one("Deployment", "kvserve")["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    return pod, container


def kvserve_args() -> Any:
    """The patched kvserve args through kvserve's own parser, $(POD_IP) expanded as the
    kubelet does."""
    _, container = kvserve()
    env = {item["name"] for item in container["env"]}
    args = []
    for arg in container["args"]:
        for variable in re.findall(r"\$\((\w+)\)", arg):
            assert variable in env, variable
        args.append(arg.replace("$(POD_IP)", SAMPLE_POD_IP))
    return build_parser().parse_args(["serve", *args])


# --- CRDs ---------------------------------------------------------------------------------------


def test_custom_resources_validate_against_the_vendored_crds() -> None:
    schemas = crd_schemas()
    docs = custom_documents()
    assert {doc["kind"] for doc in docs} == {"InferencePool", "Gateway", "HTTPRoute"}
    for doc in docs:
        assert (doc["apiVersion"], doc["kind"]) in schemas, (doc["apiVersion"], doc["kind"])
        validate_custom(doc)
    # The overlay applies the same pool it validates.
    assert one("InferencePool", "kvserve-llm-d") == custom("InferencePool")


@pytest.mark.parametrize(
    ("kind", "path", "value", "why"),
    [
        ("InferencePool", ("spec", "targetPorts"), [{"number": 70000}], "greater than the max"),
        ("InferencePool", ("spec", "endpointPickerRef", "failureMode"), "Fail", "not one of"),
        ("InferencePool", ("spec", "selector", "matchLabels"), {}, NON_EMPTY),
        ("InferencePool", ("spec", "endpointPickerRef", "portNumber"), 9002, "unexpected"),
        ("InferencePool", ("spec", "targetPorts"), None, "is not of type 'array'"),
        ("Gateway", ("spec", "listeners", 0, "port"), 0, "less than the minimum"),
        ("Gateway", ("spec", "listeners", 0, "hostname"), "Not A Host", "does not match"),
        ("Gateway", ("spec", "gatewayClassName"), "", NON_EMPTY),
        ("HTTPRoute", ("spec", "rules", 0, "matches", 0, "path", "type"), "Prefix", "not one of"),
        ("HTTPRoute", ("spec", "rules", 0, "timeouts", "request"), "ten", "does not match"),
        ("HTTPRoute", ("spec", "rules", 0, "backendRefs", 0, "kind"), "Inference Pool", "match"),
        ("HTTPRoute", ("spec", "parentRefs", 0, "nmae"), "x", "unexpected"),
    ],
)
def test_a_broken_copy_of_each_custom_resource_is_rejected(
    kind: str, path: tuple[Any, ...], value: Any, why: str
) -> None:
    import jsonschema

    doc = copy.deepcopy(custom(kind))
    node = doc
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    with pytest.raises(jsonschema.ValidationError, match=why):
        validate_custom(doc)


# --- core objects and the overlay ---------------------------------------------------------------


@pytest.mark.parametrize("version", ["1.28.0", "latest"])
def test_core_objects_match_the_kubernetes_schemas(version: str) -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    target = kubernetes_validate.latest_version() if version == "latest" else version
    core = [doc for doc in rendered() if doc["apiVersion"] in CORE_GROUPS]
    kinds = {doc["kind"] for doc in core}
    assert kinds >= {"Deployment", "Service", "ConfigMap", "Role", "RoleBinding", "ServiceAccount"}
    assert kinds >= {"ClusterRole", "ClusterRoleBinding", "NetworkPolicy"}
    for doc in core:  # the patched kvserve Deployment and NetworkPolicy among them
        kubernetes_validate.validate(doc, target, strict=True)


def test_a_broken_patch_fails_the_schema_check() -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    deployment = copy.deepcopy(one("Deployment", "kvserve"))
    apply_json_patch(
        deployment,
        [
            {
                "op": "add",
                "path": "/spec/template/spec/containers/0/ports/-",
                "value": {"name": "kv-events", "containerPort": "5557"},
            }
        ],
    )
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, "1.28.0", strict=True)


def test_the_overlay_renders_as_kubectl_kustomize_does() -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl missing: the overlay is rendered by this test's own kustomize")
    result = subprocess.run(
        [kubectl, "kustomize", str(LLM_D)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    built = [doc for doc in yaml.safe_load_all(result.stdout) if doc]

    def key(doc: dict[str, Any]) -> tuple[str, str]:
        return doc["kind"], doc["metadata"]["name"]

    assert sorted(built, key=key) == sorted(rendered(), key=key)


def test_the_kvserve_patch_keeps_the_base_and_adds_events() -> None:
    base = yaml.safe_load((ROOT / "deploy" / "kubernetes" / "deployment.yaml").read_text())
    (base_container,) = base["spec"]["template"]["spec"]["containers"]
    pod, container = kvserve()
    assert container["args"][: len(base_container["args"])] == base_container["args"]
    assert pod["metadata"] == base["spec"]["template"]["metadata"]
    added = [arg for arg in container["args"] if arg not in base_container["args"]]
    assert [arg.split("=", 1)[0] for arg in added] == ["--served-model-name", "--kv-events-config"]


# --- wiring -------------------------------------------------------------------------------------


def test_the_pool_selects_the_kvserve_pods_and_their_engine_label() -> None:
    pool = custom("InferencePool")["spec"]
    pod, container = kvserve()
    labels = pod["metadata"]["labels"]
    assert pool["selector"]["matchLabels"].items() <= labels.items()
    (http,) = [port for port in container["ports"] if port["name"] == "http"]
    assert [port["number"] for port in pool["targetPorts"]] == [http["containerPort"]]
    assert int(kvserve_args().port) == http["containerPort"]
    # llm-d's router reads the first key; the engine named there is kvserve's entry.
    assert labels[ENGINE_LABEL_KEYS[0]] == ENGINE_NAME
    for config in picker_configs().values():
        extractor = plugin(config, "core-metrics-extractor")
        assert extractor["engineLabelKey"] == ENGINE_LABEL_KEYS[0]
        assert extractor["defaultEngine"] == ENGINE_NAME
        assert extractor["engineConfigs"] == [epp_engine_config()]
        assert plugin(config, "metrics-data-source")["path"] == "/metrics"


def test_the_pool_and_the_picker_point_at_each_other() -> None:
    pool = custom("InferencePool")
    ref = pool["spec"]["endpointPickerRef"]
    service = one("Service", ref["name"])
    epp, container = picker()
    ports = {port["port"]: port for port in service["spec"]["ports"]}
    assert ref["port"]["number"] in ports
    template = epp["spec"]["template"]
    assert service["spec"]["selector"].items() <= template["metadata"]["labels"].items()
    named = {port["name"]: port["containerPort"] for port in container["ports"]}
    assert named[ports[ref["port"]["number"]]["targetPort"]] == ref["port"]["number"]
    args = flags(container)
    assert args["pool-name"] == pool["metadata"]["name"]
    assert args["pool-group"] == pool["apiVersion"].split("/")[0]
    assert int(args["grpc-port"]) == ref["port"]["number"]
    for probe in ("livenessProbe", "readinessProbe"):
        assert container[probe]["grpc"]["port"] == int(args["grpc-health-port"])
    assert named["metrics"] == int(args["metrics-port"])
    assert "$(NAMESPACE)" in args["pool-namespace"]
    assert {item["name"] for item in container["env"]} >= {"NAMESPACE", "POD_NAME"}
    assert container["image"] == PICKER_IMAGE


def test_the_picker_may_watch_the_pool_and_its_pods() -> None:
    epp, _ = picker()
    account = epp["spec"]["template"]["spec"]["serviceAccountName"]
    assert one("ServiceAccount", account)
    binding = one("RoleBinding", "kvserve-llm-d-epp")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account}]
    rules = one("Role", binding["roleRef"]["name"])["rules"]
    granted = {
        (group, resource)
        for rule in rules
        if {"get", "list", "watch"} <= set(rule["verbs"])
        for group in rule["apiGroups"]
        for resource in rule["resources"]
    }
    assert {("", "pods"), ("inference.networking.k8s.io", "inferencepools")} <= granted
    cluster_binding = one("ClusterRoleBinding", "kvserve-llm-d-epp-auth")
    assert cluster_binding["subjects"][0]["name"] == account
    (review,) = [
        rule
        for rule in one("ClusterRole", "kvserve-llm-d-epp-auth")["rules"]
        if "tokenreviews" in rule["resources"]
    ]
    assert review["verbs"] == ["create"]


def test_kvserve_publishes_its_events_where_the_picker_subscribes() -> None:
    args = kvserve_args()
    events: KVEventsConfig = args.kv_events_config
    assert events.publishes
    producer = plugin(loaded_config(), "precise-prefix-cache-producer")
    subscribe = producer["kvEventsConfig"]
    # The picker dials every pool pod (discoverPods); it binds nothing itself.
    assert subscribe["discoverPods"] is True and "zmqEndpoint" not in subscribe
    assert subscribe["engineType"] == "vllm"
    discovery = subscribe["podDiscoveryConfig"]
    for endpoint, port in (
        (events.endpoint, discovery["socketPort"]),
        (events.replay_endpoint, discovery["replaySocketPort"]),
    ):
        assert endpoint == f"tcp://*:{port}"  # every interface, so the pod IP answers
    _, container = kvserve()
    exposed = {port["containerPort"] for port in container["ports"]}
    assert {discovery["socketPort"], discovery["replaySocketPort"]} <= exposed
    # The pods' network policy lets the picker's pods reach both sockets.
    epp, _ = picker()
    epp_labels = epp["spec"]["template"]["metadata"]["labels"]
    policy = one("NetworkPolicy", "kvserve")
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= (
        kvserve()[0]["metadata"]["labels"].items()
    )
    allowed = {
        port["port"]
        for rule in policy["spec"]["ingress"]
        if any(
            peer["podSelector"]["matchLabels"].items() <= epp_labels.items()
            for peer in rule.get("from", [])
        )
        for port in rule["ports"]
    }
    assert {discovery["socketPort"], discovery["replaySocketPort"]} <= allowed


def test_topic_and_model_names_agree() -> None:
    args = kvserve_args()
    events: KVEventsConfig = args.kv_events_config
    (served,) = args.served_model_name
    config = loaded_config()
    producer = plugin(config, "precise-prefix-cache-producer")
    assert events.topic.startswith(producer["kvEventsConfig"]["topicFilter"])
    # kv@<pod id>@<model>: llm-d keys a pod <address>:<target port>, and indexes the blocks
    # under the topic's model, which must be the `model` the requests carry.
    prefix, pod_id, model = events.topic.split("@")
    assert prefix == "kv"
    pool_port = custom("InferencePool")["spec"]["targetPorts"][0]["number"]
    assert pod_id == f"{SAMPLE_POD_IP}:{pool_port}"
    assert model == served
    _, container = kvserve()
    (pod_ip,) = [item for item in container["env"] if item["name"] == "POD_IP"]
    assert pod_ip["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    for each in picker_configs().values():
        assert plugin(each, "token-producer")["modelName"] == served
    # The picker's blocks line up with the engine's.
    assert producer["tokenProcessorConfig"]["blockSizeTokens"] == args.block_size


def test_the_token_producer_renders_on_kvserve() -> None:
    from server.routes.render import router

    served_paths = {getattr(route, "path", None) for route in router.routes}
    assert {"/v1/completions/render", "/v1/chat/completions/render"} <= served_paths
    service = one("Service", "kvserve")
    for config in picker_configs().values():
        url = urlsplit(plugin(config, "token-producer")["vllm"]["url"])
        assert url.scheme == "http" and url.path in ("", "/")
        assert url.hostname == service["metadata"]["name"]
        assert url.port in {port["port"] for port in service["spec"]["ports"]}


def test_the_picker_configs_load_and_reference_only_what_they_declare() -> None:
    configs = picker_configs()
    assert set(configs) == {"epp-config.yaml", "approx-prefix-config.yaml"}
    for name, config in configs.items():
        assert config_problems(config) == [], name
    precise = loaded_config()
    assert precise == configs["epp-config.yaml"]
    kinds = {spec["type"] for spec in precise["plugins"]}
    assert kinds >= SCORERS | {"token-producer", "precise-prefix-cache-producer"}
    (profile,) = precise["schedulingProfiles"]
    used = {entry["pluginRef"] for entry in profile["plugins"]}
    assert used >= SCORERS  # every declared scorer scores
    assert plugin(precise, "prefix-cache-scorer") == {
        "prefixMatchInfoProducerName": "precise-prefix-cache-producer"
    }
    # The producer hears about pool members from the endpoint-notification-source.
    sources = {s["pluginRef"]: s["extractors"] for s in precise["dataLayer"]["sources"]}
    assert sources["endpoint-notification-source"] == [
        {"pluginRef": "precise-prefix-cache-producer"}
    ]
    assert sources["metrics-data-source"] == [{"pluginRef": "core-metrics-extractor"}]


def broken(config: dict[str, Any], change: str) -> dict[str, Any]:
    config = copy.deepcopy(config)
    plugins = {spec["type"]: spec for spec in config["plugins"]}
    profile = config["schedulingProfiles"][0]
    if change == "misspelt parameter":
        plugins["precise-prefix-cache-producer"]["parameters"]["kvEventsConfig"][
            "podDiscoveryConfig"
        ]["socketport"] = 5557
    elif change == "unknown type":
        plugins["queue-scorer"]["type"] = "queue-depth-scorer"
    elif change == "undeclared pluginRef":
        profile["plugins"].append({"pluginRef": "session-affinity-scorer", "weight": 1})
    elif change == "undeclared extractor":
        config["dataLayer"]["sources"][1]["extractors"] = [{"pluginRef": "precise-scorer"}]
    elif change == "producer name":
        plugins["prefix-cache-scorer"]["parameters"]["prefixMatchInfoProducerName"] = "precise"
    elif change == "two pickers":
        profile["plugins"].append({"pluginRef": "max-score-picker"})
    elif change == "no handler":
        config["plugins"].remove(plugins["single-profile-handler"])
    elif change == "old apiVersion":
        config["apiVersion"] = "inference.networking.x-k8s.io/v1alpha1"
    elif change == "scorer without weight":
        del profile["plugins"][0]["weight"]
    elif change == "unknown top-level key":
        config["data"] = config.pop("dataLayer")
    return config


@pytest.mark.parametrize(
    "change",
    [
        "misspelt parameter",
        "unknown type",
        "undeclared pluginRef",
        "undeclared extractor",
        "producer name",
        "two pickers",
        "no handler",
        "old apiVersion",
        "scorer without weight",
        "unknown top-level key",
    ],
)
def test_a_broken_picker_config_is_caught(change: str) -> None:
    assert config_problems(broken(loaded_config(), change)) != []


def test_the_picker_runs_restricted() -> None:
    epp, container = picker()
    pod = epp["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
    context = container["securityContext"]
    assert context["allowPrivilegeEscalation"] is False
    assert context["capabilities"]["drop"] == ["ALL"]
    assert context["readOnlyRootFilesystem"] is True
    assert epp["spec"]["replicas"] == 1  # no leader election, no leases Role


def test_the_release_is_recorded_where_people_look() -> None:
    for path in (LLM_D / "epp.yaml", ROOT / "deploy" / "README.md"):
        text = path.read_text()
        assert RELEASE in text and RELEASE_COMMIT[:8] in text, path
    assert RELEASE in (LLM_D / "kustomization.yaml").read_text()
