"""Write deploy/kuberay/: a KubeRay RayService (ray.io/v1, KubeRay 1.7) for each GPU profile,
its serveConfigV2 taken from the shipped serve config, plus the voice store's volume claim and
a PodMonitor for Prometheus.

    .venv/bin/python -m scripts.write_rayservices            # rewrite deploy/kuberay/*.yaml
    .venv/bin/python -m scripts.write_rayservices --check    # exit 1 where a file differs
    .venv/bin/python -m scripts.write_rayservices --image registry.example.com/tts:0.1.0 \
        --out my-deploy/                                     # your image, into a folder of yours

Every value comes from the profile or from a named constant here: the GPU group's min/max from
the Synthesizer's autoscaling bounds, idle timeouts from Serve's downscale delays, the CPU group
from the Ingress replicas and the measured streams per core, rayVersion and the image's Ray
from the lock. The one change to the serve config is ``api.voice_store``, set to where the
shared volume is mounted (a line in the manifest's header says so).
``tests/deploy/test_rayservices.py`` fails when a manifest drifts from what this writes.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from serve_app.config import AppArgs

ROOT = Path(__file__).resolve().parents[1]
OUT_DIR = ROOT / "deploy" / "kuberay"
GPU_LOCK = ROOT / "requirements" / "minicpmo+cpu-voice+quant+gpu.txt"

# Real-time mp3 streams one core of Ingress carries. mp3 is the API's default format and the
# costliest streamed one but opus: StreamEncoder spends ~33 ms of CPU per second of 24 kHz mp3
# (2-core x86; serve_config.yaml's Ingress comment, which sizes target_ongoing_requests by it).
# pcm costs far less: served at read 1408 on two H100s the Ingress replicas and HAProxy together
# used 1.48 cores, 1.05 cores per 1000 pcm streams (docs/benchmarks/served-2gpu.json,
# front_sizing). Replace with a served mp3 measurement when there is one.
INGRESS_STREAMS_PER_CORE = 30
# A CPU worker pod: cores and memory (8 cores as cluster.yaml's c6i.2xlarge; Ray gets them all,
# one Ingress replica per core, num_cpus: 1 in every profile).
CPU_POD_CORES = 8
CPU_POD_MEMORY_GIB = 16
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
# Object store and Ray's shared memory; the service moves chunks over gRPC, not the store.
SHM_SIZE = "2Gi"
# In every Ray container: Ray's HAProxy in front (read when Ray starts on a node, not from the
# app's runtime_env: serve_app/ingress_env.py), listening on all interfaces of the pod.
RAY_ENV = {"RAY_SERVE_ENABLE_HA_PROXY": "1", "RAY_SERVE_DEFAULT_HTTP_HOST": "0.0.0.0"}


@dataclass(frozen=True)
class GpuProfile:
    """One shipped GPU serve config and the pod its Synthesizer replica runs in."""

    serve_config: str     # the profile, at the repository root
    manifest: str         # what this writes in deploy/kuberay/
    name: str             # the RayService's metadata.name
    gpu_pod_cores: int    # the GPU pod's cores: the Synthesizer's 2 and its engine's host work
    gpu_pod_memory_gib: int


# The GPU profiles, in one place: every serve_config*.yaml whose Synthesizer asks for a GPU must
# be here (tests/deploy/test_rayservices.py checks). Pods: 64 GiB on an H100 node holds the
# replica, its engine process and the 17 GB checkpoint in the page cache while it loads; an A10G
# node (g5.2xlarge: 8 vCPU, 32 GiB) leaves a core and 4 GiB to the kubelet.
GPU_PROFILES = (
    GpuProfile("serve_config.yaml", "rayservice.yaml", "tts", 8, 64),
    GpuProfile("serve_config.chat.yaml", "rayservice.chat.yaml", "tts-chat", 8, 64),
    GpuProfile("serve_config.h200.yaml", "rayservice.h200.yaml", "tts-h200", 8, 64),
    GpuProfile("serve_config.a10g.yaml", "rayservice.a10g.yaml", "tts-a10g", 7, 28),
)


def locked_version(package: str, lock: Path = GPU_LOCK) -> str:
    """The version ``lock`` pins for ``package`` (``name==version``)."""
    found = re.search(rf"^{re.escape(package)}==([^\s;\\]+)", lock.read_text(), flags=re.M)
    if found is None:
        raise ValueError(f"{lock.name} pins no {package}")
    return found.group(1)


def project_version() -> str:
    return re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(),
                     flags=re.M).group(1)


def default_image() -> str:
    return f"minicpmo-serve:{project_version()}"


def serve_config_text(profile: GpuProfile) -> str:
    """The profile's text, comments kept, with ``api.voice_store`` pointing at the shared mount."""
    text = (ROOT / profile.serve_config).read_text()
    pattern = re.compile(r"^(\s+voice_store:)[^\n]*$", flags=re.M)
    if len(pattern.findall(text)) != 1:
        raise ValueError(f"{profile.serve_config}: expected one api.voice_store line")
    return pattern.sub(rf"\1 {VOICE_STORE_MOUNT}   # the shared volume (scripts/write_rayservices)",
                       text)


