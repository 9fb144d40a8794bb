"""A smaller first chunk (``first_chunk_frames``): the first audio leaves after fewer frames, the
codes stay upstream's, the audio differs from upstream's only around the extra cut, and a loaded
engine sends a longer first chunk so the listener's buffer never runs dry."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from serve_app.engines.minicpmo.engine import EngineOptions, MiniCPMOEngine
from serve_app.engines.minicpmo.model.codec import OVERLAP_SAMPLES, SAMPLES_PER_CODE_FRAME
from serve_app.engines.minicpmo.model.loader import load_speech_model
from serve_app.engines.minicpmo.step.first_chunk import FRAME_S, FirstChunkPlanner, piece_cuts
from tests.engines.minicpmo.test_golden_parity import golden_codes_by_call, golden_plan
from tests.golden.checkpoint import load_expected

FIRST_CHUNK_FRAMES = 15
# Code frames on either side of the cut whose audio the cut may change: the decoder sees up
# to 9 frames ahead, and the next piece re-decodes 4 frames of context and crossfades over them
# (measured on the tiny checkpoint: 5.8-20.1 frames for a cut at 15).
CHANGED_BEFORE_CUT, CHANGED_AFTER_CUT = 10, 6


@pytest.fixture(scope="module")
def early_engine(tiny_checkpoint):
    model = load_speech_model(str(tiny_checkpoint), device="cpu", dtype=torch.float32)
    options = EngineOptions(model=str(tiny_checkpoint), device="cpu", dtype="float32",
                            admission="slots", max_slots=4, max_chat_slots=2, tts_max_positions=1024,
                            llm_max_positions=256, tts_sampling="greedy", keep_traces=True,
                            first_chunk_frames=FIRST_CHUNK_FRAMES,
                            first_chunk_follows_load=False)
    engine = MiniCPMOEngine(model, options)
    yield engine
    engine.close()


@pytest.mark.parametrize("case", ["stream_short", "stream_long"])
def test_first_chunk_is_cut_early_and_the_rest_is_upstreams(early_engine, case):
    expected = load_expected(case)
    request_id = f"first-chunk-{case}"

    async def run():
        (stream,) = early_engine.submit_plans([golden_plan(case, request_id)])
        return [chunk.samples async for chunk in stream]

    chunks = asyncio.run(run())
    codes = np.concatenate(golden_codes_by_call(early_engine.trace(request_id)))
    assert np.array_equal(codes, expected["codes"])  # the cut changes no code
    # the first chunk: 15 frames decoded, less the tail held back for the crossfade
    assert len(chunks[0]) == FIRST_CHUNK_FRAMES * SAMPLES_PER_CODE_FRAME - OVERLAP_SAMPLES
    wav, want = np.concatenate(chunks), expected["wav"]
    assert wav.shape == want.shape  # nothing lost or played twice at the cut
    begin = (FIRST_CHUNK_FRAMES - CHANGED_BEFORE_CUT) * SAMPLES_PER_CODE_FRAME
    end = (FIRST_CHUNK_FRAMES + CHANGED_AFTER_CUT) * SAMPLES_PER_CODE_FRAME
    np.testing.assert_allclose(wav[:begin], want[:begin], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(wav[end:], want[end:], rtol=1e-4, atol=1e-5)
    around_cut = wav[begin:end] - want[begin:end]
    assert np.abs(around_cut).max() < 0.1 * np.abs(want).max()  # a crossfaded seam, not a gap


def test_first_chunk_frames_beyond_a_call_is_refused():
    with pytest.raises(ValueError, match="first_chunk_frames"):
        EngineOptions(chunk_frames=25, first_chunk_frames=30)


def plan_at(step_ms: float, first_chunk_frames: int = 10) -> tuple[int, ...]:
    planner = FirstChunkPlanner(EngineOptions(first_chunk_frames=first_chunk_frames))
    planner.observe(step_ms / 1000)
    return planner.cuts_at_admission()


@pytest.mark.parametrize("step_ms, cuts", [
    (9, (10,)),  # one stream: the first audio after 2 steps, whole calls after it
    (30, (10, 15)),  # the first call's audio cut at two steps' ends, then whole calls
    (53, (15, 20, 30, 35)),  # 640 read streams on an H100: 3 steps, more cuts in 2 calls
    (70, (20, 30, 35, 40, 55, 60, 80)),
    (80, ()),  # too close to real time to start thin: upstream's pieces
])
def test_a_loaded_engine_cuts_a_longer_first_chunk_and_more_pieces(step_ms, cuts):
    assert plan_at(step_ms) == cuts


def test_the_plan_follows_the_recent_step_time():
    planner = FirstChunkPlanner(EngineOptions(first_chunk_frames=10))
    planner.observe(0.009)
    assert planner.cuts_at_admission() == (10,)
    for _ in range(3):  # load arrives: slow steps count at once
        planner.observe(0.070)
    assert planner.cuts_at_admission()[0] == 15
    for _ in range(40):  # steps take 70 ms
        planner.observe(0.070)
    assert planner.cuts_at_admission()[0] == 20
    planner.observe(0.009)  # one fast step: the first chunk stays long
    assert planner.cuts_at_admission()[0] >= 15
    for _ in range(40):
        planner.observe(0.009)
    assert planner.cuts_at_admission() == (10,)


def longest_wait_s(cuts: tuple[int, ...], step_s: float, late_s: float, frames: int = 300) -> float:
    """Play the stream out: pieces end at the cuts and at every 25-frame call's end, the piece
    ending at frame g arrives (g - first) / 5 steps after the first one plus ``late_s``, each
    piece sends its frames up to 4 before its end. The longest the player waits for audio."""
    first = cuts[0] if cuts else 25
    ends = sorted(set(cuts) | set(range(25, frames + 1, 25)))
    sent_frames, worst = 0, 0.0
    for index, end in enumerate(ends):
        at = 0.0 if index == 0 else (end - first) / 5 * step_s + late_s
        worst = max(worst, at - sent_frames * FRAME_S)
        sent_frames = end - 4
    return worst


@pytest.mark.parametrize("step_ms", [5, 20, 30, 40, 45, 53, 60, 65, 70])
def test_the_planned_cuts_keep_a_player_fed_when_steps_are_slower_and_chunks_late(step_ms):
    step_s = step_ms / 1000
    cuts = plan_at(step_ms)
    assert longest_wait_s(cuts, 1.25 * step_s, late_s=2 * step_s) <= 1e-9
    if cuts and cuts[0] > 10:  # a shorter first chunk has no such plan
        assert piece_cuts(cuts[0] - 5, step_s, 25, 5) is None


def test_without_a_shorter_first_chunk_every_call_is_one_piece():
    planner = FirstChunkPlanner(EngineOptions())
    planner.observe(0.001)
    assert planner.cuts_at_admission() == ()


def speak_golden_case(checkpoint, case: str, as_if_loaded, **options) -> tuple[list, object]:
    """Run golden ``case`` through the real engine on the tiny checkpoint with a short first
    chunk; ``as_if_loaded(cuts)`` sets the engine's audio cuts up first. Returns the chunks'
    samples and the stream's schedule."""
    model = load_speech_model(str(checkpoint), device="cpu", dtype=torch.float32)
    engine = MiniCPMOEngine(model, EngineOptions(
        model=str(checkpoint), device="cpu", dtype="float32", max_slots=4, max_chat_slots=2,
        admission="slots",
        tts_max_positions=1024, llm_max_positions=256, tts_sampling="greedy", keep_traces=True,
        first_chunk_frames=10, **options))
    try:
        as_if_loaded(engine._loop.admission.audio_cuts)

        async def run():
            (stream,) = engine.submit_plans([golden_plan(case, "cuts")])
            return [chunk.samples async for chunk in stream]

        return asyncio.run(run()), engine.trace("cuts")
    finally:
        engine.close()


