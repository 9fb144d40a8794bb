"""The served benchmark's config: the production config, sized for the levels it measures."""

from __future__ import annotations

import yaml

from bench.served.config import STREAM_HEADROOM, bench_config, parse_args
from harness.service import ROOT


def deployments(config: dict) -> dict[str, dict]:
    [app] = config["applications"]
    return {d["name"]: d for d in app["deployments"]}


def test_stream_caps_are_raised_to_the_largest_level() -> None:
    """384 read streams (the level the service refused with 503 under the production caps):
    every cap on the way admits them with Poisson headroom, and the Synthesizer takes as many
    streams as its engine has slots."""
    config = bench_config(parse_args(["--modes", "read", "chat", "--read-levels", "1", "384",
                                      "--chat-levels", "96", "--engine-option", "max_slots=416",
                                      "--cpus", "64"]))
    [app] = config["applications"]
    peak = int(384 * STREAM_HEADROOM)
    by_name = deployments(config)
    assert by_name["Ingress"]["max_ongoing_requests"] > app["args"]["api"]["max_streams"]
    assert by_name["Synthesizer"]["max_ongoing_requests"] == 416
    assert by_name["Synthesizer"]["num_replicas"] == 1
    ingress = by_name["Ingress"]
    assert "autoscaling_config" not in ingress  # fixed for the run: no replica starts mid-level
    assert ingress["num_replicas"] * app["args"]["api"]["max_streams"] >= peak


def test_caps_the_levels_fit_are_left_as_configured() -> None:
    """Small levels leave the production config's caps as they are (never lowered)."""
    production = yaml.safe_load((ROOT / "serve_config.yaml").read_text(encoding="utf-8"))
    [app] = production["applications"]
    config = bench_config(parse_args(["--modes", "read", "--read-levels", "1", "32",
                                      "--cpus", "64"]))
    assert config["applications"][0]["args"]["api"]["max_streams"] == app["args"]["api"]["max_streams"]
    before, after = deployments(production), deployments(config)
    assert after["Ingress"]["max_ongoing_requests"] == before["Ingress"]["max_ongoing_requests"]
    assert after["Ingress"]["num_replicas"] == before["Ingress"]["autoscaling_config"]["min_replicas"]
    # the bench engine's 256 slots: the Synthesizer takes that many streams
    assert after["Synthesizer"]["max_ongoing_requests"] == 256


def test_ingress_replicas_fit_the_machines_cpus() -> None:
    """576 streams on a 16-CPU machine: one-CPU Ingress replicas of 128 streams each fit beside
    the Synthesizer's two CPUs, and every stream has a place; on a machine with less room,
    fewer replicas take more streams each."""
    by_name = deployments(bench_config(parse_args(["--modes", "read", "--read-levels", "1", "576",
                                                   "--engine-option", "max_slots=576",
                                                   "--cpus", "16"])))
    peak = int(576 * STREAM_HEADROOM)
    ingress = by_name["Ingress"]
    reserved = sum(d.get("ray_actor_options", {}).get("num_cpus", 1)
                   for name, d in by_name.items() if name != "Ingress")
    assert reserved + ingress["num_replicas"] * ingress["ray_actor_options"]["num_cpus"] <= 16
    small = deployments(bench_config(parse_args(["--modes", "read", "--read-levels", "576",
                                                 "--cpus", "5"])))
    [app] = bench_config(parse_args(["--modes", "read", "--read-levels", "576",
                                     "--cpus", "5"]))["applications"]
    assert small["Ingress"]["num_replicas"] == 3 < ingress["num_replicas"]
    assert small["Ingress"]["num_replicas"] * app["args"]["api"]["max_streams"] >= peak
    assert small["Ingress"]["max_ongoing_requests"] > app["args"]["api"]["max_streams"]


def test_the_cpu_profile_runs_as_shipped_with_its_engines_own_options() -> None:
    """serve_config.cpu.yaml (Piper): the benchmark setting and the engine benchmark's options are
    MiniCPM-o's and stay out, so its engine options are the profile's and ``serve run``'s own
    check (AppArgs) takes them; the Synthesizer is one replica, as on a GPU."""
    from serve_app.config import AppArgs

    shipped = yaml.safe_load((ROOT / "serve_config.cpu.yaml").read_text(encoding="utf-8"))
    config = bench_config(parse_args(["--config", str(ROOT / "serve_config.cpu.yaml"),
                                      "--modes", "read", "--read-levels", "1", "3",
                                      "--cpus", "2", "--word-timestamps"]))
    [app] = config["applications"]
    assert app["args"]["engine_options"] == shipped["applications"][0]["args"]["engine_options"]
    assert AppArgs.model_validate(app["args"]).engine == "piper"
    assert deployments(config)["Synthesizer"]["num_replicas"] == 1


def test_the_result_names_the_replicas_event_loop() -> None:
    """The served JSON says whether Ray ran the replicas on uvloop (the locked requirements
    install it, so the test environment has it) or on asyncio's own loop."""
    import uvloop

    from bench.served.report import event_loop

    assert event_loop({}) == f"uvloop {uvloop.__version__}"
    assert event_loop({"RAY_USE_UVLOOP": "0"}) == "asyncio"
