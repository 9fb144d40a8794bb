"""The pods of the RayServices that scripts/write_rayservices.py writes: where each group may run,
what it mounts, how it stops, how it is secured, and the PodDisruptionBudgets beside them.

Names of Secrets, volumes and labels live here as constants; docs/operations.md ("Kubernetes")
tells the operator to create the Secrets under these names.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

# Labels GPU feature discovery (NVIDIA's GPU operator) puts on GPU nodes: the product name NVML
# reports, spaces as dashes. A GPU group is pinned to the products its profile fits.
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"
# The taint GPU node pools carry (GKE puts it on every GPU pool; on EKS and elsewhere the docs
# have the operator add it), so that nothing but a GPU pod lands on a GPU node.
GPU_TAINT = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
# Copied into the pod template's annotations: KubeRay leaves tolerations out of the hash that
# decides whether a RayService's cluster changed (GenerateHashWithoutReplicasAndWorkersToDelete,
# KubeRay 1.7), so without this a changed toleration would never reach a running cluster.
TOLERATIONS_ANNOTATION = "minicpmo-serve/tolerations"
# Node autoscalers (Karpenter, Cluster Autoscaler) leave a node alone while such a pod runs on it:
# the head holds the cluster, a GPU pod its replica and the weights it loaded. Ray's autoscaler
# removes an idle GPU pod itself, after which the empty node goes.
DO_NOT_DISRUPT = {"karpenter.sh/do-not-disrupt": "true",
                  "cluster-autoscaler.kubernetes.io/safe-to-evict": "false"}
APP_LABEL = "app.kubernetes.io/name"
INSTANCE_LABEL = "app.kubernetes.io/instance"
APP_NAME = "minicpmo-serve"

# The image's user is ray:users (1000:100); the restricted Pod Security standard.
RUN_AS_USER, RUN_AS_GROUP = 1000, 100
POD_SECURITY = {"runAsNonRoot": True, "runAsUser": RUN_AS_USER, "runAsGroup": RUN_AS_GROUP,
                "fsGroup": RUN_AS_GROUP, "seccompProfile": {"type": "RuntimeDefault"}}
CONTAINER_SECURITY = {"runAsNonRoot": True, "allowPrivilegeEscalation": False,
                      "capabilities": {"drop": ["ALL"]},
                      "seccompProfile": {"type": "RuntimeDefault"}}

# Secrets the operator creates (docs/operations.md, "Kubernetes"), by name and key.
PULL_SECRET = "tts-registry"
API_KEYS_SECRET, API_KEYS_KEY = "tts-api-keys", "keys"
API_KEYS_MOUNT = "/etc/tts/api-keys"
RAY_TOKEN_SECRET = "tts-ray-token"     # key auth_token: KubeRay's authOptions.secretName
REDIS_SECRET, REDIS_PASSWORD_KEY = "tts-redis", "password"
HF_TOKEN_SECRET, HF_TOKEN_KEY = "tts-hf-token", "token"

# The checkpoints: one ReadWriteMany volume a Job fills once per model and revision, mounted
# read-only by every GPU pod, so no pod downloads 17 GB into its container layer.
WEIGHTS_CLAIM = "tts-weights"
WEIGHTS_MOUNT = "/mnt/weights"
# MiniCPM-o 2.6 in bf16 is 17 GB; room for it, the int4 checkpoint and one revision beside each
# while a new one is rolled out.
WEIGHTS_SIZE = "80Gi"

# Ray's logs (/tmp/ray) on a volume a log-shipping sidecar reads, so they outlive the pod: Fluent
# Bit tails them and writes every line to its stdout, which the cluster's log collector keeps.
LOGS_VOLUME = "ray-logs"    # KubeRay's own name for /tmp/ray: it adds none of its own then
LOGS_MOUNT = "/tmp/ray"
LOGS_SIZE_GIB = 10
LOG_SIDECAR_IMAGE = "fluent/fluent-bit:3.2.10"
LOG_SIDECAR = "ray-logs"
# The pod's writable layer beside the logs volume: Triton's and torch's caches, pip's none.
EPHEMERAL_STORAGE_GIB = 20

# Ray's shared memory: the object store lives in /dev/shm only if /dev/shm is larger than the
# store (else Ray falls back to /tmp). The service moves chunks over gRPC, not the store.
OBJECT_STORE_GIB = 2
SHM_GIB = OBJECT_STORE_GIB + 1

# On SIGTERM `ray start --block` (the container's process: KubeRay's `bash -c` execs it as its
# last command, as bash 5.2 did here) drains its node for up to this setting's seconds.
DRAIN_SETTING = "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"
# After the drain Ray ends the node's processes (SIGTERM, then SIGKILL): room for that.
TEARDOWN_S = 30
# The head runs no replica: Ray's own drain default.
HEAD_DRAIN_S = 30


@dataclass(frozen=True)
class Stop:
    """How long a worker pod takes to stop: Ray's drain and the pod's grace period after it."""

    drain_s: int
    grace_s: int


def worker_stop(serve_config: dict[str, Any]) -> Stop:
    """A replica leaving a draining node finishes its streams within its deployment's
    ``graceful_shutdown_timeout_s``, and the Synthesizer's engine waits ``api.drain_timeout_s``
    more: Ray's drain covers the longest of those, the grace period the drain and teardown."""
    (app,) = serve_config["applications"]
    longest = max(d.get("graceful_shutdown_timeout_s", 20) for d in app["deployments"])
    drain_s = int(longest + app["args"]["api"]["drain_timeout_s"])
    return Stop(drain_s, drain_s + TEARDOWN_S)