def assert_upstream_away_from_cuts(chunks: list, schedule, expected: dict) -> None:
    """Codes and length exactly upstream's, the first chunk its cut's length, the audio
    upstream's away from each cut and a crossfaded seam near one."""
    cuts = sorted(schedule.extra_cuts)
    assert np.array_equal(np.concatenate(golden_codes_by_call(schedule)), expected["codes"])
    assert len(chunks[0]) == cuts[0] * SAMPLES_PER_CODE_FRAME - OVERLAP_SAMPLES
    wav, want = np.concatenate(chunks), expected["wav"]
    assert wav.shape == want.shape
    near_a_cut = np.zeros(len(want), dtype=bool)
    for cut in cuts:
        near_a_cut[max(cut - CHANGED_BEFORE_CUT, 0) * SAMPLES_PER_CODE_FRAME:
                   (cut + CHANGED_AFTER_CUT) * SAMPLES_PER_CODE_FRAME] = True
    np.testing.assert_allclose(wav[~near_a_cut], want[~near_a_cut], rtol=1e-4, atol=1e-5)
    assert np.abs(wav[near_a_cut] - want[near_a_cut]).max() < 0.1 * np.abs(want).max()


@pytest.mark.parametrize("case", ["stream_short", "stream_long"])
def test_cuts_planned_for_a_loaded_engine_change_no_code_and_only_audio_near_them(tiny_checkpoint,
                                                                                 case):
    """The real engine, planning its cuts for 60 ms steps: codes and length exactly upstream's,
    the audio exactly upstream's away from each cut."""
    def loaded(planner):
        planner.step_s = 0.060  # as if loaded: the stream is admitted at the next step

    chunks, schedule = speak_golden_case(tiny_checkpoint, case, loaded)
    assert sorted(schedule.extra_cuts) == [15, 20, 30, 35, 55]
    assert_upstream_away_from_cuts(chunks, schedule, load_expected(case))
