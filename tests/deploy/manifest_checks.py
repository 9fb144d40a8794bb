"""Checks of a RayService manifest: KubeRay 1.7.0's CRD schema with unknown fields refused, the
operator's rules the schema cannot express, and this project's own rules for its manifests.

Each check returns the problems it found (empty: none), so a test can show it passing on the
shipped manifests and failing on a broken copy. The operator's rules are written here by hand
from KubeRay's documented behaviour (its validation runs in the operator, in Go: nothing on PyPI
runs it); the schema check is the ``jsonschema`` package over the vendored CRD.
"""

from __future__ import annotations

import copy
import functools
import re
from pathlib import Path
from typing import Any, Iterator

import jsonschema
import yaml

ROOT = Path(__file__).resolve().parents[2]
CRD = ROOT / "deploy" / "kuberay" / "crd" / "ray.io_rayservices.yaml"
# KubeRay 1.7: a RayService's name leaves room for the RayCluster names made from it.
MAX_RAYSERVICE_NAME_CHARS = 47
DNS_1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
UPGRADE_TYPES = {"NewCluster", "NewClusterWithIncrementalUpgrade", "None"}
AUTOSCALER_V2_ENV = "RAY_enable_autoscaler_v2"
SERVE_PORT_NAME = "serve"
HAPROXY_HEALTH_PATH = "/-/healthz"


def closed(schema: dict[str, Any]) -> dict[str, Any]:
    """A copy of an OpenAPI v3 schema that refuses fields it does not list: every object schema
    with ``properties`` and no ``additionalProperties`` of its own gets ``additionalProperties:
    false``, except where ``x-kubernetes-preserve-unknown-fields`` keeps unknown fields (as the
    API server prunes unknown fields everywhere else, a misspelt one would vanish silently)."""
    schema = copy.deepcopy(schema)

    def close(node: Any) -> None:
        if isinstance(node, list):
            for item in node:
                close(item)
            return
        if not isinstance(node, dict):
            return
        if ("properties" in node and "additionalProperties" not in node
                and not node.get("x-kubernetes-preserve-unknown-fields")):
            node["additionalProperties"] = False
        for key in ("properties", "patternProperties"):
            for child in node.get(key, {}).values():
                close(child)
        for key in ("items", "additionalProperties", "not"):
            close(node.get(key))
        for key in ("allOf", "anyOf", "oneOf"):
            close(node.get(key, []))

    close(schema)
    return schema


@functools.cache
def crd_schema(version: str = "v1") -> dict[str, Any]:
    """The CRD's ``openAPIV3Schema`` for ``version``, as the operator installs it."""
    crd = yaml.safe_load(CRD.read_text())
    (served,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    return served["schema"]["openAPIV3Schema"]


@functools.cache
def closed_crd_schema() -> dict[str, Any]:
    return closed(crd_schema())


def schema_problems(manifest: dict[str, Any], schema: dict[str, Any] | None = None) -> list[str]:
    """Where ``manifest`` breaks the CRD's schema, unknown fields refused unless a schema is
    given (the CRD's own, open one, to show what closing it adds)."""
    validator = jsonschema.Draft202012Validator(schema or closed_crd_schema())
    return [f"{'.'.join(map(str, error.absolute_path)) or '<root>'}: {error.message}"
            for error in validator.iter_errors(manifest)]


def cluster(manifest: dict[str, Any]) -> dict[str, Any]:
    return manifest["spec"]["rayClusterConfig"]


def groups(manifest: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(name, group) for the head and each worker group."""
    yield "head", cluster(manifest)["headGroupSpec"]
    for group in cluster(manifest).get("workerGroupSpecs", []):
        yield group["groupName"], group


def ray_container(group: dict[str, Any]) -> dict[str, Any]:
    """KubeRay runs Ray in the pod's first container."""
    return group["template"]["spec"]["containers"][0]


def env_of(container: dict[str, Any]) -> dict[str, str]:
    return {item["name"]: item.get("value") for item in container.get("env", [])}


def operator_problems(manifest: dict[str, Any]) -> list[str]:
    """KubeRay 1.7's own checks of a RayService that its schema cannot express."""
    problems = []
    name = manifest["metadata"]["name"]
    if len(name) > MAX_RAYSERVICE_NAME_CHARS or not DNS_1035_LABEL.match(name):
        problems.append(f"name {name!r}: a DNS-1035 label of at most "
                        f"{MAX_RAYSERVICE_NAME_CHARS} characters")
    upgrade = manifest["spec"].get("upgradeStrategy", {}).get("type")
    if upgrade is not None and upgrade not in UPGRADE_TYPES:
        problems.append(f"upgradeStrategy.type {upgrade!r} is not one of {sorted(UPGRADE_TYPES)}")
    if upgrade == "NewClusterWithIncrementalUpgrade" and not (
            cluster(manifest).get("enableInTreeAutoscaling")
            and manifest["spec"]["upgradeStrategy"].get("clusterUpgradeOptions")):
        problems.append("NewClusterWithIncrementalUpgrade needs the autoscaler and "
                        "clusterUpgradeOptions")
    for group_name, group in groups(manifest):
        if not group["template"]["spec"].get("containers"):
            problems.append(f"{group_name}: no container")
        start = group.get("rayStartParams", {})
        if group.get("resources") and any(start.get(key) for key in
                                          ("num-cpus", "num-gpus", "memory", "resources")):
            problems.append(f"{group_name}: resources in both rayStartParams and resources")
        if group_name == "head":
            continue
        low, high = group.get("minReplicas", 0), group.get("maxReplicas", 2**31 - 1)
        if low < 0 or high < 0 or low > high:
            problems.append(f"{group_name}: minReplicas {low} > maxReplicas {high} or negative")
        if "replicas" in group and not low <= group["replicas"] <= high:
            problems.append(f"{group_name}: replicas {group['replicas']} outside [{low}, {high}]")
    problems += autoscaler_v2_problems(manifest)
    problems += fault_tolerance_and_auth_problems(manifest)
    return problems


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text)[:3])


