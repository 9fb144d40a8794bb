"""Fault injection on the MiniCPM-o engine (tiny checkpoint, CPU): one stream fails, others go on."""

from __future__ import annotations

import asyncio

import pytest
import torch

from serve_app.engines.base import EngineError, LengthControls, SpeechRequest
from serve_app.engines.minicpmo.engine import EngineOptions, MiniCPMOEngine
from serve_app.engines.minicpmo.model.loader import load_speech_model
from tests.engines.streams import drain

TEXT = "This sentence keeps the stream going for a few chunks. " * 3
# Random tiny weights never stop by themselves: a fixed length of several chunks.
FRAMES = LengthControls(audio_frames=100)


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    model = load_speech_model(str(tiny_checkpoint), device="cpu", dtype=torch.float32)
    options = EngineOptions(model=str(tiny_checkpoint), device="cpu", dtype="float32",
                            admission="slots", max_slots=4,
                            max_chat_slots=2, tts_max_positions=1024, llm_max_positions=256,
                            tts_sampling="greedy",
                            fault_injection={"fail_request_text": "FAIL"})
    engine = MiniCPMOEngine(model, options)
    yield engine
    engine.close()


def test_an_injected_failure_ends_only_its_own_stream_after_its_first_chunk(engine) -> None:
    async def run():
        streams = engine.submit([SpeechRequest("good", TEXT, lengths=FRAMES),
                                 SpeechRequest("bad", "FAIL " + TEXT, lengths=FRAMES)])
        return await asyncio.gather(*(drain(stream) for stream in streams))

    failed = engine.stats().failed
    (good_chunks, good_error), (bad_chunks, bad_error) = asyncio.run(run())
    assert good_error is None and good_chunks >= 2
    assert isinstance(bad_error, EngineError) and bad_chunks == 1
    assert engine.stats().failed == failed + 1
    assert engine.stats().active_streams == 0

