"""Instructions (OpenAI's voice and style direction) shape MiniCPM-o's voice through the prompt."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from serve_app.engines.base import SpeechRequest
from serve_app.engines.minicpmo.engine import EngineOptions, MiniCPMOEngine
from serve_app.engines.minicpmo.model.layers import SlotKVCache, StepInputs, causal_attend
from serve_app.engines.minicpmo.model.loader import load_speech_model

TEXT = "Hello there, this is read aloud."
INSTRUCTIONS = "Speak slowly, in a warm and cheerful voice."


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    model = load_speech_model(str(tiny_checkpoint), device="cpu", dtype=torch.float32)
    options = EngineOptions(model=str(tiny_checkpoint), device="cpu", dtype="float32", max_slots=4,
                            max_chat_slots=2, tts_max_positions=1024, llm_max_positions=256,
                            tts_sampling="greedy", max_segment_frames=100)
    engine = MiniCPMOEngine(model, options)
    yield engine
    engine.close()


def speaker_embedding(engine: MiniCPMOEngine, request: SpeechRequest) -> torch.Tensor:
    """The speaker embedding of the engine's prompt for ``request`` (one uncached prefill)."""
    ids = (engine.model.tokenizer(engine.plan(request).prompt, add_special_tokens=False)["input_ids"]
           + engine._gen_prompt_ids)
    cache = SlotKVCache(engine.model.config.llm, 1, len(ids), torch.device("cpu"), torch.float32)
    positions = torch.arange(len(ids))[None]
    valid = torch.ones_like(positions, dtype=torch.bool)
    step = StepInputs(torch.tensor([0]), positions, positions,
                      causal_attend(positions, valid, len(ids) + 1))
    with torch.inference_mode():
        hidden = engine.model.llm.hidden_states(torch.tensor([ids]), cache, step)
        return engine.model.tts.speaker_embedding(hidden[0, ids.index(engine._spk_id)][None])[0]


def speak(engine: MiniCPMOEngine, request: SpeechRequest) -> np.ndarray:
    async def run() -> np.ndarray:
        (stream,) = engine.submit([request])
        return np.concatenate([chunk.samples async for chunk in stream])

    return asyncio.run(run())


def test_instructions_come_first_as_upstream_places_a_system_prompt(engine):
    prompt = engine.plan(SpeechRequest("p", TEXT, system_prompt=INSTRUCTIONS)).prompt
    assert prompt == (f"<|im_start|>user\n{INSTRUCTIONS}<|im_end|>\n"
                      f"<|im_start|>user\nPlease read the text below.\n{TEXT}<|im_end|>\n")
    assert engine.plan(SpeechRequest("q", TEXT)).prompt == (
        f"<|im_start|>user\nPlease read the text below.\n{TEXT}<|im_end|>\n")


def test_instructions_change_the_speaker_embedding_and_the_audio(engine):
    plain = SpeechRequest("plain", TEXT)
    directed = SpeechRequest("directed", TEXT, system_prompt=INSTRUCTIONS)
    engine.validate(directed)
    plain_speaker = speaker_embedding(engine, plain)
    directed_speaker = speaker_embedding(engine, directed)
    assert plain_speaker.shape == directed_speaker.shape
    assert not torch.allclose(plain_speaker, directed_speaker, atol=1e-4)
    # Greedy decoding: the same text spoken twice is identical unless the speaker differs.
    assert np.array_equal(speak(engine, plain), speak(engine, SpeechRequest("plain-2", TEXT)))
    assert not np.array_equal(speak(engine, plain), speak(engine, directed))


def test_usage_counts_the_instructions_tokens(engine):
    from serve_app.gpu.usage import stream_usage

    plain = stream_usage(engine, SpeechRequest("a", TEXT), TEXT, samples=2048)
    directed = stream_usage(engine, SpeechRequest("b", TEXT, system_prompt=INSTRUCTIONS), TEXT,
                            samples=2048)
    assert plain.input_tokens == engine.count_tokens(TEXT) > 0
    assert directed.input_tokens == plain.input_tokens + engine.count_tokens(INSTRUCTIONS)
    assert plain.output_tokens == 2048 // engine.samples_per_audio_token == 4