def fault_tolerance_and_auth_problems(manifest: dict[str, Any]) -> list[str]:
    """KubeRay 1.7's rules for GCS fault tolerance and token auth (ValidateRayClusterSpec,
    ValidateRayServiceSpec): Redis's address and password only through
    gcsFaultToleranceOptions, never beside it in the head's env or rayStartParams; token auth
    needs Ray 2.52 or later, and a RayService cannot use Kubernetes token auth."""
    spec = cluster(manifest)
    head = spec["headGroupSpec"]
    head_env = env_of(ray_container(head))
    problems = []
    options = spec.get("gcsFaultToleranceOptions")
    if options is None and "RAY_REDIS_ADDRESS" in head_env:
        problems.append("RAY_REDIS_ADDRESS without gcsFaultToleranceOptions")
    if options is not None:
        if head.get("rayStartParams", {}).get("redis-password"):
            problems.append("redis-password in rayStartParams beside gcsFaultToleranceOptions")
        for name in ("REDIS_PASSWORD", "RAY_REDIS_ADDRESS"):
            if name in head_env:
                problems.append(f"{name} in the head's env beside gcsFaultToleranceOptions")
        if "ray.io/external-storage-namespace" in manifest["metadata"].get("annotations", {}):
            problems.append("external-storage-namespace annotation beside "
                            "gcsFaultToleranceOptions")
        if options.get("backend", "redis") == "redis" and not options.get("redisAddress"):
            problems.append("gcsFaultToleranceOptions without redisAddress")
    if head.get("rayStartParams", {}).get("redis-username") or "REDIS_USERNAME" in head_env:
        problems.append("redis username outside gcsFaultToleranceOptions")
    auth = spec.get("authOptions") or {}
    if auth.get("mode") == "token" and _version(spec.get("rayVersion", "0")) < (2, 52, 0):
        problems.append("authOptions token needs rayVersion 2.52.0 or later")
    if auth.get("enableK8sTokenAuth"):
        problems.append("a RayService cannot use enableK8sTokenAuth")
    return problems


