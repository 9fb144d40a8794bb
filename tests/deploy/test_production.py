"""What a real GPU cluster needs of every RayService (issue 60), each shown passing on the shipped
manifests (or on what the script writes to apply) and failing on a broken copy: GPU placement,
the weights' volume and pins, Secrets and auth, stopping and disruption, head loss, spread, pod
security, shared memory, logs, KubeRay's probes, metrics by cluster and rollouts at size."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from scripts import kuberay_pods as pods
from scripts import write_rayservices as writer
from tests.deploy import production_checks as prod
from tests.deploy.manifest_checks import cluster, env_of, groups, operator_problems, ray_container
from tests.deploy.manifest_checks import schema_problems
from tests.deploy import manifest_checks as mc

PROFILES = {profile.serve_config: profile for profile in writer.GPU_PROFILES}
COMMIT = "c" * 40
IMAGE = "registry.example.com/minicpmo-serve@sha256:" + "d" * 64
# GPU memory of the products the profiles name (GB), and each profile's measured peak (its
# serve config's comments): a product must hold the peak.
GPU_MEMORY_GB = {"NVIDIA-H100-80GB-HBM3": 80, "NVIDIA-H200": 141, "NVIDIA-A10G": 24}
PEAK_GB = {"serve_config.yaml": 67.6, "serve_config.chat.yaml": 67.6,
           "serve_config.h200.yaml": 100.6, "serve_config.a10g.yaml": 19.2}


def documents(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


@pytest.fixture(scope="module", params=sorted(PROFILES))
def profile(request: pytest.FixtureRequest) -> writer.GpuProfile:
    return PROFILES[request.param]


@pytest.fixture()
def shipped_documents(profile: writer.GpuProfile) -> list[dict[str, Any]]:
    return documents(writer.OUT_DIR / profile.manifest)


@pytest.fixture()
def manifest(shipped_documents: list[dict[str, Any]]) -> dict[str, Any]:
    return shipped_documents[0]


def group(manifest: dict[str, Any], name: str) -> dict[str, Any]:
    return dict(groups(manifest))[name]


def applied(profile: writer.GpuProfile, **release: Any) -> dict[str, Any]:
    """What the operator applies: the image by digest, the weights by commit."""
    return writer.rayservice(profile, writer.Release(IMAGE, COMMIT, **release))[0]


# --- placement ---------------------------------------------------------------------------------

def test_gpu_pods_on_their_gpu_and_nothing_else_on_gpu_nodes(
        profile: writer.GpuProfile, manifest: dict[str, Any]) -> None:
    assert prod.placement_problems(manifest, profile.gpu_products) == []
    assert all(GPU_MEMORY_GB[product] > PEAK_GB[profile.serve_config]
               for product in profile.gpu_products)


def test_the_h200_profile_never_lands_on_an_80_gb_gpu() -> None:
    assert PROFILES["serve_config.h200.yaml"].gpu_products == ("NVIDIA-H200",)


@pytest.mark.parametrize("breakage", ["no-toleration", "no-pin", "cpu-tolerates", "head-anywhere"])
def test_misplaced_pods_fail(profile: writer.GpuProfile, manifest: dict[str, Any],
                             breakage: str) -> None:
    gpu, cpu = prod.pod_spec(group(manifest, prod.GPU_GROUP)), prod.pod_spec(
        group(manifest, prod.CPU_GROUP))
    if breakage == "no-toleration":
        gpu.pop("tolerations")
    elif breakage == "no-pin":
        gpu.pop("affinity")
    elif breakage == "cpu-tolerates":
        cpu["tolerations"] = [dict(pods.GPU_TAINT)]
    else:
        prod.pod_spec(group(manifest, "head")).pop("affinity")
    assert prod.placement_problems(manifest, profile.gpu_products) != []


def test_a_changed_toleration_reaches_kuberays_hash(profile: writer.GpuProfile,
                                                    manifest: dict[str, Any],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """KubeRay mutes tolerations in the hash that decides whether the cluster changed; the
    annotation that repeats them is hashed, so a new toleration rolls out a new cluster."""
    assert prod.tolerations_annotation_problems(manifest, pods.TOLERATIONS_ANNOTATION) == []
    monkeypatch.setattr(pods, "GPU_TAINT", {**pods.GPU_TAINT, "effect": "NoExecute"})
    changed = writer.rayservice(profile, writer.Release(writer.default_image()))[0]
    assert prod.kuberay_hashed_spec(changed) != prod.kuberay_hashed_spec(manifest)
    # without the annotation KubeRay would not see the change
    for spec in (changed, manifest):
        for _, each in groups(spec):
            each["template"]["metadata"]["annotations"].pop(pods.TOLERATIONS_ANNOTATION, None)
    assert prod.kuberay_hashed_spec(changed) == prod.kuberay_hashed_spec(manifest)
    assert prod.tolerations_annotation_problems(changed, pods.TOLERATIONS_ANNOTATION) != []


# --- weights, pins, Secrets ------------------------------------------------------------------

def test_gpu_pods_read_the_weights_from_a_volume_never_the_hub(profile: writer.GpuProfile) -> None:
    manifest = applied(profile)
    options = prod.serve_config(manifest)["applications"][0]["args"]["engine_options"]
    assert options["revision"] == COMMIT
    gpu = group(manifest, prod.GPU_GROUP)
    mounts = {m["mountPath"]: m for m in ray_container(gpu)["volumeMounts"]}
    assert mounts[pods.WEIGHTS_MOUNT]["readOnly"] is True
    assert options["model"].startswith(pods.WEIGHTS_MOUNT + "/") and COMMIT in options["model"]
    assert env_of(ray_container(gpu))["HF_HUB_OFFLINE"] == "1"
    volumes = {v["name"]: v for v in prod.pod_spec(gpu)["volumes"]}
    assert volumes[mounts[pods.WEIGHTS_MOUNT]["name"]]["persistentVolumeClaim"][
        "claimName"] == pods.WEIGHTS_CLAIM
    # the Job puts that model at that revision exactly there, HF_TOKEN from its Secret
    written = writer.manifests(writer.Release(IMAGE, COMMIT), Path("/nowhere"))
    jobs = [d for d in yaml.safe_load_all(written[Path("/nowhere/tts-weights.yaml")])
            if d["kind"] == "Job"]
    commands = [j["spec"]["template"]["spec"]["containers"][0]["command"] for j in jobs]
    assert any(options["model"] in command and COMMIT in command for command in commands)
    for job in jobs:
        env = {e["name"]: e for e in job["spec"]["template"]["spec"]["containers"][0]["env"]}
        assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == pods.HF_TOKEN_SECRET


def test_every_container_asks_for_its_ephemeral_storage(manifest: dict[str, Any]) -> None:
    for name, each in groups(manifest):
        for container in prod.all_containers(each):
            if container["name"] != pods.LOG_SIDECAR:
                assert "ephemeral-storage" in container["resources"]["requests"], name


@pytest.mark.parametrize("flags, message", [
    (["--image", "registry.example.com/tts:0.1.0", "--model-revision", COMMIT], "digest"),
    (["--image", IMAGE], "model-revision"),
    (["--image", IMAGE, "--model-revision", "main"], "40 hex"),
    (["--image", IMAGE, "--model-revision", COMMIT, "--gpu-replicas", "9"], "outside"),
])
def test_what_is_applied_must_be_pinned(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                        flags: list[str], message: str) -> None:
    assert writer.main(["--out", str(tmp_path), *flags]) == 2
    assert message in capsys.readouterr().err
    assert not list(tmp_path.iterdir())
    assert writer.main(["--out", str(tmp_path), "--image", IMAGE,
                        "--model-revision", COMMIT]) == 0


def test_the_api_takes_keys_from_a_secret(manifest: dict[str, Any]) -> None:
    api = prod.serve_config(manifest)["applications"][0]["args"]["api"]
    assert api["api_key"] is None and api["api_keys_file"]
    cpu = group(manifest, prod.CPU_GROUP)
    mounted = {m["mountPath"]: m["name"] for m in ray_container(cpu)["volumeMounts"]}
    folder = str(Path(api["api_keys_file"]).parent)
    volumes = {v["name"]: v for v in prod.pod_spec(cpu)["volumes"]}
    assert volumes[mounted[folder]]["secret"]["secretName"] == pods.API_KEYS_SECRET
    assert Path(api["api_keys_file"]).name == pods.API_KEYS_KEY


def test_redis_and_the_dashboard_token_come_from_secrets(manifest: dict[str, Any]) -> None:
    spec = cluster(manifest)
    password = spec["gcsFaultToleranceOptions"]["redisPassword"]
    assert password["valueFrom"]["secretKeyRef"] == {"name": pods.REDIS_SECRET,
                                                     "key": pods.REDIS_PASSWORD_KEY}
    assert spec["authOptions"] == {"mode": "token", "secretName": pods.RAY_TOKEN_SECRET}
    for _, each in groups(manifest):
        assert prod.pod_spec(each)["imagePullSecrets"] == [{"name": pods.PULL_SECRET}]


def test_head_loss_and_dashboard_auth(manifest: dict[str, Any]) -> None:
    assert prod.head_loss_and_auth_problems(manifest) == []


@pytest.mark.parametrize("breakage", ["no-ft", "plain-password", "shared-namespace", "no-auth"])
def test_without_fault_tolerance_or_auth_fails(manifest: dict[str, Any], breakage: str) -> None:
    spec = cluster(manifest)
    if breakage == "no-ft":
        spec.pop("gcsFaultToleranceOptions")
    elif breakage == "plain-password":
        spec["gcsFaultToleranceOptions"]["redisPassword"] = {"value": "hunter2"}
    elif breakage == "shared-namespace":
        spec["gcsFaultToleranceOptions"]["externalStorageNamespace"] = "tts"
    else:
        spec["authOptions"] = {"mode": "disabled"}
    assert prod.head_loss_and_auth_problems(manifest) != []


def test_the_operators_fault_tolerance_and_auth_rules(manifest: dict[str, Any]) -> None:
    assert mc.cluster(manifest)["gcsFaultToleranceOptions"]["redisAddress"]
    assert mc.cluster(manifest)["authOptions"]["mode"] == "token"
    assert mc.fault_tolerance_and_auth_problems(manifest) == []


@pytest.mark.parametrize("breakage", ["password-param", "address-env", "old-ray", "k8s-auth"])
def test_fault_tolerance_or_auth_set_twice_fails(manifest: dict[str, Any],
                                                  breakage: str) -> None:
    head = mc.cluster(manifest)["headGroupSpec"]
    if breakage == "password-param":
        head["rayStartParams"]["redis-password"] = "secret"
    elif breakage == "address-env":
        mc.ray_container(head)["env"].append({"name": "RAY_REDIS_ADDRESS", "value": "r:6379"})
    elif breakage == "old-ray":
        mc.cluster(manifest)["rayVersion"] = "2.51.0"
    else:
        mc.cluster(manifest)["authOptions"]["enableK8sTokenAuth"] = True
    assert mc.operator_problems(manifest) != []


# --- stopping and disruption -----------------------------------------------------------------

def test_pods_stop_after_their_streams(profile: writer.GpuProfile,
                                       manifest: dict[str, Any]) -> None:
    assert prod.stop_problems(manifest, pods.DRAIN_SETTING, pods.TEARDOWN_S) == []
    synthesizer = prod.deployment(manifest, "Synthesizer")
    api = prod.serve_config(manifest)["applications"][0]["args"]["api"]
    drain = int(env_of(ray_container(group(manifest, prod.GPU_GROUP)))[pods.DRAIN_SETTING])
    assert drain >= synthesizer["graceful_shutdown_timeout_s"] + api["drain_timeout_s"] > 30


@pytest.mark.parametrize("breakage", ["grace", "drain", "no-drain"])
def test_a_pod_killed_before_its_streams_end_fails(manifest: dict[str, Any],
                                                   breakage: str) -> None:
    gpu = group(manifest, prod.GPU_GROUP)
    env = ray_container(gpu)["env"]
    if breakage == "grace":
        prod.pod_spec(gpu)["terminationGracePeriodSeconds"] = 30
    elif breakage == "drain":
        next(e for e in env if e["name"] == pods.DRAIN_SETTING)["value"] = "30"
    else:
        env[:] = [e for e in env if e["name"] != pods.DRAIN_SETTING]
    assert prod.stop_problems(manifest, pods.DRAIN_SETTING, pods.TEARDOWN_S) != []


def test_disruption_budgets_and_annotations(shipped_documents: list[dict[str, Any]]) -> None:
    manifest, budgets = shipped_documents[0], shipped_documents[1:]
    assert {b["kind"] for b in budgets} == {"PodDisruptionBudget"}
    assert prod.disruption_problems(manifest, budgets, pods.DO_NOT_DISRUPT) == []


@pytest.mark.parametrize("breakage", ["head-budget", "loose-gpu", "gpu-annotation", "labels"])
def test_a_missing_budget_fails(shipped_documents: list[dict[str, Any]], breakage: str) -> None:
    manifest, budgets = shipped_documents[0], shipped_documents[1:]
    if breakage == "head-budget":
        budgets = [b for b in budgets if not b["metadata"]["name"].endswith("-head")]
    elif breakage == "loose-gpu":
        next(b for b in budgets if b["metadata"]["name"].endswith("-gpu"))["spec"][
            "maxUnavailable"] = 2
    elif breakage == "gpu-annotation":
        group(manifest, prod.GPU_GROUP)["template"]["metadata"]["annotations"].pop(
            "karpenter.sh/do-not-disrupt")
    else:
        for _, each in groups(manifest):
            each["template"]["metadata"]["labels"].pop(pods.INSTANCE_LABEL)
    assert prod.disruption_problems(manifest, budgets, pods.DO_NOT_DISRUPT) != []


# --- head loss and spread --------------------------------------------------------------------

def test_two_cpu_pods_at_least_one_per_node(manifest: dict[str, Any]) -> None:
    assert prod.spread_problems(manifest, writer.MIN_CPU_PODS) == []


@pytest.mark.parametrize("breakage", ["one-pod", "no-spread", "one-ingress"])
def test_cpu_pods_together_fail(manifest: dict[str, Any], breakage: str) -> None:
    cpu = group(manifest, prod.CPU_GROUP)
    if breakage == "one-pod":
        cpu["minReplicas"] = cpu["replicas"] = 1
    elif breakage == "no-spread":
        prod.pod_spec(cpu).pop("topologySpreadConstraints")
    else:
        text = manifest["spec"]["serveConfigV2"]
        config = yaml.safe_load(text)
        ingress = {d["name"]: d for d in config["applications"][0]["deployments"]}["Ingress"]
        ingress["autoscaling_config"]["min_replicas"] = 1
        manifest["spec"]["serveConfigV2"] = yaml.safe_dump(config)
    assert prod.spread_problems(manifest, writer.MIN_CPU_PODS) != []


# --- pod security, shared memory, logs, probes, metrics --------------------------------------

def test_every_pod_is_restricted(manifest: dict[str, Any]) -> None:
    assert prod.security_problems(manifest) == []


@pytest.mark.parametrize("breakage", ["root", "escalation", "caps", "seccomp", "hostpath",
                                      "autoscaler"])
def test_an_unrestricted_pod_fails(manifest: dict[str, Any], breakage: str) -> None:
    gpu = group(manifest, prod.GPU_GROUP)
    spec, container = prod.pod_spec(gpu), ray_container(gpu)
    if breakage == "root":
        container["securityContext"]["runAsUser"] = 0
    elif breakage == "escalation":
        container["securityContext"].pop("allowPrivilegeEscalation")
    elif breakage == "caps":
        spec["initContainers"][0]["securityContext"]["capabilities"] = {}
    elif breakage == "seccomp":
        spec["securityContext"].pop("seccompProfile")
        container["securityContext"].pop("seccompProfile")
    elif breakage == "hostpath":
        spec["volumes"].append({"name": "host", "hostPath": {"path": "/var"}})
    else:
        cluster(manifest)["autoscalerOptions"].pop("securityContext")
    assert prod.security_problems(manifest) != []


def test_the_object_store_fits_dev_shm(manifest: dict[str, Any]) -> None:
    assert prod.shared_memory_problems(manifest) == []
    shm = next(v for v in prod.pod_spec(group(manifest, prod.GPU_GROUP))["volumes"]
               if v["name"] == "shm")
    shm["emptyDir"]["sizeLimit"] = "2Gi"   # the old size: the 2 GiB store no longer fits
    assert prod.shared_memory_problems(manifest) != []


def test_logs_outlive_the_pod(manifest: dict[str, Any]) -> None:
    assert prod.logs_problems(manifest, pods.LOGS_MOUNT) == []
    prod.pod_spec(group(manifest, prod.CPU_GROUP))["initContainers"][0].pop("restartPolicy")
    assert prod.logs_problems(manifest, pods.LOGS_MOUNT) != []


def test_kuberays_probes_are_kept(manifest: dict[str, Any]) -> None:
    """KubeRay's worker readiness asks the raylet and Serve's proxy at -/healthz on the port
    named serve (HAProxy answers it); a probe of ours would replace the raylet check."""
    assert prod.probe_problems(manifest) == []
    ray_container(group(manifest, prod.CPU_GROUP))["readinessProbe"] = {
        "httpGet": {"path": "/-/healthz", "port": "serve"}}
    assert prod.probe_problems(manifest) != []


def test_the_engine_is_never_cpu_throttled(manifest: dict[str, Any]) -> None:
    resources = ray_container(group(manifest, prod.GPU_GROUP))["resources"]
    assert "cpu" in resources["requests"] and "cpu" not in resources["limits"]
    assert resources["requests"]["memory"] == resources["limits"]["memory"]


def test_metrics_name_their_cluster() -> None:
    monitor = documents(writer.OUT_DIR / "podmonitor.yaml")[0]
    for endpoint in monitor["spec"]["podMetricsEndpoints"]:
        assert {"sourceLabels": ["__meta_kubernetes_pod_label_ray_io_cluster"],
                "targetLabel": "ray_io_cluster"} in endpoint["relabelings"]


# --- rollouts at size ------------------------------------------------------------------------

def test_a_rollout_starts_the_new_cluster_at_the_running_size(profile: writer.GpuProfile) -> None:
    """KubeRay's NewCluster copies the groups' replicas into the new RayCluster; the serve
    config's initial_replicas has Serve start that many Synthesizers on it, so traffic moves
    to a cluster as large as the old one. Both stay inside the CRD and the operator's rules, and
    applying it changes nothing KubeRay hashes (it starts no rollout by itself)."""
    scaled = applied(profile, gpu_replicas=4)
    gpu = group(scaled, prod.GPU_GROUP)
    assert (gpu["replicas"], gpu["minReplicas"], gpu["maxReplicas"]) == (4, 1, 4)
    synthesizer = prod.deployment(scaled, "Synthesizer")["autoscaling_config"]
    assert synthesizer["initial_replicas"] == 4 and synthesizer["min_replicas"] == 1
    ingress = prod.deployment(scaled, "Ingress")["autoscaling_config"]
    assert ingress["min_replicas"] <= ingress["initial_replicas"] <= ingress["max_replicas"]
    cpu = group(scaled, prod.CPU_GROUP)
    assert cpu["replicas"] * writer.CPU_POD_CORES >= ingress["initial_replicas"]
    assert schema_problems(scaled) == [] and operator_problems(scaled) == []
    assert prod.kuberay_hashed_spec(scaled) == prod.kuberay_hashed_spec(applied(profile))
    from ray.serve.schema import ServeDeploySchema
    ServeDeploySchema.model_validate(prod.serve_config(scaled))


def test_applied_manifests_pass_every_check(profile: writer.GpuProfile) -> None:
    manifest = applied(profile, gpu_replicas=2)
    assert ray_container(group(manifest, prod.GPU_GROUP))["image"] == IMAGE
    assert schema_problems(manifest) == [] and operator_problems(manifest) == []
    assert prod.placement_problems(manifest, profile.gpu_products) == []
    assert prod.security_problems(manifest) == []
    assert json.dumps(manifest).count(writer.UNPINNED) == 0
