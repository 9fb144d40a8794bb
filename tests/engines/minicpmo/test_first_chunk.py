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
from serve_app.engines.minicpmo.step.first_chunk import FRAME_S, FirstChunkPlanner, keeps_buffer
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
                            max_slots=4, max_chat_slots=2, tts_max_positions=1024,
                            llm_max_positions=256, tts_sampling="greedy", keep_traces=True,
                            first_chunk_frames=FIRST_CHUNK_FRAMES, first_chunk_safety=0)
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


@pytest.mark.parametrize("step_ms, frames", [(9, 10), (28, 10), (29, 15), (42, 15), (43, 20),
                                             (49, 20), (50, 25), (56, 25), (120, 25)])
def test_a_loaded_engine_sends_a_longer_first_chunk(step_ms, frames):
    planner = FirstChunkPlanner(EngineOptions(first_chunk_frames=10))  # safety 1.5, 5 per step
    planner.observe(step_ms / 1000)
    assert planner.frames() == frames


def test_the_step_time_follows_recent_steps():
    planner = FirstChunkPlanner(EngineOptions(first_chunk_frames=10))
    planner.observe(0.009)
    assert planner.frames() == 10  # one stream: 9 ms steps
    for _ in range(40):  # load arrives: steps take 60 ms
        planner.observe(0.060)
    assert planner.frames() == 25
    for _ in range(40):
        planner.observe(0.020)
    assert planner.frames() == 10


def runs_dry(first: int, step_s: float) -> bool:
    """A player starting at the first chunk runs dry before the second call's chunk, if steps
    take ``step_s`` (25-frame calls, 5 frames a step, 4 frames held back for the crossfade)."""
    rest_at = -(-(25 - first) // 5)
    arrivals = [(0, first - 4), (rest_at, 25 - first), (rest_at + 5, 25)]  # (step, frames)
    held_s = 0.0
    for at_step, frames in arrivals:
        if at_step * step_s > held_s + 1e-9:
            return True
        held_s += frames * FRAME_S
    return False


@pytest.mark.parametrize("step_ms", [5, 20, 30, 40, 45, 49])
def test_the_shortest_first_chunk_that_keeps_a_player_fed_is_chosen(step_ms):
    planner = FirstChunkPlanner(EngineOptions(first_chunk_frames=10))
    planner.observe(step_ms / 1000)
    first = planner.frames()
    planned_step_s = step_ms / 1000 * planner.safety
    assert not runs_dry(first, planned_step_s)
    assert keeps_buffer(first, planned_step_s, 25, 5)
    if first > 10:  # one step's frames shorter would run dry at that step time
        assert runs_dry(first - 5, planned_step_s)


def test_without_a_shorter_first_chunk_every_call_is_one_piece():
    planner = FirstChunkPlanner(EngineOptions())
    planner.observe(0.001)
    assert planner.frames() == 25
