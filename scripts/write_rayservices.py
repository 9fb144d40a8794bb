"""Write deploy/kuberay/: a KubeRay RayService (ray.io/v1, KubeRay 1.7) for each GPU profile,
its serveConfigV2 taken from the shipped serve config, with its PodDisruptionBudgets; the voice
store's and the weights' volume claims, the Job that fills the weights volume, and a PodMonitor.

    .venv/bin/python -m scripts.write_rayservices            # rewrite deploy/kuberay/*.yaml
    .venv/bin/python -m scripts.write_rayservices --check    # exit 1 where a file differs
    .venv/bin/python -m scripts.write_rayservices --out my-deploy/ \
        --image registry.example.com/tts@sha256:<digest> --model-revision <commit>
    ... --gpu-replicas 4                                     # a rollout: start at the running size

deploy/kuberay/ holds templates (the tested files: image by tag, weights unpinned); what is
applied is written with --out, the image pinned by digest and the model by commit. Every value
comes from the profile or from a named constant here or in scripts/kuberay_*.py: the GPU group's min/max from the Synthesizer's autoscaling bounds, idle
timeouts from Serve's downscale delays, the CPU group from the Ingress replicas and the measured
streams per core, Ray's drain and the pods' grace periods from the deployments' shutdown
timeouts, rayVersion and the image's Ray from the lock. The serve config's changed lines say so
in their comments; each manifest's header lists them.
``tests/deploy/test_rayservices.py`` fails when a manifest drifts from what this writes.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from scripts import kuberay_pods as pods
from scripts.kuberay_documents import pod_monitor, render, volume_claim, weights_documents
from scripts.kuberay_release import (  # noqa: F401 (the tests read them here)
    GPU_LOCK,
    REDIS_ADDRESS,
    UNPINNED,
    Release,
    default_image,
    locked_version,
    release_for,
)
from scripts.kuberay_serve_config import edited
from scripts.kuberay_sizing import (  # noqa: F401 (the tests read them here)
    CPU_POD_CORES,
    CPU_POD_MEMORY_GIB,
    INGRESS_STREAMS_PER_CORE,
    MIN_CPU_PODS,
    cpu_group_size,
    deployments_of,
    engine_slots,
    ingress_replicas_at,
)
from serve_app.ingress_env import HAPROXY_FLAG, HAPROXY_HARD_STOP_SETTING, LONGEST_STREAM_S

ROOT = Path(__file__).resolve().parents[1]
OUT_DIR = ROOT / "deploy" / "kuberay"

# The head runs Ray's GCS, the dashboard (which KubeRay deploys serveConfigV2 through), Serve's
# controller and an HAProxy; no replica (num-cpus 0).
HEAD_POD_CORES = 4
HEAD_POD_MEMORY_GIB = 16
# Where the voice store's shared volume is mounted; api.voice_store is set to it.
VOICE_STORE_MOUNT = "/mnt/voices"
VOICE_STORE_CLAIM = "tts-voices"
# A voice is its clip (FLAC, <= 30 s) and the engine's float32 embeddings of it: megabytes.
# Size the claim to API keys x api.max_voices_per_key of them.
VOICE_STORE_SIZE = "20Gi"
SERVE_PORT = 8000
# Ray's Prometheus export on every node (docs/operations.md, "Metrics and dashboard").
METRICS_PORT = 8080
# HAProxy's own Prometheus exporter (Ray 2.60's RAY_SERVE_HAPROXY_METRICS_PORT default).
HAPROXY_METRICS_PORT = 9101
# In every Ray container: Ray's HAProxy in front (read when Ray starts on a node, not from the
# app's runtime_env: serve_app/ingress_env.py), listening on all interfaces of the pod, and
# keeping a reloaded-out process's connections (an app or an Ingress replica changed) for the
# longest stream, not Ray's 120 s, after which it closes them.
RAY_ENV = {HAPROXY_FLAG: "1", "RAY_SERVE_DEFAULT_HTTP_HOST": "0.0.0.0",
           HAPROXY_HARD_STOP_SETTING: str(LONGEST_STREAM_S)}


@dataclass(frozen=True)
class GpuProfile:
    """One shipped GPU serve config and the pod its Synthesizer replica runs in."""

    serve_config: str     # the profile, at the repository root
    manifest: str         # what this writes in deploy/kuberay/
    name: str             # the RayService's metadata.name
    gpu_pod_cores: int    # the GPU pod's cores: the Synthesizer's 2 and its engine's host work
    gpu_pod_memory_gib: int
    gpu_products: tuple[str, ...]   # nvidia.com/gpu.product values whose memory fits the peak


# The GPU profiles, in one place: every serve_config*.yaml whose Synthesizer asks for a GPU must
# be here (tests/deploy/test_rayservices.py checks). Pods: 64 GiB on an H100 node holds the
# replica, its engine process and the 17 GB checkpoint in the page cache while it loads; an A10G
# node (g5.2xlarge: 8 vCPU, 32 GiB) leaves a core and 4 GiB to the kubelet. GPUs: the profile's
# measured peak (its serve config's comments) fits them: 67.6 GB on an H100 80GB (or an H200),
# 100.6 GB only on an H200 (141 GB), 19.2 GB on an A10G (24 GB).
H100_OR_H200 = ("NVIDIA-H100-80GB-HBM3", "NVIDIA-H200")
GPU_PROFILES = (
    GpuProfile("serve_config.yaml", "rayservice.yaml", "tts", 8, 64, H100_OR_H200),
    GpuProfile("serve_config.chat.yaml", "rayservice.chat.yaml", "tts-chat", 8, 64, H100_OR_H200),
    GpuProfile("serve_config.h200.yaml", "rayservice.h200.yaml", "tts-h200", 8, 64,
               ("NVIDIA-H200",)),
    GpuProfile("serve_config.a10g.yaml", "rayservice.a10g.yaml", "tts-a10g", 7, 28,
               ("NVIDIA-A10G",)),
)


def shipped_model(profile: GpuProfile) -> str:
    (app,) = yaml.safe_load((ROOT / profile.serve_config).read_text())["applications"]
    return app["args"]["engine_options"]["model"]


def serve_config_text(profile: GpuProfile, release: Release) -> str:
    """The profile's text, comments kept, with the lines Kubernetes needs changed."""
    shipped_text = (ROOT / profile.serve_config).read_text()
    shipped = yaml.safe_load(shipped_text)
    ingress_min = deployments_of(shipped)["Ingress"]["autoscaling_config"]["min_replicas"]
    initial = None
    if release.gpu_replicas is not None:
        initial = {"Synthesizer": release.gpu_replicas,
                   "Ingress": ingress_replicas_at(shipped, release.gpu_replicas)}
    return edited(shipped_text, profile.serve_config, {
        "voice_store": VOICE_STORE_MOUNT,
        "api_keys_file": f"{pods.API_KEYS_MOUNT}/{pods.API_KEYS_KEY}",
        "model": pods.weights_folder(shipped_model(profile), release.revision),
        "revision": f'"{release.revision}"',
    }, {"Ingress": {"min_replicas": str(MIN_CPU_PODS)}} if ingress_min < MIN_CPU_PODS else {},
        initial)


