"""How the engine benchmark (bench/engine/report.py) counts real-time streams: a level counts only when every arrival
measured at it was real-time (a burst that passes does not make up for a Poisson run that fails)."""

from bench.engine.report import (
    SAMPLE_RATE,
    first_dry_at,
    longest_stall_s,
    realtime_streams,
    stream_is_realtime,
)


def _row(concurrency: int, arrival: str, ok: bool) -> dict:
    return {"mode": "chat", "concurrency": concurrency, "arrival": arrival, "ok": ok}


def test_a_level_counts_only_when_all_its_arrivals_are_realtime():
    rows = [_row(32, "burst", True), _row(32, "poisson", True),
            _row(64, "burst", True), _row(64, "poisson", False)]
    assert realtime_streams(rows, floor=1) == 32
    assert realtime_streams([r for r in rows if r["arrival"] == "burst"], floor=1) == 64
    assert realtime_streams([r for r in rows if r["arrival"] == "poisson"], floor=1) == 32


def test_no_level_realtime_leaves_the_single_stream_floor():
    rows = [_row(32, "poisson", False)]
    assert realtime_streams(rows, floor=1) == 1
    assert realtime_streams(rows) == 0


def test_a_stream_stalls_when_a_chunk_comes_after_the_audio_it_holds_has_played():
    half_second = SAMPLE_RATE // 2
    on_time = [(10.0, half_second), (10.4, half_second), (10.9, half_second)]
    assert longest_stall_s(on_time) == 0.0 and stream_is_realtime(on_time)
    late = [(10.0, half_second), (10.7, half_second), (11.0, half_second), (11.8, half_second)]
    # played out at 10.5 (0.2 s late), then at 11.5 (0.3 s late): the worst stall is 0.3 s
    assert abs(longest_stall_s(late) - 0.3) < 1e-9 and not stream_is_realtime(late)
    assert longest_stall_s([]) == 0.0 and not stream_is_realtime([])
    # the moment it first ran dry: the chunk at 10.7 came after 0.5 s of audio had played
    assert first_dry_at(late) == 10.7
    assert first_dry_at(on_time) is None and first_dry_at([]) is None


def test_merging_runs_of_one_mode_keeps_the_measured_single_stream_and_the_highest_count():
    from bench.engine.report import merge_results

    def run(levels, held, single):
        return {"gpu": "H100", "git_commit": "abc", "command": "c", "peak_gpu_memory_gb": 1.0,
                "sweep": [_row(c, "poisson", c <= held) for c in levels],
                "max_realtime_streams": {"chat": held},
                "single_stream": {"chat": {"ttfb_ms_p50": single, "rtf": None}}}

    merged = merge_results([run([1, 64], 64, 120.0), run([96], 0, None)])
    assert merged["max_realtime_streams"] == {"chat": 64}
    assert merged["single_stream"]["chat"]["ttfb_ms_p50"] == 120.0
    assert [r["concurrency"] for r in merged["sweep"]] == [1, 64, 96]


def test_step_phases_are_summarised_per_phase_over_the_steps():
    """The engine benchmark's per-phase step times (from the engine's step log): a phase absent from a
    step counts as 0 ms there, so its mean is over every step."""
    from serve_app.engines.minicpmo.step_loop import StepRecord
    from bench.engine.report import slow_step, step_phase_percentiles

    records = [StepRecord(0.0, 0.010, 4, (), 0.0, (("tts_step", 0.008), ("decode_emit", 0.002))),
               StepRecord(0.1, 0.030, 4, (0.05,), 0.001, (("tts_step", 0.010), ("admit_prefill", 0.020)),
                          (("llm_prefill_passes", 1),))]
    phases = step_phase_percentiles(records)
    assert set(phases) == {"tts_step", "decode_emit", "admit_prefill"}
    assert phases["admit_prefill"]["mean"] == 10.0 and phases["tts_step"]["mean"] == 9.0
    assert phases["tts_step"]["p50"] == 9.0
    slow = slow_step(records[1], level_start_s=0.05)
    assert slow == {"at_s": 0.05, "ms": 30.0, "generating": 4, "admitted": 1, "gc_ms": 1.0,
                    "phase_ms": {"tts_step": 10.0, "admit_prefill": 20.0},
                    "work": {"llm_prefill_passes": 1}}


def test_refinement_steps_up_from_the_best_level_to_the_first_failure():
    from bench.served.measure import refinement

    def row(level, ok, mode="read", arrival="poisson"):
        return {"mode": mode, "arrival": arrival, "concurrency": level, "ok": ok}

    sweep = [row(1, True, arrival="single"), row(448, True), row(576, False), row(640, False),
             row(128, False, mode="chat")]
    assert refinement(sweep, "read", 32) == [480, 512, 544]
    assert refinement(sweep, "read", 0) == []
    assert refinement(sweep, "chat", 32) == []  # nothing passed
    assert refinement([row(448, True)], "read", 32) == []  # nothing failed above it