def gpu_affinity(products: tuple[str, ...]) -> dict[str, Any]:
    return {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [
            {"key": GPU_PRODUCT_LABEL, "operator": "In", "values": list(products)}]}]}}}


def off_gpu_nodes() -> dict[str, Any]:
    """Nodes without a GPU product label; with no toleration for the GPU taint, the head and
    the CPU group stay off GPU nodes both ways."""
    return {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [
            {"key": GPU_PRODUCT_LABEL, "operator": "DoesNotExist"}]}]}}}


def spread(instance: str, group: str, when_unsatisfiable: str) -> list[dict[str, Any]]:
    """One pod of the group per node (and across zones where it can), counted per RayCluster:
    during a rollout the old cluster's pods do not count against the new one's."""
    selector = {"matchLabels": {INSTANCE_LABEL: instance, "ray.io/group": group}}
    return [
        {"maxSkew": 1, "topologyKey": "kubernetes.io/hostname",
         "whenUnsatisfiable": when_unsatisfiable, "labelSelector": selector,
         "matchLabelKeys": ["ray.io/cluster"]},
        {"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone",
         "whenUnsatisfiable": "ScheduleAnyway", "labelSelector": selector,
         "matchLabelKeys": ["ray.io/cluster"]},
    ]


def log_sidecar(image: str) -> dict[str, Any]:
    """Fluent Bit as a native sidecar (an init container that keeps running, Kubernetes 1.29+):
    it starts before Ray and stops after it, so the last lines are shipped too."""
    logs = f"{LOGS_MOUNT}/session_latest/logs"
    return {
        "name": LOG_SIDECAR,
        "image": image,
        "restartPolicy": "Always",
        "args": ["-q", "-i", "tail", "-p", f"path={logs}/*.log,{logs}/serve/*.log",
                 "-p", "path_key=file", "-p", "refresh_interval=5",
                 "-o", "stdout", "-p", "match=*", "-p", "format=json_lines"],
        "resources": {"requests": {"cpu": "100m", "memory": "128Mi"},
                      "limits": {"cpu": "100m", "memory": "128Mi"}},
        "securityContext": dict(CONTAINER_SECURITY),
        "volumeMounts": [{"name": LOGS_VOLUME, "mountPath": LOGS_MOUNT, "readOnly": True}],
    }


