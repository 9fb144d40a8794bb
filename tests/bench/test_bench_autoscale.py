"""The autoscaling benchmark's own logic: its config, its ramp and how it reads a run."""

from __future__ import annotations

import argparse
import time

import pytest

from bench.autoscale.load import arrivals_s, load_seconds, load_stages, peak_span_s, target_streams
from bench.autoscale.readings import engine_gauges, step_ms_by_replica
from bench.autoscale.report import scale_decisions, summarize
from bench.autoscale.run import POLICY, autoscale_config, parse_args


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


def test_without_a_plateau_the_ramp_is_as_before() -> None:
    args = parse_args(["--peak-streams", "1000", "--low-streams", "4", "--ramp-up-s", "200",
                       "--hold-s", "45", "--ramp-down-s", "10", "--low-s", "60"])
    assert [s["stage"] for s in load_stages(args)] == ["ramp_up", "peak", "ramp_down", "low"]
    assert load_seconds(args) == 315 and peak_span_s(args) == (200, 245)
    assert target_streams(100, args) == 500 and target_streams(147.2, args) == pytest.approx(736)
    assert target_streams(220, args) == 1000 and target_streams(250, args) == 502
    assert target_streams(300, args) == 4 and target_streams(400, args) == 4
    # a namespace from an older run's JSON ("load") has no plateau fields
    old = argparse.Namespace(peak_streams=1000, low_streams=4, ramp_up_s=200.0, hold_s=45.0,
                             ramp_down_s=10.0, low_s=60.0)
    assert target_streams(147.2, old) == pytest.approx(736) and load_seconds(old) == 315


def test_a_plateau_pauses_the_ramp_at_its_level() -> None:
    args = parse_args(["--peak-streams", "1000", "--low-streams", "4", "--ramp-up-s", "100",
                       "--plateau-streams", "650", "--plateau-s", "120", "--hold-s", "60",
                       "--ramp-down-s", "10", "--low-s", "50"])
    stages = load_stages(args)
    assert [(s["stage"], s["from_t_s"], s["to_t_s"], s["from_streams"], s["to_streams"])
            for s in stages] == [("ramp_up", 0, 65, 0, 650), ("plateau", 65, 185, 650, 650),
                                 ("ramp_up", 185, 220, 650, 1000), ("peak", 220, 280, 1000, 1000),
                                 ("ramp_down", 280, 290, 1000, 4), ("low", 290, 340, 4, 4)]
    assert load_seconds(args) == 340 and peak_span_s(args) == (220, 280)
    # the same slope (10 streams a second) before and after the plateau
    assert target_streams(30, args) == pytest.approx(300)
    assert target_streams(65, args) == target_streams(184.9, args) == 650
    assert target_streams(195, args) == pytest.approx(750)
    assert target_streams(250, args) == 1000 and target_streams(320, args) == 4
    times = arrivals_s(args)
    assert times == sorted(times) and times[-1] < 340
    rate = 650 / (args.audio_seconds * 1.05)
    on_plateau = [t for t in times if 65 <= t < 185]
    assert abs(len(on_plateau) - rate * 120) < 4 * (rate * 120) ** 0.5


@pytest.mark.parametrize("argv", [["--plateau-streams", "650"], ["--plateau-s", "60"],
                                  ["--plateau-streams", "1000", "--plateau-s", "60"]])
