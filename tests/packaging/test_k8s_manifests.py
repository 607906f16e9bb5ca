"""The Kubernetes manifests: valid against the API schemas of the oldest and newest Kubernetes
releases kubernetes-validate carries (offline), the ServiceMonitor against the operator's shape,
and the wiring between them (config, mounts, ports, labels, capabilities)."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml

from kvwatch.config.load import load_config
from kvwatch.config.schema import AgentConfig, split_listen
from tests.packaging.conftest import AGENT_CAPABILITIES, PACKAGING

K8S = PACKAGING / "k8s"
KUBERNETES_VERSIONS = ["1.27.0", kubernetes_validate.utils.latest_version()]
NOT_CORE_API = ("kustomize.config.k8s.io/", "monitoring.coreos.com/")

# The fields of monitoring.coreos.com/v1 ServiceMonitor the manifest uses, as the operator's
# CRD defines them (required fields, types, duration pattern, relabel actions).
DURATION = "^(0|(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"
SERVICE_MONITOR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "metadata": {
            "type": "object",
            "required": ["name", "namespace"],
            "properties": {
                "labels": {"type": "object", "additionalProperties": {"type": "string"}}
            },
        },
        "spec": {
            "type": "object",
            "required": ["selector", "endpoints"],
            "additionalProperties": False,
            "properties": {
                "selector": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "matchLabels": {
                            "type": "object",
                            "additionalProperties": {"type": "string"},
                        }
                    },
                },
                "namespaceSelector": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "any": {"type": "boolean"},
                        "matchNames": {"type": "array", "items": {"type": "string"}},
                    },
                },
                "endpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "required": ["port"],
                        "properties": {
                            "port": {"type": "string"},
                            "path": {"type": "string", "pattern": "^/"},
                            "interval": {"type": "string", "pattern": DURATION},
                            "scrapeTimeout": {"type": "string", "pattern": DURATION},
                            "relabelings": {
                                "type": "array",
                                "items": {
                                    "type": "object",
                                    "additionalProperties": False,
                                    "properties": {
                                        "sourceLabels": {
                                            "type": "array",
                                            "items": {
                                                "type": "string",
                                                "pattern": "^[a-zA-Z_][a-zA-Z0-9_]*$",
                                            },
                                        },
                                        "targetLabel": {"type": "string"},
                                        "action": {
                                            "enum": [
                                                "replace",
                                                "keep",
                                                "drop",
                                                "hashmod",
                                                "labelmap",
                                                "labeldrop",
                                                "labelkeep",
                                                "lowercase",
                                                "uppercase",
                                                "keepequal",
                                                "dropequal",
                                            ]
                                        },
                                    },
                                },
                            },
                        },
                    },
                },
            },
        },
    },
}


def documents() -> list[tuple[str, dict[str, Any]]]:
    return [
        (path.name, document)
        for path in sorted(K8S.glob("*.yaml"))
        for document in yaml.safe_load_all(path.read_text())
        if document
    ]


def by_kind() -> dict[str, dict[str, Any]]:
    kinds: dict[str, dict[str, Any]] = {}
    for _, document in documents():
        assert document["kind"] not in kinds, f"two {document['kind']}s"
        kinds[document["kind"]] = document
    return kinds


@pytest.fixture(scope="module")
def kinds() -> dict[str, dict[str, Any]]:
    return by_kind()


@pytest.fixture(scope="module")
def agent_config(kinds: dict[str, dict[str, Any]]) -> AgentConfig:
    with tempfile.NamedTemporaryFile("w", suffix=".toml") as file:
        file.write(kinds["ConfigMap"]["data"]["kvwatch.toml"])
        file.flush()
        return load_config(file.name, {}, {})


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_core_manifests_are_valid_for_kubernetes(version: str) -> None:
    checked = []
    for _, document in documents():
        if document["apiVersion"].startswith(NOT_CORE_API):
            continue
        kubernetes_validate.validate(document, version, strict=True)
        checked.append(document["kind"])
    assert sorted(checked) == ["ConfigMap", "DaemonSet", "Namespace", "Service"]


def test_service_monitor_has_the_operators_shape(kinds: dict[str, dict[str, Any]]) -> None:
    jsonschema.validate(kinds["ServiceMonitor"], SERVICE_MONITOR_SCHEMA)


def test_kustomization_lists_every_core_manifest(kinds: dict[str, dict[str, Any]]) -> None:
    listed = kinds["Kustomization"]["resources"]
    core = sorted(
        name
        for name, document in documents()
        if not document["apiVersion"].startswith(NOT_CORE_API)
    )
    assert sorted(listed) == core  # the ServiceMonitor is applied on its own (needs the CRD)


def pod_spec(kinds: dict[str, dict[str, Any]]) -> dict[str, Any]:
    spec: dict[str, Any] = kinds["DaemonSet"]["spec"]["template"]["spec"]
    return spec


def agent_container(kinds: dict[str, dict[str, Any]]) -> dict[str, Any]:
    (container,) = pod_spec(kinds)["containers"]
    return dict(container)


def mounts(kinds: dict[str, dict[str, Any]]) -> dict[str, tuple[dict[str, Any], dict[str, Any]]]:
    """Mount path -> (volumeMount, volume)."""
    volumes = {volume["name"]: volume for volume in pod_spec(kinds)["volumes"]}
    return {
        mount["mountPath"]: (mount, volumes[mount["name"]])
        for mount in agent_container(kinds)["volumeMounts"]
    }


def test_daemonset_uses_capabilities_not_privileged(kinds: dict[str, dict[str, Any]]) -> None:
    spec = pod_spec(kinds)
    assert spec["hostPID"] is True
    assert spec["automountServiceAccountToken"] is False  # no RBAC: the agent never calls the API
    security = agent_container(kinds)["securityContext"]
    assert security["privileged"] is False
    assert security["readOnlyRootFilesystem"] is True
    assert security["capabilities"]["drop"] == ["ALL"]
    added = {f"CAP_{name}" for name in security["capabilities"]["add"]}
    assert added == AGENT_CAPABILITIES  # the same set as the systemd unit's


def test_host_paths_the_agent_reads(
    kinds: dict[str, dict[str, Any]], agent_config: AgentConfig
) -> None:
    paths = mounts(kinds)
    args = agent_container(kinds)["args"]
    procfs = args[args.index("--path.procfs") + 1]
    assert procfs == agent_config.path.procfs == "/host/proc"
    for mount_path, host_path in (
        (procfs, "/proc"),
        ("/sys/kernel/tracing", "/sys/kernel/tracing"),
        ("/sys/kernel/btf", "/sys/kernel/btf"),
    ):
        mount, volume = paths[mount_path]
        assert volume["hostPath"]["path"] == host_path
        assert mount["readOnly"] is True, mount_path


def test_engine_socket_directory_is_shared_through_the_host(
    kinds: dict[str, dict[str, Any]], agent_config: AgentConfig
) -> None:
    directory = str(Path(agent_config.hook.socket).parent)
    mount, volume = mounts(kinds)[directory]
    assert volume["hostPath"] == {"path": directory, "type": "DirectoryOrCreate"}
    assert not mount.get("readOnly", False)


def test_config_is_mounted_where_the_agent_reads_it(kinds: dict[str, dict[str, Any]]) -> None:
    args = agent_container(kinds)["args"]
    config_path = Path(args[args.index("--config") + 1])
    _, volume = mounts(kinds)[str(config_path.parent)]
    assert volume["configMap"]["name"] == kinds["ConfigMap"]["metadata"]["name"]
    assert config_path.name in kinds["ConfigMap"]["data"]


def test_gpu_nodes_resources_and_probes(
    kinds: dict[str, dict[str, Any]], agent_config: AgentConfig
) -> None:
    spec = pod_spec(kinds)
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec[
        "tolerations"
    ]
    container = agent_container(kinds)
    for kind in ("requests", "limits"):
        assert {"cpu", "memory"} <= set(container["resources"][kind])
    (port,) = container["ports"]
    assert port["containerPort"] == split_listen(agent_config.http.listen)[1]
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": port["name"]}


def test_service_and_monitor_select_the_agent(kinds: dict[str, dict[str, Any]]) -> None:
    pod_labels = kinds["DaemonSet"]["spec"]["template"]["metadata"]["labels"]
    service = kinds["Service"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    (service_port,) = service["spec"]["ports"]
    assert service_port["targetPort"] == agent_container(kinds)["ports"][0]["name"]
    monitor = kinds["ServiceMonitor"]
    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    )
    assert [e["port"] for e in monitor["spec"]["endpoints"]] == [service_port["name"]]
    namespaces = {doc["metadata"].get("namespace") for _, doc in documents() if "metadata" in doc}
    assert namespaces == {None, kinds["Namespace"]["metadata"]["name"]}