def autoscaler_v2_problems(manifest: dict[str, Any]) -> list[str]:
    """Autoscaler v2 as KubeRay 1.7 wants it asked for: ``autoscalerOptions.version: v2`` with
    the in-tree autoscaler on, not the old head env var beside it, and pods that are never
    restarted in place (``restartPolicy`` Never or unset)."""
    spec = cluster(manifest)
    problems = []
    head_env = env_of(ray_container(spec["headGroupSpec"]))
    version = spec.get("autoscalerOptions", {}).get("version")
    if not spec.get("enableInTreeAutoscaling"):
        problems.append("enableInTreeAutoscaling is not true")
    if version != "v2":
        problems.append(f"autoscalerOptions.version is {version!r}, not v2")
    if version is not None and AUTOSCALER_V2_ENV in head_env:
        problems.append(f"both autoscalerOptions.version and {AUTOSCALER_V2_ENV} are set")
    if spec.get("autoscalerOptions", {}).get("idleTimeoutSeconds", 0) < 0:
        problems.append("autoscalerOptions.idleTimeoutSeconds is negative")
    for group_name, group in groups(manifest):
        policy = group["template"]["spec"].get("restartPolicy")
        if policy not in (None, "Never"):
            problems.append(f"{group_name}: restartPolicy {policy} (autoscaler v2: Never)")
        if group.get("idleTimeoutSeconds", 0) < 0:
            problems.append(f"{group_name}: idleTimeoutSeconds is negative")
    return problems


def serve_port_problems(manifest: dict[str, Any], port: int) -> list[str]:
    """KubeRay's serve Service and its proxy checks find Serve at the port named ``serve`` of
    each Ray container; it must be the port the serve config listens on."""
    problems = []
    for group_name, group in groups(manifest):
        ports = {p.get("name"): p["containerPort"] for p in ray_container(group).get("ports", [])}
        if ports.get(SERVE_PORT_NAME) != port:
            problems.append(f"{group_name}: port {SERVE_PORT_NAME!r} is "
                            f"{ports.get(SERVE_PORT_NAME)}, not {port}")
    return problems


def haproxy_env_problems(manifest: dict[str, Any], wanted: dict[str, str]) -> list[str]:
    """Every container of every pod starts Ray with HAProxy in front, on all interfaces."""
    return [f"{group_name}/{container['name']}: {key}={env_of(container).get(key)!r}"
            for group_name, group in groups(manifest)
            for container in group["template"]["spec"]["containers"]
            for key, value in wanted.items() if env_of(container).get(key) != value]


def voice_store_problems(manifest: dict[str, Any], claims: dict[str, dict[str, Any]],
                         voice_store: str) -> list[str]:
    """Every worker mounts one ReadWriteMany claim at the serve config's ``api.voice_store``."""
    problems = []
    for group_name, group in groups(manifest):
        if group_name == "head":
            continue
        pod = group["template"]["spec"]
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        mounts = [m for m in ray_container(group).get("volumeMounts", [])
                  if m["mountPath"] == voice_store]
        claim_names = [volumes.get(m["name"], {}).get("persistentVolumeClaim", {})
                       .get("claimName") for m in mounts]
        if len(claim_names) != 1 or claim_names[0] not in claims:
            problems.append(f"{group_name}: no claim from deploy/kuberay mounted at {voice_store}")
        elif "ReadWriteMany" not in claims[claim_names[0]]["spec"]["accessModes"]:
            problems.append(f"{group_name}: claim {claim_names[0]} is not ReadWriteMany")
    return problems


def serve_config_unknown_keys(config: dict[str, Any]) -> list[str]:
    """Keys of a Serve config that Ray's schemas do not define. ``ServeDeploySchema`` lets them
    through and Serve ignores them, so a misspelt option (``autoscalng_config``) would silently
    run with the default; here it is named."""
    from ray.serve.config import AutoscalingConfig
    from ray.serve.schema import (
        DeploymentSchema,
        HTTPOptionsSchema,
        ServeApplicationSchema,
        ServeDeploySchema,
    )

    def unknown(where: str, values: dict[str, Any], model: Any) -> list[str]:
        return [f"{where}.{key}" for key in values if key not in model.model_fields]

    found = unknown("config", config, ServeDeploySchema)
    found += unknown("http_options", config.get("http_options") or {}, HTTPOptionsSchema)
    for app in config.get("applications", []):
        name = app.get("name", "?")
        found += unknown(f"applications[{name}]", app, ServeApplicationSchema)
        for deployment in app.get("deployments", []):
            where = f"applications[{name}].deployments[{deployment.get('name', '?')}]"
            found += unknown(where, deployment, DeploymentSchema)
            found += unknown(f"{where}.autoscaling_config",
                             deployment.get("autoscaling_config") or {}, AutoscalingConfig)
    return found
