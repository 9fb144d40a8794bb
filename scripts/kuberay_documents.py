"""The documents beside the RayServices (volume claims, the weights Job, the PodMonitor) and the
YAML they are written as (scripts/write_rayservices.py)."""

from __future__ import annotations

from typing import Any

import yaml

from scripts import kuberay_pods as pods


def volume_claim(name: str, size: str) -> dict[str, Any]:
    """A ReadWriteMany claim: pods on several nodes mount it (the voices: Ingress replicas write,
    Synthesizer replicas read; the weights: a Job writes, every GPU pod reads)."""
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": name},
            "spec": {"accessModes": ["ReadWriteMany"],
                     "resources": {"requests": {"storage": size}}}}


def weights_documents(models: list[str], revision: str, image: str) -> list[dict[str, Any]]:
    """The weights' claim and a Job per model that fills it with the files the engine reads."""
    from serve_app.engines.minicpmo.model.loader import HUB_PATTERNS

    return [volume_claim(pods.WEIGHTS_CLAIM, pods.WEIGHTS_SIZE),
            *(pods.weights_job(model, revision, image, HUB_PATTERNS) for model in models)]


def pod_monitor(ports: list[str]) -> dict[str, Any]:
    """Prometheus Operator's scrape of ``ports`` on every Ray pod. During a rollout two clusters
    run: each series names its RayCluster (as KubeRay's PodMonitor sample and Ray's Grafana
    dashboards do), so the two are told apart."""
    relabel = [{"sourceLabels": ["__meta_kubernetes_pod_label_ray_io_cluster"],
                "targetLabel": "ray_io_cluster"}]
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PodMonitor",
        "metadata": {"name": "tts-ray-nodes"},
        "spec": {
            # every Ray pod KubeRay makes carries this label, head and workers of every profile
            "selector": {"matchLabels": {"ray.io/is-ray-node": "yes"}},
            "podMetricsEndpoints": [{"port": port, "path": "/metrics", "relabelings": relabel}
                                    for port in ports],
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


def render(documents: dict[str, Any] | list[dict[str, Any]], header: list[str]) -> str:
    """One YAML file of ``documents`` (``---`` between them) under a comment ``header``."""
    documents = documents if isinstance(documents, list) else [documents]
    bodies = []
    for document in documents:
        body = yaml.dump(document, Dumper=_LiteralDumper, sort_keys=False, width=100)
        if yaml.safe_load(body) != document:
            raise ValueError(f"{document['kind']} does not read back as written")
        bodies.append(body)
    lines = ["Written by scripts/write_rayservices.py: edit the serve config or the script, then "
             "rerun it.", *header]
    return "".join(f"# {line}\n" if line else "#\n" for line in lines) + "---\n".join(bodies)