def pod_template(instance: str, container: dict[str, Any], volumes: list[dict[str, Any]],
                 affinity: dict[str, Any], grace_s: int, log_image: str,
                 tolerations: list[dict[str, Any]] | None = None,
                 spread_over: list[dict[str, Any]] | None = None,
                 annotations: dict[str, str] | None = None,
                 metrics_port: int = 8080) -> dict[str, Any]:
    container = {**container, "securityContext": dict(CONTAINER_SECURITY)}
    container["volumeMounts"] = [*container.get("volumeMounts", []),
                                 {"name": LOGS_VOLUME, "mountPath": LOGS_MOUNT}]
    metadata_annotations = {"prometheus.io/scrape": "true",
                            "prometheus.io/port": str(metrics_port), **(annotations or {})}
    if tolerations:
        metadata_annotations[TOLERATIONS_ANNOTATION] = json.dumps(tolerations, sort_keys=True)
    spec: dict[str, Any] = {
        # Autoscaler v2 replaces a failed Ray node with a new pod; a container restarted in
        # place would rejoin as a node Ray already counted dead (KubeRay refuses other values
        # with v2).
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": grace_s,
        "securityContext": dict(POD_SECURITY),
        "imagePullSecrets": [{"name": PULL_SECRET}],
        "affinity": affinity,
        "initContainers": [log_sidecar(log_image)],
        "containers": [container],
        "volumes": [{"name": "shm", "emptyDir": {"medium": "Memory",
                                                 "sizeLimit": f"{SHM_GIB}Gi"}},
                    {"name": LOGS_VOLUME, "emptyDir": {"sizeLimit": f"{LOGS_SIZE_GIB}Gi"}},
                    *volumes],
    }
    if tolerations:
        spec["tolerations"] = tolerations
    if spread_over:
        spec["topologySpreadConstraints"] = spread_over
    return {"metadata": {"labels": {APP_LABEL: APP_NAME, INSTANCE_LABEL: instance},
                         "annotations": metadata_annotations},
            "spec": spec}


def disruption_budgets(instance: str) -> list[dict[str, Any]]:
    """Voluntary evictions (node drains, upgrades): never the head (a new head is a minute
    without Serve's controller and autoscaler, even with GCS fault tolerance), one GPU pod and
    one CPU pod at a time, each draining its streams within its grace period."""
    def budget(suffix: str, selector: dict[str, str], max_unavailable: int) -> dict[str, Any]:
        return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
                "metadata": {"name": f"{instance}-{suffix}"},
                "spec": {"maxUnavailable": max_unavailable,
                         "selector": {"matchLabels": {INSTANCE_LABEL: instance, **selector}}}}

    return [budget("head", {"ray.io/node-type": "head"}, 0),
            budget("gpu", {"ray.io/group": "gpu-synthesizer"}, 1),
            budget("ingress", {"ray.io/group": "cpu-ingress"}, 1)]


def weights_folder(model: str, revision: str) -> str:
    """Where the weights Job puts ``model`` at ``revision`` on the weights volume."""
    return f"{WEIGHTS_MOUNT}/{model}/{revision}"


def weights_job(model: str, revision: str, image: str, include: list[str]) -> dict[str, Any]:
    """A Job that downloads ``model`` at ``revision`` (only the files the engine reads) onto
    the weights volume, with HF_TOKEN from its Secret where the model needs one."""
    name = "tts-weights-" + "".join(c if c.isalnum() else "-" for c in model.lower().split("/")[-1])
    patterns = [arg for pattern in include for arg in ("--include", pattern)]
    container = {
        "name": "download",
        "image": image,
        "command": ["hf", "download", model, "--revision", revision,
                    "--local-dir", weights_folder(model, revision), *patterns],
        "env": [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {
                    "name": HF_TOKEN_SECRET, "key": HF_TOKEN_KEY, "optional": True}}},
                {"name": "HF_HOME", "value": "/tmp/hf"}],
        "resources": {"requests": {"cpu": "2", "memory": "4Gi", "ephemeral-storage": "2Gi"},
                      "limits": {"cpu": "2", "memory": "4Gi", "ephemeral-storage": "2Gi"}},
        "securityContext": dict(CONTAINER_SECURITY),
        "volumeMounts": [{"name": "weights", "mountPath": WEIGHTS_MOUNT}],
    }
    return {
        "apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": name[:63]},
        "spec": {"backoffLimit": 3, "template": {"spec": {
            "restartPolicy": "OnFailure",
            "securityContext": dict(POD_SECURITY),
            "imagePullSecrets": [{"name": PULL_SECRET}],
            "affinity": off_gpu_nodes(),
            "containers": [container],
            "volumes": [{"name": "weights",
                         "persistentVolumeClaim": {"claimName": WEIGHTS_CLAIM}}]}}},
    }
