"""scripts/bench_timestamps: its arms are bench_serve's SSE sweep with and without word
timestamps at the same levels, and its cost is on minus off judged against the two off runs."""

from __future__ import annotations

import json

import pytest

from bench.served.timestamps import (
    arm_args,
    arm_order,
    compared,
    cost,
    main,
    parse_args,
    words_seen,
)


def _level(concurrency: int, p50: float, p99: float, share: float = 1.0,
           completed: int = 4, with_words: int = 0) -> dict:
    return {"concurrency": concurrency, "arrival": "single" if concurrency == 1 else "poisson",
            "ttfb_ms_p50": p50, "ttfb_ms_p99": p99, "realtime_share": share,
            "completed": completed, "streams_with_words": with_words}


def _arm(name: str, run: int, single_p50: float, best: int, levels: list[dict]) -> dict:
    return {"arm": name, "run": run, "single_stream": {"ttfb_ms_p50": single_p50},
            "max_realtime_streams": best, "levels": levels}


def test_every_arm_is_the_sse_read_sweep_over_the_same_levels() -> None:
    args, out = parse_args(["--config", "serve_config.cpu.yaml", "--read-levels", "1", "2",
                            "--refine-step", "8", "--out", "t.json"])
    assert str(out) == "t.json" and args.rounds == 1
    assert args.modes == ["read"] and args.sse and args.arrivals == ["poisson"]
    # no refinement and no early stop: each arm measures exactly the levels asked for
    assert args.refine_step == 0 and args.stop_after_ttfb_ms == float("inf")
    order = arm_order(args.rounds)
    assert order == [("off", False), ("on", True), ("off", False)]
    assert [arm_args(args, words).word_timestamps for _, words in order] == [False, True, False]
    assert not args.word_timestamps  # the arms set it, the parsed options stay off
    # more rounds: every on run still has an off run on each side
    assert [name for name, _ in arm_order(2)] == ["off", "on", "off", "on", "off"]


def test_a_difference_inside_the_off_runs_spread_is_noise() -> None:
    inside = compared([300.0, 320.0], [325.0])
    assert inside["off_mean"] == 310.0 and inside["on_minus_off"] == 15.0
    assert inside["noise"] == 20.0 and inside["within_noise"] is True
    outside = compared([300.0, 320.0], [340.0])
    assert outside["on_minus_off"] == 30.0 and outside["within_noise"] is False
    # two on runs are judged by their mean, against the spread of all three off runs
    rounds = compared([300.0, 320.0, 290.0], [350.0, 310.0])
    assert rounds["on_mean"] == 330.0 and rounds["noise"] == 30.0
    assert rounds["on_minus_off"] == 26.6667 and rounds["within_noise"] is True
    assert compared([2, 2], [2])["within_noise"] is True
    assert compared([2, 2], [1])["within_noise"] is False  # no spread: any change counts
    assert compared([None, 300.0], [310.0])["within_noise"] is None  # a level that did not run


def test_cost_lines_up_the_arms_level_by_level() -> None:
    arms = [_arm("off", 1, 300.0, 2, [_level(1, 300, 400), _level(2, 350, 480),
                                      _level(3, 900, 2000, 0.9)]),
            _arm("on", 1, 330.0, 2, [_level(1, 330, 420, with_words=4),
                                     _level(2, 354, 490, with_words=4),
                                     _level(3, 950, 2100, 0.8, with_words=4)]),
            _arm("off", 2, 310.0, 2, [_level(1, 310, 410), _level(2, 355, 470),
                                      _level(3, 920, 1900, 0.95)])]
    result = cost(arms)
    single = result["single_stream_ttfb_ms_p50"]
    assert single["off_runs"] == [300.0, 310.0] and single["on_minus_off"] == 25.0
    assert single["within_noise"] is False
    assert result["max_realtime_streams"]["on_minus_off"] == 0
    assert result["max_realtime_streams"]["within_noise"] is True
    assert [row["concurrency"] for row in result["per_level"]] == [1, 2, 3]
    three = result["per_level"][2]
    assert three["realtime_share"]["on_minus_off"] == -0.125
    assert three["ttfb_ms_p99"]["on_minus_off"] == 150.0  # mean of 2000 and 1900
    assert three["ttfb_ms_p99"]["within_noise"] is False  # their spread: 100
    assert three["ttfb_ms_p50"]["within_noise"] is False and result["per_level"][1][
        "ttfb_ms_p50"]["within_noise"] is True  # 354 against 350 and 355
    seen = words_seen(arms)
    assert seen["on 1"] == {"completed_streams": 12, "streams_with_words": 12}
    assert seen["as_asked"] is True
    arms[0]["levels"][0]["streams_with_words"] = 1  # an off stream that got words
    assert words_seen(arms)["as_asked"] is False


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_run_against_the_real_app_writes_each_arm_and_the_cost(server, tmp_path, monkeypatch
                                                                 ) -> None:
    """scripts/bench_timestamps on the app already serving (``--reuse``), over HTTP: three
    arms at the same level, words on every stream of the on arm and none of the off arms'."""
    monkeypatch.setenv("LOADTEST_API_KEY", server.api_key)
    out = tmp_path / "timestamps.json"
    port = server.base_url.rsplit(":", 1)[1]
    assert main(["--reuse", "--port", port, "--config", "serve_config.cpu.yaml",
                 "--read-levels", "2", "--arrivals", "burst",
                 "--log", str(tmp_path / "no-service-log"), "--out", str(out)]) == 0

    result = json.loads(out.read_text())
    assert [(arm["arm"], arm["run"]) for arm in result["arms"]] == [("off", 1), ("on", 1),
                                                                  ("off", 2)]
    assert result["words"]["as_asked"] is True
    assert result["words"]["on 1"] == {"completed_streams": 2, "streams_with_words": 2}
    for arm in result["arms"]:
        [level] = arm["levels"]
        assert level["concurrency"] == 2 and level["completed"] == 2
        assert level["ttfb_ms_p50"] > 0
        assert ("timestamp_granularities" in arm["body"]) == (arm["arm"] == "on")
    [per_level] = result["cost"]["per_level"]
    assert len(per_level["ttfb_ms_p50"]["off_runs"]) == 2
    assert per_level["ttfb_ms_p50"]["within_noise"] in (True, False)
    assert result["git_commit"] and result["device"]["cpu_count"] >= 1
