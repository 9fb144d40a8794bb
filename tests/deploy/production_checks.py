"""Checks of what a RayService needs on a real GPU cluster (issue 60): placement, weights,
secrets, disruption, head loss, rollouts, pod security, shared memory, logs and KubeRay's probes.

Each returns the problems it found (empty: none), so a test shows it passing on the shipped
manifests and failing on a broken copy. KubeRay's behaviour they lean on is quoted from its
v1.7.0 source where it matters (the hash it compares, the labels it puts on pods).
"""

from __future__ import annotations

import copy
import json
from typing import Any

import yaml

from tests.deploy.manifest_checks import cluster, env_of, groups, ray_container

GPU_GROUP, CPU_GROUP = "gpu-synthesizer", "cpu-ingress"
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"
GPU_TAINT_KEY = "nvidia.com/gpu"
# Volume types the restricted Pod Security standard allows.
RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral",
                      "persistentVolumeClaim", "projected", "secret"}


def pod_spec(group: dict[str, Any]) -> dict[str, Any]:
    return group["template"]["spec"]


def all_containers(group: dict[str, Any]) -> list[dict[str, Any]]:
    spec = pod_spec(group)
    return [*spec.get("initContainers", []), *spec["containers"]]


def serve_config(manifest: dict[str, Any]) -> dict[str, Any]:
    return yaml.safe_load(manifest["spec"]["serveConfigV2"])


def deployment(manifest: dict[str, Any], name: str) -> dict[str, Any]:
    (app,) = serve_config(manifest)["applications"]
    return {d["name"]: d for d in app["deployments"]}[name]


def _expressions(group: dict[str, Any]) -> list[dict[str, Any]]:
    terms = (pod_spec(group).get("affinity", {}).get("nodeAffinity", {})
             .get("requiredDuringSchedulingIgnoredDuringExecution", {})
             .get("nodeSelectorTerms", []))
    return [e for term in terms for e in term.get("matchExpressions", [])]


def tolerates_gpu_taint(group: dict[str, Any]) -> bool:
    return any(t.get("key") in (GPU_TAINT_KEY, None) and t.get("operator") in ("Exists", None)
               for t in pod_spec(group).get("tolerations", []))


def placement_problems(manifest: dict[str, Any], products: tuple[str, ...]) -> list[str]:
    """The GPU group only on nodes of ``products``, tolerating the GPU taint; the head and the
    CPU group off every GPU node (no GPU product label, no toleration)."""
    problems = []
    for name, group in groups(manifest):
        expressions = _expressions(group)
        if name == GPU_GROUP:
            pinned = [e for e in expressions if e["key"] == GPU_PRODUCT_LABEL
                      and e["operator"] == "In"]
            if len(pinned) != 1 or set(pinned[0]["values"]) != set(products):
                problems.append(f"{name}: not pinned to {products} by {GPU_PRODUCT_LABEL}")
            if not tolerates_gpu_taint(group):
                problems.append(f"{name}: no toleration for the {GPU_TAINT_KEY} taint")
        else:
            if not any(e["key"] == GPU_PRODUCT_LABEL and e["operator"] == "DoesNotExist"
                       for e in expressions):
                problems.append(f"{name}: may land on a GPU node")
            if tolerates_gpu_taint(group):
                problems.append(f"{name}: tolerates the GPU taint")
    return problems


def kuberay_hashed_spec(manifest: dict[str, Any]) -> str:
    """What KubeRay 1.7 compares to decide a RayService's cluster changed: the cluster spec
    with tolerations, scheduling gates, replicas, min/max and upgradeStrategy muted
    (utils.GenerateHashWithoutReplicasAndWorkersToDelete), as canonical JSON."""
    spec = copy.deepcopy(cluster(manifest))
    spec.pop("upgradeStrategy", None)
    pod_specs = [spec["headGroupSpec"]["template"]["spec"]]
    for group in spec.get("workerGroupSpecs", []):
        for key in ("replicas", "minReplicas", "maxReplicas"):
            group.pop(key, None)
        group.get("scaleStrategy", {}).pop("workersToDelete", None)
        pod_specs.append(group["template"]["spec"])
    for pod in pod_specs:
        pod.pop("tolerations", None)
        pod.pop("schedulingGates", None)
    return json.dumps(spec, sort_keys=True)


def tolerations_annotation_problems(manifest: dict[str, Any], annotation: str) -> list[str]:
    """Each pod template with tolerations repeats them in ``annotation`` (which KubeRay does
    hash), so a changed toleration rolls out a new cluster."""
    problems = []
    for name, group in groups(manifest):
        tolerations = pod_spec(group).get("tolerations")
        noted = group["template"].get("metadata", {}).get("annotations", {}).get(annotation)
        if tolerations and (noted is None or json.loads(noted) != tolerations):
            problems.append(f"{name}: tolerations not in the hashed annotation {annotation}")
    return problems


