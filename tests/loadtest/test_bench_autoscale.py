"""The autoscaling benchmark's own logic: its config, its ramp and how it reads a run."""

from __future__ import annotations

import time

from loadtest.bench_autoscale import (
    POLICY,
    arrivals_s,
    autoscale_config,
    parse_args,
    scale_decisions,
    summarize,
)


def test_config_runs_the_shipped_policy_on_fractional_gpus() -> None:
    args = parse_args(["--replica-gpus", "0.5", "--max-slots", "160", "--cpus", "16"])
    [app] = autoscale_config(args)["applications"]
    [synthesizer] = [d for d in app["deployments"] if d["name"] == "Synthesizer"]
    assert synthesizer["ray_actor_options"]["num_gpus"] == 0.5
    scaling = synthesizer["autoscaling_config"]
    assert scaling["min_replicas"] == 1 and scaling["max_replicas"] == 2
    assert scaling["policy"]["policy_function"] == POLICY
    assert app["args"]["engine_options"]["max_slots"] == 160
    assert app["args"]["engine_options"]["gpu_memory_gb"] == 38.0
    assert app["args"]["engine_options"]["benchmark"]["random_weights"] is True


def test_arrivals_hold_the_ramp_by_littles_law() -> None:
    args = parse_args(["--peak-streams", "200", "--low-streams", "4", "--ramp-up-s", "30",
                       "--hold-s", "200", "--ramp-down-s", "10", "--low-s", "100"])
    times = arrivals_s(args)
    assert times == sorted(times) and times[-1] < 340
    held = [t for t in times if 30 <= t < 230]
    rate = 200 / (args.audio_seconds * 1.05)  # streams of 10 s at 200 concurrent
    assert abs(len(held) - rate * 200) < 4 * (rate * 200) ** 0.5
    low = [t for t in times if t >= 240]
    assert len(low) < 0.1 * len(held)


def test_a_run_is_read_into_a_timeline_with_its_scale_events() -> None:
    args = parse_args(["--peak-streams", "10", "--ramp-up-s", "5", "--hold-s", "30",
                       "--ramp-down-s", "5", "--low-s", "40"])
    t0 = time.mktime(time.strptime("2026-11-25 13:00:00", "%Y-%m-%d %H:%M:%S"))
    log = ("INFO 2026-11-25 13:00:12,500 controller 7 -- Upscaling Deployment(name='Synthesizer'"
           ", app='tts') from 1 to 2 replicas. Current ongoing requests: 9.0\n"
           "INFO 2026-11-25 13:01:05,000 controller 7 -- Downscaling Deployment(name="
           "'Synthesizer', app='tts') from 2 to 1 replicas. Current ongoing requests: 1.0\n")
    assert [d["action"] for d in scale_decisions(log, t0)] == ["upscaling", "downscaling"]
    samples = ([{"t_s": t, "states": {"RUNNING": 1}} for t in range(0, 13)]
               + [{"t_s": t, "states": {"RUNNING": 1, "STARTING": 1}} for t in range(13, 30)]
               + [{"t_s": t, "states": {"RUNNING": 2}} for t in range(30, 66)]
               + [{"t_s": t, "states": {"RUNNING": 1}} for t in range(66, 90)])
    rows = [{"start": t0 + t, "ok": True, "ttfb_s": 0.1 + (0.3 if 12 <= t < 30 else 0.0),
             "audio_s": 10.0} for t in range(0, 60)]
    rows.append({"start": t0 + 20, "ok": True, "ttfb_s": 0.2, "audio_s": 3.0})  # cut short
    result = summarize(rows, samples, t0, t0, args, log)
    assert result["replicas_went"] == [1, 2, 1]
    assert result["scale_out_decision_t_s"] == 12.5
    assert result["second_replica_ready_t_s"] == 30
    assert result["second_replica_ready_s"] == 17.5
    assert result["cut_streams"] == 1 and result["failed_streams"] == 0
    assert result["ttfb_ms_p99_during_scale_up"] > 300 > result["ttfb_ms_p99_after_ready"]


def test_gpu_readings_land_in_their_window() -> None:
    args = parse_args(["--peak-streams", "10", "--ramp-up-s", "5", "--hold-s", "10",
                       "--ramp-down-s", "5", "--low-s", "5"])
    reading = [{"index": 0, "memory_used_gib": 70.5, "memory_total_gib": 79.6,
                "utilization_percent": 93.0},
               {"index": 1, "memory_used_gib": 0.5, "memory_total_gib": 79.6,
                "utilization_percent": 0.0}]
    samples = [{"t_s": t, "states": {"RUNNING": 1}, **({"gpus": reading} if t == 6 else {})}
               for t in range(0, 15)]
    result = summarize([], samples, 0.0, 0.0, args)
    windows = {row["t_s"]: row["gpus"] for row in result["replicas_timeline"]}
    assert windows[5.0] == reading  # the window that holds the reading
    assert windows[0.0] == [] and windows[10.0] == []
