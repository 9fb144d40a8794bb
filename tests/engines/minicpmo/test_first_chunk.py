"""A smaller first chunk (``first_chunk_frames``): the first audio leaves after fewer frames, the
codes stay upstream's, and the audio differs from upstream's only around the extra cut."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from serve_app.engines.minicpmo.engine import EngineOptions, MiniCPMOEngine
from serve_app.engines.minicpmo.model.codec import OVERLAP_SAMPLES, SAMPLES_PER_CODE_FRAME
from serve_app.engines.minicpmo.model.loader import load_speech_model
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
                            first_chunk_frames=FIRST_CHUNK_FRAMES)
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