def test_a_plateau_needs_its_level_below_the_peak_and_its_length(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--peak-streams", "1000", *argv])


def test_after_ready_ends_with_the_hold_at_the_peak_after_a_plateau() -> None:
    args = parse_args(["--peak-streams", "10", "--ramp-up-s", "10", "--plateau-streams", "5",
                       "--plateau-s", "20", "--hold-s", "10", "--ramp-down-s", "5",
                       "--low-s", "20"])
    assert peak_span_s(args) == (30, 40)
    samples = ([{"t_s": t, "states": {"RUNNING": 1}} for t in range(0, 10)]
               + [{"t_s": t, "states": {"RUNNING": 2}} for t in range(10, 65)])
    # streams started at the peak (30-40 s) count as after ready, those of the ramp down not
    rows = [{"start": float(t), "ok": True, "audio_s": 10.0,
             "ttfb_s": 0.9 if t >= 40 else 0.3 if t >= 30 else 0.1} for t in range(0, 60)]
    result = summarize(rows, samples, 0.0, 0.0, args)
    assert result["second_replica_ready_t_s"] == 10
    assert result["ttfb_ms_p99_after_ready"] == pytest.approx(300)
    ranges = result["ttfb_ranges"]
    assert ranges["after_ready"] == {"from_t_s": 10, "to_t_s": 40, "streams": 30,
                                     "ttfb_ms_p50": 100.0, "ttfb_ms_p99": pytest.approx(300)}
    assert ranges["at_peak_after_ready"]["from_t_s"] == 30
    assert ranges["at_peak_after_ready"]["streams"] == 10
    assert ranges["at_peak_after_ready"]["ttfb_ms_p50"] == 300
    assert ranges["before_scale_out"]["streams"] == 10
    assert "request was sent" in result["ttfb_ranges_rule"]


def test_the_ttfb_ranges_split_the_streams_by_their_start() -> None:
    args = parse_args(["--peak-streams", "10", "--ramp-up-s", "5", "--hold-s", "30",
                       "--ramp-down-s", "5", "--low-s", "40"])
    samples = ([{"t_s": t, "states": {"RUNNING": 1}} for t in range(0, 12)]
               + [{"t_s": t, "states": {"RUNNING": 1, "STARTING": 1}} for t in range(12, 25)]
               + [{"t_s": t, "states": {"RUNNING": 2}} for t in range(25, 80)])
    # a stream sent at 24 s whose first byte came at 26 s counts as during the scale-up
    rows = [{"start": float(t), "ok": True, "audio_s": 10.0,
             "ttfb_s": 2.0 if t == 24 else 0.1} for t in range(0, 50)]
    ranges = summarize(rows, samples, 0.0, 0.0, args)["ttfb_ranges"]
    assert {name: (r["from_t_s"], r["to_t_s"], r["streams"]) for name, r in ranges.items()} == {
        "before_scale_out": (0.0, 12, 12), "during_scale_up": (12, 25, 13),
        "after_ready": (25, 35, 10), "at_peak_after_ready": (25, 35, 10)}
    assert ranges["during_scale_up"]["ttfb_ms_p99"] > 1000
    assert ranges["after_ready"]["ttfb_ms_p99"] == pytest.approx(100)


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


SCRAPE = """\
# HELP ray_tts_engine_active_streams Streams holding an engine batch slot
# TYPE ray_tts_engine_active_streams gauge
ray_tts_engine_active_streams{deployment="Synthesizer",replica="a"} 300.0
ray_tts_engine_active_streams{deployment="Synthesizer",replica="b"} 36.0
# HELP ray_tts_engine_slots Batch slots of the engine (max_slots)
# TYPE ray_tts_engine_slots gauge
ray_tts_engine_slots{deployment="Synthesizer",replica="a"} 736.0
ray_tts_engine_slots{deployment="Synthesizer",replica="b"} 736.0
# HELP ray_tts_queued_requests Requests waiting
# TYPE ray_tts_queued_requests gauge
ray_tts_queued_requests{deployment="Synthesizer",replica="a",stage="admission"} 2.0
ray_tts_queued_requests{deployment="Synthesizer",replica="a",stage="engine"} 5.0
ray_tts_queued_requests{deployment="Synthesizer",replica="b",stage="engine"} 0.0
# HELP ray_tts_engine_steps_total Engine batch steps run
# TYPE ray_tts_engine_steps_total counter
ray_tts_engine_steps_total{deployment="Synthesizer",replica="a"} 1000.0
ray_tts_engine_steps_total{deployment="Synthesizer",replica="b"} 10.0
# HELP ray_tts_engine_step_seconds_total Wall-clock seconds the engine spent running steps
# TYPE ray_tts_engine_step_seconds_total counter
ray_tts_engine_step_seconds_total{deployment="Synthesizer",replica="a"} 30.0
ray_tts_engine_step_seconds_total{deployment="Synthesizer",replica="b"} 0.1
# HELP ray_tts_ttfb_seconds Time to first byte
# TYPE ray_tts_ttfb_seconds gauge
ray_tts_ttfb_seconds{deployment="Ingress",replica="i"} 9.0
"""


def test_a_scrape_is_read_per_replica_and_summed() -> None:
    gauges = engine_gauges(SCRAPE)
    assert gauges["active_streams"] == 336 and gauges["slots"] == 1472 and gauges["queued"] == 7
    assert gauges["slot_occupancy"] == round(336 / 1472, 3)
    assert set(gauges["per_replica"]) == {"a", "b"}
    a = gauges["per_replica"]["a"]
    assert (a["active_streams"], a["queued"], a["slots"], a["steps"], a["step_seconds"]) == (
        300, 7, 736, 1000, 30)
    assert a["slot_occupancy"] == round(300 / 736, 3)


def test_step_time_per_replica_comes_from_its_counters_between_exports() -> None:
    def sample(t_s: float, steps: float, busy_s: float) -> dict:
        return {"t_s": t_s, "states": {"RUNNING": 1},
                "per_replica": {"a": {"steps": steps, "step_seconds": busy_s,
                                      "active_streams": 300.0, "slot_occupancy": 0.4,
                                      "queued": 3.0}}}

    # counters exported every ~10 s: repeated readings in between
    samples = [sample(0, 100, 2.0), sample(2, 100, 2.0), sample(10, 300, 8.0),
               sample(12, 300, 8.0), sample(20, 400, 12.0)]
    assert step_ms_by_replica(samples, 5) == {}  # one export seen: no interval yet
    assert step_ms_by_replica(samples, 15) == {"a": 30.0}  # (8 - 2) s / 200 steps
    assert step_ms_by_replica(samples, 25) == {"a": 40.0}
    args = parse_args(["--peak-streams", "10", "--ramp-up-s", "5", "--hold-s", "10",
                       "--ramp-down-s", "5", "--low-s", "5"])
    rows = summarize([], samples, 0.0, 0.0, args)["replicas_timeline"]
    by_t = {row["t_s"]: row["per_replica"] for row in rows}
    assert by_t[10.0] == {"a": {"slot_occupancy": 0.4, "active_streams": 300.0, "queued": 3.0,
                                "step_ms": 30.0}}
    assert by_t[0.0]["a"]["step_ms"] is None
