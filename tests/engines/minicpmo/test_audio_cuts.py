"""Audio cut on demand (``audio_cuts: on_demand``): the first chunk outlasts the slowest recent
step, a stream is cut at a step's end when its listener would otherwise run out, at most
``thin_cuts_per_step`` a step; played out on the engine's timeline the player never waits, and on the
real engine the cuts change no code and the audio only around them."""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest

from serve_app.engines.base import Outbox, SpeechRequest
from serve_app.engines.minicpmo import output
from serve_app.engines.minicpmo.engine import EngineOptions
from serve_app.engines.minicpmo.model.codec import SAMPLE_RATE_HZ
from serve_app.engines.minicpmo.scheduler import Stream, StreamPlan
from serve_app.engines.minicpmo.step.audio_cuts import RECENT_STEPS, OnDemandCuts
from serve_app.engines.minicpmo.step.first_chunk import FRAME_S
from tests.engines.minicpmo.test_first_chunk import (
    assert_upstream_away_from_cuts,
    speak_golden_case,
)
from tests.golden.checkpoint import load_expected


def cuts_after(step_ms: list[float], first_chunk_frames: int | None = 10,
               **options: object) -> OnDemandCuts:
    cuts = OnDemandCuts(EngineOptions(first_chunk_frames=first_chunk_frames, audio_cuts="on_demand",
                                      **options))
    for ms in step_ms:
        cuts.observe(ms / 1000)
    return cuts


@pytest.mark.parametrize("slowest_ms, first", [
    (9, (10,)),  # one stream: the first audio after 2 steps
    (85, (10,)),  # 768 read streams on an H100 (50 ms steps, the slowest 75-120)
    (95, (15,)),  # the 6 frames of a first chunk of 10 (128 ms) would not outlast it, guarded
    (190, (15,)),
    (200, (20,)),
    (310, ()),  # too slow for any first chunk shorter than a call: upstream's pieces
])
def test_the_first_chunk_outlasts_the_slowest_recent_step(slowest_ms, first):
    assert cuts_after([9, slowest_ms, 40]).cuts_at_admission() == first


def test_the_first_chunk_follows_the_recent_steps():
    cuts = cuts_after([9])
    assert cuts.cuts_at_admission() == (10,)
    cuts.observe(0.120)  # one slow step counts at once
    assert cuts.cuts_at_admission() == (15,)
    for _ in range(RECENT_STEPS - 1):
        cuts.observe(0.009)
    assert cuts.cuts_at_admission() == (15,)
    cuts.observe(0.009)  # ... until RECENT_STEPS faster ones followed it
    assert cuts.cuts_at_admission() == (10,)


def test_without_a_shorter_first_chunk_every_call_is_one_piece():
    cuts = cuts_after([1], first_chunk_frames=None)
    assert cuts.cuts_at_admission() == ()
    assert cuts.running_thin([SimpleNamespace(played_out_at=0.0)], 1.0) == []


def test_a_stream_is_cut_when_its_listener_would_run_out_before_the_piece_after_next():
    cuts = cuts_after([40, 60])  # the slowest step: 60 ms, due = now + 60 + 40 + 40 ms
    stream = SimpleNamespace(played_out_at=10.5)
    waiting = SimpleNamespace(played_out_at=None)  # its first chunk is planned, none came
    now = 10.5 - 0.139
    assert cuts.running_thin([stream, waiting], now) == [stream]
    assert cuts.running_thin([stream, waiting], now - 0.002) == []


def test_at_most_so_many_streams_are_cut_a_step_the_thinnest_first():
    cuts = cuts_after([60])
    per_step = EngineOptions().thin_cuts_per_step
    streams = [SimpleNamespace(played_out_at=i / 1000) for i in range(per_step + 8, 0, -1)]
    assert cuts.running_thin(streams, 0.0) == streams[::-1][:per_step]
    assert cuts.uncut_thin == 8
    wider = cuts_after([60], thin_cuts_per_step=per_step + 8)
    assert wider.running_thin(streams, 0.0) == streams[::-1]
    assert wider.uncut_thin == 0


