"""The overload benchmark's counting (bench/overload/levels.py, bench/overload/run.py): the
arrivals a level offers, each stream's fate, a level's figures and the acceptance per mix."""

from __future__ import annotations

import json

import pytest

from bench.overload.levels import StreamFate, arrivals, summarize
from bench.overload.run import acceptance, merged


def test_a_level_offers_its_mix_at_the_rate_that_holds_its_capacity():
    # mixed: 384 read + 96 chat streams of 10 s held, at 2x for 100 s: ~7680 + ~1920
    schedule = arrivals("mixed", {"read": 384, "chat": 96}, 2.0, 100.0, 10.0)
    reads = sum(kind == "read" for _, kind in schedule)
    chats = sum(kind == "chat" for _, kind in schedule)
    assert reads == pytest.approx(7680, rel=0.05) and chats == pytest.approx(1920, rel=0.08)
    assert [at for at, _ in schedule] == sorted(at for at, _ in schedule)
    assert schedule == arrivals("mixed", {"read": 384, "chat": 96}, 2.0, 100.0, 10.0)


def stream(kind="read", *, status=200, pieces=(), whole=True, retry_after=False,
           answered_s=0.01) -> StreamFate:
    fate = StreamFate(kind=kind, at_s=0.0, status=status, answered_s=answered_s,
                      retry_after=retry_after, whole=whole)
    for now_s, seconds in pieces:
        fate.audio(now_s, seconds)
    return fate


def test_each_stream_is_refused_admitted_real_time_late_or_cut():
    on_time = stream(pieces=[(0.2, 1.0), (1.1, 1.0), (2.0, 1.0)])
    late = stream(pieces=[(0.2, 1.0), (1.5, 1.0)])  # the second second came 0.3 s after dry
    cut = stream(pieces=[(0.2, 1.0)], whole=False)
    refused = stream(status=503, retry_after=True, answered_s=0.004)
    assert (on_time.realtime, late.realtime, cut.realtime) == (True, False, False)
    assert late.ran_dry and cut.cut and not on_time.cut
    assert refused.refused and not refused.admitted
    level = summarize([on_time, late, cut, refused], "read", 2.0, window_s=2.0)
    assert (level["admitted"], level["refused"], level["failed"]) == (3, 1, 0)
    assert level["goodput_streams_per_s"] == 0.5  # one real-time stream in a 2 s window
    assert level["goodput_audio_s_per_s"] == 1.5
    assert level["admitted_realtime_share"] == pytest.approx(1 / 3)
    assert level["cut_after_first_byte"] == 1
    assert level["refusals_with_retry_after"] == 1 and level["refusal_statuses"] == {"503": 1}
    assert level["refusal_ms_p99"] == pytest.approx(4.0)


def level(mix, offered_x, goodput, realtime=1.0, ttfb=300.0, refused=10, refusal_ms=20.0,
          retry_after=10, cut=0) -> dict:
    return {"mix": mix, "offered_x": offered_x, "goodput_streams_per_s": goodput,
            "admitted_realtime_share": realtime, "admitted_ttfb_ms_p99": ttfb,
            "refused": refused, "refusal_ms_p99": refusal_ms,
            "refusals_with_retry_after": retry_after, "cut_after_first_byte": cut}


def test_the_acceptance_holds_each_mix_to_its_own_1x_and_to_slot_admission():
    work = [level("chat", 1.0, 20.0), level("chat", 2.0, 19.0), level("chat", 3.0, 17.0),
            level("read", 1.0, 100.0), level("read", 3.0, 95.0, retry_after=9)]
    slots = [level("chat", 1.0, 21.0), level("read", 1.0, 120.0)]
    result = acceptance(work, slots, ttfb_p99_ms=500.0)
    assert result["chat"]["2x"]["goodput_ok"] and not result["chat"]["3x"]["goodput_ok"]
    assert result["chat"]["1x_vs_slots"] == pytest.approx(20 / 21)
    assert not result["read"]["3x"]["refusals_ok"]  # one refusal without Retry-After
    assert result["read"]["1x_vs_slots"] == pytest.approx(100 / 120)


def test_a_refusals_time_is_split_at_the_ingress_by_its_log_line():
    """bench/overload/run.py: the client's wait for a refusal, the Ingress's share of it (its
    request line's duration_ms, by request id) and the rest; admitted streams are left out."""
    from bench.overload.run import refusal_breakdown

    log = ("request id=a method=POST path=/v1/speak status=503 outcome=rejected "
           "code=overloaded duration_ms=4.0\n"
           "request id=b method=POST path=/v1/speak status=503 outcome=rejected duration_ms=90.0\n"
           "request id=c method=POST path=/v1/speak status=200 outcome=ok duration_ms=9000.0\n")
    refused = [StreamFate(kind="read", at_s=0.0, status=503, answered_s=seconds, request_id=rid)
               for rid, seconds in (("a", 0.010), ("b", 0.100))]
    admitted = StreamFate(kind="read", at_s=0.0, status=200, answered_s=0.2, request_id="c")
    admitted.audio(0.3, 1.0)
    split = refusal_breakdown(log, refused + [admitted])
    assert split["refusals"] == 2
    assert split["ingress_ms"]["p50"] == 47.0
    assert split["outside_ingress_ms"]["p50"] == 8.0  # (6 + 10) / 2
    assert refusal_breakdown("", refused) is None


def test_merged_runs_keep_each_levels_own_commit(tmp_path):
    """A merged file merged again keeps the commit each level was measured at; a later run's
    level of the same mix and load replaces the earlier one."""
    old = {"git_commit": "bbb", "command": "merge", "sessions": {"offered": 1, "git_commit": "aaa"},
           "levels": [{"mix": "read", "offered_x": 1.0, "git_commit": "aaa"},
                      {"mix": "read", "offered_x": 2.0, "git_commit": "bbb"}],
           "slots_levels": [{"mix": "read", "offered_x": 1.0, "git_commit": "aaa"}]}
    new = {"git_commit": "ccc", "command": "run", "levels": [{"mix": "read", "offered_x": 2.0}]}
    paths = [tmp_path / "old.json", tmp_path / "new.json"]
    for path, part in zip(paths, (old, new)):
        path.write_text(json.dumps(part))
    result = merged(paths)
    assert [(level["offered_x"], level["git_commit"]) for level in result["levels"]] == [
        (1.0, "aaa"), (2.0, "ccc")]
    assert result["slots_levels"][0]["git_commit"] == "aaa"
    assert result["sessions"]["git_commit"] == "aaa"
    assert result["git_commit"] == "ccc"


def test_the_engine_alone_takes_the_shipped_options_with_the_ones_asked_over_them():
    """bench.overload.engine builds its engine from serve_config.yaml's engine options, an
    admission variant and ``--engine-option`` pairs (read as YAML) over them."""
    from bench.overload.engine import engine_options, parse_args

    args = parse_args(["--out", "x.json", "--engine-option", "llm_step_rows=slot_range",
                       "--engine-option", "packed_prefill=true"])
    options = engine_options(args, "work:0.4:1")
    assert options["llm_step_rows"] == "slot_range" and options["packed_prefill"] is True
    assert (options["admission"], options["admission_margin"], options["behind_hold_s"]) == (
        "work", 0.4, 1.0)
    assert options["prefill_beside_window"] is True  # the config's own, kept
    assert engine_options(parse_args(["--out", "x.json"]), "slots").get("packed_prefill") is None