def deployments_of(serve_config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    (app,) = serve_config["applications"]
    return {d["name"]: d for d in app["deployments"]}


def engine_slots(serve_config: dict[str, Any]) -> int:
    """Streams one Synthesizer replica runs at once, as build_app derives them."""
    (app,) = serve_config["applications"]
    return AppArgs.model_validate(app["args"]).max_slots


@dataclass(frozen=True)
class CpuGroupSize:
    """The CPU worker group for the Ingress replicas, and the arithmetic behind it."""

    min_pods: int
    max_pods: int
    streams_at_gpu_max: int     # every Synthesizer replica's slots, at its max_replicas
    cores_for_streams: int      # at INGRESS_STREAMS_PER_CORE
    cores_serve_may_use: int    # Ingress max_replicas x num_cpus


def cpu_group_size(serve_config: dict[str, Any]) -> CpuGroupSize:
    """Enough pods for the Ingress min_replicas; at most what the GPU group's streams need at
    INGRESS_STREAMS_PER_CORE, and never more than the Ingress max_replicas can use."""
    deployments = deployments_of(serve_config)
    ingress = deployments["Ingress"]
    cores_per_replica = ingress["ray_actor_options"]["num_cpus"]
    scaling = ingress["autoscaling_config"]
    synthesizer_max = deployments["Synthesizer"]["autoscaling_config"]["max_replicas"]
    streams = synthesizer_max * engine_slots(serve_config)
    cores_for_streams = math.ceil(streams / INGRESS_STREAMS_PER_CORE)
    usable = math.ceil(scaling["max_replicas"] * cores_per_replica)
    min_pods = math.ceil(scaling["min_replicas"] * cores_per_replica / CPU_POD_CORES)
    max_pods = max(min_pods, math.ceil(min(cores_for_streams, usable) / CPU_POD_CORES))
    return CpuGroupSize(min_pods, max_pods, streams, cores_for_streams, usable)


def _container(name: str, image: str, cores: int, memory_gib: int, ports: dict[str, int],
               extra_limits: dict[str, Any] | None = None,
               mounts: list[dict[str, str]] | None = None,
               readiness: dict[str, Any] | None = None) -> dict[str, Any]:
    # requests = limits: Guaranteed pods, so a busy neighbour never takes the Ingress's cores
    resources = {"cpu": str(cores), "memory": f"{memory_gib}Gi", **(extra_limits or {})}
    container: dict[str, Any] = {
        "name": name,
        "image": image,
        "env": [{"name": key, "value": value} for key, value in RAY_ENV.items()],
        "ports": [{"name": port_name, "containerPort": port} for port_name, port in ports.items()],
        "resources": {"requests": dict(resources), "limits": dict(resources)},
        "volumeMounts": [{"name": "shm", "mountPath": "/dev/shm"}, *(mounts or [])],
    }
    if readiness is not None:
        container["readinessProbe"] = readiness
    return container


def _pod(container: dict[str, Any], volumes: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "metadata": {"annotations": {"prometheus.io/scrape": "true",
                                     "prometheus.io/port": str(METRICS_PORT)}},
        "spec": {
            # Autoscaler v2 replaces a failed Ray node with a new pod; a container restarted in
            # place would rejoin as a node Ray already counted dead (KubeRay refuses other values
            # with v2).
            "restartPolicy": "Never",
            # the ray image's user is ray:users (1000:100): the voice volume must be writable to it
            "securityContext": {"fsGroup": 100},
            "containers": [container],
            "volumes": [{"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": SHM_SIZE}},
                        *volumes],
        },
    }


# HAProxy answers GET /-/healthz on the serve port: 200 "success" while one of its backends (an
# Ingress replica) is up, 503 when none is or the node drains (ray/serve/_private/
# haproxy_templates.py). Not on the head: KubeRay deploys serveConfigV2 only once the head pod
# is ready, and HAProxy starts with the app, so such a probe would never pass; KubeRay places the
# head in the serve Service by itself (here: out of it, excludeHeadPodFromServeSvc).
READINESS_PROBE = {
    "httpGet": {"path": "/-/healthz", "port": "serve"},
    "periodSeconds": 5,
    "timeoutSeconds": 2,
    "failureThreshold": 1,   # a draining node leaves the Service's endpoints at once
    "successThreshold": 1,
}


