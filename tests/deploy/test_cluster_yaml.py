"""cluster.yaml passes the checks `ray up` runs, and its node types fit the A10G profile it
deploys (serve_config.a10g.yaml)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import jsonschema
import pytest
import ray.autoscaler
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

from serve_app.engines.minicpmo.options import EngineOptions

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def cluster() -> dict:
    return yaml.safe_load((ROOT / "cluster.yaml").read_text())


@pytest.fixture(scope="module")
def a10g_profile() -> dict:
    return yaml.safe_load((ROOT / "serve_config.a10g.yaml").read_text())["applications"][0]


@pytest.fixture(scope="module")
def deployments(a10g_profile: dict) -> dict[str, dict]:
    return {d["name"]: d for d in a10g_profile["deployments"]}


def test_the_cluster_deploys_the_a10g_profile_and_it_fits_an_a10g(a10g_profile: dict) -> None:
    header = (ROOT / "cluster.yaml").read_text().split("cluster_name:")[0]
    assert "serve deploy serve_config.a10g.yaml" in header
    options = EngineOptions.from_raw(a10g_profile["args"]["engine_options"])
    assert options.quantization == "int4" and options.gpu_memory_gb <= 22
    synthesizer = {d["name"]: d for d in a10g_profile["deployments"]}["Synthesizer"]
    # build_app derives max_ongoing_requests from max_slots; the profile does not override it
    assert synthesizer.get("max_ongoing_requests", options.max_slots) == options.max_slots


def test_matches_rays_cluster_schema(cluster: dict) -> None:
    schema_path = Path(ray.autoscaler.__file__).parent / "ray-schema.json"
    jsonschema.validate(cluster, json.loads(schema_path.read_text()))


def test_passes_what_ray_up_checks_after_filling_defaults(cluster: dict) -> None:
    prepared = prepare_config(copy.deepcopy(cluster))
    validate_config(prepared)
    assert prepared["provider"]["type"] == "aws"
    assert prepared["head_node_type"] == "head.cpu"


def test_gpu_workers_hold_the_synthesizer_replicas(cluster: dict,
                                                   deployments: dict[str, dict]) -> None:
    gpu = cluster["available_node_types"]["worker.gpu.a10g"]
    synthesizer = deployments["Synthesizer"]
    assert gpu["node_config"]["InstanceType"].startswith("g5.")  # one A10G per g5 (x)large
    assert gpu["resources"]["GPU"] == synthesizer["ray_actor_options"]["num_gpus"] == 1
    assert gpu["resources"]["CPU"] >= synthesizer["ray_actor_options"]["num_cpus"]
    autoscaling = synthesizer["autoscaling_config"]
    assert gpu["min_workers"] == autoscaling["min_replicas"]
    assert gpu["max_workers"] == autoscaling["max_replicas"]


def test_cpu_workers_and_head_have_no_gpu(cluster: dict, deployments: dict[str, dict]) -> None:
    types = cluster["available_node_types"]
    assert "GPU" not in types["head.cpu"]["resources"]
    cpu = types["worker.cpu"]
    assert "GPU" not in cpu["resources"]
    front_cpus = deployments["Ingress"]["ray_actor_options"]["num_cpus"]
    assert cpu["resources"]["CPU"] >= front_cpus
    assert cluster["max_workers"] >= sum(t.get("max_workers", 0) for t in types.values())


def test_setup_installs_the_project(cluster: dict) -> None:
    assert cluster["file_mounts"]["~/minicpmo-serve"] == "."
    assert any("pip install" in command and "-e '.[minicpmo" in command and "gpu" in command
               for command in cluster["setup_commands"])


def test_every_shipped_config_gives_its_replicas_the_same_serve_transport() -> None:
    """The Serve settings in serve_config.yaml's runtime_env (gRPC between replicas, our code on
    the replica's own loop) are what the tests run under; every shipped profile carries them."""
    def replica_env(name: str) -> dict:
        config = yaml.safe_load((ROOT / name).read_text())
        return config["applications"][0]["runtime_env"]["env_vars"]

    production = replica_env("serve_config.yaml")
    assert production["RAY_SERVE_USE_GRPC_BY_DEFAULT"] == "1"
    assert production["RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD"] == "0"
    for name in sorted(p.name for p in ROOT.glob("serve_config*.yaml")):
        assert replica_env(name) == production, name


def test_every_node_starts_ray_with_haproxy_in_front(cluster: dict) -> None:
    """Serve's controller and proxies read the HAProxy flag when Ray starts on a node, not from
    an application's runtime_env: every node's start command sets it, and how long a reloaded-out
    HAProxy keeps its connections (the longest stream)."""
    from serve_app.ingress_env import HAPROXY_FLAG, HAPROXY_HARD_STOP_SETTING, LONGEST_STREAM_S

    exported = f"export {HAPROXY_FLAG}=1 {HAPROXY_HARD_STOP_SETTING}={LONGEST_STREAM_S};"
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        starts = [command for command in cluster[key] if "ray start" in command]
        assert starts and all(exported in command for command in starts), key