def _container(name: str, image: str, cores: int, memory_gib: int, ports: dict[str, int],
               env: dict[str, str], cpu_limit: bool = True,
               extra_limits: dict[str, Any] | None = None,
               mounts: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    # requests = limits where cpu_limit: Guaranteed pods, so a busy neighbour never takes the
    # Ingress's cores. The GPU pod has no CPU limit: its engine's step loop is never throttled.
    requests = {"cpu": str(cores), "memory": f"{memory_gib}Gi",
                "ephemeral-storage": f"{pods.EPHEMERAL_STORAGE_GIB}Gi"}
    limits = {**requests, **(extra_limits or {})}
    if not cpu_limit:
        limits.pop("cpu")
    # No readiness or liveness probe: KubeRay injects its own, which check the raylet (and the
    # GCS on the head), and on a RayService's workers also Serve's proxy at GET /-/healthz on
    # the port named "serve" (HAProxy answers it: 503 while its node drains).
    return {
        "name": name,
        "image": image,
        "env": [{"name": key, "value": value} for key, value in {**RAY_ENV, **env}.items()],
        "ports": [{"name": port_name, "containerPort": port} for port_name, port in ports.items()],
        "resources": {"requests": requests, "limits": limits},
        "volumeMounts": [{"name": "shm", "mountPath": "/dev/shm"}, *(mounts or [])],
    }


def rayservice(profile: GpuProfile, release: Release) -> tuple[dict[str, Any], list[str]]:
    """The RayService of ``profile`` and the lines of arithmetic its header explains it with."""
    config_text = serve_config_text(profile, release)
    serve_config = yaml.safe_load(config_text)
    deployments = deployments_of(serve_config)
    synthesizer, ingress = deployments["Synthesizer"], deployments["Ingress"]
    gpu_scaling = synthesizer["autoscaling_config"]
    (app,) = serve_config["applications"]
    cpu_group = cpu_group_size(serve_config)
    gpu_replicas = release.gpu_replicas or gpu_scaling["min_replicas"]
    if not gpu_scaling["min_replicas"] <= gpu_replicas <= gpu_scaling["max_replicas"]:
        raise ValueError(f"{profile.serve_config}: --gpu-replicas {gpu_replicas} is outside the "
                         f"Synthesizer's {gpu_scaling['min_replicas']}-"
                         f"{gpu_scaling['max_replicas']} replicas")
    ingress_pods = max(cpu_group.min_pods, math.ceil(
        ingress_replicas_at(serve_config, gpu_replicas)
        * ingress["ray_actor_options"]["num_cpus"] / CPU_POD_CORES))
    stop = pods.worker_stop(serve_config)
    worker_env = {pods.DRAIN_SETTING: str(stop.drain_s)}
    voices = ({"name": "voices", "persistentVolumeClaim": {"claimName": VOICE_STORE_CLAIM}},
              {"name": "voices", "mountPath": VOICE_STORE_MOUNT})
    weights = ({"name": "weights", "persistentVolumeClaim": {"claimName": pods.WEIGHTS_CLAIM,
                                                            "readOnly": True}},
               {"name": "weights", "mountPath": pods.WEIGHTS_MOUNT, "readOnly": True})
    api_keys = ({"name": "api-keys", "secret": {"secretName": pods.API_KEYS_SECRET}},
                {"name": "api-keys", "mountPath": pods.API_KEYS_MOUNT, "readOnly": True})
    worker_ports = {"serve": SERVE_PORT, "metrics": METRICS_PORT,
                    "haproxy-metrics": HAPROXY_METRICS_PORT}
    head = _container("ray-head", release.image, HEAD_POD_CORES, HEAD_POD_MEMORY_GIB, {
        "gcs-server": 6379, "dashboard": 8265, "client": 10001, **worker_ports},
        {pods.DRAIN_SETTING: str(pods.HEAD_DRAIN_S)})
    cpu_worker = _container("ray-worker", release.image, CPU_POD_CORES, CPU_POD_MEMORY_GIB,
                            worker_ports, worker_env, mounts=[voices[1], api_keys[1]])
    gpu_worker = _container("ray-worker", release.image, profile.gpu_pod_cores,
                            profile.gpu_pod_memory_gib, worker_ports,
                            # the weights are on the volume: a missing file fails, never downloads
                            {**worker_env, "HF_HUB_OFFLINE": "1"}, cpu_limit=False,
                            extra_limits={"nvidia.com/gpu": synthesizer["ray_actor_options"][
                                "num_gpus"]},
                            mounts=[voices[1], weights[1]])
    start = {"metrics-export-port": str(METRICS_PORT),
             "object-store-memory": str(pods.OBJECT_STORE_GIB * 2**30)}
    template = {"instance": profile.name, "log_image": release.log_image,
                "metrics_port": METRICS_PORT}
    manifest = {
        "apiVersion": "ray.io/v1",
        "kind": "RayService",
        "metadata": {"name": profile.name},
        "spec": {
            # A changed rayClusterConfig brings up a whole new cluster and moves the Service to it
            # once it serves; the old one goes after rayClusterDeletionDelaySeconds. That delay is
            # the longest a stream may run (api.max_stream_s), so streams on the old cluster end
            # on their own. The new cluster starts at the groups' `replicas`: for a rollout,
            # written at the running cluster's size (--gpu-replicas). A change to serveConfigV2
            # alone is applied to the running cluster by Serve (its replicas drain within
            # graceful_shutdown_timeout_s).
            "upgradeStrategy": {"type": "NewCluster"},
            "rayClusterDeletionDelaySeconds": math.ceil(app["args"]["api"]["max_stream_s"]),
            # Clients reach the workers' HAProxies only: the head holds the cluster's state.
            "excludeHeadPodFromServeSvc": True,
            "serveConfigV2": config_text,
            "rayClusterConfig": {
                "rayVersion": locked_version("ray"),
                "enableInTreeAutoscaling": True,
                # The dashboard (and its job API, which runs code) and Ray's RPCs take the token
                # in this Secret (key auth_token).
                "authOptions": {"mode": "token", "secretName": pods.RAY_TOKEN_SECRET},
                # The head keeps the cluster's state in Redis: a new head pod takes it over
                # while the workers' streams go on (fleet/head_loss.py).
                "gcsFaultToleranceOptions": {
                    "redisAddress": release.redis_address,
                    "redisPassword": {"valueFrom": {"secretKeyRef": {
                        "name": pods.REDIS_SECRET, "key": pods.REDIS_PASSWORD_KEY}}}},
                "autoscalerOptions": {
                    "version": "v2",
                    "upscalingMode": "Default",
                    # A node idles this long once Serve has let its replica go (after its own
                    # downscale_delay_s): a GPU node and the weights take minutes to come back.
                    "idleTimeoutSeconds": gpu_scaling["downscale_delay_s"],
                    "securityContext": dict(pods.CONTAINER_SECURITY),
                },
                "headGroupSpec": {
                    # No replica on the head: num-cpus 0 leaves it to GCS, the dashboard, Serve's
                    # controller and its HAProxy, so no stream's work crowds it.
                    "rayStartParams": {"num-cpus": "0", "dashboard-host": "0.0.0.0", **start},
                    "template": pods.pod_template(
                        container=head, volumes=[], affinity=pods.off_gpu_nodes(),
                        grace_s=pods.HEAD_DRAIN_S + pods.TEARDOWN_S,
                        annotations=pods.DO_NOT_DISRUPT, **template),
                },
                "workerGroupSpecs": [
                    {
                        "groupName": "cpu-ingress",
                        "replicas": ingress_pods,
                        "minReplicas": cpu_group.min_pods,
                        "maxReplicas": max(cpu_group.max_pods, ingress_pods),
                        "idleTimeoutSeconds": ingress["autoscaling_config"]["downscale_delay_s"],
                        "rayStartParams": dict(start),
                        "template": pods.pod_template(
                            container=cpu_worker, volumes=[voices[0], api_keys[0]],
                            affinity=pods.off_gpu_nodes(), grace_s=stop.grace_s,
                            spread_over=pods.spread(profile.name, "cpu-ingress",
                                                    "DoNotSchedule"), **template),
                    },
                    {
                        "groupName": "gpu-synthesizer",
                        "replicas": gpu_replicas,
                        "minReplicas": gpu_scaling["min_replicas"],
                        "maxReplicas": gpu_scaling["max_replicas"],
                        "idleTimeoutSeconds": gpu_scaling["downscale_delay_s"],
                        # Ray sees only the Synthesizer's CPUs, so no Ingress replica lands here;
                        # the pod's other cores are the engine process's host work.
                        "rayStartParams": {
                            "num-cpus": str(synthesizer["ray_actor_options"]["num_cpus"]),
                            **start},
                        "template": pods.pod_template(
                            container=gpu_worker, volumes=[voices[0], weights[0]],
                            affinity=pods.gpu_affinity(profile.gpu_products),
                            grace_s=stop.grace_s, tolerations=[dict(pods.GPU_TAINT)],
                            spread_over=pods.spread(profile.name, "gpu-synthesizer",
                                                    "ScheduleAnyway"),
                            annotations=pods.DO_NOT_DISRUPT, **template),
                    },
                ],
            },
        },
    }
    notes = [
        f"serveConfigV2: {profile.serve_config} as shipped but the lines marked "
        "'(scripts/write_rayservices)': voice_store, api_keys_file, model and revision (the "
        f"weights volume), the Ingress min_replicas (>= {MIN_CPU_PODS})"
        + (", initial_replicas (a rollout)." if release.gpu_replicas else "."),
        f"GPU group: {gpu_scaling['min_replicas']}-{gpu_scaling['max_replicas']} pods = the "
        f"Synthesizer's min/max_replicas, one GPU each, on {', '.join(profile.gpu_products)}; "
        f"starts at {gpu_replicas}.",
        f"CPU group: {cpu_group.min_pods}-{cpu_group.max_pods} pods of {CPU_POD_CORES} cores: the "
        f"GPU group at its max holds {cpu_group.streams_at_gpu_max} streams, "
        f"{cpu_group.cores_for_streams} cores at {INGRESS_STREAMS_PER_CORE} mp3 streams a core; "
        f"the Ingress max_replicas use at most {cpu_group.cores_serve_may_use}.",
        f"Workers stop in up to {stop.grace_s} s: Ray drains {stop.drain_s} s (the longest "
        "graceful_shutdown_timeout_s + api.drain_timeout_s), then ends its processes.",
    ]
    return manifest, notes


def manifests(release: Release, out_dir: Path = OUT_DIR) -> dict[Path, str]:
    """Every file this writes, by path, with its text."""
    files = {}
    for profile in GPU_PROFILES:
        manifest, notes = rayservice(profile, release)
        header = [f"KubeRay 1.7 RayService for {profile.serve_config} and its "
                  "PodDisruptionBudgets; apply after the volumes (docs/operations.md, "
                  f"'Kubernetes'): kubectl apply -f deploy/kuberay/{profile.manifest}", "", *notes]
        files[out_dir / profile.manifest] = render(
            [manifest, *pods.disruption_budgets(profile.name)], header)
    files[out_dir / f"{VOICE_STORE_CLAIM}.yaml"] = render(
        volume_claim(VOICE_STORE_CLAIM, VOICE_STORE_SIZE), [
            "The voice store every Ingress and Synthesizer pod mounts at "
            + VOICE_STORE_MOUNT + ".",
            "Needs a storage class that offers ReadWriteMany (NFS, EFS, Filestore, CephFS): set",
            "spec.storageClassName to yours, or the cluster's default class is asked."])
    models = sorted({shipped_model(profile) for profile in GPU_PROFILES})
    files[out_dir / f"{pods.WEIGHTS_CLAIM}.yaml"] = render(
        weights_documents(models, release.revision, release.image), [
            "The checkpoints every GPU pod mounts read-only at " + pods.WEIGHTS_MOUNT + ", and a "
            "Job per model that downloads it there",
            "at the pinned revision (HF_TOKEN from the Secret " + pods.HF_TOKEN_SECRET + " where "
            "the model needs one). ReadWriteMany, as the voices."])
    files[out_dir / "podmonitor.yaml"] = render(pod_monitor(["metrics", "haproxy-metrics"]), [
        "Prometheus Operator: scrape Ray's export (" + str(METRICS_PORT) + ") and HAProxy's ("
        + str(HAPROXY_METRICS_PORT) + ") on every Ray pod, labelled by RayCluster.",
        "Without the operator the pods' prometheus.io/scrape annotations say the same."])
    return files


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--image", help="the image deploy/Dockerfile was built and pushed as, "
                                        "by digest (default for the templates: "
                                        f"{default_image()})")
    parser.add_argument("--model-revision", help="the weights' commit on the Hub (40 hex)")
    parser.add_argument("--redis-address", default=REDIS_ADDRESS,
                        help="host:port of the Redis the head keeps its state in "
                             "(default: %(default)s)")
    parser.add_argument("--log-image", default=pods.LOG_SIDECAR_IMAGE,
                        help="the Fluent Bit image that ships Ray's logs (default: %(default)s)")
    parser.add_argument("--gpu-replicas", type=int,
                        help="for a rollout: the running cluster's GPU pods, so the new cluster "
                             "starts at that size (docs/operations.md, 'Upgrading')")
    parser.add_argument("--out", type=Path, default=OUT_DIR,
                        help="the folder to write (default: deploy/kuberay, the tested templates)")
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 if a file differs from what would be written")
    args = parser.parse_args(argv)
    try:
        release = release_for(args, applied=args.out.resolve() != OUT_DIR)
        files = manifests(release, args.out.resolve())
    except ValueError as error:
        print(f"write_rayservices: {error}", file=sys.stderr)
        return 2
    stale = []
    for path, text in files.items():
        relative = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
        if args.check:
            if not path.is_file() or path.read_text() != text:
                stale.append(str(relative))
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"wrote {relative}")
    if stale:
        print("differs from scripts/write_rayservices.py's output: " + ", ".join(stale),
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
