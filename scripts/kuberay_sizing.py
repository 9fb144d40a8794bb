"""How many pods each RayService group holds, from the serve config's replicas and slots
(scripts/write_rayservices.py writes the groups with these)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from serve_app.config import AppArgs

# Real-time mp3 streams one core of Ingress carries. mp3 is the API's default format and the
# costliest streamed one but opus: StreamEncoder spends ~33 ms of CPU per second of 24 kHz mp3
# (2-core x86; serve_config.yaml's Ingress comment, which sizes target_ongoing_requests by it).
# pcm costs far less: served at read 1408 on two H100s the Ingress replicas and HAProxy together
# used 1.48 cores, 1.05 cores per 1000 pcm streams
# (docs/benchmarks/history/served-2gpu-474c873.json, front_sizing). Replace with a served mp3 measurement when there is one.
INGRESS_STREAMS_PER_CORE = 30
# A CPU worker pod: cores and memory (8 cores as cluster.yaml's c6i.2xlarge; Ray gets them all,
# one Ingress replica per core, num_cpus: 1 in every profile).
CPU_POD_CORES = 8
CPU_POD_MEMORY_GIB = 16
# Two CPU pods at least, on two nodes: one lost node leaves Ingress replicas and an HAProxy up.
MIN_CPU_PODS = 2


def deployments_of(serve_config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    (app,) = serve_config["applications"]
    return {d["name"]: d for d in app["deployments"]}


def engine_slots(serve_config: dict[str, Any]) -> int:
    """Streams one Synthesizer replica runs at once, as build_app derives them."""
    (app,) = serve_config["applications"]
    return AppArgs.model_validate(app["args"]).max_slots


def ingress_replicas_at(serve_config: dict[str, Any], gpu_replicas: int) -> int:
    """Ingress replicas for ``gpu_replicas`` GPUs: the profile's Ingress min_replicas are sized
    for its Synthesizer min_replicas' streams, so as many per GPU, up to max_replicas."""
    deployments = deployments_of(serve_config)
    ingress = deployments["Ingress"]["autoscaling_config"]
    synthesizer = deployments["Synthesizer"]["autoscaling_config"]
    per_gpu = ingress["min_replicas"] / max(1, synthesizer["min_replicas"])
    return min(ingress["max_replicas"], max(ingress["min_replicas"],
                                            math.ceil(per_gpu * gpu_replicas)))


@dataclass(frozen=True)
class CpuGroupSize:
    """The CPU worker group for the Ingress replicas, and the arithmetic behind it."""

    min_pods: int
    max_pods: int
    streams_at_gpu_max: int     # every Synthesizer replica's slots, at its max_replicas
    cores_for_streams: int      # at INGRESS_STREAMS_PER_CORE
    cores_serve_may_use: int    # Ingress max_replicas x num_cpus


def cpu_group_size(serve_config: dict[str, Any]) -> CpuGroupSize:
    """Enough pods for the Ingress min_replicas and never fewer than MIN_CPU_PODS; at most what
    the GPU group's streams need at INGRESS_STREAMS_PER_CORE, and never more than the Ingress
    max_replicas can use."""
    deployments = deployments_of(serve_config)
    ingress = deployments["Ingress"]
    cores_per_replica = ingress["ray_actor_options"]["num_cpus"]
    scaling = ingress["autoscaling_config"]
    synthesizer_max = deployments["Synthesizer"]["autoscaling_config"]["max_replicas"]
    streams = synthesizer_max * engine_slots(serve_config)
    cores_for_streams = math.ceil(streams / INGRESS_STREAMS_PER_CORE)
    usable = math.ceil(scaling["max_replicas"] * cores_per_replica)
    min_pods = max(MIN_CPU_PODS,
                   math.ceil(scaling["min_replicas"] * cores_per_replica / CPU_POD_CORES))
    max_pods = max(min_pods, math.ceil(min(cores_for_streams, usable) / CPU_POD_CORES))
    return CpuGroupSize(min_pods, max_pods, streams, cores_for_streams, usable)