def rayservice(profile: GpuProfile, image: str) -> tuple[dict[str, Any], list[str]]:
    """The RayService of ``profile`` and the lines of arithmetic its header explains it with."""
    config_text = serve_config_text(profile)
    serve_config = yaml.safe_load(config_text)
    deployments = deployments_of(serve_config)
    synthesizer, ingress = deployments["Synthesizer"], deployments["Ingress"]
    gpu_scaling = synthesizer["autoscaling_config"]
    (app,) = serve_config["applications"]
    cpu_group = cpu_group_size(serve_config)
    voices_volume = {"name": "voices",
                     "persistentVolumeClaim": {"claimName": VOICE_STORE_CLAIM}}
    voices_mount = [{"name": "voices", "mountPath": VOICE_STORE_MOUNT}]
    worker_ports = {"serve": SERVE_PORT, "metrics": METRICS_PORT,
                    "haproxy-metrics": HAPROXY_METRICS_PORT}
    head = _container("ray-head", image, HEAD_POD_CORES, HEAD_POD_MEMORY_GIB, {
        "gcs-server": 6379, "dashboard": 8265, "client": 10001, **worker_ports})
    cpu_worker = _container("ray-worker", image, CPU_POD_CORES, CPU_POD_MEMORY_GIB, worker_ports,
                            mounts=voices_mount, readiness=READINESS_PROBE)
    gpu_worker = _container("ray-worker", image, profile.gpu_pod_cores,
                            profile.gpu_pod_memory_gib, worker_ports,
                            extra_limits={"nvidia.com/gpu": synthesizer["ray_actor_options"][
                                "num_gpus"]},
                            mounts=voices_mount, readiness=READINESS_PROBE)
    # nvidia.com/gpu is a limit only (Kubernetes sets its request from it)
    gpu_worker["resources"]["requests"].pop("nvidia.com/gpu")
    metrics_start = {"metrics-export-port": str(METRICS_PORT)}
    manifest = {
        "apiVersion": "ray.io/v1",
        "kind": "RayService",
        "metadata": {"name": profile.name},
        "spec": {
            # A changed rayClusterConfig brings up a whole new cluster and moves the Service to it
            # once it serves; the old one goes after rayClusterDeletionDelaySeconds. That delay is
            # the longest a stream may run (api.max_stream_s), so streams on the old cluster end
            # on their own. A change to serveConfigV2 alone is applied to the running cluster by
            # Serve (its replicas drain within graceful_shutdown_timeout_s).
            "upgradeStrategy": {"type": "NewCluster"},
            "rayClusterDeletionDelaySeconds": math.ceil(app["args"]["api"]["max_stream_s"]),
            # Clients reach the workers' HAProxies only: the head holds the cluster's state.
            "excludeHeadPodFromServeSvc": True,
            "serveConfigV2": config_text,
            "rayClusterConfig": {
                "rayVersion": locked_version("ray"),
                "enableInTreeAutoscaling": True,
                "autoscalerOptions": {
                    "version": "v2",
                    "upscalingMode": "Default",
                    # A node idles this long once Serve has let its replica go (after its own
                    # downscale_delay_s): a GPU node and the weights take minutes to come back.
                    "idleTimeoutSeconds": gpu_scaling["downscale_delay_s"],
                },
                "headGroupSpec": {
                    # No replica on the head: num-cpus 0 leaves it to GCS, the dashboard, Serve's
                    # controller and its HAProxy; losing the head loses the cluster, so no
                    # stream's work should crowd it.
                    "rayStartParams": {"num-cpus": "0", "dashboard-host": "0.0.0.0",
                                       **metrics_start},
                    "template": _pod(head, []),
                },
                "workerGroupSpecs": [
                    {
                        "groupName": "cpu-ingress",
                        "replicas": cpu_group.min_pods,
                        "minReplicas": cpu_group.min_pods,
                        "maxReplicas": cpu_group.max_pods,
                        "idleTimeoutSeconds": ingress["autoscaling_config"]["downscale_delay_s"],
                        "rayStartParams": dict(metrics_start),
                        "template": _pod(cpu_worker, [voices_volume]),
                    },
                    {
                        "groupName": "gpu-synthesizer",
                        "replicas": gpu_scaling["min_replicas"],
                        "minReplicas": gpu_scaling["min_replicas"],
                        "maxReplicas": gpu_scaling["max_replicas"],
                        "idleTimeoutSeconds": gpu_scaling["downscale_delay_s"],
                        # Ray sees only the Synthesizer's CPUs, so no Ingress replica lands here;
                        # the pod's other cores are the engine process's host work.
                        "rayStartParams": {
                            "num-cpus": str(synthesizer["ray_actor_options"]["num_cpus"]),
                            **metrics_start},
                        "template": _pod(gpu_worker, [voices_volume]),
                    },
                ],
            },
        },
    }
    notes = [
        f"serveConfigV2: {profile.serve_config} as shipped, but api.voice_store = "
        f"{VOICE_STORE_MOUNT} (the {VOICE_STORE_CLAIM} volume, ReadWriteMany).",
        f"GPU group: {gpu_scaling['min_replicas']}-{gpu_scaling['max_replicas']} pods = the "
        "Synthesizer's min/max_replicas, one GPU each.",
        f"CPU group: {cpu_group.min_pods}-{cpu_group.max_pods} pods of {CPU_POD_CORES} cores: the "
        f"GPU group at its max holds {cpu_group.streams_at_gpu_max} streams, "
        f"{cpu_group.cores_for_streams} cores at {INGRESS_STREAMS_PER_CORE} mp3 streams a core; "
        f"the Ingress max_replicas use at most {cpu_group.cores_serve_may_use}.",
    ]
    return manifest, notes