def stop_problems(manifest: dict[str, Any], drain_setting: str, teardown_s: int) -> list[str]:
    """Every worker: Ray's drain covers the longest replica shutdown plus the Synthesizer's
    drain, and the pod's grace period covers the drain plus Ray's teardown."""
    (app,) = serve_config(manifest)["applications"]
    wanted = (max(d.get("graceful_shutdown_timeout_s", 20) for d in app["deployments"])
              + app["args"]["api"]["drain_timeout_s"])
    problems = []
    for name, group in groups(manifest):
        drain = env_of(ray_container(group)).get(drain_setting)
        grace = pod_spec(group).get("terminationGracePeriodSeconds", 30)
        if drain is None:
            problems.append(f"{name}: no {drain_setting} (Ray's 30 s)")
            continue
        if name != "head" and float(drain) < wanted:
            problems.append(f"{name}: drains {drain} s, replicas need {wanted}")
        if grace < float(drain) + teardown_s:
            problems.append(f"{name}: grace {grace} s < drain {drain} + teardown {teardown_s}")
    return problems


def head_loss_and_auth_problems(manifest: dict[str, Any]) -> list[str]:
    """GCS fault tolerance in Redis with its password from a Secret, each RayCluster in its own
    storage namespace (KubeRay's default, the cluster's UID: a rollout's new cluster never reads
    the old one's state), and token auth on the dashboard from a Secret."""
    spec = cluster(manifest)
    options = spec.get("gcsFaultToleranceOptions") or {}
    problems = []
    if not options.get("redisAddress"):
        problems.append("no GCS fault tolerance: losing the head loses the cluster")
    if "secretKeyRef" not in (options.get("redisPassword") or {}).get("valueFrom", {}):
        problems.append("Redis's password is not from a Secret")
    if options.get("externalStorageNamespace"):
        problems.append("one storage namespace for every RayCluster of the service")
    auth = spec.get("authOptions") or {}
    if auth.get("mode") != "token" or not auth.get("secretName"):
        problems.append("the dashboard takes no token from a Secret")
    return problems


def pod_labels(manifest: dict[str, Any], name: str) -> dict[str, str]:
    """The labels a pod of group ``name`` carries: its template's and KubeRay's own
    (ray.io/group, ray.io/node-type; the head's group is named headgroup)."""
    group = dict(groups(manifest))[name]
    own = group["template"].get("metadata", {}).get("labels", {})
    return {**own, "ray.io/group": "headgroup" if name == "head" else name,
            "ray.io/node-type": "head" if name == "head" else "worker",
            "ray.io/is-ray-node": "yes"}


def disruption_problems(manifest: dict[str, Any], budgets: list[dict[str, Any]],
                        do_not_disrupt: dict[str, str]) -> list[str]:
    """A budget selects the head (none unavailable) and the GPU and CPU groups (at most one);
    the head and GPU pods carry the node autoscalers' do-not-disrupt annotations."""
    wanted = {"head": 0, GPU_GROUP: 1, CPU_GROUP: 1}
    problems = []
    for name, most in wanted.items():
        labels = pod_labels(manifest, name)
        covering = [b for b in budgets
                    if b["spec"]["selector"]["matchLabels"].items() <= labels.items()]
        if not covering:
            problems.append(f"{name}: no PodDisruptionBudget selects its pods")
        elif any(b["spec"].get("maxUnavailable", 1) > most for b in covering):
            problems.append(f"{name}: a budget lets more than {most} go at once")
    for name in ("head", GPU_GROUP):
        annotations = dict(groups(manifest))[name]["template"]["metadata"].get("annotations", {})
        if not do_not_disrupt.items() <= annotations.items():
            problems.append(f"{name}: no do-not-disrupt annotations")
    return problems


def spread_problems(manifest: dict[str, Any], min_pods: int) -> list[str]:
    """At least ``min_pods`` CPU pods, one per node (a hard spread on the hostname counted per
    RayCluster), and at least as many Ingress replicas."""
    group = dict(groups(manifest))[CPU_GROUP]
    problems = []
    if group.get("minReplicas", 0) < min_pods:
        problems.append(f"{CPU_GROUP}: minReplicas {group.get('minReplicas')} < {min_pods}")
    labels = pod_labels(manifest, CPU_GROUP)
    hard = [c for c in pod_spec(group).get("topologySpreadConstraints", [])
            if c["topologyKey"] == "kubernetes.io/hostname" and c["maxSkew"] == 1
            and c["whenUnsatisfiable"] == "DoNotSchedule"
            and c["labelSelector"]["matchLabels"].items() <= labels.items()
            and "ray.io/cluster" in c.get("matchLabelKeys", [])]
    if not hard:
        problems.append(f"{CPU_GROUP}: not spread one per node")
    ingress_min = deployment(manifest, "Ingress")["autoscaling_config"]["min_replicas"]
    if ingress_min < min_pods:
        problems.append(f"Ingress min_replicas {ingress_min} < {min_pods} pods")
    return problems