def play_out(step_s: list[float], cuts: OnDemandCuts, frames: int = 300) -> tuple[float, float, int]:
    """One stream through the engine's timeline: a step plans and launches (15 ms), hands out
    the pieces the last step decided, runs a window of 5 frames and reads them (5 ms before its
    end), decides this window's pieces: the first chunk, each 25-frame call's end, and the cuts
    :class:`OnDemandCuts` asks for. A piece sends its frames up to 4 before its end (all at the
    stream's end). Returns the first audio's time, the longest the player waited for audio after
    it, and the pieces."""
    first = cuts.cuts_at_admission()
    stream = SimpleNamespace(played_out_at=None)
    decided, sent_upto, start, waited, pieces, first_audio_at = None, 0, 0.0, 0.0, 0, None
    for index, step in enumerate(step_s):
        handed_at = start + min(0.015, step / 4)
        if decided is not None:
            upto = decided if decided == frames else decided - 4
            if first_audio_at is None:
                first_audio_at = stream.played_out_at = handed_at
            waited = max(waited, handed_at - stream.played_out_at)
            stream.played_out_at = max(stream.played_out_at, handed_at) + (upto - sent_upto) * FRAME_S
            sent_upto, decided, pieces = upto, None, pieces + 1
            if upto == frames:
                return first_audio_at, waited, pieces
        made = 5 * (index + 1)
        if made in first or made % 25 == 0 or made == frames or cuts.running_thin(
                [stream], start + step - min(0.005, step / 4)):
            decided = made
        cuts.observe(step)  # at the step's end, as the engine does
        start += step
    raise AssertionError("more steps needed")


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("mean_ms, slowest_ms", [(10, 30), (40, 90), (57, 100), (70, 130),
                                                 (90, 140)])
def test_cuts_keep_a_player_fed_when_steps_vary_and_spike(seed, mean_ms, slowest_ms):
    """Steps around the mean with spikes up to the slowest (admission prefills, collections),
    the engine's recent steps as slow: the player never waits once it has started, and the
    first audio comes after the first chunk's steps."""
    rng = random.Random(seed)
    steps = [rng.uniform(0.8, 1.2) * mean_ms / 1000 if rng.random() > 0.1 else slowest_ms / 1000
             for _ in range(80)]
    cuts = cuts_after([slowest_ms] + [mean_ms] * 4)
    first = cuts.cuts_at_admission()[0]
    first_audio_s, waited_s, pieces = play_out(steps, cuts)
    assert waited_s <= 1e-9
    assert first_audio_s == pytest.approx(sum(steps[:first // 5]) + min(0.015, steps[first // 5] / 4))
    assert pieces < 300 // 5  # whole calls once the buffer holds enough


def test_without_the_cuts_a_thin_first_chunk_runs_dry():
    """The same timeline with no cut after the first chunk: the player waits (what the cuts
    are for)."""
    class FirstOnly(OnDemandCuts):
        def running_thin(self, streams, now):
            return []

    steps = [0.057] * 80
    cuts = FirstOnly(EngineOptions(first_chunk_frames=10, audio_cuts="on_demand"))
    cuts.observe(0.057)
    assert play_out(steps, cuts)[1] > 0.02


@pytest.mark.parametrize("case", ["stream_short", "stream_long"])
def test_cuts_on_demand_change_no_code_and_only_audio_near_them(tiny_checkpoint, case):
    """The real engine, its recent steps as slow as 190 ms: a first chunk of 15 frames, the next
    step's audio cut too (the listener holds 234 ms, less than such a step and the guards), maybe
    more cuts (by the clock); codes and length exactly upstream's, the audio upstream's away from
    each cut."""
    chunks, schedule = speak_golden_case(tiny_checkpoint, case, lambda cuts: cuts.observe(0.190),
                                         audio_cuts="on_demand")
    assert sorted(schedule.extra_cuts)[:2] == [15, 20]
    assert_upstream_away_from_cuts(chunks, schedule, load_expected(case))


def test_a_listener_that_ran_dry_plays_the_next_chunk_from_when_it_comes(monkeypatch):
    """The engine's bookkeeping of when a listener plays its audio out (what the cuts read): a
    chunk plays after the last one, or from when it comes if the listener ran dry before it."""
    stream = Stream(plan=StreamPlan(request=SpeechRequest(request_id="dry", text="hi"),
                                    prompt="", pieces=[]), sink=None, submitted_at=0.0)
    outbox = Outbox()
    monkeypatch.setattr(outbox, "put", lambda sink, request_id, item: None)
    clock = iter([1.0, 1.05, 3.0])
    monkeypatch.setattr(output.time, "perf_counter", lambda: next(clock))
    second = np.zeros(SAMPLE_RATE_HZ, dtype=np.float32)
    output.emit(outbox, stream, second)  # at 1.0: plays out at 2.0
    assert stream.played_out_at == pytest.approx(2.0)
    output.emit(outbox, stream, second / 2)  # at 1.05, while playing: after it, at 3.0
    assert stream.played_out_at == pytest.approx(3.0)
    output.emit(outbox, stream, second[:SAMPLE_RATE_HZ // 4])  # at 3.0, ran dry: to 3.25
    assert stream.played_out_at == pytest.approx(3.25)
