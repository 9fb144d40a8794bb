"""The RayServices in deploy/kuberay/ are what scripts/write_rayservices.py writes from the shipped
serve configs, pass KubeRay 1.7.0's CRD schema (unknown fields refused) and the operator's own
rules, carry what the issue asks of them (HAProxy, the serve port, the voice store, metrics, the
GPU group's bounds), and their serveConfigV2 passes Ray's ServeDeploySchema and build_app's own
check. Each check is shown failing on a broken copy."""

from __future__ import annotations

import copy
import dataclasses
import math
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError
from ray.serve.schema import ServeDeploySchema

from scripts import write_rayservices as writer
from serve_app.app import build_app
from serve_app.config import ApiConfig
from tests.deploy import manifest_checks as checks

ROOT = Path(__file__).resolve().parents[2]
PROFILES = {profile.serve_config: profile for profile in writer.GPU_PROFILES}


def load_all(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def load(path: Path) -> dict[str, Any]:
    """The file's first document (a RayService file's RayService; its budgets follow)."""
    return load_all(path)[0]


@pytest.fixture(scope="module", params=sorted(PROFILES))
def profile(request: pytest.FixtureRequest) -> writer.GpuProfile:
    return PROFILES[request.param]


@pytest.fixture()
def manifest(profile: writer.GpuProfile) -> dict[str, Any]:
    """The committed manifest, a fresh copy per test (the broken-copy tests mutate it)."""
    return load(writer.OUT_DIR / profile.manifest)


@pytest.fixture(scope="module")
def claims() -> dict[str, dict[str, Any]]:
    documents = [d for path in writer.OUT_DIR.glob("*.yaml") for d in load_all(path)]
    return {d["metadata"]["name"]: d for d in documents if d["kind"] == "PersistentVolumeClaim"}


def shipped(profile: writer.GpuProfile) -> dict[str, Any]:
    return load(ROOT / profile.serve_config)


def serve_config_of(manifest: dict[str, Any]) -> dict[str, Any]:
    return yaml.safe_load(manifest["spec"]["serveConfigV2"])


def deployment(config: dict[str, Any], name: str) -> dict[str, Any]:
    return {d["name"]: d for d in config["applications"][0]["deployments"]}[name]


def worker_group(manifest: dict[str, Any], name: str) -> dict[str, Any]:
    return dict(checks.groups(manifest))[name]


# --- the files are the generator's, and it covers every GPU profile ---------------------------

def test_every_gpu_profile_has_a_rayservice() -> None:
    gpu_profiles = sorted(
        path.name for path in ROOT.glob("serve_config*.yaml")
        if deployment(load(path), "Synthesizer")["ray_actor_options"].get("num_gpus", 0) >= 1)
    assert sorted(PROFILES) == gpu_profiles, "add the profile to GPU_PROFILES and rerun the script"


def test_the_committed_files_are_what_the_script_writes() -> None:
    written = writer.manifests(writer.Release(writer.default_image()))
    stale = [str(path.relative_to(ROOT)) for path, text in written.items()
             if not path.is_file() or path.read_text() != text]
    assert not stale, f"rerun: .venv/bin/python -m scripts.write_rayservices ({stale})"


PINNED = ["--image", "registry.example.com/tts@sha256:" + "a" * 64,
          "--model-revision", "b" * 40]


def test_the_scripts_check_fails_where_a_file_differs(tmp_path: Path) -> None:
    out = ["--out", str(tmp_path), *PINNED]
    assert writer.main(["--check", *out]) == 1  # nothing written yet
    assert writer.main(out) == 0
    assert writer.main(["--check", *out]) == 0
    (tmp_path / "rayservice.yaml").write_text("# edited by hand\n")
    assert writer.main(["--check", *out]) == 1


def expected_serve_config(shipped_config: dict[str, Any]) -> dict[str, Any]:
    """The shipped config with the changes the script makes: the shared voice volume, the API
    keys' Secret, the weights' volume at the template's revision, two Ingress replicas at
    least (one per CPU pod)."""
    expected = copy.deepcopy(shipped_config)
    args = expected["applications"][0]["args"]
    args["api"]["voice_store"] = writer.VOICE_STORE_MOUNT
    args["api"]["api_keys_file"] = "/etc/tts/api-keys/keys"
    model = args["engine_options"]["model"]
    args["engine_options"]["model"] = f"/mnt/weights/{model}/{writer.UNPINNED}"
    args["engine_options"]["revision"] = writer.UNPINNED
    ingress = deployment(expected, "Ingress")["autoscaling_config"]
    ingress["min_replicas"] = max(ingress["min_replicas"], 2)
    return expected


def test_serve_config_v2_is_the_shipped_config_but_the_voice_store(
        profile: writer.GpuProfile, manifest: dict[str, Any]) -> None:
    assert serve_config_of(manifest) == expected_serve_config(shipped(profile))


def test_a_changed_serve_config_is_drift(profile: writer.GpuProfile, manifest: dict[str, Any],
                                         tmp_path: Path) -> None:
    """Both checks above fail once the shipped config changes and the script is not rerun."""
    changed = tmp_path / profile.serve_config
    changed.write_text(re.sub(r"max_replicas: (\d+)", lambda m: f"max_replicas: {int(m[1]) + 1}",
                              (ROOT / profile.serve_config).read_text(), count=1))
    assert serve_config_of(manifest) != expected_serve_config(load(changed))
    rewritten = writer.rayservice(dataclasses.replace(profile, serve_config=str(changed)),
                                  writer.Release(writer.default_image()))[0]
    assert writer.render(rewritten, []) != writer.render(manifest, [])


# --- KubeRay 1.7.0's CRD schema, unknown fields refused ---------------------------------------

def test_passes_the_crd_schema_with_unknown_fields_refused(manifest: dict[str, Any]) -> None:
    assert checks.schema_problems(manifest) == []


def test_the_schema_refuses_a_misspelt_field_the_open_crd_would_let_through(
        manifest: dict[str, Any]) -> None:
    checks.cluster(manifest)["enableInTreeAutoscalling"] = True
    assert checks.schema_problems(manifest, checks.crd_schema()) == []  # the API server prunes it
    problems = checks.schema_problems(manifest)
    assert any("enableInTreeAutoscalling" in problem for problem in problems), problems


def test_the_schema_refuses_a_misspelt_field_deep_in_a_pod(manifest: dict[str, Any]) -> None:
    checks.ray_container(worker_group(manifest, "gpu-synthesizer"))["readinesProbe"] = {}
    assert any("readinesProbe" in problem for problem in checks.schema_problems(manifest))


def test_the_schema_refuses_a_wrong_type(manifest: dict[str, Any]) -> None:
    worker_group(manifest, "gpu-synthesizer")["maxReplicas"] = "four"
    assert any("maxReplicas" in problem for problem in checks.schema_problems(manifest))


def test_closing_keeps_fields_kubernetes_preserves() -> None:
    schema = {"type": "object", "properties": {
        "kept": {"type": "object", "properties": {"a": {"type": "string"}},
                 "x-kubernetes-preserve-unknown-fields": True},
        "strict": {"type": "object", "properties": {"a": {"type": "string"}}}}}
    closed = checks.closed(schema)
    assert "additionalProperties" not in closed["properties"]["kept"]
    assert closed["properties"]["strict"]["additionalProperties"] is False
    assert closed["additionalProperties"] is False


# --- the operator's rules the schema cannot express -------------------------------------------

def test_passes_the_operators_rules(manifest: dict[str, Any]) -> None:
    assert checks.operator_problems(manifest) == []


@pytest.mark.parametrize("group_name", ["cpu-ingress", "gpu-synthesizer"])
def test_min_above_max_replicas_fails(manifest: dict[str, Any], group_name: str) -> None:
    group = worker_group(manifest, group_name)
    group["minReplicas"] = group["maxReplicas"] + 1
    assert any("minReplicas" in problem for problem in checks.operator_problems(manifest))


def test_autoscaler_v1_fails(manifest: dict[str, Any]) -> None:
    checks.cluster(manifest)["autoscalerOptions"]["version"] = "v1"
    assert any("not v2" in problem for problem in checks.operator_problems(manifest))


def test_autoscaler_off_fails(manifest: dict[str, Any]) -> None:
    checks.cluster(manifest)["enableInTreeAutoscaling"] = False
    assert any("enableInTreeAutoscaling" in p for p in checks.operator_problems(manifest))


def test_the_old_autoscaler_v2_env_beside_the_version_fails(manifest: dict[str, Any]) -> None:
    head = checks.ray_container(checks.cluster(manifest)["headGroupSpec"])
    head["env"].append({"name": checks.AUTOSCALER_V2_ENV, "value": "true"})
    assert any(checks.AUTOSCALER_V2_ENV in p for p in checks.operator_problems(manifest))


@pytest.mark.parametrize("group_name", ["head", "cpu-ingress", "gpu-synthesizer"])
def test_a_pod_restarted_in_place_fails_with_autoscaler_v2(manifest: dict[str, Any],
                                                           group_name: str) -> None:
    dict(checks.groups(manifest))[group_name]["template"]["spec"]["restartPolicy"] = "Always"
    assert any(f"{group_name}: restartPolicy" in p for p in checks.operator_problems(manifest))


def test_resources_twice_fails(manifest: dict[str, Any]) -> None:
    worker_group(manifest, "gpu-synthesizer")["resources"] = {"CPU": "2"}
    assert any("both" in problem for problem in checks.operator_problems(manifest))


def test_an_unknown_upgrade_strategy_fails(manifest: dict[str, Any]) -> None:
    manifest["spec"]["upgradeStrategy"]["type"] = "BlueGreen"
    assert any("upgradeStrategy" in problem for problem in checks.operator_problems(manifest))


def test_a_name_too_long_for_its_clusters_fails(manifest: dict[str, Any]) -> None:
    manifest["metadata"]["name"] = "t" * (checks.MAX_RAYSERVICE_NAME_CHARS + 1)
    assert any("DNS-1035" in problem for problem in checks.operator_problems(manifest))


def test_the_serve_port_is_named_and_is_the_configs(profile: writer.GpuProfile,
                                                    manifest: dict[str, Any]) -> None:
    port = serve_config_of(manifest)["http_options"]["port"]
    assert port == writer.SERVE_PORT == 8000
    assert checks.serve_port_problems(manifest, port) == []


def test_a_serve_port_by_another_name_fails(manifest: dict[str, Any]) -> None:
    ports = checks.ray_container(worker_group(manifest, "cpu-ingress"))["ports"]
    next(p for p in ports if p["name"] == "serve")["name"] = "http"
    assert checks.serve_port_problems(manifest, 8000) != []


def test_a_serve_port_off_the_configs_fails(manifest: dict[str, Any]) -> None:
    assert checks.serve_port_problems(manifest, 8001) != []


# --- serveConfigV2: Ray's schema and build_app's own check ------------------------------------

def test_serve_config_v2_passes_rays_serve_deploy_schema(manifest: dict[str, Any]) -> None:
    ServeDeploySchema.model_validate(serve_config_of(manifest))


def test_a_broken_serve_config_v2_fails_rays_schema(manifest: dict[str, Any]) -> None:
    config = serve_config_of(manifest)
    deployment(config, "Ingress")["max_ongoing_requests"] = 0
    with pytest.raises(ValidationError, match="max_ongoing_requests"):
        ServeDeploySchema.model_validate(config)


def test_serve_config_v2_has_no_key_rays_schemas_lack(manifest: dict[str, Any]) -> None:
    assert checks.serve_config_unknown_keys(serve_config_of(manifest)) == []


@pytest.mark.parametrize("where", ["deployment", "autoscaling", "application"])
def test_a_misspelt_serve_option_is_named(manifest: dict[str, Any], where: str) -> None:
    """Ray's schema accepts these and Serve would run with the default instead."""
    config = serve_config_of(manifest)
    ingress = deployment(config, "Ingress")
    if where == "deployment":
        ingress["max_ongoing_request"] = ingress.pop("max_ongoing_requests")
    elif where == "autoscaling":
        scaling = ingress["autoscaling_config"]
        scaling["downscale_delay"] = scaling.pop("downscale_delay_s")
    else:
        config["applications"][0]["route_prefx"] = config["applications"][0].pop("route_prefix")
    ServeDeploySchema.model_validate(config)  # let through by Ray's own check ...
    assert len(checks.serve_config_unknown_keys(config)) == 1  # ... named by this one


def test_serve_config_v2_builds_the_app(manifest: dict[str, Any]) -> None:
    """What `serve deploy` runs on the head, without loading any model: the args' check."""
    (app,) = serve_config_of(manifest)["applications"]
    assert build_app(app["args"]) is not None


def test_a_misspelt_engine_option_fails_build_app(manifest: dict[str, Any]) -> None:
    (app,) = serve_config_of(manifest)["applications"]
    app["args"]["engine_options"]["max_slot"] = app["args"]["engine_options"].pop("max_slots")
    with pytest.raises(ValidationError, match="max_slot"):
        build_app(app["args"])


# --- what the issue asks of the manifests -----------------------------------------------------

def test_ray_is_the_locked_version(manifest: dict[str, Any]) -> None:
    assert checks.cluster(manifest)["rayVersion"] == writer.locked_version("ray") == "2.60.0"


def test_haproxy_in_every_container(manifest: dict[str, Any]) -> None:
    assert checks.haproxy_env_problems(manifest, writer.RAY_ENV) == []
    assert writer.RAY_ENV == {"RAY_SERVE_ENABLE_HA_PROXY": "1",
                              "RAY_SERVE_DEFAULT_HTTP_HOST": "0.0.0.0",
                              "RAY_SERVE_HAPROXY_HARD_STOP_AFTER_S": "900"}


def test_a_reloaded_haproxy_keeps_its_connections_for_the_longest_stream() -> None:
    """HAProxy closes a reloaded-out process's connections after RAY_SERVE_HAPROXY_HARD_STOP_AFTER_S
    (Ray's 120 s cut three-minute streams 120 s after a new app was added: docs/benchmarks/
    README.md, "A rollout that keeps capacity"): no profile's stream runs longer."""
    from serve_app.ingress_env import LONGEST_STREAM_S
    for path in sorted(ROOT.glob("serve_config*.yaml")):
        for app in yaml.safe_load(path.read_text())["applications"]:
            longest = app.get("args", {}).get("api", {}).get("max_stream_s", ApiConfig().max_stream_s)
            assert longest <= LONGEST_STREAM_S, path


def test_a_container_without_haproxy_fails(manifest: dict[str, Any]) -> None:
    checks.ray_container(worker_group(manifest, "gpu-synthesizer"))["env"].pop(0)
    assert checks.haproxy_env_problems(manifest, writer.RAY_ENV) != []


def test_the_probed_path_and_haproxys_metrics_port_are_ray_2_60s() -> None:
    """What the probe asks (and the PodMonitor scrapes) is what Ray's HAProxy config answers:
    its health route on the serve port, its Prometheus exporter's default port."""
    from ray.serve._private.haproxy import HAProxyConfig

    defaults = {field.name: field.default for field in dataclasses.fields(HAProxyConfig)}
    assert defaults["health_check_endpoint"] == checks.HAPROXY_HEALTH_PATH
    assert defaults["metrics_port"] == writer.HAPROXY_METRICS_PORT




def test_gpu_group_is_the_synthesizers_bounds(profile: writer.GpuProfile,
                                              manifest: dict[str, Any]) -> None:
    synthesizer = deployment(shipped(profile), "Synthesizer")
    scaling = synthesizer["autoscaling_config"]
    group = worker_group(manifest, "gpu-synthesizer")
    assert (group["minReplicas"], group["maxReplicas"]) == (scaling["min_replicas"],
                                                            scaling["max_replicas"])
    container = checks.ray_container(group)
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert group["rayStartParams"]["num-cpus"] == str(synthesizer["ray_actor_options"]["num_cpus"])
    assert group["idleTimeoutSeconds"] == scaling["downscale_delay_s"]
    assert checks.cluster(manifest)["autoscalerOptions"]["idleTimeoutSeconds"] \
        == scaling["downscale_delay_s"]


def test_no_gpu_outside_the_gpu_group(manifest: dict[str, Any]) -> None:
    for group_name, group in checks.groups(manifest):
        if group_name != "gpu-synthesizer":
            assert "nvidia.com/gpu" not in checks.ray_container(group)["resources"]["limits"]


def test_the_head_takes_no_replica(manifest: dict[str, Any]) -> None:
    head = checks.cluster(manifest)["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0"
    assert manifest["spec"]["excludeHeadPodFromServeSvc"] is True


def test_cpu_group_holds_the_ingress_replicas(profile: writer.GpuProfile,
                                              manifest: dict[str, Any]) -> None:
    config = shipped(profile)
    ingress = deployment(config, "Ingress")
    cores = ingress["ray_actor_options"]["num_cpus"]
    group = worker_group(manifest, "cpu-ingress")
    assert group["minReplicas"] * writer.CPU_POD_CORES >= ingress["autoscaling_config"][
        "min_replicas"] * cores
    assert group["minReplicas"] >= writer.MIN_CPU_PODS == 2
    size = writer.cpu_group_size(config)
    streams = deployment(config, "Synthesizer")["autoscaling_config"]["max_replicas"] \
        * writer.engine_slots(config)
    assert size.streams_at_gpu_max == streams
    wanted_cores = min(math.ceil(streams / writer.INGRESS_STREAMS_PER_CORE),
                       ingress["autoscaling_config"]["max_replicas"] * cores)
    assert group["maxReplicas"] == max(group["minReplicas"],
                                       math.ceil(wanted_cores / writer.CPU_POD_CORES))
    assert group["idleTimeoutSeconds"] == ingress["autoscaling_config"]["downscale_delay_s"]


def test_voice_store_is_one_shared_volume_at_the_configs_path(
        manifest: dict[str, Any], claims: dict[str, dict[str, Any]]) -> None:
    voice_store = serve_config_of(manifest)["applications"][0]["args"]["api"]["voice_store"]
    assert voice_store == writer.VOICE_STORE_MOUNT
    assert checks.voice_store_problems(manifest, claims, voice_store) == []


def test_a_voice_store_elsewhere_fails(manifest: dict[str, Any],
                                       claims: dict[str, dict[str, Any]]) -> None:
    assert checks.voice_store_problems(manifest, claims, "/home/ray/voices") != []
    rwo = copy.deepcopy(claims)
    rwo[writer.VOICE_STORE_CLAIM]["spec"]["accessModes"] = ["ReadWriteOnce"]
    assert checks.voice_store_problems(manifest, rwo, writer.VOICE_STORE_MOUNT) != []


def test_every_ray_pod_exports_metrics_prometheus_finds(manifest: dict[str, Any]) -> None:
    monitor = load(writer.OUT_DIR / "podmonitor.yaml")
    scraped = {endpoint["port"] for endpoint in monitor["spec"]["podMetricsEndpoints"]}
    for group_name, group in checks.groups(manifest):
        ports = {p["name"]: p["containerPort"] for p in checks.ray_container(group)["ports"]}
        assert ports["metrics"] == int(group["rayStartParams"]["metrics-export-port"]) == 8080
        assert scraped <= set(ports), group_name
        assert group["template"]["metadata"]["annotations"]["prometheus.io/port"] == "8080"


def test_upgrade_keeps_the_old_cluster_for_the_longest_stream(profile: writer.GpuProfile,
                                                              manifest: dict[str, Any]) -> None:
    api = shipped(profile)["applications"][0]["args"]["api"]
    assert manifest["spec"]["upgradeStrategy"] == {"type": "NewCluster"}
    assert manifest["spec"]["rayClusterDeletionDelaySeconds"] >= api["max_stream_s"]