def security_problems(manifest: dict[str, Any]) -> list[str]:
    """The restricted Pod Security standard on every pod and container, the autoscaler's too."""
    problems = []
    for name, group in groups(manifest):
        spec = pod_spec(group)
        pod_security = spec.get("securityContext", {})
        for container in all_containers(group):
            security = {**pod_security, **container.get("securityContext", {})}
            where = f"{name}/{container['name']}"
            if security.get("runAsNonRoot") is not True or security.get("runAsUser") == 0:
                problems.append(f"{where}: may run as root")
            if container.get("securityContext", {}).get("allowPrivilegeEscalation") is not False:
                problems.append(f"{where}: allowPrivilegeEscalation is not false")
            if "ALL" not in container.get("securityContext", {}).get("capabilities", {}).get(
                    "drop", []):
                problems.append(f"{where}: capabilities not dropped")
            if security.get("seccompProfile", {}).get("type") not in ("RuntimeDefault",
                                                                      "Localhost"):
                problems.append(f"{where}: no seccomp profile")
        for volume in spec.get("volumes", []):
            kinds = set(volume) - {"name"}
            if not kinds <= RESTRICTED_VOLUMES:
                problems.append(f"{name}: volume {volume['name']} of type {kinds}")
    autoscaler = cluster(manifest).get("autoscalerOptions", {}).get("securityContext", {})
    if (autoscaler.get("allowPrivilegeEscalation") is not False
            or "ALL" not in autoscaler.get("capabilities", {}).get("drop", [])
            or autoscaler.get("runAsNonRoot") is not True):
        problems.append("autoscaler: not restricted")
    return problems


def _gib(quantity: str) -> float:
    units = {"Gi": 1.0, "Mi": 1 / 1024, "Ti": 1024.0}
    for unit, scale in units.items():
        if quantity.endswith(unit):
            return float(quantity[:-len(unit)]) * scale
    return float(quantity) / 2**30


def shared_memory_problems(manifest: dict[str, Any]) -> list[str]:
    """Each pod's object store fits its /dev/shm (else Ray puts it in /tmp)."""
    problems = []
    for name, group in groups(manifest):
        store = group.get("rayStartParams", {}).get("object-store-memory")
        volumes = {v["name"]: v for v in pod_spec(group).get("volumes", [])}
        mounts = [m["name"] for m in ray_container(group).get("volumeMounts", [])
                  if m["mountPath"] == "/dev/shm"]
        shm = volumes.get(mounts[0], {}).get("emptyDir", {}) if mounts else {}
        if store is None or shm.get("medium") != "Memory" or "sizeLimit" not in shm:
            problems.append(f"{name}: object store or /dev/shm unsized")
        elif int(store) / 2**30 >= _gib(shm["sizeLimit"]):
            problems.append(f"{name}: object store {int(store) / 2**30:.1f} GiB does not fit "
                            f"/dev/shm {shm['sizeLimit']}")
    return problems


def logs_problems(manifest: dict[str, Any], logs_mount: str) -> list[str]:
    """Ray's logs on a volume a sidecar that outlives Ray (a native sidecar: an init container
    that restarts Always) reads and ships."""
    problems = []
    for name, group in groups(manifest):
        ray_mounts = {m["mountPath"]: m["name"] for m in ray_container(group)["volumeMounts"]}
        volume = ray_mounts.get(logs_mount)
        shippers = [c for c in pod_spec(group).get("initContainers", [])
                    if c.get("restartPolicy") == "Always"
                    and any(m["name"] == volume for m in c.get("volumeMounts", []))]
        if volume is None or not shippers:
            problems.append(f"{name}: Ray's logs ({logs_mount}) go with the pod")
    return problems


def probe_problems(manifest: dict[str, Any]) -> list[str]:
    """No probe of our own on a Ray container: KubeRay then injects its raylet (and GCS, on the
    head) checks, and on a RayService's workers Serve's proxy check on the port named serve."""
    return [f"{name}: {probe} replaces KubeRay's" for name, group in groups(manifest)
            for probe in ("readinessProbe", "livenessProbe") if probe in ray_container(group)]