def voice_store_claim() -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": VOICE_STORE_CLAIM},
        "spec": {
            # Ingress replicas write voices, Synthesizer replicas on other nodes read them.
            "accessModes": ["ReadWriteMany"],
            "resources": {"requests": {"storage": VOICE_STORE_SIZE}},
        },
    }


def pod_monitor() -> dict[str, Any]:
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PodMonitor",
        "metadata": {"name": "tts-ray-nodes"},
        "spec": {
            # every Ray pod KubeRay makes carries this label, head and workers of every profile
            "selector": {"matchLabels": {"ray.io/is-ray-node": "yes"}},
            "podMetricsEndpoints": [{"port": "metrics", "path": "/metrics"},
                                    {"port": "haproxy-metrics", "path": "/metrics"}],
        },
    }


class _LiteralDumper(yaml.SafeDumper):
    """Multi-line strings (serveConfigV2) as literal blocks, so they read as the YAML they are;
    a value used twice (the groups' volume mount) written out twice, not as an anchor."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def _represent_str(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_LiteralDumper.add_representer(str, _represent_str)


def render(document: dict[str, Any], header: list[str]) -> str:
    body = yaml.dump(document, Dumper=_LiteralDumper, sort_keys=False, width=100)
    if yaml.safe_load(body) != document:
        raise ValueError(f"{document['kind']} does not read back as written")
    lines = ["Written by scripts/write_rayservices.py: edit the serve config or the script, then "
             "rerun it.", *header]
    return "".join(f"# {line}\n" if line else "#\n" for line in lines) + body


def manifests(image: str, out_dir: Path = OUT_DIR) -> dict[Path, str]:
    """Every file this writes, by path, with its text."""
    files = {}
    for profile in GPU_PROFILES:
        manifest, notes = rayservice(profile, image)
        header = [f"KubeRay 1.7 RayService for {profile.serve_config}; "
                  f"kubectl apply -f deploy/kuberay/{VOICE_STORE_CLAIM}.yaml -f "
                  f"deploy/kuberay/{profile.manifest}", "", *notes]
        files[out_dir / profile.manifest] = render(manifest, header)
    files[out_dir / f"{VOICE_STORE_CLAIM}.yaml"] = render(voice_store_claim(), [
        "The voice store every Ingress and Synthesizer pod mounts at " + VOICE_STORE_MOUNT + ".",
        "Needs a storage class that offers ReadWriteMany (NFS, EFS, Filestore, CephFS): set",
        "spec.storageClassName to yours, or the cluster's default class is asked."])
    files[out_dir / "podmonitor.yaml"] = render(pod_monitor(), [
        "Prometheus Operator: scrape Ray's export (" + str(METRICS_PORT) + ") and HAProxy's ("
        + str(HAPROXY_METRICS_PORT) + ") on every Ray pod.",
        "Without the operator the pods' prometheus.io/scrape annotations say the same."])
    return files


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--image", default=default_image(),
                        help="the image deploy/Dockerfile was built and pushed as "
                             "(default: %(default)s)")
    parser.add_argument("--out", type=Path, default=OUT_DIR,
                        help="the folder to write (default: deploy/kuberay, the tested files)")
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 if a file differs from what would be written")
    args = parser.parse_args(argv)
    stale = []
    for path, text in manifests(args.image, args.out.resolve()).items():
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
